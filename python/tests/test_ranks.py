"""One rank of several, without PyTorch: the snapshot file names (``{rank}``, ``{local_rank}``,
``{pid}``, ``<stem>_rank<N><ext>``), the ``[rankN]:`` log prefix of the library and of the
package, and the snapshot written at the first out of memory (``ferrocache.oom``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import MIB, memory_env, run_json, run_python

from ferrocache import _ranks

pytestmark = pytest.mark.usefixtures("fake_libcuda")

RANK_3_OF_8 = _ranks.Process(rank=3, local_rank=1, world_size=8, pid=4242)
ALONE = _ranks.Process(rank=0, local_rank=0, world_size=1, pid=4242)
#: The environment torchrun gives rank 1 of 2.
RANK_1_OF_2 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}


@pytest.mark.parametrize(
    ("given", "alone", "rank_3_of_8"),
    [
        ("run.pickle", "run.pickle", "run_rank3.pickle"),
        ("out/run.pickle", "out/run.pickle", "out/run_rank3.pickle"),
        ("dir.v2/run", "dir.v2/run", "dir.v2/run_rank3"),
        ("snap-{rank}.pickle", "snap-0.pickle", "snap-3.pickle"),
        ("n{local_rank}/r{rank:02d}.pickle", "n0/r00.pickle", "n1/r03.pickle"),
        ("oom-{pid}.pickle", "oom-4242.pickle", "oom-4242.pickle"),
        ("{{literal}}.pickle", "{literal}.pickle", "{literal}_rank3.pickle"),
    ],
)
def test_each_rank_writes_its_own_file(given: str, alone: str, rank_3_of_8: str) -> None:
    assert _ranks.per_rank_path(given, ALONE) == alone
    assert _ranks.per_rank_path(given, RANK_3_OF_8) == rank_3_of_8
    assert _ranks.per_rank_path(Path(given), RANK_3_OF_8) == rank_3_of_8


@pytest.mark.parametrize(
    "bad", ["run-{host}.pickle", "run-{}.pickle", "run-{0}.pickle", "run-{rank", "r{rank.real}"]
)
def test_an_unknown_placeholder_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="snapshot path"):
        _ranks.check_path(bad)


def test_the_process_is_read_from_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    alone = _ranks.this_process()
    assert (alone.rank, alone.local_rank, alone.world_size, alone.in_a_job) == (0, 0, 1, False)
    assert _ranks.log_prefix() == ""
    for name, value in {"WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    ranked = _ranks.this_process()
    assert (ranked.rank, ranked.local_rank, ranked.world_size, ranked.in_a_job) == (3, 1, 8, True)
    assert _ranks.log_prefix() == "[rank3]:"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _ranks.log_prefix() == ""


DUMP_AND_LOG = """
import ferrocache as fc
p = fc.caching_allocator_alloc(4096)
fc.caching_allocator_delete(p)
result(fc.dump_snapshot({path!r}))
"""


def test_rank_files_and_lines_under_torchrun_variables(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pickle")
    env = memory_env(256 * MIB, TORCH_CUDA_ALLOC_LOG_LEVEL="INFO", **RANK_1_OF_2)
    process = run_python(
        "def result(v): print('RESULT:' + v)\n" + DUMP_AND_LOG.format(path=path), env=env
    )
    assert f"RESULT:{tmp_path / 'run_rank1.pickle'}" in process.stdout
    assert (tmp_path / "run_rank1.pickle").is_file() and not (tmp_path / "run.pickle").exists()
    lines = process.stderr.splitlines()
    assert lines and all(line.startswith("[rank1]:[INFO] Allocator: ") for line in lines), lines


def test_a_single_process_keeps_the_plain_format_and_name(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pickle")
    env = memory_env(256 * MIB, TORCH_CUDA_ALLOC_LOG_LEVEL="INFO", WORLD_SIZE="1", RANK="0")
    process = run_python(
        "def result(v): print('RESULT:' + v)\n" + DUMP_AND_LOG.format(path=path), env=env
    )
    assert f"RESULT:{path}" in process.stdout
    lines = process.stderr.splitlines()
    assert lines and all(line.startswith("[INFO] Allocator: ") for line in lines), lines


SNAPSHOT_ON_OOM = """
import ferrocache as fc
from ferrocache import oom
oom.snapshot_on_oom({path!r})

