"""``scripts/gpu-check``: builds and installs ferrocache, runs it side by side with PyTorch's
native allocator on the GPU, and writes ``report.md`` and ``report.json`` into ``--out``.

Steps: (0) probe PyTorch and the GPU, stop with status 2 where there is none; (1) make a
virtual environment with the system's packages (PyTorch) and ``pip install`` the repository
into it; (2) train the example model under native, ferrocache and ferrocache with expandable
segments, one process each, plus a second native run with PyTorch's history recording (the
control of the loss comparison, and a snapshot): losses, peak reserved memory, step time;
(3) two streams with ``record_stream``, ``empty_cache`` against ``mem_get_info``, an
out-of-memory error, per allocator; (4) host cost of ``torch.empty`` + free, two worker
processes measured in turns; (5) ``examples/train.py`` as a user runs it; (6) the native
snapshot replayed with the installed ``ferrocache`` command (``ferrocache replay``; the GPU
machine has no cargo); (7) ``ferrocache tune`` on it within the GPU's memory, and the replay of
its recommendation giving the peak tune reported.

Exit status: 0 all checks passed, 1 something failed, 2 no usable GPU or PyTorch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import bench, checks
from .report import ERROR, SKIPPED, CheckResult, Report

REPO = Path(__file__).resolve().parents[3]
TOOLS = Path(__file__).resolve().parents[1]
#: Variables that would change the allocators' behaviour in the children: cleared there.
ALLOCATOR_VARIABLES = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "TORCH_CUDA_ALLOC_LOG_LEVEL",
    "FERROCACHE_LIBRARY",
)
BENCH_SIZES = (4 << 10, 8 << 20, 256 << 20)
#: The ferrocache-expandable runs' setting, replayed too.
REPLAY_EXPANDABLE = "expandable_segments:True"
#: A step is not started with less time than this left of the budget.
MINIMUM_STEP_SECONDS = 20.0

PROBE = """
import json, sys
info = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
except Exception as err:
    info["error"] = f"import torch failed: {err}"
else:
    info.update(torch=torch.__version__, cuda_build=torch.version.cuda,
                cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, device_count=torch.cuda.device_count(),
                    total_memory=props.total_memory)
