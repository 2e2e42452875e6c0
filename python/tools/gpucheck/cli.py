"""``scripts/gpu-check``: ferrocache on a real GPU, side by side with PyTorch's native allocator,
in one call of at most 8 minutes (``--budget``), writing ``docs/gpu-results.md`` and printing
one summary line at the end.

Steps, the required ones first so that the budget cuts the extras: (0) probe PyTorch and the
GPU, stop with status 2 where there is none; (1) install ferrocache: the wheel
``FERROCACHE_WHEEL`` names, unpacked (no cargo, no network, no pip), else the ferrocache
``--python`` imports, else ``pip install .``; (2) the real-PyTorch tests chosen for a
GPU (:mod:`gpucheck.real_torch`); (3) the training step under native and ferrocache (its median
time and their ratio), then the same training under native with history recording (the
control), expandable segments and cross-stream reuse (bit-identical losses, peaks); (4) per
allocator: two streams with ``record_stream``, cross-stream reuse, a CUDA graph, ``empty_cache``
against ``mem_get_info``, an out-of-memory error; (5) the peer copy where there are 2 GPUs, and ferrocache's sleep and wake with backup
against plain copies of the same bytes;
(6) ``python/tools/memory_api/compare.py --markdown``; (7) host cost of ``torch.empty`` + free;
(8) ``examples/train.py``; (9) the native snapshot replayed and (10) tuned with the installed
``ferrocache`` command.

On the fake CUDA (the rehearsal) every step runs; the work that needs kernels is reported
"skipped on the fake".

Exit status: 0 all checks passed, 1 something failed, 2 no usable GPU or PyTorch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import bench, checks, real_torch, workloads
from .report import ERROR, RESULTS_NAME, SKIPPED, CheckResult, Report

REPO = Path(__file__).resolve().parents[3]
TOOLS = Path(__file__).resolve().parents[1]
#: Variables that would change the allocators' behaviour in the children: cleared there.
ALLOCATOR_VARIABLES = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "TORCH_CUDA_ALLOC_LOG_LEVEL",
    "FERROCACHE_LIBRARY",
    "FERROCACHE_CROSS_STREAM",
)
#: The wheel to install (scripts/build-wheel), which needs neither cargo nor network.
WHEEL_ENV = "FERROCACHE_WHEEL"
#: issue 28's side-by-side table of the public torch.cuda memory functions.
COMPARE = REPO / "python" / "tools" / "memory_api" / "compare.py"
RESULTS = REPO / "docs" / "gpu-results.md"
#: How to bring pytest to a machine without it (and without network).
PYTEST_WHEELS_COMMAND = "python3 -m pip download -d dist/ pytest exceptiongroup tomli"
#: The one call on a machine with a GPU (docs/python.md, "The GPU check").
ONE_CALL = (
    "set -o pipefail; FERROCACHE_WHEEL=dist/ferrocache-0.1.0-py3-none-manylinux_2_34_x86_64.whl "
    "scripts/gpu-check --out $OUT 2>&1 | tee $OUT/log"
)
BENCH_SIZES = (4 << 10, 8 << 20, 256 << 20)
#: The ferrocache-expandable runs' setting, replayed too.
REPLAY_EXPANDABLE = "expandable_segments:True"
#: A step is not started with less time than this left of the budget.
MINIMUM_STEP_SECONDS = 20.0
#: The real-PyTorch tests may take at most this long (a hung test must not eat the budget).
TESTS_SECONDS = 200.0

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
        import ctypes
        props = torch.cuda.get_device_properties(0)
        try:  # the project's fake CUDA (the rehearsal) has this counter, no driver has
            fake = hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_stat")
        except OSError:
            fake = False
        info.update(device=props.name, device_count=torch.cuda.device_count(),
                    total_memory=props.total_memory, capability=f"{props.major}.{props.minor}",
                    fake_cuda=fake)
print(json.dumps(info))
"""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=(
            "ferrocache against PyTorch's native allocator on a real GPU, in one call of at most "
            "8 minutes; writes docs/gpu-results.md and prints one summary line at the end."
        ),
        epilog=(
            "The one call on a machine with a GPU (PyTorch installed, no cargo, no network), after "
            "scripts/build-wheel and " + PYTEST_WHEELS_COMMAND + " here, with dist/ carried along: "
            + ONE_CALL
            + " (the output directory gets gpu-results.md, report.json, logs/ and raw/). "
            "Exit status: 0 passed, 1 a check failed, 2 no usable GPU or PyTorch."
        ),
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-check-out"), help="output directory (default gpu-check-out/)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="the results page (default docs/gpu-results.md; a copy goes to --out)",
    )
    parser.add_argument("--python", default=sys.executable, help="the Python with PyTorch (default: this one)")
    parser.add_argument(
        "--steps", type=int, default=60, help="training steps per run (default 60: 5 warm-up, 55 timed)"
    )
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    parser.add_argument("--bench-repetitions", type=int, default=9)
    parser.add_argument("--bench-iterations", type=int, default=5000)
    parser.add_argument(
        "--tests", default=None, help="a pytest -k expression: only those of the chosen real-PyTorch tests"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="pytest processes side by side for the real-PyTorch tests (default: a quarter of the CPUs, at most 4)",
    )
    parser.add_argument(
        "--skip-install",
        action="store_true",
        help="use the ferrocache that --python already imports, even where FERROCACHE_WHEEL is set",
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.bench_repetitions, args.bench_iterations, args.jobs) < 1:
        parser.error("--steps, --bench-repetitions, --bench-iterations and --jobs must be at least 1")
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
    #: Where the wheel was installed (unpacked, or pip --target), first on the children's PYTHONPATH.
    site: Optional[Path] = None
    on_fake: bool = False
    device_count: int = 1

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def raw(self) -> Path:
        return self.out / "raw"

    def site_directory(self) -> Path:
        """The directory ferrocache (and pytest) go into, made on first use, removed at the end."""
        if self.site is None:
            self.site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
        return self.site

    def remaining(self) -> float:
        return float(self.args.budget) - (time.monotonic() - self.started)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
        first = [str(self.site)] if self.site else []
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, str(TOOLS), env.get("PYTHONPATH", "")) if p)
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


