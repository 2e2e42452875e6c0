"""ferrocache as a drop-in under real PyTorch: torch.cuda's memory API by torch's own names,
Python stacks in snapshots, torch.OutOfMemoryError, PyTorch's own tools on ferrocache's output,
and examples/drop_in.py. PyTorch's native allocator on the same fake CUDA (the same code run
without install()) is the reference for keys and layouts."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, RESULT_MARK

from torch_env import GIB, require_real_torch, run_torch, run_torch_process, torch_env

require_real_torch()

#: A small program, the same under both allocators: two live tensors, one freed, one peak.
PROGRAM = """
    a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty(1000, dtype=torch.uint8, device="cuda")
    c = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    del c
"""


#: result() for children run with run_torch_process (whose stderr the test reads).
#: (Indented as the tests' code is, which is dedented after.)
PRINT_RESULT = f"""
        def result(value):
            print({RESULT_MARK!r} + json.dumps(value), flush=True)
"""


def _child_result(stdout: str) -> Any:
    line = next(line for line in stdout.splitlines() if line.startswith(RESULT_MARK))
    return json.loads(line[len(RESULT_MARK) :])


def _program(code: str, install: bool = True) -> str:
    """``code`` after PROGRAM, after ferrocache.install() unless ``install`` is False."""
    head = "ferrocache.install()\n" if install else ""
    return head + textwrap.dedent(PROGRAM) + textwrap.dedent(code)


def _both(code: str, **env: str) -> tuple[Any, Any]:
    """``code`` after PROGRAM under PyTorch's allocator, then under ferrocache."""
    native = run_torch(_program(code, install=False), env=torch_env(**env))
    ours = run_torch(_program(code), env=torch_env(**env))
    return native, ours


def test_memory_stats_have_pytorchs_keys_and_figures() -> None:
    native, ours = _both(
        """
        flat = torch.cuda.memory_stats()
        nested = torch.cuda.memory_stats_as_nested_dict()
        result({"flat": flat, "nested_keys": sorted(nested), "order": list(flat),
                "same_module": torch.cuda.memory.memory_stats() == flat})
        """
    )
    assert isinstance(native, dict) and isinstance(ours, dict)
    assert set(ours["flat"]) == set(native["flat"])
    assert ours["order"] == native["order"]
    assert ours["nested_keys"] == native["nested_keys"]
    assert ours["same_module"]
    # The same program, the same rules: the figures agree too (device counters included).
    assert ours["flat"] == native["flat"]


DEVICE_FORMS = ["None", "0", "'cuda'", "'cuda:0'", "torch.device('cuda')", "torch.device('cuda', 0)"]


def test_each_function_answers_by_torchs_names_for_every_device_form() -> None:
    out = run_torch(
        _program(
            f"""
        import warnings
        warnings.simplefilter("ignore", FutureWarning)
        names = {{
            "memory_allocated": ferrocache.memory_allocated,
            "max_memory_allocated": ferrocache.max_memory_allocated,
            "memory_reserved": ferrocache.memory_reserved,
            "max_memory_reserved": ferrocache.max_memory_reserved,
            "memory_cached": ferrocache.memory_reserved,
            "max_memory_cached": ferrocache.max_memory_reserved,
        }}
        answers = {{}}
        for name, ours in names.items():
            for module in (torch.cuda, torch.cuda.memory):
                for form in {DEVICE_FORMS!r}:
                    device = eval(form)
                    answers[f"{{module.__name__}}.{{name}}({{form}})"] = [
                        getattr(module, name)(device), ours(device)]
        result(answers)
        """
        )
    )
    assert len(out) == 6 * 2 * len(DEVICE_FORMS)
    for call, (torch_value, ours) in out.items():
        assert torch_value == ours, call
    assert out["torch.cuda.memory_allocated(None)"][0] == (1 << 20) + 1024
    assert out["torch.cuda.max_memory_allocated(None)"][0] == (4 << 20) + 1024