print(json.dumps(info))
"""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="ferrocache against PyTorch's native allocator on a real GPU",
        epilog="Exit status: 0 passed, 1 a check failed, 2 no usable GPU or PyTorch.",
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="output directory (default gpu-check-out/)")
    parser.add_argument("--python", default=sys.executable, help="the Python with PyTorch (default: this one)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    parser.add_argument("--bench-repetitions", type=int, default=9)
    parser.add_argument("--bench-iterations", type=int, default=5000)
    parser.add_argument(
        "--skip-install",
        action="store_true",
        help="use the ferrocache that --python already imports (no venv, no build)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.bench_repetitions < 1 or args.bench_iterations < 1:
        parser.error("--steps, --bench-repetitions and --bench-iterations must be at least 1")
    return args


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


@dataclass
class Context:
    args: argparse.Namespace
    report: Report
    out: Path
    started: float = field(default_factory=time.monotonic)
    python: str = ""

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def raw(self) -> Path:
        return self.out / "raw"

    def remaining(self) -> float:
        return float(self.args.budget) - (time.monotonic() - self.started)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOLS), env.get("PYTHONPATH", "")) if p)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
        return env


def probe(python: str) -> dict[str, Any]:
    """What ``python`` says about PyTorch and the GPU; ``error`` where it cannot say."""
    try:
        process = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{python} could not be run: {err}"}
    try:
        return dict(json.loads(process.stdout.strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        return {"error": f"{python} failed: {(process.stderr or process.stdout).strip()[-400:]}"}


def environment_problem(info: dict[str, Any]) -> Optional[str]:
    """Why the check cannot run with this PyTorch, or None."""
    if "error" in info:
        return f"no usable PyTorch: {info['error']}"
    if not info.get("cuda_available"):
        return (
            f"no CUDA GPU: torch.cuda.is_available() is False (torch {info.get('torch')}, "
            f"CUDA build {info.get('cuda_build')}); run this on a machine with an NVIDIA GPU"
        )
    return None


def _run_logged(command: Sequence[str], log_file: Path, **kwargs: Any) -> int:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        return subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, **kwargs).returncode


def install(ctx: Context) -> Optional[str]:
    """Builds and installs ferrocache; returns the Python to run the workloads with."""
    args = ctx.args
    if args.skip_install:
        ctx.report.notes.append("--skip-install: used the ferrocache that --python imports")
        return str(args.python)
    venv = ctx.out / "venv"
    started = time.monotonic()
    python = str(venv / "bin" / "python")
    # A wheel from scripts/build-wheel installs without cargo, and without PyPI (pip install .
    # fetches maturin): the way onto a machine that reaches neither.
    source = os.environ.get("FERROCACHE_WHEEL") or str(REPO)
    if _run_logged([args.python, "-m", "venv", "--system-site-packages", str(venv)], ctx.logs / "venv.log") != 0:
        ctx.report.notes.append("no venv (python -m venv failed): installed with pip --user instead")
        python = str(args.python)
        command = [python, "-m", "pip", "install", "--user", source]
    else:
        command = [python, "-m", "pip", "install", source]
    log(f"pip install {source} ...")
    if _run_logged(command, ctx.logs / "pip-install.log", cwd=REPO) != 0:
        ctx.report.problem = f"pip install failed; see {ctx.logs / 'pip-install.log'}"
        return None
    ctx.report.environment["build + install"] = f"{time.monotonic() - started:.0f} s (pip install {source})"
    return python


def workload(ctx: Context, name: str, allocator: str, label: str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Runs one workload in a fresh process; its JSON result, or ``{"error": ...}``."""
    ctx.raw.mkdir(parents=True, exist_ok=True)
    out = ctx.raw / f"{label}.json"
    command = [ctx.python, "-m", "gpucheck.workloads", name, "--allocator", allocator, "--out", str(out), *extra]
    log(f"{name} under {allocator} ...")
    timeout = max(ctx.remaining(), MINIMUM_STEP_SECONDS)
    try:
        code = _run_logged(command, ctx.logs / f"{label}.log", env=ctx.env(), cwd=ctx.out, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s; see logs/{label}.log"}
    if code != 0:
        return {"error": f"exit status {code}: {bench.last_line(ctx.logs / f'{label}.log')} (logs/{label}.log)"}
    return dict(json.loads(out.read_text()))


def guarded(ctx: Context, key: str, step: Callable[[], CheckResult]) -> None:
    """Runs a step unless the budget is spent; an exception becomes an ERROR item."""
    title = checks.TITLES[key]
    if ctx.remaining() < MINIMUM_STEP_SECONDS:
        ctx.report.checks.append(CheckResult(key, title, SKIPPED, "time budget spent"))
        return
    try:
        result = step()
    except Exception as err:  # one broken step must not hide the others
        result = CheckResult(key, title, ERROR, f"{type(err).__name__}: {err}")
    ctx.report.checks.append(result)


#: Set it to a ``ferrocache`` command to use that one (tests).
COMMAND_ENV = "FERROCACHE_COMMAND"


def ferrocache_command(ctx: Context) -> Optional[str]:
    """The ``ferrocache`` command the install put beside ``ctx.python`` (the venv's bin), else
    the one on the PATH; None where there is none. ``$FERROCACHE_COMMAND`` overrides."""
    override = os.environ.get(COMMAND_ENV)
    if override:
        return override if Path(override).is_file() else None
    beside = Path(ctx.python or sys.executable).parent / "ferrocache"
    if beside.is_file():
        return str(beside)
    return shutil.which("ferrocache")


def _run_command(ctx: Context, command: Sequence[str], name: str) -> tuple[Optional[subprocess.CompletedProcess[str]], str]:
    """Runs the ``ferrocache`` command, its stdout in ``<name>.json`` and stderr in the logs;
    the process, or None and why."""
    timeout = max(min(ctx.remaining(), 300.0), MINIMUM_STEP_SECONDS)
    try:
        process = subprocess.run(list(command), cwd=ctx.out, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    except OSError as err:
        return None, f"{command[0]} could not be run: {err}"
    (ctx.out / f"{name}.json").write_text(process.stdout)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    (ctx.logs / f"{name}.log").write_text("$ " + " ".join(command) + "\n" + process.stderr)
    return process, ""


def run_replay(ctx: Context, snapshot: Path) -> dict[str, Any]:
    command = ferrocache_command(ctx)
    if command is None:
        return {"skipped": "no ferrocache command (the package installs one beside its Python)"}
    if not snapshot.is_file():
        return {"skipped": f"no native snapshot at {snapshot}"}
    # Both settings the GPU runs used, so that each replayed row has a measured counterpart.
    log("replay of the native snapshot (ferrocache replay) ...")
    process, why = _run_command(
        ctx, [command, "replay", str(snapshot), "--json", "--conf", "", "--conf", REPLAY_EXPANDABLE], "replay"
    )
    if process is None:
        return {"returncode": None, "stderr_tail": why}
    outcome: dict[str, Any] = {"returncode": process.returncode, "stderr_tail": process.stderr.strip()[-300:]}
    outcome["rows"] = json_lines(process.stdout)
    return outcome


def capacity_gib(total_memory: Any) -> Optional[str]:
    """The GPU's memory as ``--capacity-gib`` takes it, exactly (None when unknown)."""
    if not isinstance(total_memory, int) or total_memory <= 0:
        return None
    return repr(total_memory / 2**30)


def run_tune(ctx: Context, snapshot: Path) -> dict[str, Any]:
    """``ferrocache tune`` on the native snapshot within this GPU's memory, then ``ferrocache
    replay`` of its recommendation (with the same capacity), which must reach the same peak."""
    command = ferrocache_command(ctx)
    if command is None:
        return {"skipped": "no ferrocache command (the package installs one beside its Python)"}
    if not snapshot.is_file():
        return {"skipped": f"no native snapshot at {snapshot}"}
    capacity = capacity_gib(ctx.report.environment.get("total_memory"))
    limit = ["--capacity-gib", capacity] if capacity else []
    log("ferrocache tune on the native snapshot ...")
    process, why = _run_command(ctx, [command, "tune", str(snapshot), "--json", *limit], "tune")
    if process is None:
        return {"returncode": None, "stderr_tail": why}
    outcome: dict[str, Any] = {"returncode": process.returncode, "stderr_tail": process.stderr.strip()[-300:]}
    try:
        tuned = json.loads(process.stdout)
    except json.JSONDecodeError:
        tuned = None
    outcome["tuned"] = tuned
    if process.returncode != 0 or not isinstance(tuned, dict) or tuned.get("recommended_conf") is None:
        return outcome
    replay = [command, "replay", str(snapshot), "--json", "--conf", str(tuned["recommended_conf"]), *limit]
    if (tuned.get("recommended_env") or {}).get("FERROCACHE_CROSS_STREAM"):
        replay.append("--cross-stream")
    if any(trace.get("served_oom_bytes") for trace in tuned.get("traces") or []):
        replay.append("--serve-final-oom")
    process, why = _run_command(ctx, replay, "tune-confirm")
    outcome["confirm_rows"] = json_lines(process.stdout) if process is not None and process.returncode == 0 else None
    outcome["confirm_error"] = why or (process.stderr.strip()[-300:] if process is not None else "")
    return outcome


def json_lines(text: str) -> Optional[list[Any]]:
    """The replay's ``--json`` output: one JSON object per line (None if it is not that)."""
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None


def run_checks(ctx: Context) -> None:
    args, out = ctx.args, ctx.out
    example = str(REPO / "examples" / "train.py")
    runs: dict[str, dict[str, Any]] = {}
    steps = ["--example", example, "--steps", str(args.steps)]

    native_snapshot = out / "native-snapshot.pickle"

    def training() -> CheckResult:
        runs["native"] = workload(ctx, "train", "native", "train-native", steps)
        # The same native run again, recording PyTorch's history: the control of the loss
        # comparison, and the snapshot for the replay.
        runs[checks.CONTROL] = workload(
            ctx, "train", "native", "train-native-history",
            [*steps, "--record-history", "--snapshot", str(native_snapshot)],
        )  # fmt: skip
        runs["ferrocache"] = workload(
            ctx, "train", "ferrocache", "train-ferrocache",
            [*steps, "--snapshot", str(out / "ferrocache-snapshot.pickle")],
        )  # fmt: skip
        runs["ferrocache-expandable"] = workload(
            ctx, "train", "ferrocache-expandable", "train-ferrocache-expandable", steps
        )
        return checks.losses(runs)

    guarded(ctx, "losses", training)
    guarded(ctx, "peaks", lambda: checks.peaks(runs))

    features: dict[str, dict[str, Any]] = {}

    def judged(judge: Callable[[dict[str, dict[str, Any]]], CheckResult]) -> Callable[[], CheckResult]:
        """The feature runs (once, for all three checks), then ``judge`` on their results."""

        def step() -> CheckResult:
            if not features:
                for allocator in ("native", "ferrocache"):
                    features[allocator] = workload(ctx, "features", allocator, f"features-{allocator}")
            return judge(features)

        return step

    guarded(ctx, "streams", judged(checks.streams))
    guarded(ctx, "oom", judged(checks.out_of_memory))
    guarded(ctx, "empty_cache", judged(checks.empty_cache))

    def host_cost() -> CheckResult:
        log("host cost, interleaved workers ...")
        commands = {
            name: [ctx.python, "-m", "gpucheck.workloads", "bench", "--allocator", name]
            for name in ("native", "ferrocache")
        }
        try:
            result = bench.interleaved(
                commands, BENCH_SIZES, args.bench_repetitions, args.bench_iterations,
                ctx.logs, env=ctx.env(), cwd=out, timeout=max(ctx.remaining(), MINIMUM_STEP_SECONDS),
            )  # fmt: skip
        except bench.BenchError as err:
            return CheckResult("host_cost", checks.TITLES["host_cost"], ERROR, str(err))
        (ctx.raw / "bench.json").write_text(json.dumps(result, indent=1))
        return checks.host_cost(result)

    guarded(ctx, "host_cost", host_cost)

    def example_run() -> CheckResult:
        log("examples/train.py ...")
        log_file = ctx.logs / "example.log"
        env = ctx.env()
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        code = _run_logged([ctx.python, example, "--steps", "5"], log_file, env=env, cwd=out,
                           timeout=max(ctx.remaining(), MINIMUM_STEP_SECONDS))  # fmt: skip
        return checks.example(code, log_file.read_text(errors="replace"))

    guarded(ctx, "example", example_run)

    def replay() -> CheckResult:
        history = runs.get(checks.CONTROL, {"error": "the native run with history did not run"})
        if "error" in history:
            return CheckResult("replay", checks.TITLES["replay"], ERROR, history["error"])
        return checks.replay(run_replay(ctx, native_snapshot), runs)

    guarded(ctx, "replay", replay)

    def tune() -> CheckResult:
        history = runs.get(checks.CONTROL, {"error": "the native run with history did not run"})
        if "error" in history:
            return CheckResult("tune", checks.TITLES["tune"], ERROR, history["error"])
        return checks.tune(run_tune(ctx, native_snapshot))

    guarded(ctx, "tune", tune)


def run(ctx: Context) -> int:
    info = probe(ctx.args.python)
    ctx.report.environment.update({k: v for k, v in info.items() if k != "error"})
    problem = environment_problem(info)
    if problem:
        ctx.report.problem = problem
        log(f"cannot run: {problem}")
        return 2
    ctx.report.environment["commit"] = _git_commit()
    python = install(ctx)
    if python is None:
        log(f"cannot run: {ctx.report.problem}")
        return 1
    ctx.python = python
    imported = probe_ferrocache(python, ctx.env())
    ctx.report.environment["ferrocache"] = imported
    if imported.startswith("error"):
        ctx.report.problem = f"ferrocache does not import with {python}: {imported}"
        return 1
    ctx.report.notes.append(
        "The children run with PYTORCH_CUDA_ALLOC_CONF and the other allocator variables "
        "cleared, and with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS)."
    )
    run_checks(ctx)
    snapshots = [p.name for p in sorted(ctx.out.glob("*-snapshot.pickle"))]
    if snapshots:
        ctx.report.notes.append(
            f"Snapshots for https://pytorch.org/memory_viz in {ctx.out}: {', '.join(snapshots)} "
            "(native-snapshot.pickle: PyTorch's allocator with its history; "
            "ferrocache-snapshot.pickle: ferrocache's state at the end of its run)"
        )
    return 1 if ctx.report.failed() else 0


def probe_ferrocache(python: str, env: dict[str, str]) -> str:
    code = "import ferrocache; print(ferrocache.__version__, ferrocache.library_path())"
    process = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    if process.returncode != 0:
        lines = process.stderr.strip().splitlines() or ["(no output)"]
        return "error: " + lines[-1]
    return process.stdout.strip()


def _git_commit() -> str:
    try:
        process = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
        return process.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    ctx = Context(args, Report(started=started), out)
    log(f"output in {out}")
    try:
        code = run(ctx)
    except KeyboardInterrupt:
        ctx.report.problem = "interrupted"
        code = 1
    finally:
        ctx.report.seconds = time.monotonic() - ctx.started
        markdown, _ = ctx.report.write(out)
    log(f"report: {markdown}")
    print(markdown.read_text())
    return code
