"""The snapshot at the first out of memory, and PyTorch's out-of-memory observers, under real
PyTorch in a single process (the torchrun job is in test_distributed.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch_env import GIB, require_real_torch, run_torch, run_torch_process, torch_env

require_real_torch()

GROW_UNTIL_OOM = """
def grow_activations():
    return torch.empty(1 << 40, dtype=torch.uint8, device="cuda")

kept = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
outcome = {{}}
for attempt in range(2):
    try:
        grow_activations()
    except torch.OutOfMemoryError as err:
        outcome.setdefault("type", type(err).__name__)
        outcome.setdefault("written_before_python_saw_it", os.path.exists({written!r}))
        outcome.setdefault("message", str(err).split(". GPU")[0])
"""


def read(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def test_install_snapshot_on_oom_writes_the_snapshot_before_the_error(tmp_path: Path) -> None:
    written = tmp_path / "oom.pickle"
    process = run_torch_process(
        "def result(value):\n    print('RESULT:' + json.dumps(value))\n"
        f"ferrocache.install(snapshot_on_oom={str(written)!r})\n"
        + GROW_UNTIL_OOM.format(written=str(written))
        + "result(outcome)\n",
        env=torch_env(GIB),
    )
    assert '"written_before_python_saw_it": true' in process.stdout, process.stdout + process.stderr
    assert '"type": "OutOfMemoryError"' in process.stdout
    assert '"message": "CUDA out of memory. Tried to allocate 1024.00 GiB"' in process.stdout
    notes = [line for line in process.stderr.splitlines() if "snapshot written" in line]
    assert notes == [
        f"[ERROR] Allocator: out of memory on device 0: snapshot written to {written} "
        "(open it at https://pytorch.org/memory_viz)"
    ], process.stderr
    snapshot = read(written)
    trace = snapshot["device_traces"][0]
    (oom,) = [entry for entry in trace if entry["action"] == "oom"]
    assert oom["size"] == 1 << 40
    assert "grow_activations" in [frame["name"] for frame in oom["frames"]]
    # History from the start: the first allocation is there, with its stack.
    (first,) = [entry for entry in trace if entry["action"] == "alloc" and entry["size"] == 8 << 20]
    assert first["frames"] and first["frames"][0]["filename"] == "<string>"
    assert [segment["device"] for segment in snapshot["segments"]] == [0]


def test_the_environment_variable_with_a_pid_placeholder(tmp_path: Path) -> None:
    out = run_torch(
        "ferrocache.install()\n"
        + GROW_UNTIL_OOM.format(written=str(tmp_path / "unused.pickle"))
        + "outcome['pid'] = os.getpid()\nresult(outcome)\n",
        env=torch_env(GIB, FERROCACHE_SNAPSHOT_ON_OOM=str(tmp_path / "oom-{pid}.pickle")),
    )
    assert out["type"] == "OutOfMemoryError"
    assert [p.name for p in tmp_path.iterdir()] == [f"oom-{out['pid']}.pickle"]


def test_a_bad_placeholder_is_refused_before_anything_changes() -> None:
    out = run_torch(
        """
        try:
            ferrocache.install(snapshot_on_oom="oom-{host}.pickle")
        except ValueError as err:
            result({"error": str(err), "installed": ferrocache.is_installed(),
                    "cuda": torch.cuda.is_initialized()})
        """
    )
    assert out == {
        "error": "snapshot path 'oom-{host}.pickle' has unknown placeholder(s) {host}; the "
        "placeholders are {rank}, {local_rank} and {pid}",
        "installed": False,
        "cuda": False,
    }


def test_pytorchs_oom_observer_recipe_works_with_ferrocache(tmp_path: Path) -> None:
    """PyTorch's own recipe (an observer that dumps a snapshot) runs unchanged: PyTorch refuses
    observers for a plugged-in allocator, install() puts ferrocache's attachment in its place."""
    written = tmp_path / "observer.pickle"
    out = run_torch(
        f"""
        import pickle
        ferrocache.install()
        torch.cuda.memory._record_memory_history(max_entries=100000)
        seen = []
        def oom_observer(device, alloc, device_alloc, device_free):
            seen.append([device, alloc, device_alloc, device_free])
            with open({str(written)!r}, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        torch._C._cuda_attach_out_of_memory_observer(oom_observer)
        try:
            torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            result({{"seen": seen, "replaced": "torch._C._cuda_attach_out_of_memory_observer"
                     in ferrocache.torch_api.replaced_names()}})
        """,
        env=torch_env(2 * GIB),
    )
    assert out == {"seen": [[0, 3 << 30, 2 * GIB, 2 * GIB]], "replaced": True}
    assert any(entry["action"] == "oom" for entry in read(written)["device_traces"][0])