@pytest.mark.parametrize(
    "reset", ["reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached"]
)
@pytest.mark.parametrize("module", ["torch.cuda", "torch.cuda.memory"])
def test_peak_resets_by_torchs_names(reset: str, module: str) -> None:
    out = run_torch(
        _program(
            f"""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = torch.cuda.max_memory_allocated()
            {module}.{reset}("cuda:0")
        result({{"before": before, "after": torch.cuda.max_memory_allocated(),
                "reserved_peak": torch.cuda.max_memory_reserved(),
                "reserved": torch.cuda.memory_reserved(),
                "warned": [str(w.category.__name__) for w in caught]}})
        """
        )
    )
    assert out["before"] == (4 << 20) + 1024
    assert out["after"] == (1 << 20) + 1024
    assert out["reserved_peak"] == out["reserved"]
    assert out["warned"] == ([] if reset == "reset_peak_memory_stats" else ["FutureWarning"])


def test_reset_accumulated_memory_stats_by_torchs_name() -> None:
    out = run_torch(
        _program(
            """
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.cuda.memory.reset_accumulated_memory_stats(torch.device("cuda"))
        stats = torch.cuda.memory_stats()
        result({"before": before, "after": stats["allocation.all.allocated"],
                "current": stats["allocation.all.current"]})
        """
        )
    )
    assert out == {"before": 3, "after": 0, "current": 2}


def test_memory_summary_is_pytorchs_table_line_for_line() -> None:
    native, ours = _both(
        """
        result([torch.cuda.memory_summary(), torch.cuda.memory.memory_summary("cuda:0", True)])
        """
    )
    assert ours == native


def test_nothing_changes_without_install() -> None:
    out = run_torch(
        """
        names = ("memory_stats", "memory_summary", "_snapshot", "_record_memory_history")
        before = {n: getattr(torch.cuda.memory, n) for n in names}
        ferrocache.memory_stats()  # ferrocache used, not installed
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        result({"same": all(getattr(torch.cuda.memory, n) is f for n, f in before.items()),
                "module": torch.cuda.memory._snapshot.__module__,
                "allocated": torch.cuda.memory_allocated(),
                "replaced": ferrocache.torch_api.replaced_names()})
        """
    )
    assert out == {"same": True, "module": "torch.cuda.memory", "allocated": 1 << 20, "replaced": []}


def test_install_reports_what_it_replaced() -> None:
    out = run_torch(
        """
        ferrocache.install()
        result(ferrocache.torch_api.replaced_names())
        """
    )
    for name in ("memory_stats", "max_memory_allocated", "_record_memory_history", "_snapshot"):
        assert f"torch.cuda.memory.{name}" in out
    assert "torch.cuda.memory_stats" in out and "torch.cuda.empty_cache" not in out


def test_caching_allocator_alloc_and_delete_keep_working() -> None:
    out = run_torch(
        """
        ferrocache.install()
        before = torch.cuda.memory_allocated()
        ptr = torch.cuda.caching_allocator_alloc(5000)
        during = torch.cuda.memory_allocated()
        torch.cuda.caching_allocator_delete(ptr)
        ours = ferrocache.caching_allocator_alloc(5000)
        ferrocache.caching_allocator_delete(ours)
        result([before, during, torch.cuda.memory_allocated()])
        """
    )
    assert out == [0, 5120, 0]


STACKS = """
    def make_activation():
        return torch.empty(4096, dtype=torch.uint8, device="cuda")

    RECORD(enabled="all", context="all", stacks="python")
    kept = make_activation()
    dropped = make_activation()
    del dropped
    snap = torch.cuda.memory._snapshot()
    blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    trace = snap["device_traces"][0]
    result({
        "block_frames": [b["frames"] for b in blocks],
        "actions": [e["action"] for e in trace],
        "trace_frames": [e["frames"] for e in trace],
        "traceback": torch.cuda.memory._allocation_traceback(kept.data_ptr())
        if hasattr(torch.cuda.memory, "_allocation_traceback") else "absent",
    })
"""


