"""The GPU check's rehearsal: ``scripts/gpu-check`` end to end with real PyTorch on the fake CUDA
(two fake GPUs, so that the peer copy runs too), with the wheel ``FERROCACHE_WHEEL`` names
(scripts/test-all) or else the installed package. Every step runs; the work that needs kernels,
which the fake cannot run, reports "skipped on the fake"; nothing fails; the summary line comes
last; the results page goes to a temporary place, never over docs/gpu-results.md.

Kept short (a minute or two): two of the chosen real-PyTorch tests, two training steps, one
benchmark repetition.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from torch_env import FAKE_CUDA, GIB, require_real_torch

require_real_torch()
if not FAKE_CUDA:  # on a GPU, scripts/gpu-check is the real thing, not a rehearsal
    pytest.skip("the rehearsal runs on the fake CUDA", allow_module_level=True)

GPU_CHECK = REPO / "scripts" / "gpu-check"
DOCS_RESULTS = REPO / "docs" / "gpu-results.md"
#: Two of the chosen tests: enough to show that the list runs under pytest from the check.
TESTS = "test_install_makes_ferrocache_pytorchs_allocator_once or test_caching_allocator_alloc_and_delete_keep_working"
SUMMARY = re.compile(
    r"gpu-check: (\d+) passed, 0 failed, (\d+) skipped in \d+ s; "
    r"step time ferrocache/native n/a \(skipped on the fake: needs kernels, which the fake CUDA cannot run\)"
)


def test_the_gpu_check_runs_end_to_end_on_the_fake(tmp_path: Path) -> None:
    docs_before = DOCS_RESULTS.read_bytes() if DOCS_RESULTS.exists() else None
    out, results = tmp_path / "out", tmp_path / "gpu-results.md"
    env = dict(os.environ, FAKE_LIBCUDA_DEVICE_COUNT="2", FAKE_LIBCUDA_TOTAL_MEM=str(4 * GIB), FAKE_CUDA_QUIET="1")
    command = [sys.executable, str(GPU_CHECK), "--out", str(out), "--results", str(results), "--steps", "2",
               "--bench-repetitions", "1", "--bench-iterations", "20", "--tests", TESTS]  # fmt: skip
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    summary = process.stdout.strip().splitlines()[-1]
    print(summary)  # shown by pytest -rA: the rehearsal's summary line
    report = json.loads((out / "report.json").read_text())
    statuses = {check["key"]: (check["status"], check["summary"]) for check in report["checks"]}
    assert process.returncode == 0, (summary, statuses, process.stderr[-3000:])
    assert SUMMARY.fullmatch(summary), summary
    assert report["environment"]["fake_cuda"] is True and report["environment"]["device_count"] == 2
    if os.environ.get("FERROCACHE_WHEEL"):
        assert report["environment"]["install"].startswith(f"{os.environ['FERROCACHE_WHEEL']} unpacked in ")
    # Every step ran: none was cut by the budget, none failed.
    assert list(statuses) == [
        "real_torch", "step_time", "losses", "peaks", "streams", "oom", "empty_cache", "expandable",
        "cross_stream", "graphs", "peer", "sleep", "memory_api", "host_cost", "example", "replay", "tune",
    ]  # fmt: skip
    assert not [key for key, (_, why) in statuses.items() if why.startswith("time budget")]
    assert statuses["real_torch"] == ("pass", "2 passed")
    # What the fake can do passes; the rest says why it did not run.
    for key in ("empty_cache", "expandable", "peer", "sleep"):
        assert statuses[key][0] == "pass", (key, statuses[key])
    assert statuses["host_cost"][0] == "measured"
    needs_kernels = ("step_time", "losses", "peaks", "streams", "oom", "cross_stream", "graphs", "example", "replay", "tune")
    for key in needs_kernels:
        assert statuses[key][0] == "skipped" and statuses[key][1].startswith("skipped on the fake: "), statuses[key]
    compare = REPO / "python" / "tools" / "memory_api" / "compare.py"
    assert statuses["memory_api"][0] == ("measured" if compare.is_file() else "skipped"), statuses["memory_api"]
    page = results.read_text()
    assert page == (out / "gpu-results.md").read_text() and f"`{summary}`" in page
    assert (DOCS_RESULTS.read_bytes() if DOCS_RESULTS.exists() else None) == docs_before
    passed, skipped = (int(n) for n in SUMMARY.fullmatch(summary).groups())  # type: ignore[union-attr]
    assert (passed, skipped) == (2 + 5 + (1 if compare.is_file() else 0), 10 + (0 if compare.is_file() else 1))
