"""ferrocache.advise() on the process's recorded history, on snapshots, and the line an
out-of-memory adds (the fake libcuda; real PyTorch in real_torch/test_advise_real.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MIB, REPO, memory_env, run_json, run_python

pytestmark = pytest.mark.usefixtures("fake_libcuda")

#: The command the package installs, beside this interpreter.
COMMAND = Path(sys.executable).parent / "ferrocache"
ORACLE = REPO / "tests" / "data" / "oracle"

#: A split cached block strands 40 MiB: on a 200 MiB GPU PyTorch's defaults cannot serve a
#: last 50 MiB although only 120 MiB are live; expandable segments can.
STRANDED = """
import ferrocache as fc
M = 2**20
first = fc.caching_allocator_alloc(100 * M)
fc.caching_allocator_delete(first)
b = fc.caching_allocator_alloc(60 * M)
c = fc.caching_allocator_alloc(60 * M)
"""


def test_advise_names_a_setting_and_its_str_is_the_table() -> None:
    out = run_json(
        "import ferrocache as fc\nfc.record_memory_history()\n"
        + STRANDED
        + """
advice = fc.advise()
result({"table": str(advice), "conf": advice.recommended_conf, "env": advice.recommended_env,
        "current": advice.current_peak_reserved_bytes, "current_conf": advice.current_conf,
        "recommended": advice.recommended_peak_reserved_bytes,
        "defaults": advice.defaults_peak_reserved_bytes, "capacity": advice.capacity_bytes,
        "exports": advice.exports, "saving": advice.saving_bytes,
        "candidates": len(advice.candidates), "max_reserved": fc.max_memory_reserved()})
""",
        env=memory_env(200 * MIB),
    )
    # Under its own setting the replay reserves what the process did.
    assert out["current"] == out["max_reserved"] == 160 * MIB
    assert out["current_conf"] == "" and out["defaults"] == out["current"]
    assert out["capacity"] == 200 * MIB, "the device's memory"
    # Expandable segments (ties go to the fewest device allocations, then the fewest keys).
    assert out["conf"].startswith("expandable_segments:True"), out["table"]
    assert out["env"] == {}
    assert out["recommended"] < out["current"] and out["saving"] == out["current"] - out["recommended"]
    assert out["exports"] == [f"export PYTORCH_CUDA_ALLOC_CONF={out['conf']}"]
    assert out["candidates"] >= 10
    table = out["table"]
    assert "this process (device 0)" in table
    assert "PyTorch defaults (the recording's setting)" in table
    assert f"\n  export PYTORCH_CUDA_ALLOC_CONF={out['conf']}\n" in table


def test_without_history_the_error_says_how_to_record() -> None:
    out = run_json(
        STRANDED
        + """
try:
    fc.advise()
except fc.NoHistoryError as err:
    result({"message": str(err), "runtime": isinstance(err, RuntimeError)})
""",
        env=memory_env(1 << 30),
    )
    assert out["runtime"]
    assert "torch.cuda.memory._record_memory_history()" in out["message"]
    assert "ferrocache.record_memory_history()" in out["message"]


def test_bad_arguments_are_refused_before_any_search() -> None:
    out = run_json(
        """
import ferrocache as fc
refused = []
for kwargs in ({"capacity_gib": 0}, {"capacity_gib": -1}, {"max_candidates": 0}):
    try:
        fc.advise(**kwargs)
    except ValueError as err:
        refused.append(str(err))
result(refused)
"""
    )
    assert len(out) == 3


def _command() -> Path:
    if not COMMAND.is_file():
        pytest.skip(f"no ferrocache command at {COMMAND}: install the package (scripts/python-tests)")
    return COMMAND


def _table_rows(text: str) -> list[str]:
    """The ranked table's lines (from its header to the first blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#"))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start:end]