@pytest.mark.parametrize(
    "record", ["torch.cuda.memory._record_memory_history", "ferrocache.record_memory_history"]
)
def test_snapshots_carry_python_frames(record: str) -> None:
    out = run_torch("ferrocache.install()\n" + textwrap.dedent(STACKS).replace("RECORD", record))
    (frames,) = out["block_frames"]
    assert frames[0]["name"] == "make_activation" and frames[1]["name"] == "<module>"
    assert set(frames[0]) == {"filename", "line", "name"} and frames[0]["line"] > 0
    assert out["actions"][:3] == ["segment_alloc", "alloc", "alloc"]
    alloc_frames = out["trace_frames"][1]
    assert alloc_frames == frames, "the alloc entry and the live block share the stack"
    # context="all": frees carry their own stack (the `del` line), not the allocation's.
    free = out["trace_frames"][out["actions"].index("free_requested")]
    assert free[0]["name"] == "<module>" and free[0]["line"] > frames[1]["line"]
    if out["traceback"] != "absent":
        assert out["traceback"] == frames


def test_native_allocator_records_the_same_frames_for_comparison() -> None:
    """The reference: PyTorch's own allocator on the fake CUDA, with Python stacks."""
    out = run_torch(textwrap.dedent(STACKS).replace("RECORD", "torch.cuda.memory._record_memory_history"))
    (frames,) = out["block_frames"]
    names = [f["name"] for f in frames]
    assert "make_activation" in names and "<module>" in names


def test_context_state_keeps_stacks_for_live_blocks_only() -> None:
    out = run_torch(
        "ferrocache.install()\n"
        + textwrap.dedent(STACKS).replace("RECORD", "torch.cuda.memory._record_memory_history").replace(
            'context="all"', 'context="state"'
        )
    )
    assert out["block_frames"][0][0]["name"] == "make_activation"
    assert all(frames == [] for frames in out["trace_frames"])


def test_with_recording_off_allocations_do_not_call_into_python() -> None:
    out = run_torch(
        """
        ferrocache.install()
        calls = []
        def watch(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "_gather_python_stack":
                calls.append(1)
        torch.cuda.memory._record_memory_history(enabled="all", context="all")
        sys.setprofile(watch)
        x = torch.empty(100, device="cuda")
        sys.setprofile(None)
        recording = len(calls)
        torch.cuda.memory._record_memory_history(enabled=None)
        sys.setprofile(watch)
        y = torch.empty(100, device="cuda")
        del x, y
        sys.setprofile(None)
        snap = torch.cuda.memory._snapshot()
        result({"recording": recording, "off": len(calls) - recording,
                "frames": [b["frames"] for s in snap["segments"] for b in s["blocks"]],
                "trace": snap["device_traces"][0]})
        """
    )
    assert out["recording"] >= 1
    assert out["off"] == 0
    assert all(f == [] for f in out["frames"]) and out["trace"] == []


def test_out_of_memory_is_torchs_out_of_memory_error_and_is_recorded() -> None:
    process = run_torch_process(
        PRINT_RESULT
        + """
        ferrocache.install()
        torch.cuda.memory._record_memory_history()
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
            caught = None
        except torch.cuda.OutOfMemoryError as err:
            caught = {"type": type(err).__name__, "is_oom": isinstance(err, torch.OutOfMemoryError),
                      "message": str(err)}
        after = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # still works
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        oom = [e for e in trace if e["action"] == "oom"]
        result({"caught": caught, "oom": oom, "num_ooms": torch.cuda.memory_stats()["num_ooms"]})
        """,
        env=torch_env(2 * GIB),
    )
    out = _child_result(process.stdout)
    caught = out["caught"]
    assert caught is not None and caught["type"] == "OutOfMemoryError" and caught["is_oom"]
    assert caught["message"].startswith("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0")
    # The message is the allocator's, unchanged: the ERROR line says the same.
    assert f"[ERROR] Allocator: {caught['message']}" in process.stderr
    assert "[WARN]" not in process.stderr
    (oom,) = out["oom"]
    assert oom["size"] == 8 << 30 and "device_free" in oom and "addr" not in oom
    assert out["num_ooms"] == 1


