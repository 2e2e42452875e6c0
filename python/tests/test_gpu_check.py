"""scripts/gpu-check without a GPU: arguments, the no-GPU exits, the whole orchestration with
a PyTorch that claims a GPU (every workload then fails, and the report says so), the verdicts,
the report, the interleaved benchmark and the replay step."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "python" / "tools"))

from gpucheck import bench, checks, cli, real_torch, workloads  # noqa: E402
from gpucheck.report import ERROR, FAIL, MEASURED, PASS, SKIPPED, CheckResult, Report, Table  # noqa: E402

GPU_CHECK = REPO / "scripts" / "gpu-check"


def fake_torch(root: Path, body: str) -> Path:
    """A ``torch`` package whose ``__init__`` is ``body``; returns the directory to put on the path."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return root


def gpu_check(args: list[str], pythonpath: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """scripts/gpu-check with ``--out OUT``'s results page beside it, never over docs/."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    out = Path(args[args.index("--out") + 1])
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), "--python", sys.executable, "--results", str(out / "page.md"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_arguments() -> None:
    args = cli.parse_args([])
    assert args.out == Path("gpu-check-out") and args.budget == 360 and args.rounds == 3
    assert args.results == REPO / "docs" / "gpu-results.md"
    assert args.steps - args.warmup >= checks.STEP_TIME_STEPS, "at least 150 timed steps per run"
    args = cli.parse_args(["--out", "x", "--steps", "3", "--skip-install", "--skip", "peer, sleep"])
    assert (args.out, args.steps, args.skip_install) == (Path("x"), 3, True)
    assert cli.skipped_steps(args) == ["peer", "sleep"]
    for wrong in (["--steps", "0"], ["--skip", "replay"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            cli.parse_args(wrong)


def test_without_pytorch_it_says_so_and_exits_2(tmp_path: Path) -> None:
    path = fake_torch(tmp_path / "lib", "raise ImportError('this PyTorch is broken')")
    process = gpu_check(["--out", str(tmp_path / "out")], path)
    assert process.returncode == 2, process.stderr
    assert "cannot run: no usable PyTorch: import torch failed: this PyTorch is broken" in process.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["problem"].startswith("no usable PyTorch")
    page = (tmp_path / "out" / "page.md").read_text()
    assert "**Could not run: no usable PyTorch" in page
    assert (tmp_path / "out" / "gpu-results.md").read_text() == page
    assert process.stdout.splitlines()[-1].startswith("gpu-check: could not run in ")


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    path = fake_torch(
        tmp_path / "lib",
        """
        __version__ = "2.9.0+cpu"
        class version:
            cuda = None
        class cuda:
            @staticmethod
            def is_available():
                return False
        """,
    )
    process = gpu_check(["--out", str(tmp_path / "out")], path)
    assert process.returncode == 2
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["problem"].startswith("no CUDA GPU: torch.cuda.is_available() is False")
    assert report["environment"]["torch"] == "2.9.0+cpu"


def test_the_whole_run_with_a_pytorch_that_only_claims_a_gpu(tmp_path: Path) -> None:
    """Installs ferrocache as on a GPU machine (the wheel where FERROCACHE_WHEEL names one, else
    the installed package); every workload then fails on this stand-in PyTorch, and the report
    must show each item as failed or skipped, never as passed."""
    path = fake_torch(
        tmp_path / "lib",
        """
        __version__ = "2.9.0+fake"
        class version:
            cuda = "12.8"
        class _Props:
            name, total_memory, major, minor = "Fake GPU", 80 * 2**30, 9, 0
        class cuda:
            is_available = staticmethod(lambda: True)
            device_count = staticmethod(lambda: 1)
            get_device_properties = staticmethod(lambda index: _Props())
        """,
    )
    out = tmp_path / "out"
    process = gpu_check(
        ["--out", str(out), "--steps", "1", "--rounds", "1", "--train-steps", "1", "--bench-repetitions", "1",
         "--bench-iterations", "1", "--tests", "test_install_makes_ferrocache_pytorchs_allocator_once",
         "--commit", "abc1234"],
        path,
    )  # fmt: skip
    assert process.returncode == 1, process.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["problem"] is None
    assert report["environment"]["device"] == "Fake GPU" and report["environment"]["capability"] == "9.0"
    assert report["environment"]["ferrocache"].startswith("0.")
    assert report["environment"]["commit"] == "abc1234 (--commit)"
    assert report["finished"] is True and report["stopped"] is None
    statuses = {c["key"]: c["status"] for c in report["checks"]}
    assert list(statuses) == list(cli.STEPS) == [
        "real_torch", "step_time", "losses", "peaks", "streams", "oom", "empty_cache", "expandable",
        "cross_stream", "graphs", "peer", "sleep", "memory_api", "host_cost", "example",
    ]  # fmt: skip
    assert PASS not in statuses.values() and MEASURED not in statuses.values(), statuses
    assert statuses["peer"] == SKIPPED and statuses["step_time"] == ERROR
    summary = process.stdout.splitlines()[-1]
    assert summary.startswith("gpu-check: 0 passed, ") and " skipped in " in summary, summary
    assert summary.endswith("; step time ferrocache/native n/a (the training failed: see the results page)")
    page = (out / "page.md").read_text()
    assert f"| 2 | {checks.TITLES['step_time']} | **ERROR** |" in page
    assert sorted(path.name for path in out.iterdir()) == ["gpu-results.md", "logs.tar.gz", "page.md", "report.json"]
    assert cli.output_problems(out) == []
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = archive.getnames()
    assert {"logs/train-native.log", "logs/steptime-0-native.log", "logs/features-ferrocache.log"} <= set(names)


#: A stand-in PyTorch that claims one GPU (every workload then fails quickly).
CLAIMS_A_GPU = """
__version__ = "2.9.0+fake"
class version:
    cuda = "12.8"
class _Props:
    name, total_memory, major, minor = "Fake GPU", 80 * 2**30, 9, 0
class cuda:
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    get_device_properties = staticmethod(lambda index: _Props())
"""


def wait_for(condition: "Callable[[], bool]", seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds} s for {what}")
        time.sleep(0.2)


def process_is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # dead, not yet reaped by its parent


def test_a_hung_step_is_capped_the_next_ones_run_and_sigterm_leaves_a_complete_report(tmp_path: Path) -> None:
    """The features workload hangs (a test-only hook); its step is cut at its cap (here 3 s)
    and the steps after it run; a SIGTERM while the benchmark's workers hang then ends every
    child's group and leaves a report that lists every step, reached or not."""
    path = fake_torch(tmp_path / "lib", CLAIMS_A_GPU)
    out, pids = tmp_path / "out", tmp_path / "hung.pids"
    env = dict(os.environ, PYTHONPATH=str(path), GPU_CHECK_TEST_STEP_CAP="streams:3", GPU_CHECK_TEST_HANG_PIDS=str(pids))
    command = [sys.executable, str(GPU_CHECK), "--python", sys.executable, "--results", str(out / "page.md"),
               "--out", str(out), "--skip", "real_torch,step_time,losses,peaks", "--bench-repetitions", "1"]  # fmt: skip
    started = time.monotonic()
    process = subprocess.run(command, env=dict(env, GPU_CHECK_TEST_HANG="features"), capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    statuses = {c["key"]: (c["status"], c["summary"]) for c in report["checks"]}
    assert time.monotonic() - started < 60, "the hang cost its step's cap, not the budget"
    assert list(statuses) == list(cli.STEPS), statuses
    # native's run hung and was stopped at the cap; ferrocache's, which the item judges, never started.
    assert statuses["streams"] == (ERROR, "not run: the step's cap or the budget was spent"), statuses["streams"]
    assert statuses["oom"][0] == ERROR, "judged on the same capped runs"
    with tarfile.open(out / "logs.tar.gz") as archive:
        raw = json.load(archive.extractfile("raw/features.json"))  # type: ignore[arg-type]
    assert raw["native"]["error"].startswith("stopped at the step's cap, after 3 s")
    for key in ("sleep", "memory_api", "host_cost", "example"):
        assert not statuses[key][1].startswith(("not run", "time budget")), (key, statuses[key])
    assert len(pids.read_text().split()) == 1, "the other three features runs were not started past the cap"
    assert all(process_is_gone(int(pid)) for pid in pids.read_text().split())
    assert process.returncode == 1 and report["finished"] is True and report["stopped"] is None

    # SIGTERM while the benchmark's workers hang: halfway through the steps.
    pids.unlink()
    running = subprocess.Popen(command, env=dict(env, GPU_CHECK_TEST_HANG="bench"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: pids.is_file() and len(pids.read_text().split()) == 2, 60, "both benchmark workers to hang")
    during = json.loads((out / "report.json").read_text())
    assert during["finished"] is False
    assert {c["key"]: c["summary"] for c in during["checks"]}["example"].startswith("not reached yet")
    running.send_signal(signal.SIGTERM)
    stdout, stderr = running.communicate(timeout=30)
    assert running.returncode == 1, stderr
    report = json.loads((out / "report.json").read_text())
    statuses = {c["key"]: (c["status"], c["summary"]) for c in report["checks"]}
    assert list(statuses) == list(cli.STEPS)
    assert report["finished"] is True and report["stopped"].startswith("stopped by SIGTERM after ")
    assert statuses["sleep"][0] == ERROR and not statuses["sleep"][1].startswith("not run")
    assert statuses["host_cost"][0] == ERROR and statuses["host_cost"][1].startswith("cut short: stopped by SIGTERM")
    assert statuses["example"] == (SKIPPED, f"not run: {report['stopped']}")
    assert all(process_is_gone(int(pid)) for pid in pids.read_text().split()), "the workers' groups were ended"
    assert "(stopped by SIGTERM after " in stdout.splitlines()[-1]
    assert cli.output_problems(out) == []
    page = (out / "gpu-results.md").read_text()
    assert "**Stopped before the end: stopped by SIGTERM after " in page


#: The device tool's limits (/work/.library/device/README.md): a command of at most 2,000
#: characters, at most 8 carried paths, timeout_s at most 600; at most 8 files come back.
DOCUMENTED_CALL = re.compile(r"### The call\n.*?```json\n(?P<call>.*?)\n```", re.S)


def test_the_documented_call_fits_the_device_tools_limits() -> None:
    """docs/python.md writes the call down once; it carries dist/ (ignored by git), finds the
    wheel by a glob, leaves the tool's timeout room after the budget and the SIGTERM, and
    what it leaves in $OUT is at most 8 files, none in a folder."""
    match = DOCUMENTED_CALL.search((REPO / "docs" / "python.md").read_text())
    assert match, "docs/python.md has a '### The call' section with a json block"
    call = json.loads(match["call"])
    command = call["command"]
    assert set(call) == {"command", "carry", "timeout_s"}
    assert len(command) <= 2000 and len(call["carry"]) <= 8 and 1 <= call["timeout_s"] <= 600
    assert "dist" in call["carry"] and "--wheel 'dist/ferrocache-*.whl'" in command
    assert "/dist/" in (REPO / ".gitignore").read_text(), "dist/ is ignored: carried, not copied with the tree"
    assert "manylinux" not in command, "the wheel is found by its glob, not by its tags"
    timeout = re.search(r"timeout -k (\d+) -s TERM (\d+) scripts/gpu-check", command)
    assert timeout, command
    kill_after, term_after = int(timeout[1]), int(timeout[2])
    budget = cli.parse_args([]).budget
    assert budget < term_after and term_after + kill_after < call["timeout_s"], "SIGTERM, then the tool's kill"
    assert call["timeout_s"] + 120 + 300 <= 900, "a start, the call, and room for a retry in 15 minutes"
    assert command.endswith("--out $OUT 2>&1 | tee $OUT/log") and "set -o pipefail" in command
    assert len(cli.OUTPUT_FILES) <= 8 and cli.CALL_LOG == "log"
    assert all(cli.RETURNABLE_NAME.fullmatch(name) for name in cli.OUTPUT_FILES)


def test_what_would_not_come_back_is_named(tmp_path: Path) -> None:
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "a" / "b" / "ok.txt").write_text("x")
    (tmp_path / "a" / "big file").write_bytes(b"\0" * ((16 << 20) + 1))
    assert sorted(cli.output_problems(tmp_path)) == [
        "12 files, more than 8",
        "a/b/c/deep.txt: more than 2 folders down",
        "a/big file: 16777217 bytes, over 16 MiB",
        "a/big file: a name the device tool does not bring back",
    ]


def test_the_snapshots_archive_stays_under_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both snapshots where they fit compressed; else the native one alone, which the replay
    needs; else none, and a note says why."""
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path / "out")]), Report(started="now"), tmp_path / "out",
                      work=tmp_path / "work")  # fmt: skip
    ctx.out.mkdir()
    ctx.snapshots.mkdir(parents=True)
    (ctx.snapshots / cli.NATIVE_SNAPSHOT).write_bytes(b"native " * 1000)
    (ctx.snapshots / cli.FERROCACHE_SNAPSHOT).write_bytes(os.urandom(64 << 10))  # does not compress
    assert cli.archive_snapshots(ctx) == [cli.NATIVE_SNAPSHOT, cli.FERROCACHE_SNAPSHOT]
    monkeypatch.setattr(cli, "ARCHIVE_LIMIT", 32 << 10)
    assert cli.archive_snapshots(ctx) == [cli.NATIVE_SNAPSHOT]
    with tarfile.open(ctx.out / cli.SNAPSHOTS_ARCHIVE) as archive:
        assert archive.getnames() == [cli.NATIVE_SNAPSHOT]
    assert ctx.report.notes[-1] == f"{cli.FERROCACHE_SNAPSHOT} left out of snapshots.tar.gz: over 0 MiB"
    (ctx.snapshots / cli.NATIVE_SNAPSHOT).write_bytes(os.urandom(64 << 10))
    assert cli.archive_snapshots(ctx) == []
    assert ctx.report.notes[-1].startswith("no snapshot came back: compressed, each is over ")


def test_verdict_on_losses() -> None:
    same = {"native": {"losses": [2.5, 2.0]}, "ferrocache": {"losses": [2.5, 2.0]}}
    result = checks.losses(same)
    assert result.status == PASS and "bit-identical" in result.summary
    result = checks.losses({**same, "ferrocache-expandable": {"losses": [2.5, 2.0000001]}})
    assert result.status == FAIL
    assert result.summary == "losses differ from native: ferrocache-expandable (max |diff| 1e-07)"
    assert checks.losses({"native": {"error": "x"}}).status == ERROR
    control_differs = {**same, "native-history": {"losses": [2.5, 2.1]}, "ferrocache": {"losses": [2.5, 2.2]}}
    result = checks.losses(control_differs)
    assert result.status == ERROR and result.summary.startswith("inconclusive: two native runs differ")
    result = checks.losses({**same, "native-history": {"losses": [2.5, 2.0]}, "ferrocache": {"error": "boom"}})
    assert result.status == FAIL and result.summary == "losses differ from native: ferrocache (failed: boom)"


def test_verdict_on_host_cost_and_peaks() -> None:
    result = checks.host_cost({"samples": {"native": {"4096": [100, 110, 90]}, "ferrocache": {"4096": [50, 60, 55]}}})
    assert result.status == MEASURED and result.data["ratios"] == {4096: 55 / 100}
    assert result.tables[0].rows == [["4 KiB", "100 ns", "55 ns", "0.55", "3"]]
    runs = {
        "native": {"peak_reserved": 2 << 30, "peak_allocated": 1 << 30, "step_seconds": [9, 9, 9, 0.010, 0.012, 0.011]},
        "ferrocache": {"peak_reserved": 3 << 30, "peak_allocated": 1 << 30, "step_seconds": [9, 9, 9, 0.02]},
    }
    result = checks.peaks(runs)
    assert result.summary == "ferrocache: reserved x1.50 of native"
    assert result.tables[0].rows[0][3] == "11.00 ms", "warm-up steps are left out"


def test_verdicts_on_streams_oom_and_empty_cache() -> None:
    good = {
        "streams": {"correct": True, "reused_while_pending": False, "reused_after_sync": True},
        "oom": {"raised": "RuntimeError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 x",
                "continued": True},
        "empty_cache": {"size": 100, "free_start": 1000, "free_holding": 900, "free_cached": 900,
                        "free_emptied": 1000, "reserved_cached": 100, "reserved_emptied": 0},
    }  # fmt: skip
    native = {"oom": {"raised": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 y"}}
    assert checks.streams({"ferrocache": good}).status == PASS
    assert checks.out_of_memory({"native": native, "ferrocache": good}).status == PASS
    assert checks.empty_cache({"ferrocache": good}).status == PASS
    bad = {
        "streams": {"correct": False, "reused_while_pending": True},
        "oom": {**good["oom"], "message": "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0"},
        "empty_cache": {**good["empty_cache"], "free_emptied": 905},
    }
    assert checks.streams({"ferrocache": bad}).status == FAIL
    assert checks.out_of_memory({"native": native, "ferrocache": bad}).status == FAIL
    # NVML's sentence for this process: in both messages or in neither.
    this_process = " is free. Including non-PyTorch memory, this process has 1.00 GiB memory in use."
    with_nvml = {"oom": {**native["oom"], "message": native["oom"]["message"] + this_process}}
    assert checks.out_of_memory({"native": with_nvml, "ferrocache": good}).status == FAIL
    ours_with_nvml = {"oom": {**good["oom"], "message": good["oom"]["message"] + this_process}}
    assert checks.out_of_memory({"native": with_nvml, "ferrocache": ours_with_nvml}).status == PASS
    assert checks.empty_cache({"ferrocache": bad}).status == FAIL
    broken = {"streams": {"error": "Traceback\nRuntimeError: boom"}}
    result = checks.streams({"ferrocache": broken})
    assert result.status == ERROR and result.summary == "RuntimeError: boom"


def test_verdict_on_sleep_and_wake_shows_each_setting_against_a_pinned_copy() -> None:
    gib = 1 << 30
    seconds = {"d2h_pinned": 0.04, "sleep": 0.05, "sleep_first": 0.5, "d2h_pageable": 0.2,
               "h2d_pinned": 0.04, "wake": 0.08, "wake_first": 0.1, "h2d_pageable": 0.2}
    good = {
        "bytes": gib, "blocks": 16, "cycles": 3, "skipped_bytes": 0, "freed_while_asleep": gib, "intact": True,
        "host_memory_pinned": True, "host_allocations": [1, 0, 0], "host_synchronizations": {"sleep": 1, "wake": 1},
        "seconds": seconds, "gib_per_s": {part: 1 / time for part, time in seconds.items()},
    }  # fmt: skip
    passed = checks.sleep_bandwidth({"ferrocache": good, "ferrocache-expandable": good})
    assert passed.status == PASS, passed.summary
    assert "ferrocache: sleep 80%, wake 50% of a pinned copy" in passed.summary, passed.summary
    assert "ferrocache-expandable: sleep 80%" in passed.summary and "(goal 80%)" in passed.summary
    assert len(passed.tables) == 2 and passed.tables[0].headers[2] == "GiB/s"
    rows = {row[0]: row for row in passed.tables[0].rows}
    assert rows["plain pinned device-to-host copy (the bus)"][2:] == ["25.00", "100%"]
    assert rows["ferrocache.sleep(backup=True), pinned memory kept"][2:] == ["20.00", "80%"]
    for wrong in ({"intact": False}, {"skipped_bytes": 1 << 20}, {"freed_while_asleep": gib // 2},
                  {"host_memory_pinned": False}):  # fmt: skip
        assert checks.sleep_bandwidth({"ferrocache": good, "ferrocache-expandable": {**good, **wrong}}).status == FAIL
    broken = checks.sleep_bandwidth({"ferrocache": good, "ferrocache-expandable": {"error": "Traceback\nRuntimeError: boom"}})
    assert broken.status == ERROR and broken.summary == "ferrocache-expandable: RuntimeError: boom"


def test_verdict_on_the_replay() -> None:
    assert checks.replay({"skipped": "no ferrocache command"}, {}).status == SKIPPED
    missing = checks.replay({"returncode": 2, "stderr_tail": "unrecognized subcommand 'replay'"}, {})
    assert missing.status == SKIPPED and "unrecognized subcommand" in missing.summary
    assert checks.replay({"returncode": 0, "rows": None}, {}).status == ERROR
    rows = [
        {"conf": "", "peak_reserved_bytes": 6 << 20, "native_peak_reserved_bytes": 5 << 20,
         "native_segment_allocs": 7, "matching_segment_allocs": 7, "ooms": 0},
        {"conf": "expandable_segments:True", "peak_reserved_bytes": 4 << 20,
         "native_peak_reserved_bytes": 5 << 20, "native_segment_allocs": 7, "matching_segment_allocs": 2,
         "ooms": 0},
    ]  # fmt: skip
    runs = {"native": {"peak_reserved": 5 << 20}, "ferrocache": {"peak_reserved": 6 << 20},
            "ferrocache-expandable": {"peak_reserved": 4 << 20}}  # fmt: skip
    result = checks.replay({"returncode": 0, "rows": rows}, runs)
    assert result.status == MEASURED
    assert result.summary == "PyTorch's segment decisions reproduced: 7 of 7"
    assert result.tables[0].rows == [
        ['"" (defaults)', "6.0 MiB", "6.0 MiB", "5.0 MiB", "5.0 MiB", "7/7", "0"],
        ["'expandable_segments:True'", "4.0 MiB", "4.0 MiB", "5.0 MiB", "5.0 MiB", "2/7", "0"],
    ]


def test_verdict_on_tune() -> None:
    assert checks.tune({"skipped": "no ferrocache command"}).status == SKIPPED
    assert checks.tune({"returncode": 2, "stderr_tail": "unrecognized subcommand 'tune'"}).status == ERROR
    tuned = {"recommended_conf": "expandable_segments:True", "recommended_env": {},
             "peak_reserved_bytes": 4 << 20, "defaults_peak_reserved_bytes": 8 << 20, "candidates": [{}] * 88}  # fmt: skip
    confirmed = checks.tune({"returncode": 0, "tuned": tuned, "confirm_rows": [{"peak_reserved_bytes": 4 << 20}]})
    assert confirmed.status == PASS
    assert confirmed.summary == (
        "recommended 'expandable_segments:True': 4.0 MiB at the peak, 4.0 MiB (50.0%) less than the "
        "defaults; replay agrees"
    )
    assert confirmed.tables[0].rows == [
        ["'expandable_segments:True'", "4.0 MiB", "8.0 MiB", "4.0 MiB (50.0%)", "4.0 MiB", "88"]
    ]
    differs = checks.tune({"returncode": 0, "tuned": tuned, "confirm_rows": [{"peak_reserved_bytes": 5 << 20}]})
    assert differs.status == FAIL
    failed = checks.tune({"returncode": 0, "tuned": tuned, "confirm_rows": None, "confirm_error": "boom"})
    assert failed.status == ERROR and "boom" in failed.summary
    none = checks.tune({"returncode": 0, "tuned": dict(tuned, recommended_conf=None)})
    assert none.status == MEASURED and "no setting fits" in none.summary


def test_the_replay_step_runs_the_ferrocache_command_and_tolerates_its_absence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = tmp_path / "native.pickle"
    snapshot.write_bytes(b"x")
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), Report(started="now"), tmp_path, work=tmp_path / "work")
    ctx.logs.mkdir()
    command = tmp_path / "ferrocache"
    command.write_text('#!/bin/sh\necho "$@" >&2\necho \'{"conf": ""}\'\necho \'{"conf": "x"}\'\n')
    command.chmod(0o755)
    monkeypatch.setenv(cli.COMMAND_ENV, str(command))
    outcome = cli.run_replay(ctx, snapshot)
    assert outcome["returncode"] == 0 and outcome["rows"] == [{"conf": ""}, {"conf": "x"}]
    assert (ctx.logs / "replay.log").read_text() == (
        f"$ {command} replay {snapshot} --json --conf  --conf expandable_segments:True\n"
        f"replay {snapshot} --json --conf  --conf expandable_segments:True\n"
    )
    command.write_text("#!/bin/sh\necho \"error: unrecognized subcommand 'replay'\" >&2\nexit 2\n")
    outcome = cli.run_replay(ctx, snapshot)
    assert checks.replay(outcome, {}).status == SKIPPED
    assert cli.run_replay(ctx, tmp_path / "none.pickle") == {"skipped": f"no native snapshot at {tmp_path / 'none.pickle'}"}
    monkeypatch.setenv(cli.COMMAND_ENV, str(tmp_path / "missing"))
    assert "no ferrocache command" in cli.run_replay(ctx, snapshot)["skipped"]
    assert "no ferrocache command" in cli.run_tune(ctx, snapshot)["skipped"]


#: The command the package installed beside this interpreter (scripts/python-tests).
INSTALLED_COMMAND = Path(sys.executable).parent / "ferrocache"


def test_the_replay_and_tune_steps_with_the_installed_command_on_a_pytorch_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runs on the GPU machine, on one of PyTorch's own recordings (tests/data/oracle) as
    the native snapshot, with the command the package installed (no cargo)."""
    if not INSTALLED_COMMAND.is_file():
        pytest.skip(f"no installed ferrocache command at {INSTALLED_COMMAND} (scripts/python-tests)")
    monkeypatch.delenv(cli.COMMAND_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no cargo, no other ferrocache
    snapshot = REPO / "tests" / "data" / "oracle" / "training_defaults.pickle"
    report = Report(started="now")
    report.environment["total_memory"] = 8 * 2**30
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), report, tmp_path, python=sys.executable, work=tmp_path / "w")
    ctx.logs.mkdir()
    assert cli.ferrocache_command(ctx) == str(INSTALLED_COMMAND)
    replayed = checks.replay(cli.run_replay(ctx, snapshot), {})
    assert replayed.status == MEASURED, replayed.summary
    assert replayed.summary.startswith("PyTorch's segment decisions reproduced: ")
    outcome = cli.run_tune(ctx, snapshot)
    assert outcome["tuned"]["capacity_bytes"] == 8 * 2**30
    assert outcome["tuned"]["capacity_source"] == "given"
    result = checks.tune(outcome)
    assert result.status == PASS, (result.summary, outcome)
    assert "replay agrees" in result.summary
    assert (ctx.raw / "tune.json").is_file() and (ctx.logs / "tune-confirm.log").is_file()
    assert cli.capacity_gib(8 * 2**30) == "8.0" and cli.capacity_gib(None) is None


def test_analyse_replays_and_tunes_what_came_back_without_a_gpu(tmp_path: Path) -> None:
    """scripts/gpu-check --analyse DIR on a GPU run's files (here one of PyTorch's own
    recordings as the native snapshot): the replay and the tune are added to its report,
    written to --results and --out; DIR itself is only read."""
    if not INSTALLED_COMMAND.is_file():
        pytest.skip(f"no installed ferrocache command at {INSTALLED_COMMAND} (scripts/python-tests)")
    returned = tmp_path / "files_at"
    returned.mkdir()
    report = Report(started="then", environment={"total_memory": 8 * 2**30}, finished=True)
    report.checks = [CheckResult("sleep", checks.TITLES["sleep"], PASS, "every byte back")]
    (returned / "report.json").write_text(report.to_json())
    with tarfile.open(returned / "snapshots.tar.gz", "w:gz") as archive:
        archive.add(REPO / "tests" / "data" / "oracle" / "training_defaults.pickle", arcname=cli.NATIVE_SNAPSHOT)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "train-native.json").write_text(json.dumps({"peak_reserved": 5 << 20}))
    with tarfile.open(returned / "logs.tar.gz", "w:gz") as archive:
        archive.add(raw / "train-native.json", arcname="raw/train-native.json")
    returned.chmod(0o555)  # the device tool's files_at is read-only
    out = tmp_path / "out"
    try:
        process = subprocess.run(
            [sys.executable, str(GPU_CHECK), "--analyse", str(returned), "--out", str(out), "--results", str(out / "page.md")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        returned.chmod(0o755)
    assert process.returncode == 0, process.stderr
    analysed = json.loads((out / "report.json").read_text())
    statuses = {c["key"]: (c["status"], c["summary"]) for c in analysed["checks"]}
    assert list(statuses) == ["sleep", "replay", "tune"]
    assert statuses["replay"][0] == MEASURED and statuses["replay"][1].startswith("PyTorch's segment decisions")
    assert statuses["tune"][0] == PASS and statuses["tune"][1].endswith("replay agrees"), statuses["tune"]
    replayed = next(c for c in analysed["checks"] if c["key"] == "replay")["tables"][0]["rows"][0]
    assert replayed[4] == "5.0 MiB", "PyTorch on the GPU: the native run's figure from logs.tar.gz"
    assert (out / "page.md").read_text() == (out / "gpu-results.md").read_text()
    assert process.stdout.splitlines()[-1].startswith("gpu-check: 3 passed, 0 failed, 0 skipped in ")


def test_the_report() -> None:
    report = Report(started="2026-01-01T00:00:00", environment={"device": "H100"}, seconds=12)
    report.checks = [
        CheckResult("a", "first | check", PASS, "fine"),
        CheckResult("b", "second", FAIL, "bad\nnews", [Table("Details:", ["x", "y"], [["1", "2|3"]])]),
    ]
    report.notes.append("a note")
    text = report.to_markdown()
    assert "| 1 | first \\| check | pass | fine |" in text
    assert "| 2 | second | **FAIL** | bad news |" in text
    assert "## 2. second\n\nDetails:\n\n| x | y |\n|---|---|\n| 1 | 2\\|3 |" in text
    assert "| device | H100 |" in text and "- a note" in text
    assert report.failed() and json.loads(report.to_json())["checks"][1]["status"] == FAIL


WORKER = """
import json, sys, time
name = sys.argv[1]
if name == "broken":
    print("cannot start", file=sys.stderr); sys.exit(3)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "quit":
        break
    size, iterations = int(words[1]), int(words[2])
    print(json.dumps({"ns_per_op": size * (2 if name == "slow" else 1) + iterations}), flush=True)
"""


def test_without_pytest_the_tests_are_skipped_with_how_to_bring_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # no site-packages: no pytest
    python.chmod(0o755)
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), Report(started="now"), tmp_path, python=str(python),
                      work=tmp_path / "work")  # fmt: skip
    monkeypatch.delenv(cli.WHEEL_ENV, raising=False)
    result = cli.run_real_torch_tests(ctx)
    assert result.status == SKIPPED
    assert result.summary == (
        f"pytest is not installed for {python}: put its wheels beside the ferrocache wheel "
        "(python3 -m pip download -d dist/ pytest exceptiongroup tomli)"
    )
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "pytest-0-py3-none-any.whl").write_bytes(b"not a wheel")
    ctx.args.wheel = str(dist / "ferrocache-0.1.0-py3-none-any.whl")
    assert cli.ensure_pytest(ctx) == f"pytest's wheels in {dist} did not unpack: File is not a zip file"
    assert ctx.site is not None
    shutil.rmtree(ctx.site)