def test_the_table_is_the_one_tune_prints_on_the_same_history(tmp_path: Path) -> None:
    snapshot = tmp_path / "run.pickle"
    out = run_json(
        "import ferrocache as fc\nfc.record_memory_history()\n"
        + STRANDED
        + f"""
advice = fc.advise(capacity_gib=1)
fc.dump_snapshot({str(snapshot)!r})
from_file = fc.advise(snapshot={str(snapshot)!r}, capacity_gib=1)
result({{"table": str(advice), "file": str(from_file), "conf": advice.recommended_conf}})
""",
        env=memory_env(200 * MIB),
    )
    done = subprocess.run(
        [str(_command()), "tune", str(snapshot), "--capacity-gib", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The same candidates, figures and order; only the trace's name differs.
    command_rows = _table_rows(done.stdout)
    assert _table_rows(out["file"]) == command_rows
    assert _table_rows(out["table"]) == command_rows
    assert f"export PYTORCH_CUDA_ALLOC_CONF={out['conf']}" in done.stdout


def test_advise_on_a_snapshot_matches_the_command() -> None:
    trace = ORACLE / "training_max_split_64.pickle"
    out = run_json(
        f"""
import ferrocache as fc
advice = fc.advise(snapshot={str(trace)!r})
with open({str(trace)!r}, "rb") as f:
    again = fc.advise(snapshot=f.read(), max_candidates=5)
result({{"conf": advice.recommended_conf, "peak": advice.recommended_peak_reserved_bytes,
        "current_conf": advice.current_conf, "limited": len(again.candidates)}})
"""
    )
    done = subprocess.run(
        [str(_command()), "tune", str(trace), "--json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    tuned = json.loads(done.stdout)
    assert out["conf"] == tuned["recommended_conf"]
    assert out["peak"] == tuned["peak_reserved_bytes"]
    assert out["current_conf"] == "max_split_size_mb:64"
    # The five simplest, and the recorded setting, always judged.
    assert out["limited"] == 6


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[ERROR]")]


def test_an_out_of_memory_with_history_names_a_setting_that_does_serve_the_program() -> None:
    program = STRANDED + """
try:
    fc.caching_allocator_alloc(50 * M)
    print("served")
except fc.OutOfMemoryError:
    print("caught")
"""
    process = run_python("import ferrocache as fc\nfc.record_memory_history()\n" + program,
                         env=memory_env(200 * MIB))  # fmt: skip
    assert "caught" in process.stdout
    errors = _error_lines(process.stderr)
    assert len(errors) == 2, process.stderr
    assert errors[0].startswith("[ERROR] Allocator: CUDA out of memory. Tried to allocate 50.00 MiB")
    named = re.match(r"\[ERROR\] Allocator: advice: PYTORCH_CUDA_ALLOC_CONF=(\S+) would have served", errors[1])
    assert named, errors[1]
    assert (
        " would have served this program so far (4 recorded allocations and frees, and this "
        "request) within the 200.0 MiB it could use on GPU 0: peak reserved "
    ) in errors[1], errors[1]
    assert errors[1].endswith("; ferrocache.advise() shows the table")
    # The advice is right: the same program under that setting is served on the same GPU.
    conf = shlex.split(named.group(1))[0]
    again = run_python(program, env=memory_env(200 * MIB, PYTORCH_CUDA_ALLOC_CONF=conf))
    assert "served" in again.stdout, (conf, again.stderr)


def test_live_bytes_beyond_the_memory_are_said_so() -> None:
    process = run_python(
        """
import ferrocache as fc
fc.record_memory_history()
a = fc.caching_allocator_alloc(150 * 2**20)
try:
    fc.caching_allocator_alloc(100 * 2**20)
except fc.OutOfMemoryError:
    print("caught")
""",
        env=memory_env(200 * MIB),
    )
    errors = _error_lines(process.stderr)
    assert len(errors) == 2, process.stderr
    assert errors[1] == (
        "[ERROR] Allocator: advice: no PYTORCH_CUDA_ALLOC_CONF would have served this program: "
        "its live tensors and this request alone need 250.0 MiB, more than the 200.0 MiB it could "
        "use on GPU 0"
    )


def test_without_history_one_line_per_process_says_how_to_get_the_advice() -> None:
    process = run_python(
        """
import ferrocache as fc
for _ in range(3):
    try:
        fc.caching_allocator_alloc(300 * 2**20)
    except fc.OutOfMemoryError:
        pass
""",
        env=memory_env(200 * MIB),
    )
    errors = _error_lines(process.stderr)
    hints = [line for line in errors if "to learn which PYTORCH_CUDA_ALLOC_CONF" in line]
    assert len(hints) == 1, process.stderr
    assert len(errors) == 4
    assert errors[1] == hints[0], "right after the first out-of-memory"
    assert "torch.cuda.memory._record_memory_history()" in hints[0]