@pytest.mark.parametrize("why", ["no shim", "no compiler"])
def test_without_the_shim_out_of_memory_is_a_runtime_error_and_one_warn_line(
    why: str, tmp_path: Path
) -> None:
    env = (
        {"FERROCACHE_OOM_SHIM": str(tmp_path / "missing.so")}
        if why == "no shim"
        else {"FERROCACHE_CACHE_DIR": str(tmp_path), "CXX": "false"}
    )
    process = run_torch_process(
        PRINT_RESULT
        + """
        ferrocache.install()
        try:
            torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        except RuntimeError as err:
            result({"type": type(err).__name__, "message": str(err),
                    "oom": isinstance(err, torch.cuda.OutOfMemoryError)})
        """,
        env=torch_env(2 * GIB, **env),
    )
    out = _child_result(process.stdout)
    assert out["type"] == "RuntimeError" and not out["oom"]
    assert out["message"].startswith("CUDA out of memory. Tried to allocate 8.00 GiB.")
    warns = [l for l in process.stderr.splitlines() if l.startswith("[WARN]")]
    # One line for the shim; without a compiler, one more for the allocator object for PyTorch
    # (python/ferrocache/frontend.cpp), which cannot be built either: each names what is lost.
    oom_warns = [w for w in warns if "RuntimeError, not torch.OutOfMemoryError" in w]
    assert len(oom_warns) == 1, process.stderr
    assert ("missing.so" if why == "no shim" else "could not build") in oom_warns[0]
    others = [w for w in warns if w not in oom_warns]
    if why == "no shim":
        assert others == [], process.stderr
    else:
        (frontend,) = others
        assert "own allocator object is unavailable" in frontend
        assert "could not build frontend.cpp" in frontend


def test_pytorchs_memory_viz_reads_the_dumped_snapshot(tmp_path: Path) -> None:
    dump = tmp_path / "snap.pickle"
    run_torch(
        f"""
        ferrocache.install()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
        def layer():
            return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        x, y = layer(), layer()
        del x
        torch.cuda.memory._dump_snapshot({str(dump)!r})
        result(None)
        """
    )
    with open(dump, "rb") as f:
        data = pickle.load(f)
    assert data["device_traces"][0] and data["segments"]
    for plot in ("trace_plot", "segment_plot"):
        html = tmp_path / f"{plot}.html"
        subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", plot, str(dump), "-o", str(html)],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "MemoryViz.js" in html.read_text()
    text = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace", str(dump)],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert "cudaMalloc" in text and "del " in text
    stats = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(dump)],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert "segment" in stats.lower() or stats


def test_the_drop_in_example_runs_unchanged_with_install(tmp_path: Path) -> None:
    script = REPO / "examples" / "drop_in.py"
    results = {}
    for mode in ("native", "ferrocache"):
        out_dir = tmp_path / mode
        env = dict(os.environ, **torch_env(256 << 20), DROP_IN_OUT=str(out_dir))
        env["FERROCACHE"] = "1" if mode == "ferrocache" else "0"
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout + done.stderr
        results[mode] = done.stdout
        with open(out_dir / "snapshot.pickle", "rb") as f:
            snap = pickle.load(f)
        frames = [fr for e in snap["device_traces"][0] for fr in e["frames"]]
        assert any(fr["name"] == "train_step" for fr in frames), mode
    for text in results.values():
        assert "out of memory at batch 64; retrying with 32" in text
        assert "step 3 batch" in text and "peak" in text
    # The same program, the same peaks.
    assert results["native"] == results["ferrocache"]