def test_the_wheel_is_unpacked_without_pip_and_its_command_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the GPU machine: FERROCACHE_WHEEL unpacked into a directory first on PYTHONPATH, and
    the ``ferrocache`` command found there (scripts/test-all's wheel stage sets the variable)."""
    wheel = os.environ.get(cli.WHEEL_ENV)
    if not wheel:
        pytest.skip("FERROCACHE_WHEEL is not set (scripts/test-all sets it for the wheel's stage)")
    monkeypatch.delenv(cli.COMMAND_ENV, raising=False)
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), Report(started="now"), tmp_path, work=tmp_path / "work")
    try:
        assert cli.install(ctx) == sys.executable
        imported = cli.probe_ferrocache(sys.executable, ctx.env())
        assert ctx.site is not None and str(ctx.site) in imported, imported
        command = cli.ferrocache_command(ctx)
        assert command == str(ctx.site / "ferrocache.scripts" / "ferrocache")
        version = subprocess.run([command, "--version"], capture_output=True, text=True, env=ctx.env())
        assert version.stdout.startswith("ferrocache 0."), version
    finally:
        if ctx.site is not None:
            shutil.rmtree(ctx.site)


def test_a_step_that_would_not_fit_the_budget_is_skipped_with_the_reason(tmp_path: Path) -> None:
    args = cli.parse_args(["--out", str(tmp_path), "--budget", "100", "--results", str(tmp_path / "page.md")])
    ctx = cli.Context(args, Report(started="now"), tmp_path, work=tmp_path / "work")
    ran = []
    cli.guarded(ctx, "peer", lambda: ran.append(1) or CheckResult("peer", "p", PASS, ""), needs=40)
    ctx.remaining = lambda: 30.0  # type: ignore[method-assign]
    cli.guarded(ctx, "memory_api", lambda: ran.append(2) or CheckResult("memory_api", "m", PASS, ""), needs=40)
    assert ran == [1]
    skipped = ctx.report.checks[1]
    assert skipped.status == SKIPPED
    assert skipped.summary == "time budget: 30 s left of 100, the step needs about 40"
    assert ctx.report.summary_line().startswith("gpu-check: 1 passed, 0 failed, 1 skipped (still running when this ")
    assert json.loads((tmp_path / "report.json").read_text())["checks"][1]["summary"] == skipped.summary