def grow():
    return fc.caching_allocator_alloc(1 << 40)

kept = fc.caching_allocator_alloc(4 * 2**20)
outcome = {{}}
for attempt in range(2):
    try:
        grow()
    except fc.OutOfMemoryError as err:
        outcome.setdefault("written_before_raise", __import__("os").path.exists({written!r}))
        outcome.setdefault("message", str(err))
result(outcome)
"""


def test_the_snapshot_is_written_at_the_first_oom_before_the_error(tmp_path: Path) -> None:
    written = tmp_path / "oom_rank1.pickle"
    env = memory_env(256 * MIB, **RANK_1_OF_2)
    process = run_python(
        "def result(v):\n    import json; print('RESULT:' + json.dumps(v))\n"
        + SNAPSHOT_ON_OOM.format(path=str(tmp_path / "oom.pickle"), written=str(written)),
        env=env,
    )
    assert '"written_before_raise": true' in process.stdout, process.stdout + process.stderr
    assert "CUDA out of memory. Tried to allocate 1024.00 GiB" in process.stdout
    notes = [line for line in process.stderr.splitlines() if "snapshot written" in line]
    assert notes == [
        f"[rank1]:[ERROR] Allocator: out of memory on device 0: snapshot written to {written} "
        "(open it at https://pytorch.org/memory_viz)"
    ], "written once, at the first out of memory"
    with open(written, "rb") as f:
        snapshot = pickle.load(f)
    trace = snapshot["device_traces"][0]
    assert [entry["action"] for entry in trace].count("oom") == 1
    (oom,) = [entry for entry in trace if entry["action"] == "oom"]
    assert "grow" in [frame["name"] for frame in oom["frames"]]
    assert any(entry["action"] == "alloc" and entry["frames"] for entry in trace)


def test_the_history_kept_for_an_oom_snapshot_is_bounded() -> None:
    out = run_json(
        """
        import ferrocache as fc
        from ferrocache import oom
        oom.snapshot_on_oom("unused.pickle")
        for _ in range(oom.SNAPSHOT_ON_OOM_MAX_ENTRIES // 2 + 10):
            fc.caching_allocator_delete(fc.caching_allocator_alloc(512))
        result([len(fc.snapshot()["device_traces"][0]), oom.SNAPSHOT_ON_OOM_MAX_ENTRIES])
        """,
        env=memory_env(256 * MIB),
    )
    assert out == [100_000, 100_000]


def test_oom_observers_see_pytorchs_figures_and_cannot_break_the_error() -> None:
    process = run_python(
        """
        import json
        import ferrocache as fc
        seen = []
        def failing(*args):
            raise KeyError("the observer's own bug")
        fc.attach_out_of_memory_observer(lambda *args: seen.append(list(args)))
        fc.attach_out_of_memory_observer(failing)
        try:
            fc.attach_out_of_memory_observer(3)
        except TypeError as err:
            print("REFUSED:", err)
        fc.set_per_process_memory_fraction(0.5, 0)
        try:
            fc.caching_allocator_alloc(200 * 2**20)
        except fc.OutOfMemoryError as err:
            print("RESULT:" + json.dumps({"seen": seen, "message": str(err)[:40]}))
        """,
        env=memory_env(256 * MIB),
    )
    assert "REFUSED: the observer must be callable, not int" in process.stdout
    assert (
        'RESULT:{"seen": [[0, %d, %d, %d]], "message": "CUDA out of memory. Tried to allocate 20"}'
        % (200 * MIB, 128 * MIB, 256 * MIB)
    ) in process.stdout, process.stdout + process.stderr
    assert "[ERROR] Allocator: an out-of-memory observer raised" in process.stderr
    assert "KeyError: \"the observer's own bug\"" in process.stderr


def test_a_bad_environment_path_names_its_variable() -> None:
    out = run_json(
        """
        import ferrocache, torch
        try:
            ferrocache.install()
        except ValueError as err:
            result([str(err), ferrocache.is_installed()])
        """,
        fake_torch=True,
        env={"FERROCACHE_SNAPSHOT_ON_OOM": "oom-{node}.pickle"},
    )
    assert out == [
        "FERROCACHE_SNAPSHOT_ON_OOM: snapshot path 'oom-{node}.pickle' has unknown placeholder(s) "
        "{node}; the placeholders are {rank}, {local_rank} and {pid}",
        False,
    ]