def _run_all_logged(
    commands: Sequence[tuple[Sequence[str], Path]], timeout: Optional[float] = None, **kwargs: Any
) -> list[Optional[int]]:
    """Runs the commands side by side, each with its output in its log file; their exit
    statuses, None for each one still running after ``timeout`` seconds, whose whole process
    group is then killed (pytest's children too, which hold the GPU)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    started = []
    for command, log_file in commands:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_file, "w")  # noqa: SIM115 - closed below
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
        )
        started.append((process, out))
    codes: list[Optional[int]] = []
    for process, out in started:
        try:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            codes.append(process.wait(timeout=left))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            codes.append(None)
        out.close()
    return codes


def _run_logged(command: Sequence[str], log_file: Path, timeout: Optional[float] = None, **kwargs: Any) -> int:
    """Runs ``command`` with its output in ``log_file``; TimeoutExpired after ``timeout``."""
    (code,) = _run_all_logged([(command, log_file)], timeout, **kwargs)
    if code is None:
        raise subprocess.TimeoutExpired(list(command), timeout or 0.0)
    return code


def install(ctx: Context) -> Optional[str]:
    """Installs ferrocache where the workloads will import it; returns the Python to run them
    with. The wheel goes into a directory of its own, put first on the children's PYTHONPATH:
    this works whatever environment holds PyTorch."""
    args = ctx.args
    wheel = os.environ.get(WHEEL_ENV)
    imported = not wheel and not probe_ferrocache(args.python, ctx.env()).startswith("error")
    if args.skip_install or imported:
        ctx.report.environment["install"] = f"the ferrocache {args.python} imports"
        return str(args.python)
    started = time.monotonic()
    if wheel:
        try:
            unpack_wheel(Path(wheel), ctx.site_directory())
        except (OSError, zipfile.BadZipFile) as err:
            ctx.report.problem = f"cannot unpack {wheel}: {err}"
            return None
        ctx.report.environment["install"] = f"{wheel} unpacked in {time.monotonic() - started:.1f} s"
        return str(args.python)
    command = [args.python, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "--target",
               str(ctx.site_directory()), str(REPO)]  # fmt: skip
    log("pip install . ...")
    if _run_logged(command, ctx.logs / "pip-install.log", cwd=REPO) != 0:
        ctx.report.problem = f"pip install failed; see {ctx.logs / 'pip-install.log'}"
        return None
    ctx.report.environment["install"] = f"pip install --target of {REPO} in {time.monotonic() - started:.0f} s"
    return str(args.python)


def unpack_wheel(wheel: Path, site: Path) -> None:
    """What ``pip install --no-deps --target site wheel`` leaves that the check uses, without
    pip (which a GPU machine's Python may lack): the files, and the executable bit of the
    programs (``ferrocache.scripts/ferrocache``, the command, whose run path finds the library
    in ``../ferrocache.libs``)."""
    log(f"unpacking {wheel} ...")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        for name in archive.namelist():
            if ".scripts/" in name or ".data/scripts/" in name:
                (site / name).chmod(0o755)


def workload(ctx: Context, name: str, allocator: str, label: str, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Runs one workload in a fresh process; its JSON result, or ``{"error": ...}``."""
    ctx.raw.mkdir(parents=True, exist_ok=True)
    out = ctx.raw / f"{label}.json"
    command = [ctx.python, "-m", "gpucheck.workloads", name, "--allocator", allocator, "--out", str(out), *extra]
    if ctx.remaining() < MINIMUM_STEP_SECONDS:
        return {"error": "not run: the time budget is spent"}
    log(f"{name} under {allocator} ...")
    timeout = ctx.remaining()
    try:
        code = _run_logged(command, ctx.logs / f"{label}.log", env=ctx.env(), cwd=ctx.out, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s; see logs/{label}.log"}
    if code != 0:
        return {"error": f"exit status {code}: {bench.last_line(ctx.logs / f'{label}.log')} (logs/{label}.log)"}
    return dict(json.loads(out.read_text()))


def guarded(ctx: Context, key: str, step: Callable[[], CheckResult], needs: float = MINIMUM_STEP_SECONDS) -> None:
    """Runs a step unless less than ``needs`` seconds of the budget are left; an exception
    becomes an ERROR item."""
    title = checks.TITLES[key]
    if ctx.remaining() < needs:
        left = max(ctx.remaining(), 0)
        why = f"time budget: {left:.0f} s left of {ctx.args.budget:.0f}, the step needs about {needs:.0f}"
        ctx.report.checks.append(CheckResult(key, title, SKIPPED, why))
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
    # The wheel's own launcher (bin/ferrocache) looks for the program in the interpreter's
    # site-packages, not in the unpacked directory: the program itself, there.
    installed = [ctx.site / "ferrocache.scripts" / "ferrocache"] if ctx.site else []
    for beside in [*installed, Path(ctx.python or sys.executable).parent / "ferrocache"]:
        if beside.is_file():
            return str(beside)
    return shutil.which("ferrocache")


def _run_command(
    ctx: Context, command: Sequence[str], name: str
) -> tuple[Optional[subprocess.CompletedProcess[str]], str]:
    """Runs the ``ferrocache`` command, its stdout in ``<name>.json`` and stderr in the logs;
    the process, or None and why."""
    timeout = max(min(ctx.remaining(), 300.0), MINIMUM_STEP_SECONDS)
    try:
        process = subprocess.run(
            list(command), cwd=ctx.out, capture_output=True, text=True, timeout=timeout, env=ctx.env()
        )
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




def _imports(ctx: Context, module: str) -> bool:
    process = subprocess.run([ctx.python, "-c", f"import {module}"], env=ctx.env(), capture_output=True)
    return process.returncode == 0


def ensure_pytest(ctx: Context) -> Optional[str]:
    """None where pytest imports, after installing it from the wheels beside FERROCACHE_WHEEL
    where it did not; else why it does not."""
    if _imports(ctx, "pytest"):
        return None
    wheel = os.environ.get(WHEEL_ENV)
    wheels = Path(wheel).resolve().parent if wheel else None
    if wheels is not None and any(wheels.glob("pytest-*.whl")):
        others = [w for w in sorted(wheels.glob("*.whl")) if not w.name.startswith("ferrocache-")]
        try:
            for other in others:  # pytest and what it needs, pure Python
                unpack_wheel(other, ctx.site_directory())
        except (OSError, zipfile.BadZipFile) as err:
            return f"pytest's wheels in {wheels} did not unpack: {err}"
        if _imports(ctx, "pytest"):
            return None
        return f"pytest does not import from the wheels in {wheels} (all of its dependencies there?)"
    return (
        f"pytest is not installed for {ctx.python}: put its wheels beside the ferrocache wheel "
        f"({PYTEST_WHEELS_COMMAND})"
    )


def run_real_torch_tests(ctx: Context) -> CheckResult:
    """The chosen real-PyTorch tests under pytest, against this machine's CUDA (the GPU, or in
    the rehearsal the fake), in ``--jobs`` pytest processes side by side (each test runs its
    own processes, which only their own allocator's figures concern); their outcomes from
    pytest's JUnit XML."""
    no_pytest = ensure_pytest(ctx)
    if no_pytest:
        return CheckResult("real_torch", checks.TITLES["real_torch"], SKIPPED, no_pytest)
    tests = real_torch.node_ids(real_torch.chosen(ctx.device_count))
    ctx.raw.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(ctx.args.jobs, len(tests)))
    commands, reports = [], []
    for job in range(jobs):
        junit = ctx.raw / f"real-torch-{job}.xml"
        junit.unlink(missing_ok=True)
        command = [ctx.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *tests[job::jobs]]
        if ctx.args.tests:
            command += ["-k", ctx.args.tests]
        commands.append((command, ctx.logs / f"real-torch-{job}.log"))
        reports.append(junit)
    env = ctx.env()
    if not ctx.on_fake:
        env["FERROCACHE_REAL_GPU"] = "1"
    narrowed = f" (-k {ctx.args.tests})" if ctx.args.tests else ""
    log(f"{len(tests)} real-PyTorch tests{narrowed}, {jobs} pytest processes ...")
    timeout = min(ctx.remaining(), TESTS_SECONDS)
    codes = _run_all_logged(commands, timeout, env=env, cwd=REPO)
    cases = [case for junit in reports if junit.is_file() for case in real_torch.results(junit)]
    problems = []
    for (_, log_file), junit, code in zip(commands, reports, codes):
        if code is None:
            problems.append(f"stopped after {timeout:.0f} s (logs/{log_file.name})")
        elif not junit.is_file():
            problems.append(f"pytest exit status {code}: {bench.last_line(log_file)} (logs/{log_file.name})")
    return checks.real_torch(cases, "; ".join(problems))


def run_compare(ctx: Context) -> dict[str, Any]:
    """issue 28's ``compare.py --markdown``: its table, verbatim."""
    if not COMPARE.is_file():
        return {"skipped": "not in this checkout (python/tools/memory_api/compare.py)"}
    log("compare.py --markdown ...")
    log_file = ctx.logs / "compare.log"
    try:
        process = subprocess.run([ctx.python, str(COMPARE), "--markdown"], capture_output=True, text=True, cwd=REPO,
                                 env=ctx.env(), timeout=max(ctx.remaining(), MINIMUM_STEP_SECONDS))  # fmt: skip
    except subprocess.TimeoutExpired as err:
        return {"returncode": None, "stderr_tail": f"timed out after {err.timeout:.0f} s"}
    ctx.logs.mkdir(parents=True, exist_ok=True)
    log_file.write_text(process.stdout + process.stderr)
    return {"returncode": process.returncode, "stdout": process.stdout, "stderr_tail": process.stderr.strip()[-300:]}


def runs_until_fake_stops(
    ctx: Context, name: str, series: Sequence[tuple[str, str, Sequence[str]]]
) -> dict[str, dict[str, Any]]:
    """One ``name`` workload per (key, allocator, extra arguments), logged as ``name-key``; on
    the fake, the first that stops at a kernel ends the series (the others would stop there too)."""
    results: dict[str, dict[str, Any]] = {}
    for key, allocator, extra in series:
        results[key] = workload(ctx, name, allocator, f"{name}-{key}", extra)
        if checks.ON_FAKE in results[key]:
            break
    return results


def run_checks(ctx: Context) -> None:
    args, out = ctx.args, ctx.out
    example = str(REPO / "examples" / "train.py")
    steps = ["--example", example, "--steps", str(args.steps)]
    native_snapshot = out / "native-snapshot.pickle"

    guarded(ctx, "real_torch", lambda: run_real_torch_tests(ctx))

    runs: dict[str, dict[str, Any]] = {}

    def training() -> CheckResult:
        # native and ferrocache first (the step time), then the control: the same native run
        # recording PyTorch's history (two native runs must agree for the loss comparison to
        # mean anything; its snapshot is replayed below), then the opt-in modes.
        series = [
            ("native", "native", steps),
            ("ferrocache", "ferrocache", [*steps, "--snapshot", str(out / "ferrocache-snapshot.pickle")]),
            (checks.CONTROL, "native", [*steps, "--record-history", "--snapshot", str(native_snapshot)]),
            ("ferrocache-expandable", "ferrocache-expandable", steps),
            ("ferrocache-cross-stream", "ferrocache-cross-stream", steps),
        ]
        runs.update(runs_until_fake_stops(ctx, "train", series))
        return checks.step_time(runs)

    guarded(ctx, "step_time", training, needs=60)
    guarded(ctx, "losses", lambda: checks.losses(runs))
    guarded(ctx, "peaks", lambda: checks.peaks(runs))

    features: dict[str, dict[str, Any]] = {}

    def judged(judge: Callable[[dict[str, dict[str, Any]]], CheckResult]) -> Callable[[], CheckResult]:
        """The feature runs (once, for all the checks below), then ``judge`` on their results."""

        def step() -> CheckResult:
            if not features:
                for allocator in ("native", "ferrocache", "ferrocache-expandable", "ferrocache-cross-stream"):
                    features[allocator] = workload(ctx, "features", allocator, f"features-{allocator}")
            return judge(features)

        return step

    feature_checks = {
        "streams": checks.streams,
        "oom": checks.out_of_memory,
        "empty_cache": checks.empty_cache,
        "expandable": checks.expandable,
        "cross_stream": checks.cross_stream,
        "graphs": checks.graphs,
    }
    for key, judge in feature_checks.items():
        guarded(ctx, key, judged(judge), needs=60 if not features else MINIMUM_STEP_SECONDS)

    def peer_copies() -> CheckResult:
        if ctx.device_count < 2:
            return checks.peer({}, ctx.device_count)
        series = [(a, a, ()) for a in ("native", "ferrocache", "native-expandable", "ferrocache-expandable")]
        return checks.peer(runs_until_fake_stops(ctx, "peer", series), ctx.device_count)

    guarded(ctx, "peer", peer_copies, needs=40)
    guarded(ctx, "sleep", lambda: checks.sleep_bandwidth(workload(ctx, "sleep", "ferrocache", "sleep")), needs=40)
    guarded(ctx, "memory_api", lambda: checks.memory_api(run_compare(ctx)), needs=40)

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

    guarded(ctx, "host_cost", host_cost, needs=40)

    def example_run() -> CheckResult:
        log("examples/train.py ...")
        log_file = ctx.logs / "example.log"
        env = ctx.env()
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        code = _run_logged([ctx.python, example, "--steps", "5"], log_file, env=env, cwd=out,
                           timeout=max(ctx.remaining(), MINIMUM_STEP_SECONDS))  # fmt: skip
        output = log_file.read_text(errors="replace")
        if code != 0 and ctx.on_fake and any(sign in output for sign in workloads.FAKE_CANNOT_RUN):
            return checks.skipped_on_fake("example", checks.TITLES["example"], "examples/train.py needs kernels")
        return checks.example(code, output)

    guarded(ctx, "example", example_run)

    def snapshot_step(key: str, judge: Callable[[], CheckResult]) -> Callable[[], CheckResult]:
        """The replay and the tune need the native run's snapshot."""

        def step() -> CheckResult:
            history = runs.get(checks.CONTROL, {"error": "the native run with history did not run"})
            if checks.ON_FAKE in runs.get("native", {}):
                return checks.skipped_on_fake(key, checks.TITLES[key], "no native snapshot: the training needs kernels")
            if "error" in history:
                return CheckResult(key, checks.TITLES[key], ERROR, history["error"])
            return judge()

        return step

    guarded(ctx, "replay", snapshot_step("replay", lambda: checks.replay(run_replay(ctx, native_snapshot), runs)))
    guarded(ctx, "tune", snapshot_step("tune", lambda: checks.tune(run_tune(ctx, native_snapshot))))


def run(ctx: Context) -> int:
    info = probe(ctx.args.python)
    ctx.report.environment.update({k: v for k, v in info.items() if k != "error"})
    problem = environment_problem(info)
    if problem:
        ctx.report.problem = problem
        log(f"cannot run: {problem}")
        return 2
    ctx.on_fake = bool(info.get("fake_cuda"))
    ctx.device_count = int(info.get("device_count") or 1)
    ctx.report.environment["commit"] = _git_commit()
    ctx.report.environment["CPUs"] = os.cpu_count()
    ctx.report.environment["nvidia-smi"] = nvidia_smi()
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
    if ctx.on_fake:
        ctx.report.notes.append(
            "A rehearsal on the fake CUDA (tests/fake-cuda), not a GPU: it runs no kernel, so the "
            "work that needs kernels is reported as skipped on the fake."
        )
    ctx.report.notes.append(
        "The children run with PYTORCH_CUDA_ALLOC_CONF and the other allocator variables "
        "cleared, and with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS)."
    )
    run_checks(ctx)
    snapshots = [p.name for p in sorted(ctx.out.glob("*-snapshot.pickle"))]
    if snapshots:
        ctx.report.notes.append(
            f"Snapshots for https://pytorch.org/memory_viz in the output directory: {', '.join(snapshots)} "
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


def nvidia_smi() -> str:
    """The driver's view of the GPUs (name, driver version, memory), or why there is none."""
    command = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        process = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"n/a ({type(err).__name__})"
    return "; ".join(process.stdout.strip().splitlines()) or f"n/a (exit status {process.returncode})"


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
    log(f"output in {out}, budget {args.budget:.0f} s")
    try:
        code = run(ctx)
    except KeyboardInterrupt:
        ctx.report.problem = "interrupted"
        code = 1
    finally:
        if ctx.site is not None:
            shutil.rmtree(ctx.site, ignore_errors=True)
        ctx.report.seconds = time.monotonic() - ctx.started
        ctx.report.write(out, args.results.resolve())
    log(f"results: {args.results} (and {out / RESULTS_NAME}, {out / 'report.json'})")
    print(ctx.report.summary_line(), flush=True)
    return code
