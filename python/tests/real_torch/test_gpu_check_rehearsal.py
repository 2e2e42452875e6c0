"""The GPU check's rehearsal: ``scripts/gpu-check`` end to end with real PyTorch on the fake CUDA
(two fake GPUs, so that the peer copy runs too), with the wheel ``FERROCACHE_WHEEL`` names
(scripts/test-all) or else the installed package. It checks the plumbing, not the figures: on
the fake no kernel computes anything, so what needs kernels says "skipped on the fake" today and
may run with meaningless figures tomorrow; what must hold either way is that every step runs
within its cap, what would come back from the GPU machine fits the device tool's limits, and
the results page goes to a temporary place, never over docs/gpu-results.md.

A second run hangs one step on purpose: it is cut at its cap, the next steps run, and a SIGTERM
halfway leaves a complete report and no child behind.

Kept short: two of the chosen real-PyTorch tests, two steps per run, one round, one benchmark
repetition. Under torch 2.11, the GPU machine's, by hand (docs/python.md, "The rehearsal").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import REPO

from torch_env import FAKE_CUDA, GIB, require_real_torch

require_real_torch()
if not FAKE_CUDA:  # on a GPU, scripts/gpu-check is the real thing, not a rehearsal
    pytest.skip("the rehearsal runs on the fake CUDA", allow_module_level=True)

sys.path.insert(0, str(REPO / "python" / "tools"))

from gpucheck import cli  # noqa: E402

GPU_CHECK = REPO / "scripts" / "gpu-check"
DOCS_RESULTS = REPO / "docs" / "gpu-results.md"
#: Two of the chosen tests: enough to show that the list runs under pytest from the check.
TESTS = "test_install_makes_ferrocache_pytorchs_allocator_once or test_caching_allocator_alloc_and_delete_keep_working"
SUMMARY = re.compile(r"gpu-check: (\d+) passed, (\d+) failed, (\d+) skipped in \d+ s; step time ferrocache/native .+")
#: The steps whose outcome hangs on what kernels compute (in part: expandable judges streams and
#: graphs too, peer a converting copy): on the fake, any outcome but a plumbing failure (a cap,
#: the budget) will do. Their parts that need no kernel are checked on their own below.
NEED_KERNELS = ("step_time", "losses", "peaks", "streams", "oom", "cross_stream", "graphs", "expandable", "peer",
                "example")
#: What a plumbing failure says.
PLUMBING_FAILURES = ("stopped at the step's cap", "not run", "time budget", "cut short", "not reached")


def fake_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, FAKE_LIBCUDA_TOTAL_MEM=str(4 * GIB), FAKE_CUDA_QUIET="1", **extra)


def assert_it_would_all_come_back(out: Path) -> None:
    assert cli.output_problems(out) == []
    assert {path.name for path in out.iterdir()} <= set(cli.OUTPUT_FILES), sorted(out.iterdir())


def test_the_gpu_check_runs_end_to_end_on_the_fake(tmp_path: Path) -> None:
    docs_before = DOCS_RESULTS.read_bytes() if DOCS_RESULTS.exists() else None
    out, results = tmp_path / "out", tmp_path / "gpu-results.md"
    command = [sys.executable, str(GPU_CHECK), "--out", str(out), "--results", str(results), "--steps", "2",
               "--warmup", "0", "--rounds", "1", "--train-steps", "2", "--bench-repetitions", "1",
               "--bench-iterations", "20", "--tests", TESTS]  # fmt: skip
    process = subprocess.run(command, env=fake_env(FAKE_LIBCUDA_DEVICE_COUNT="2"), capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    summary = process.stdout.strip().splitlines()[-1]
    print(summary)  # shown by pytest -rA: the rehearsal's summary line
    report = json.loads((out / "report.json").read_text())
    statuses = {check["key"]: (check["status"], check["summary"]) for check in report["checks"]}
    failing = {key for key, (status, _) in statuses.items() if status in ("FAIL", "ERROR")}
    assert process.returncode == (1 if failing else 0), (summary, statuses, process.stderr[-3000:])
    assert failing <= set(NEED_KERNELS), (failing, statuses)
    assert SUMMARY.fullmatch(summary), summary
    assert report["environment"]["fake_cuda"] is True and report["environment"]["device_count"] == 2
    assert report["finished"] is True and report["stopped"] is None
    if os.environ.get("FERROCACHE_WHEEL"):
        assert report["environment"]["install"].startswith(f"{os.environ['FERROCACHE_WHEEL']} unpacked in ")
    # Every step ran, within its cap.
    assert list(statuses) == list(cli.STEPS)
    plumbing = [key for key, (_, why) in statuses.items() if why.startswith(PLUMBING_FAILURES)]
    assert not plumbing, {key: statuses[key] for key in plumbing}
    assert statuses["real_torch"] == ("pass", "2 passed")
    # What the fake can do without kernels passes: empty_cache, under expandable segments too,
    # the peer copies (copies, not kernels), sleep and wake.
    for key in ("empty_cache", "sleep"):
        assert statuses[key][0] == "pass", (key, statuses[key])
    tables = {check["key"]: check["tables"] for check in report["checks"]}
    parts = {row[0]: row[1] for row in tables["expandable"][0]["rows"]}
    assert parts["torch.cuda.empty_cache() gives memory back"] == "pass", parts
    copies = [row[1:3] for row in tables["peer"][0]["rows"]]
    assert len(copies) == 4 and all(cell == "True" for row in copies for cell in row), copies
    assert statuses["host_cost"][0] == "measured"
    compare = REPO / "python" / "tools" / "memory_api" / "compare.py"
    assert statuses["memory_api"][0] == ("measured" if compare.is_file() else "skipped"), statuses["memory_api"]
    # What comes back: the page, the report, the two archives (the call's tee adds the log).
    assert_it_would_all_come_back(out)
    assert {path.name for path in out.iterdir()} == {"gpu-results.md", "report.json", "logs.tar.gz"} | (
        {"snapshots.tar.gz"} if statuses["losses"][0] != "skipped" else set()
    )
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"logs/steptime-0-native.log", "logs/train-native.log", "logs/sleep.log", "raw/sleep.json"} <= names
    page = results.read_text()
    assert page == (out / "gpu-results.md").read_text() and f"`{summary}`" in page
    assert (DOCS_RESULTS.read_bytes() if DOCS_RESULTS.exists() else None) == docs_before


def test_a_hung_step_is_capped_and_a_sigterm_halfway_leaves_a_complete_report(tmp_path: Path) -> None:
    """The features workload hangs; its step ends at its cap (here 5 s) and the steps after it
    run; a SIGTERM once the sleep step is done ends the check: every step is in the report,
    the one it cut short and those it never reached say so, and no child is left."""
    out, pids = tmp_path / "out", tmp_path / "hung.pids"
    env = fake_env(FAKE_LIBCUDA_DEVICE_COUNT="1", GPU_CHECK_TEST_HANG="features", GPU_CHECK_TEST_STEP_CAP="streams:5",
                   GPU_CHECK_TEST_HANG_PIDS=str(pids))  # fmt: skip
    command = [sys.executable, str(GPU_CHECK), "--out", str(out), "--results", str(tmp_path / "page.md"),
               "--skip", "real_torch,step_time,losses,peaks"]  # fmt: skip
    running = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def statuses() -> dict[str, tuple[str, str]]:
        try:
            report = json.loads((out / "report.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return {check["key"]: (check["status"], check["summary"]) for check in report["checks"]}

    def sleep_done() -> bool:
        sleep = statuses().get("sleep")
        return sleep is not None and not sleep[1].startswith("not reached yet")

    deadline = time.monotonic() + 240
    while not sleep_done():
        assert running.poll() is None, running.communicate()
        assert time.monotonic() < deadline, statuses()
        time.sleep(0.2)
    running.send_signal(signal.SIGTERM)
    stdout, stderr = running.communicate(timeout=60)
    assert running.returncode == 1, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    done = statuses()
    assert list(done) == list(cli.STEPS) and report["finished"] is True
    assert report["stopped"].startswith("stopped by SIGTERM after "), report["stopped"]
    # The hang: cut at the cap; the other features runs not started past it; the steps after ran.
    with tarfile.open(out / "logs.tar.gz") as archive:
        features = json.load(archive.extractfile("raw/features.json"))  # type: ignore[arg-type]
    assert features["native"]["error"].startswith("stopped at the step's cap, after 5 s"), features["native"]
    assert done["streams"] == ("ERROR", "not run: the step's cap or the budget was spent")
    assert done["peer"][0] == "skipped" and done["sleep"][0] == "pass", done
    # The SIGTERM: whatever ran is cut short, the rest not run; every child gone.
    after_sleep = list(cli.STEPS)[list(cli.STEPS).index("sleep") + 1 :]
    for key in after_sleep:
        status, why = done[key]
        assert why.startswith(("cut short: stopped by SIGTERM", "not run: stopped by SIGTERM")) or status in (
            "pass", "measured"), (key, done[key])  # fmt: skip
    assert any(done[key][1].startswith(("cut short", "not run")) for key in after_sleep), done
    for pid in pids.read_text().split():
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert "(stopped by SIGTERM after " in stdout.strip().splitlines()[-1]
    assert_it_would_all_come_back(out)