def test_at_the_cap_pytest_gets_sigint_and_a_grace_to_write_its_report(tmp_path: Path) -> None:
    """As pytest does on SIGINT: the child writes what it has, then the group goes."""
    report = tmp_path / "report.xml"
    child = (
        "import signal, sys, time\n"
        "def interrupted(*_):\n"
        f"    open({str(report)!r}, 'w').write('<testsuites/>'); sys.exit(2)\n"
        "signal.signal(signal.SIGINT, interrupted)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    assert cli._run_all_logged([([sys.executable, "-c", child], tmp_path / "x.log")], timeout=2, grace=5) == [None]
    assert report.read_text() == "<testsuites/>" and time.monotonic() - started < 6


def test_commands_side_by_side_and_the_group_killed_at_the_deadline(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    sleeper = f"import os, subprocess, sys; p = subprocess.Popen(['sleep', '60']); open({str(child)!r}, 'w').write(str(p.pid)); p.wait()"
    commands = [
        ([sys.executable, "-c", "print('quick')"], tmp_path / "quick.log"),
        ([sys.executable, "-c", sleeper], tmp_path / "slow.log"),
    ]
    assert cli._run_all_logged(commands, timeout=5) == [0, None]
    assert (tmp_path / "quick.log").read_text().endswith("\nquick\n")
    stat = Path(f"/proc/{int(child.read_text())}/stat")
    for _ in range(50):  # the sleep, pytest's child in the real thing, went with its group
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not yet reaped
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived the deadline")
    with pytest.raises(subprocess.TimeoutExpired):
        cli._run_logged([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "x.log", timeout=1)


def test_interleaved_workers(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    commands = {name: [sys.executable, str(worker), name] for name in ("fast", "slow")}
    result = bench.interleaved(commands, [10, 20], repetitions=3, iterations=1, logs=tmp_path)
    assert result["samples"] == {"fast": {10: [11] * 3, 20: [21] * 3}, "slow": {10: [21] * 3, 20: [41] * 3}}
    assert result["order"][:6] == [
        [0, 10, "fast"], [0, 10, "slow"], [0, 20, "fast"], [0, 20, "slow"],
        [1, 10, "slow"], [1, 10, "fast"],  # the other one goes first in the next repetition
    ]  # fmt: skip
    assert bench.medians(result["samples"])["slow"] == {10: 21, 20: 41}
    broken = {"fast": commands["fast"], "broken": [sys.executable, str(worker), "broken"]}
    with pytest.raises(bench.BenchError, match="broken worker exited with status 3: cannot start"):
        bench.interleaved(broken, [10], repetitions=1, iterations=1, logs=tmp_path)


def test_the_workloads_module_parses_its_arguments() -> None:
    from gpucheck import workloads

    args = workloads.parse_args(["peer", "--allocator", "ferrocache-expandable", "--out", "r.json"])
    assert args.workload == "peer" and workloads.ALLOCATORS[args.allocator].conf == "expandable_segments:True"
    assert workloads.ALLOCATORS["ferrocache-cross-stream"] == workloads.Allocator(True, None, True)
    assert workloads.ALLOCATORS["native-expandable"].ferrocache is False
    with pytest.raises(SystemExit):
        workloads.parse_args(["train", "--allocator", "jemalloc"])


def test_only_a_kernel_on_the_fake_counts_as_skipped_on_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")
    monkeypatch.setattr(workloads, "on_fake_cuda", lambda: True)
    assert workloads.fake_cannot_run(kernel) == "needs kernels, which the fake CUDA cannot run"
    assert workloads.fake_cannot_run(RuntimeError("CUDA error: an illegal memory access")) is None
    monkeypatch.setattr(workloads, "on_fake_cuda", lambda: False)
    assert workloads.fake_cannot_run(kernel) is None, "on a GPU it is a failure"


def test_the_chosen_real_torch_tests_exist() -> None:
    """A renamed or removed test must not shorten the GPU's list silently."""
    assert real_torch.chosen(1) == [*real_torch.ON_ANY_GPU, *real_torch.ON_ONE_GPU]
    assert real_torch.chosen(2) == [*real_torch.ON_ANY_GPU, *real_torch.ON_TWO_GPUS]
    chosen = real_torch.chosen(1) + list(real_torch.ON_TWO_GPUS)
    for file, function in chosen:
        source = (REPO / real_torch.DIRECTORY / file).read_text()
        assert f"def {function}(" in source, (file, function)
    assert real_torch.node_ids(chosen[:1]) == [
        "python/tests/real_torch/test_install_real.py::test_install_makes_ferrocache_pytorchs_allocator_once"
    ]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="python.tests.real_torch.test_drop_in" name="test_a" time="1.5"/>
<testcase classname="python.tests.real_torch.test_drop_in" name="test_b[x]" time="0.2">
<failure message="AssertionError: 1 != 2&#10;more">trace</failure></testcase>
<testcase classname="python.tests.real_torch.test_cuda_graphs" name="test_c" time="0.1">
<skipped message="this torch cannot capture" /></testcase>
</testsuite></testsuites>"""


def test_real_torch_results_from_junit(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    cases = real_torch.results(xml)
    assert [(c["name"], c["outcome"], c["why"]) for c in cases] == [
        ("test_drop_in::test_a", "passed", ""),
        ("test_drop_in::test_b[x]", "failed", "AssertionError: 1 != 2"),
        ("test_cuda_graphs::test_c", "skipped", "this torch cannot capture"),
    ]
    result = checks.real_torch(cases)
    assert result.status == FAIL and result.summary == "1 passed, 1 failed, 1 skipped"
    assert result.counts() == {"passed": 1, "failed": 1, "skipped": 1}
    assert checks.real_torch(cases[:1]).status == PASS
    stopped = checks.real_torch(cases[:1], "stopped after 200 s (logs/real-torch-1.log)")
    assert stopped.status == ERROR and stopped.summary == "1 passed; stopped after 200 s (logs/real-torch-1.log)"
    assert stopped.counts() == {"passed": 1, "failed": 1, "skipped": 0}


def step_run(host: float, events: float, steps: int = 150, warmup: int = 20, round_number: int = 0) -> dict:
    """A step-time run's raw result: both models, each step the same time (warm-up steps 9 s)."""
    def model() -> dict:
        return {"host_seconds": [9.0] * warmup + [host] * steps, "event_seconds": [9.0] * warmup + [events] * steps}

    return {"models": {"launch-bound": model(), "gpu-bound": model()}, "round": round_number}


def test_verdict_on_step_time() -> None:
    runs = {
        "native": [step_run(0.010, 0.009), step_run(0.012, 0.009, round_number=1), step_run(0.011, 0.009)],
        "ferrocache": [step_run(0.0101, 0.009), step_run(0.0111, 0.009), step_run(0.0131, 0.009)],
        checks.NOISE: [step_run(0.011, 0.009), step_run(0.011, 0.009), step_run(0.011, 0.009)],
    }
    result = checks.step_time(runs, warmup=20)
    assert result.status == MEASURED
    assert result.data["ratio"] == pytest.approx(0.0111 / 0.011)
    assert result.data["noise_floor"]["launch-bound"] == {"host": 1.0, "CUDA events": 1.0}
    assert result.summary == (
        "ferrocache/native launch-bound: 1.009 host, 1.000 CUDA events (native/native 1.000, 1.000); "
        "gpu-bound: 1.009 host, 1.000 CUDA events (native/native 1.000, 1.000); 3 rounds of 150 timed steps"
    )
    row = result.tables[0].rows[1]
    assert row == ["launch-bound", "host", "ferrocache", "3", "11.10 ms", "10.10 ms", "13.10 ms", "1.0091"]
    short = checks.step_time({"native": [step_run(0.01, 0.01, steps=5)], "ferrocache": [step_run(0.01, 0.01, steps=5)]})
    assert short.summary.endswith("1 rounds of 5 timed steps; fewer than 150 steps timed")
    failed = checks.step_time({**runs, "ferrocache": [*runs["ferrocache"][:2], {"error": "exit status 1", "round": 2}]})
    assert failed.status == ERROR and failed.summary.endswith("1 run(s) failed: ferrocache round 2: exit status 1")
    assert checks.step_time({"native": [{"error": "exit status 1"}], "ferrocache": []}).status == ERROR
    fake = checks.step_time({"native": [{checks.ON_FAKE: "needs kernels"}]})
    assert fake.status == SKIPPED and fake.summary == "skipped on the fake: needs kernels"
    assert checks.losses({"native": {checks.ON_FAKE: "needs kernels"}}).status == SKIPPED


def test_verdicts_on_cross_stream_graphs_and_expandable() -> None:
    good_graphs = {"replays": 5, "correct": True, "others_intact": True, "pool": [1, 2]}
    features = {
        "native": {"cross_stream": {"reused": False, "correct": True}, "graphs": good_graphs},
        "ferrocache": {"cross_stream": {"reused": False, "correct": True}, "graphs": good_graphs},
        "ferrocache-cross-stream": {"cross_stream": {"reused": True, "correct": True}},
    }
    assert checks.cross_stream(features).status == PASS
    assert checks.graphs(features).status == PASS
    unwaited = {**features, "ferrocache-cross-stream": {"cross_stream": {"reused": True, "correct": False}}}
    assert checks.cross_stream(unwaited).status == FAIL
    moved_without_mode = {**features, "ferrocache": {"cross_stream": {"reused": True, "correct": True}}}
    assert checks.cross_stream(moved_without_mode).status == FAIL
    assert checks.graphs({"ferrocache": {"graphs": {**good_graphs, "correct": False}}}).status == FAIL
    assert checks.graphs({"ferrocache": {"graphs": {**good_graphs, "others_intact": False}}}).status == FAIL
    on_fake = {"ferrocache-cross-stream": {"cross_stream": {checks.ON_FAKE: "needs kernels"}}}
    assert checks.cross_stream(on_fake).status == SKIPPED
    expandable = {
        "streams": {"correct": True, "reused_while_pending": False},
        "graphs": good_graphs,
        "empty_cache": {"size": 100, "free_start": 1000, "free_holding": 900, "free_cached": 900,
                        "free_emptied": 1000, "reserved_cached": 100, "reserved_emptied": 0},
        "oom": {checks.ON_FAKE: "needs kernels"},
    }  # fmt: skip
    result = checks.expandable({"ferrocache-expandable": expandable})
    assert result.status == PASS and result.summary == "3 of 4 parts passed (1 skipped)"
    broken = checks.expandable({"ferrocache-expandable": {**expandable, "graphs": {"error": "Traceback\nboom"}}})
    assert broken.status == ERROR and broken.summary.endswith(": boom")


def test_verdict_on_the_peer_copy() -> None:
    assert checks.peer({}, 1).summary == "needs 2 GPUs, this machine has 1"
    good = {"copies": {"before_peer_access": True, "after_peer_access": True}, "converting": {"correct": True}}
    assert checks.peer({"native": good, "ferrocache-expandable": good}, 2).status == PASS
    faulted = {"native": good, "ferrocache-expandable": {"error": "exit status -6: illegal memory access"}}
    result = checks.peer(faulted, 2)
    assert result.status == ERROR and "ferrocache-expandable copies: exit status -6" in result.summary
    wrong = {"native": good, "ferrocache": {**good, "copies": {"before_peer_access": True, "after_peer_access": False}}}
    assert checks.peer(wrong, 2).status == FAIL
    fake = {"native": {**good, "converting": {checks.ON_FAKE: "needs kernels"}}}
    result = checks.peer(fake, 2)
    assert result.status == PASS and result.summary.endswith("the converting copy skipped on the fake")


def test_verdict_on_the_memory_api_table() -> None:
    assert checks.memory_api({"skipped": "not in this checkout"}).status == SKIPPED
    table = "| function | native | ferrocache |\n|---|---|---|\n| memory_allocated | 0 | 0 |"
    result = checks.memory_api({"returncode": 0, "stdout": table + "\n"})
    assert result.status == MEASURED and result.summary == "1 rows side by side" and result.text == table
    assert checks.memory_api({"returncode": 1, "stderr_tail": "boom"}).status == ERROR


def test_the_summary_line_counts_each_test_and_quotes_the_step_time() -> None:
    report = Report(started="now", seconds=312.4)
    tests = checks.real_torch([{"name": f"t{i}", "outcome": "passed", "seconds": 1.0} for i in range(20)])
    step = CheckResult("step_time", "t", MEASURED, "s", data={"ratio": 0.9874})
    report.checks = [tests, step, CheckResult("peer", "p", SKIPPED, "1 GPU"), CheckResult("x", "x", PASS, "")]
    assert report.summary_line() == (
        "gpu-check: 22 passed, 0 failed, 1 skipped (still running when this was written) in 312 s; "
        "step time ferrocache/native 0.987"
    )
    report.finished = True
    assert report.summary_line() == "gpu-check: 22 passed, 0 failed, 1 skipped in 312 s; step time ferrocache/native 0.987"
    report.checks = [CheckResult("step_time", "t", SKIPPED, "skipped on the fake: needs kernels")]
    assert report.summary_line() == (
        "gpu-check: 0 passed, 0 failed, 1 skipped in 312 s; step time ferrocache/native n/a "
        "(skipped on the fake: needs kernels)"
    )


def test_the_results_page_goes_to_docs_and_a_copy_to_the_output(tmp_path: Path) -> None:
    report = Report(started="now", environment={"device": "NVIDIA H200"})
    report.checks = [CheckResult("memory_api", "api", MEASURED, "1 rows", text="| a |\n|---|\n| b |")]
    report.write(tmp_path / "out", tmp_path / "docs" / "gpu-results.md")
    page = (tmp_path / "docs" / "gpu-results.md").read_text()
    assert page == (tmp_path / "out" / "gpu-results.md").read_text()
    assert "| device | NVIDIA H200 |" in page and "## 1. api\n\n| a |\n|---|\n| b |\n" in page
    assert json.loads((tmp_path / "out" / "report.json").read_text())["checks"][0]["text"].startswith("| a |")


def test_the_example_without_cuda_says_so(tmp_path: Path) -> None:
    for body, expected in (
        ("raise ImportError('no torch here')", "needs PyTorch with CUDA"),
        ("class cuda:\n    is_available = staticmethod(lambda: False)\n", "needs a CUDA GPU"),
    ):
        path = fake_torch(tmp_path / str(len(expected)), body)
        process = subprocess.run(
            [sys.executable, str(REPO / "examples" / "train.py"), "--steps", "1"],
            env=dict(os.environ, PYTHONPATH=str(path)),
            capture_output=True,
            text=True,
        )
        assert process.returncode == 2 and expected in process.stderr

