"""scripts/gpu-check without a GPU: arguments, the no-GPU exits, the whole orchestration with
a PyTorch that claims a GPU (every workload then fails, and the report says so), the verdicts,
the report, the interleaved benchmark and the replay step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "python" / "tools"))

from gpucheck import bench, checks, cli  # noqa: E402
from gpucheck.report import ERROR, FAIL, MEASURED, PASS, SKIPPED, CheckResult, Report, Table  # noqa: E402

GPU_CHECK = REPO / "scripts" / "gpu-check"


def fake_torch(root: Path, body: str) -> Path:
    """A ``torch`` package whose ``__init__`` is ``body``; returns the directory to put on the path."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return root


def gpu_check(args: list[str], pythonpath: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), "--python", sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_arguments() -> None:
    args = cli.parse_args([])
    assert args.out == Path("gpu-check-out") and args.steps == 30 and args.budget == 450
    args = cli.parse_args(["--out", "x", "--steps", "3", "--skip-install"])
    assert (args.out, args.steps, args.skip_install) == (Path("x"), 3, True)
    with pytest.raises(SystemExit):
        cli.parse_args(["--steps", "0"])


def test_without_pytorch_it_says_so_and_exits_2(tmp_path: Path) -> None:
    path = fake_torch(tmp_path / "lib", "raise ImportError('this PyTorch is broken')")
    process = gpu_check(["--out", str(tmp_path / "out")], path)
    assert process.returncode == 2, process.stderr
    assert "cannot run: no usable PyTorch: import torch failed: this PyTorch is broken" in process.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["problem"].startswith("no usable PyTorch")
    assert "**Could not run: no usable PyTorch" in (tmp_path / "out" / "report.md").read_text()


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
    """Builds and installs ferrocache into a venv as on a GPU machine; every workload then fails
    on this stand-in PyTorch, and the report must show each item as an error, not as passed."""
    path = fake_torch(
        tmp_path / "lib",
        """
        __version__ = "2.9.0+fake"
        class version:
            cuda = "12.8"
        class _Props:
            name, total_memory = "Fake GPU", 80 * 2**30
        class cuda:
            is_available = staticmethod(lambda: True)
            device_count = staticmethod(lambda: 1)
            get_device_properties = staticmethod(lambda index: _Props())
        """,
    )
    out = tmp_path / "out"
    process = gpu_check(
        ["--out", str(out), "--steps", "1", "--bench-repetitions", "1", "--bench-iterations", "1"], path
    )
    assert process.returncode == 1, process.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["problem"] is None
    assert report["environment"]["device"] == "Fake GPU"
    assert report["environment"]["ferrocache"].startswith("0.")  # imported from the new venv
    assert str(out / "venv") in report["environment"]["ferrocache"]
    statuses = {c["key"]: c["status"] for c in report["checks"]}
    assert list(statuses) == [
        "losses", "peaks", "streams", "oom", "empty_cache", "host_cost", "example", "replay", "tune",
    ]  # fmt: skip
    for key in ("losses", "streams", "oom", "empty_cache", "host_cost", "replay", "tune"):
        assert statuses[key] == ERROR, (key, report["checks"])
    assert statuses["example"] == FAIL
    markdown = (out / "report.md").read_text()
    assert "| 1 | Same training, same losses (native vs ferrocache) | **ERROR** |" in markdown
    assert (out / "logs" / "pip-install.log").is_file() and (out / "logs" / "train-native.log").is_file()


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
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), Report(started="now"), tmp_path)
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
    ctx = cli.Context(cli.parse_args(["--out", str(tmp_path)]), report, tmp_path, python=sys.executable)
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
    assert (tmp_path / "tune.json").is_file() and (tmp_path / "logs" / "tune-confirm.log").is_file()
    assert cli.capacity_gib(8 * 2**30) == "8.0" and cli.capacity_gib(None) is None


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

    args = workloads.parse_args(["train", "--allocator", "ferrocache-expandable", "--out", "r.json"])
    assert args.workload == "train" and workloads.FERROCACHE_CONF[args.allocator] == "expandable_segments:True"
    with pytest.raises(SystemExit):
        workloads.parse_args(["train", "--allocator", "jemalloc"])


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

