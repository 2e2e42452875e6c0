"""The fault sweep under real PyTorch (``scripts/torch-fault-sweep``, docs/robustness.md) kept
working, on a sample: every 250th runtime or driver call of its loop fails with an out-of-memory
and with a sticky illegal address. Each run must end reported or without effect, and a death
only where PyTorch's own allocator dies the same way; the whole sweep (7,510 runs) is run by
hand."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO
from torch_env import TORCH_VERSION, require_real_torch

require_real_torch()


def test_a_sample_of_the_torch_fault_sweep_is_clean(tmp_path) -> None:
    out = tmp_path / "summary.json"
    command = [sys.executable, str(REPO / "python/tools/torch_fault_sweep.py"),
               "--stride", "250", "--workers", "2", "--kinds",
               "out_of_memory,illegal_address_sticky", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    # CUDA start-up, the loop's allocations and copies: both the runtime's calls and the driver's
    # (ferrocache's) are counted.
    calls = summary["calls_by_function"]
    assert calls.get("cudaMemcpyAsync", 0) + calls.get("cudaMemcpy", 0) > 0, calls
    assert calls.get("cuMemAlloc_v2", 0) > 0, calls
    if TORCH_VERSION >= (2, 12):
        assert "cudaStreamBeginCapture" in calls, "the loop captures a CUDA graph"
    assert summary["runs"] == 2 * len(range(1, summary["calls"] + 1, 250))
    verdicts = {v for counts in summary["counts"].values() for v in counts}
    assert verdicts <= {"reported", "no effect", "DIED as under PyTorch's allocator"}, summary
    assert summary["counts"]["out_of_memory"].get("reported", 0) > 0
