"""``scripts/gpu-check``: ferrocache on a real GPU, side by side with PyTorch's native allocator,
in one call of at most 6 minutes (``--budget``), on a machine lent for minutes: at most 8 files
come back from its output folder, a timeout may end the call with SIGTERM, and every GPU
second should go to GPU work.

So the check writes at most :data:`OUTPUT_FILES` into ``--out`` (the results page, the JSON
report, one archive of the per-step logs and raw figures, one of the snapshots, kept under
16 MiB; the call's ``tee`` adds the log), rewrites the report, the page and the logs' archive
after every step, each file replaced whole, and on SIGTERM or SIGINT ends every child's process
group and writes the report with the steps it did not reach. Each step has a cap of its own
(:data:`STEPS`), each benchmark reply too, so that a hang costs one step, not the rest.

Steps, the required ones first so that the budget cuts the extras: probe PyTorch and the GPU
(status 2 where there is none); unpack the wheel (``--wheel``, a glob; no pip, no network);
(1) the real-PyTorch tests chosen for a GPU (:mod:`gpucheck.real_torch`); (2) the step time:
native and ferrocache in interleaved processes, N F N' / N' F N, round after round, a second
native run in each round as the noise floor, two models (launch-bound, GPU-bound), timed on
the host and with CUDA events; (3) the training under each allocator and mode (bit-identical
losses, peaks; the native run records its history with Python stacks only, for the snapshot
that comes back); (4) per allocator: two streams with ``record_stream``, cross-stream reuse, a
CUDA graph, ``empty_cache`` against ``mem_get_info``, an out-of-memory error; (5) the peer copy
where there are 2 GPUs, and ferrocache's sleep and wake with backup against plain copies;
(6) ``python/tools/memory_api/compare.py --markdown``; (7) host cost of ``torch.empty`` + free;
(8) ``examples/train.py``.

The replay and the tune of the returned native snapshot need no GPU: ``scripts/gpu-check
--analyse DIR`` runs them afterwards, here, on the files that came back.

On the fake CUDA (the rehearsal) every step runs; the work that needs kernels is reported
"skipped on the fake".

Exit status: 0 all checks passed, 1 something failed or the check was stopped, 2 no usable GPU
or PyTorch.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

from . import bench, checks, processes, real_torch, workloads
from .report import ERROR, REPORT_NAME, RESULTS_NAME, SKIPPED, CheckResult, Report, replace_file

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
#: The wheel to install (scripts/build-wheel), a path or a glob, as ``--wheel`` takes it.
WHEEL_ENV = "FERROCACHE_WHEEL"
#: Beside the wheel: the commit it was built from (scripts/build-wheel writes it; the GPU
#: machine's copy of the checkout may have no git).
COMMIT_FILE = "ferrocache-commit"
#: issue 28's side-by-side table of the public torch.cuda memory functions.
COMPARE = REPO / "python" / "tools" / "memory_api" / "compare.py"
RESULTS = REPO / "docs" / "gpu-results.md"
#: How to bring pytest to a machine without it (and without network).
PYTEST_WHEELS_COMMAND = "python3 -m pip download -d dist/ pytest exceptiongroup tomli"
#: Where the call is written down, once.
CALL_DOCUMENTED = "docs/python.md, \"The GPU check\""
BENCH_SIZES = (4 << 10, 8 << 20, 256 << 20)
#: The ferrocache-expandable runs' setting, replayed too.
REPLAY_EXPANDABLE = "expandable_segments:True"
#: A step that runs processes is not started with less time than this left of the budget.
MINIMUM_STEP_SECONDS = 20.0
#: At its step's cap, pytest gets SIGINT and this long to write its report before SIGKILL.
PYTEST_GRACE_SECONDS = 8.0
#: The most one benchmark reply may take (a worker that hangs costs this, not the step).
BENCH_REPLY_SECONDS = 30.0
#: The output's files: what comes back from the GPU machine (at most 8, none in a folder).
LOGS_ARCHIVE = "logs.tar.gz"
SNAPSHOTS_ARCHIVE = "snapshots.tar.gz"
#: The call's ``tee`` writes this one.
CALL_LOG = "log"
OUTPUT_FILES = (RESULTS_NAME, REPORT_NAME, LOGS_ARCHIVE, SNAPSHOTS_ARCHIVE, CALL_LOG)
#: What comes back of one file, at most (the device tool's limit is 16 MiB).
ARCHIVE_LIMIT = 15 << 20
#: A log longer than this goes into the archive as its last this-many bytes.
LOG_TAIL_BYTES = 2 << 20
#: Test-only: a step whose cap is this many seconds (``key:seconds``), to show that a hang is
#: capped without a long test (see also workloads.HANG_ENV).
STEP_CAP_ENV = "GPU_CHECK_TEST_STEP_CAP"
NATIVE_SNAPSHOT = "native-snapshot.pickle"
FERROCACHE_SNAPSHOT = "ferrocache-snapshot.pickle"

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


class Step(NamedTuple):
    """A step of the check: the seconds of budget it needs to start, and its cap."""

    needs: float
    cap: float


#: Every step, in order (the report's items), with its needs and cap. A cap bounds a hang: it
#: is never more than what is left of the budget, and no cap is the whole budget.
STEPS = {
    "real_torch": Step(40, 150),
    "step_time": Step(60, 150),
    "losses": Step(40, 120),  # the training runs, which peaks judges too
    "peaks": Step(40, 120),
    "streams": Step(40, 100),  # the features runs, which the next five judge too
    "oom": Step(40, 100),
    "empty_cache": Step(40, 100),
    "expandable": Step(40, 100),
    "cross_stream": Step(40, 100),
    "graphs": Step(40, 100),
    "peer": Step(30, 80),
    "sleep": Step(30, 90),
    "memory_api": Step(30, 60),
    "host_cost": Step(30, 60),
    "example": Step(MINIMUM_STEP_SECONDS, 45),
}
#: The step-time runs of one round: (label, allocator); odd rounds run it backwards.
STEP_TIME_ROUND = (("native", "native"), ("ferrocache", "ferrocache"), (checks.NOISE, "native"))


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived (a BaseException: no step's ``except Exception`` keeps it)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=(
            "ferrocache against PyTorch's native allocator on a real GPU, in one call of at most "
            "6 minutes; writes docs/gpu-results.md and at most 5 files in --out, and prints one "
            "summary line at the end."
        ),
        epilog=(
            f"The call on the GPU machine, with dist/ carried along, is written down in {CALL_DOCUMENTED}. "
            f"--out gets {', '.join(OUTPUT_FILES[:-1])} (and the call's tee writes {CALL_LOG}); "
            "afterwards, here: scripts/gpu-check --analyse DIR replays and tunes the returned snapshot. "
            "Exit status: 0 passed, 1 a check failed or the check was stopped, 2 no usable GPU or PyTorch."
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
        "--wheel",
        default=os.environ.get(WHEEL_ENV),
        help="the wheel to unpack, a path or a glob such as 'dist/ferrocache-*.whl' (default $FERROCACHE_WHEEL)",
    )
    parser.add_argument(
        "--commit",
        default=None,
        help=f"the commit the wheel was built from (default: dist/{COMMIT_FILE} beside the wheel, else git)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=170,
        help="steps of each step-time run (default 170: 20 warm-up, 150 timed)",
    )
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps of each step-time run (default 20)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="step-time rounds, each native, ferrocache and native again (default 3)"
    )
    parser.add_argument(
        "--train-steps", type=int, default=30, help="steps of each training run for the losses (default 30)"
    )
    parser.add_argument("--budget", type=float, default=360.0, help="seconds for the whole check (default 360)")
    parser.add_argument("--bench-repetitions", type=int, default=9)
    parser.add_argument("--bench-iterations", type=int, default=5000)
    parser.add_argument(
        "--tests", default=None, help="a pytest -k expression: only those of the chosen real-PyTorch tests"
    )
    parser.add_argument(
        "--skip",
        default="",
        help=f"steps not to run, comma-separated (for a retry): {', '.join(STEPS)}",
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
        help="use the ferrocache that --python already imports, even where a wheel is given",
    )
    parser.add_argument(
        "--analyse",
        type=Path,
        metavar="DIR",
        default=None,
        help="no GPU: replay and tune the native snapshot in DIR (the files a GPU run brought back), "
        "and add both to its report, written to --results and --out",
    )
    args = parser.parse_args(argv)
    numbers = (args.steps, args.rounds, args.train_steps, args.bench_repetitions, args.bench_iterations, args.jobs)
    if min(numbers) < 1 or args.warmup < 0:
        parser.error("--steps, --rounds, --train-steps, --bench-repetitions, --bench-iterations and --jobs "
                     "must be at least 1, --warmup at least 0")  # fmt: skip
    if os.sep in args.python:  # the children run elsewhere; abspath, not resolve: a venv's python is a link
        args.python = os.path.abspath(args.python)
    unknown = [key for key in skipped_steps(args) if key not in STEPS]
    if unknown:
        parser.error(f"--skip: no step {', '.join(unknown)} (the steps: {', '.join(STEPS)})")
    return args


def skipped_steps(args: argparse.Namespace) -> list[str]:
    return [key.strip() for key in str(args.skip or "").split(",") if key.strip()]


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
    #: The per-step logs, raw figures and snapshots, outside --out (only archives go there).
    work: Optional[Path] = None
    wheel: Optional[Path] = None
    on_fake: bool = False
    device_count: int = 1
    #: When the running step must end (monotonic seconds).
    step_deadline: float = float("inf")
    #: Whether the steps began: the report then lists every step, reached or not.
    steps_began: bool = False
    #: The step running now, and since when (monotonic seconds).
    running: Optional[str] = None
    running_since: float = 0.0

    def work_directory(self) -> Path:
        if self.work is None:
            self.work = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
        self.work.mkdir(parents=True, exist_ok=True)
        return self.work

    @property
    def logs(self) -> Path:
        return self.work_directory() / "logs"

    @property
    def raw(self) -> Path:
        return self.work_directory() / "raw"

    @property
    def snapshots(self) -> Path:
        return self.work_directory() / "snapshots"

    def site_directory(self) -> Path:
        """The directory ferrocache (and pytest) go into, made on first use, removed at the end."""
        if self.site is None:
            self.site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
        return self.site

    def remaining(self) -> float:
        return float(self.args.budget) - (time.monotonic() - self.started)

    def step_left(self) -> float:
        """Seconds left of the running step's cap (and of the budget)."""
        return min(self.step_deadline - time.monotonic(), self.remaining())

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
        first = [str(self.site)] if self.site else []
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, str(TOOLS), env.get("PYTHONPATH", "")) if p)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
        # PyTorch symbolises C++ frames (snapshots, warnings) with addr2line, which has taken
        # minutes: GPU minutes. The check records Python stacks only.
        env["TORCH_DISABLE_ADDR2LINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        return env


def probe(python: str) -> dict[str, Any]:
    """What ``python`` says about PyTorch and the GPU; ``error`` where it cannot say."""
    try:
        process = processes.run_captured([python, "-c", PROBE], timeout=120)
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


# The runners, kept under their old names for the tests.
_run_all_logged = processes.run_all_logged
_run_logged = processes.run_logged


def find_wheel(pattern: str) -> tuple[Optional[Path], str]:
    """The one wheel ``pattern`` (a path or a glob) names; or None and why not."""
    matches = sorted(glob.glob(pattern))
    if len(matches) == 1:
        return Path(matches[0]), ""
    if not matches:
        return None, f"no wheel matches {pattern} (scripts/build-wheel writes dist/ferrocache-*.whl; carry dist/)"
    return None, f"{len(matches)} wheels match {pattern}: {', '.join(matches)}; keep one"


def install(ctx: Context) -> Optional[str]:
    """Installs ferrocache where the workloads will import it; returns the Python to run them
    with. The wheel goes into a directory of its own, put first on the children's PYTHONPATH:
    this works whatever environment holds PyTorch, without pip."""
    args = ctx.args
    imported = not args.wheel and not probe_ferrocache(args.python, ctx.env()).startswith("error")
    if args.skip_install or imported:
        ctx.report.environment["install"] = f"the ferrocache {args.python} imports"
        return str(args.python)
    started = time.monotonic()
    if args.wheel:
        wheel, why = find_wheel(args.wheel)
        if wheel is None:
            ctx.report.problem = why
            return None
        ctx.wheel = wheel
        try:
            unpack_wheel(wheel, ctx.site_directory())
        except (OSError, zipfile.BadZipFile) as err:
            ctx.report.problem = f"cannot unpack {wheel}: {err}"
            return None
        ctx.report.environment["install"] = f"{wheel} unpacked in {time.monotonic() - started:.1f} s"
        return str(args.python)
    command = [args.python, "-m", "pip", "--disable-pip-version-check", "install", "--no-deps", "--target",
               str(ctx.site_directory()), str(REPO)]  # fmt: skip
    log("pip install . ...")
    if processes.run_logged(command, ctx.logs / "pip-install.log", timeout=max(ctx.remaining(), 1.0), cwd=REPO) != 0:
        ctx.report.problem = f"pip install failed; see {LOGS_ARCHIVE}: logs/pip-install.log"
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
    """Runs one workload in a fresh process, within the running step's cap; its JSON result,
    or ``{"error": ...}``."""
    ctx.raw.mkdir(parents=True, exist_ok=True)
    out = ctx.raw / f"{label}.json"
    command = [ctx.python, "-m", "gpucheck.workloads", name, "--allocator", allocator, "--out", str(out), *extra]
    timeout = ctx.step_left()
    if timeout < 1.0:
        return {"error": "not run: the step's cap or the budget was spent"}
    log(f"{name} under {allocator} ({label}) ...")
    try:
        code = processes.run_logged(command, ctx.logs / f"{label}.log", env=ctx.env(), cwd=ctx.work, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the step's cap, after {timeout:.0f} s; see logs/{label}.log"}
    if code != 0:
        return {"error": f"exit status {code}: {bench.last_line(ctx.logs / f'{label}.log')} (logs/{label}.log)"}
    return dict(json.loads(out.read_text()))


def step_cap(ctx: Context, key: str) -> float:
    """The step's cap: its own, the test-only override (``key:seconds``), never past the budget."""
    cap = STEPS[key].cap
    override = os.environ.get(STEP_CAP_ENV, "")
    if override.partition(":")[0] == key:
        cap = float(override.partition(":")[2])
    return max(min(cap, ctx.remaining()), 0.0)


def guarded(ctx: Context, key: str, step: Callable[[], CheckResult], needs: Optional[float] = None) -> None:
    """Runs a step within its cap unless less than ``needs`` seconds of the budget are left or
    ``--skip`` names it; an exception becomes an ERROR item. The report, the page and the logs'
    archive are rewritten after it."""
    title = checks.TITLES[key]
    needs = STEPS[key].needs if needs is None else needs
    if key in skipped_steps(ctx.args):
        ctx.report.checks.append(CheckResult(key, title, SKIPPED, "not run: --skip named it"))
    elif ctx.remaining() < needs:
        left = max(ctx.remaining(), 0)
        why = f"time budget: {left:.0f} s left of {ctx.args.budget:.0f}, the step needs about {needs:.0f}"
        ctx.report.checks.append(CheckResult(key, title, SKIPPED, why))
    else:
        cap = step_cap(ctx, key)
        ctx.running, ctx.running_since = key, time.monotonic()
        ctx.step_deadline = ctx.running_since + cap
        try:
            result = step()
        except Exception as err:  # one broken step must not hide the others
            result = CheckResult(key, title, ERROR, f"{type(err).__name__}: {err}")
        ctx.step_deadline, ctx.running = float("inf"), None
        result.data.setdefault("seconds", round(time.monotonic() - ctx.running_since, 1))
        ctx.report.checks.append(result)
    checkpoint(ctx)


#: Set it to a ``ferrocache`` command to use that one (tests).
COMMAND_ENV = "FERROCACHE_COMMAND"


def ferrocache_command(ctx: Context) -> Optional[str]:
    """The ``ferrocache`` command the install put beside ``ctx.python`` (the venv's bin), else
    the one on the PATH, else cargo's build here; None where there is none.
    ``$FERROCACHE_COMMAND`` overrides."""
    override = os.environ.get(COMMAND_ENV)
    if override:
        return override if Path(override).is_file() else None
    # The wheel's own launcher (bin/ferrocache) looks for the program in the interpreter's
    # site-packages, not in the unpacked directory: the program itself, there.
    installed = [ctx.site / "ferrocache.scripts" / "ferrocache"] if ctx.site else []
    for beside in [*installed, Path(ctx.python or sys.executable).parent / "ferrocache"]:
        if beside.is_file():
            return str(beside)
    on_path = shutil.which("ferrocache")
    if on_path:
        return on_path
    for built in (REPO / "target" / "release" / "ferrocache", REPO / "target" / "debug" / "ferrocache"):
        if built.is_file():
            return str(built)
    return None


def _run_command(
    ctx: Context, command: Sequence[str], name: str
) -> tuple[Optional[subprocess.CompletedProcess[str]], str]:
    """Runs the ``ferrocache`` command, its stdout in ``<name>.json`` and stderr in the logs;
    the process, or None and why."""
    timeout = 300.0
    try:
        process = processes.run_captured(list(command), timeout=timeout, cwd=ctx.out, env=ctx.env())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    except OSError as err:
        return None, f"{command[0]} could not be run: {err}"
    ctx.raw.mkdir(parents=True, exist_ok=True)
    (ctx.raw / f"{name}.json").write_text(process.stdout)
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
    try:
        process = processes.run_captured([ctx.python, "-c", f"import {module}"], timeout=60, env=ctx.env())
    except subprocess.TimeoutExpired:
        return False
    return process.returncode == 0


def ensure_pytest(ctx: Context) -> Optional[str]:
    """None where pytest imports (the GPU machine's image has it), after installing it from the
    wheels beside the ferrocache wheel where it did not; else why it does not."""
    if _imports(ctx, "pytest"):
        return None
    wheels = ctx.wheel.resolve().parent if ctx.wheel is not None else None
    if wheels is None and ctx.args.wheel:
        wheels = Path(ctx.args.wheel).resolve().parent
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
    # SIGINT at the cap, and a few seconds for pytest to write the outcomes of the tests that ran.
    grace = PYTEST_GRACE_SECONDS
    timeout = max(ctx.step_left() - grace, 0.0)
    codes = processes.run_all_logged(commands, timeout, grace=grace, env=env, cwd=REPO)
    cases = [case for junit in reports if junit.is_file() for case in real_torch.results(junit)]
    problems = []
    for (_, log_file), junit, code in zip(commands, reports, codes):
        if code is None:
            problems.append(f"stopped at the step's cap, after {timeout:.0f} s (logs/{log_file.name})")
        elif not junit.is_file():
            problems.append(f"pytest exit status {code}: {bench.last_line(log_file)} (logs/{log_file.name})")
    return checks.real_torch(cases, "; ".join(problems))


def run_compare(ctx: Context) -> dict[str, Any]:
    """issue 28's ``compare.py --markdown``: its table, verbatim."""
    if not COMPARE.is_file():
        return {"skipped": "not in this checkout (python/tools/memory_api/compare.py)"}
    log("compare.py --markdown ...")
    timeout = max(ctx.step_left(), 1.0)
    try:
        process = processes.run_captured([ctx.python, str(COMPARE), "--markdown"], timeout=timeout, cwd=REPO,
                                         env=ctx.env())  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"returncode": None, "stderr_tail": f"stopped at the step's cap, after {timeout:.0f} s"}
    ctx.logs.mkdir(parents=True, exist_ok=True)
    (ctx.logs / "compare.log").write_text(process.stdout + process.stderr)
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


def step_time_runs(ctx: Context) -> dict[str, list[dict[str, Any]]]:
    """The step-time runs, interleaved: each round runs native, ferrocache and native again
    (the noise floor), odd rounds backwards (N F N', N' F N, ...), one process each; every
    process trains both models. On the fake the first run that stops at a kernel ends it."""
    args = ctx.args
    extra = ["--example", str(REPO / "examples" / "train.py"), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in STEP_TIME_ROUND}
    for round_number in range(args.rounds):
        order = STEP_TIME_ROUND if round_number % 2 == 0 else STEP_TIME_ROUND[::-1]
        for label, allocator in order:
            result = workload(ctx, "steptime", allocator, f"steptime-{round_number}-{label}", extra)
            result["round"] = round_number
            runs[label].append(result)
            if checks.ON_FAKE in result:
                return runs
            if ctx.step_left() < 1.0:
                return runs
    return runs


#: What the device tool brings back of a name: letters, digits, '.', '_' and '-'.
RETURNABLE_NAME = re.compile(r"[A-Za-z0-9._-]+")
#: The device tool's limits on what comes back of the output folder.
RETURNED_FILES, RETURNED_FILE_BYTES, RETURNED_DEPTH = 8, 16 << 20, 2


def output_problems(out: Path) -> list[str]:
    """What in ``out`` would not come back from the GPU machine: more than 8 files, a file over
    16 MiB, one more than 2 folders down, a name with other characters than letters, digits,
    '.', '_' and '-'. Empty where all of it comes back."""
    files = [path for path in out.rglob("*") if path.is_file() or path.is_symlink()]
    problems = [f"{len(files)} files, more than {RETURNED_FILES}"] if len(files) > RETURNED_FILES else []
    for path in files:
        relative = path.relative_to(out)
        if path.is_symlink():
            problems.append(f"{relative}: a link")
        elif path.stat().st_size > RETURNED_FILE_BYTES:
            problems.append(f"{relative}: {path.stat().st_size} bytes, over 16 MiB")
        if len(relative.parts) - 1 > RETURNED_DEPTH:
            problems.append(f"{relative}: more than {RETURNED_DEPTH} folders down")
        if not all(RETURNABLE_NAME.fullmatch(part) for part in relative.parts):
            problems.append(f"{relative}: a name the device tool does not bring back")
    return problems


def checkpoint(ctx: Context, final: bool = False) -> None:
    """Writes the report, the page and the logs' archive as they stand; until the end, the
    steps not reached yet are listed as such."""
    ctx.report.seconds = time.monotonic() - ctx.started
    report = ctx.report
    done = {check.key for check in report.checks}
    if ctx.steps_began and not final:
        pending = [CheckResult(key, checks.TITLES[key], SKIPPED, "not reached yet: the check was still running")
                   for key in STEPS if key not in done]  # fmt: skip
        report = replace(report, checks=[*report.checks, *pending])
    try:
        report.write(ctx.out, ctx.args.results.resolve())
        archive_logs(ctx)
    except OSError as err:  # a full disk must not end the check; the next checkpoint tries again
        log(f"could not write the report: {err}")


def _add_file(archive: tarfile.TarFile, path: Path, name: str) -> None:
    """Adds a file, a long log as its last LOG_TAIL_BYTES (the end says how it ended)."""
    size = path.stat().st_size
    if size <= LOG_TAIL_BYTES or path.suffix == ".json":
        archive.add(path, arcname=name)
        return
    with open(path, "rb") as handle:
        handle.seek(size - LOG_TAIL_BYTES)
        data = b"[... the first %d bytes left out ...]\n" % (size - LOG_TAIL_BYTES) + handle.read()
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(path.stat().st_mtime)
    archive.addfile(info, io.BytesIO(data))


def archive_logs(ctx: Context) -> None:
    """``logs.tar.gz`` in --out: the per-step logs (logs/) and raw figures (raw/), replaced whole."""
    if ctx.work is None:
        return
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for folder in ("logs", "raw"):
            for path in sorted((ctx.work / folder).glob("*")) if (ctx.work / folder).is_dir() else []:
                if path.is_file():
                    _add_file(archive, path, f"{folder}/{path.name}")
    replace_file(ctx.out / LOGS_ARCHIVE, buffer.getvalue())


def archive_snapshots(ctx: Context) -> list[str]:
    """``snapshots.tar.gz`` in --out, under ARCHIVE_LIMIT: both snapshots compressed, else the
    native one alone (the one the replay needs), else none; the names kept, and a note why."""
    if ctx.work is None or not ctx.snapshots.is_dir():
        return []
    found = [ctx.snapshots / name for name in (NATIVE_SNAPSHOT, FERROCACHE_SNAPSHOT) if (ctx.snapshots / name).is_file()]
    for kept in (found, found[:1] if found and found[0].name == NATIVE_SNAPSHOT else []):
        if not kept:
            continue
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as archive:
            for path in kept:
                archive.add(path, arcname=path.name)
        if buffer.tell() <= ARCHIVE_LIMIT:
            replace_file(ctx.out / SNAPSHOTS_ARCHIVE, buffer.getvalue())
            left = [p.name for p in found if p not in kept]
            if left:
                ctx.report.notes.append(f"{', '.join(left)} left out of {SNAPSHOTS_ARCHIVE}: over {ARCHIVE_LIMIT >> 20} MiB")
            return [p.name for p in kept]
    sizes = ", ".join(f"{p.name} {p.stat().st_size >> 20} MiB" for p in found)
    ctx.report.notes.append(f"no snapshot came back: compressed, each is over {ARCHIVE_LIMIT >> 20} MiB ({sizes})")
    return []


def run_checks(ctx: Context) -> None:
    args = ctx.args
    example = str(REPO / "examples" / "train.py")
    ctx.snapshots.mkdir(parents=True, exist_ok=True)
    ctx.steps_began = True
    checkpoint(ctx)  # the machine and every step, "not reached yet", before the first one starts

    guarded(ctx, "real_torch", lambda: run_real_torch_tests(ctx))
    def step_time() -> CheckResult:
        runs = step_time_runs(ctx)
        (ctx.raw / "steptime.json").write_text(json.dumps(runs))
        return checks.step_time(runs, args.warmup)

    guarded(ctx, "step_time", step_time)

    runs: dict[str, dict[str, Any]] = {}

    def training(judge: Callable[[dict[str, dict[str, Any]]], CheckResult]) -> Callable[[], CheckResult]:
        """The training runs (once, for losses and peaks), then ``judge`` on their results:
        native first (the losses' reference), then ferrocache, then the control (native again,
        recording PyTorch's history with Python stacks: the snapshot that comes back), then the
        opt-in modes."""

        def step() -> CheckResult:
            if not runs:
                steps = ["--example", example, "--steps", str(args.train_steps)]
                series = [
                    ("native", "native", steps),
                    ("ferrocache", "ferrocache", [*steps, "--snapshot", str(ctx.snapshots / FERROCACHE_SNAPSHOT)]),
                    (checks.CONTROL, "native",
                     [*steps, "--record-history", "--snapshot", str(ctx.snapshots / NATIVE_SNAPSHOT)]),
                    ("ferrocache-expandable", "ferrocache-expandable", steps),
                    ("ferrocache-cross-stream", "ferrocache-cross-stream", steps),
                ]  # fmt: skip
                runs.update(runs_until_fake_stops(ctx, "train", series))
                kept = archive_snapshots(ctx)
                if kept:
                    ctx.report.notes.append(
                        f"{SNAPSHOTS_ARCHIVE}: {', '.join(kept)}, for https://pytorch.org/memory_viz and for "
                        "scripts/gpu-check --analyse (native-snapshot.pickle: PyTorch's allocator with its "
                        "history; ferrocache-snapshot.pickle: ferrocache's state at the end of its run)"
                    )
            return judge(runs)

        return step

    guarded(ctx, "losses", training(checks.losses), needs=None if not runs else 0)
    guarded(ctx, "peaks", training(checks.peaks), needs=None if not runs else 0)

    features: dict[str, dict[str, Any]] = {}

    def judged(judge: Callable[[dict[str, dict[str, Any]]], CheckResult]) -> Callable[[], CheckResult]:
        """The feature runs (once, for all the checks below), then ``judge`` on their results."""

        def step() -> CheckResult:
            if not features:
                for allocator in ("native", "ferrocache", "ferrocache-expandable", "ferrocache-cross-stream"):
                    features[allocator] = workload(ctx, "features", allocator, f"features-{allocator}")
                (ctx.raw / "features.json").write_text(json.dumps(features, indent=1))
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
        guarded(ctx, key, judged(judge), needs=None if not features else 0)

    def peer_copies() -> CheckResult:
        if ctx.device_count < 2:
            return checks.peer({}, ctx.device_count)
        series = [(a, a, ()) for a in ("native", "ferrocache", "native-expandable", "ferrocache-expandable")]
        return checks.peer(runs_until_fake_stops(ctx, "peer", series), ctx.device_count)

    guarded(ctx, "peer", peer_copies, needs=0 if ctx.device_count < 2 else None)

    def sleep_runs() -> CheckResult:
        settings = (("ferrocache", "sleep"), ("ferrocache-expandable", "sleep-expandable"))
        runs = {allocator: workload(ctx, "sleep", allocator, label) for allocator, label in settings}
        return checks.sleep_bandwidth(runs)

    guarded(ctx, "sleep", sleep_runs)
    guarded(ctx, "memory_api", lambda: checks.memory_api(run_compare(ctx)))

    def host_cost() -> CheckResult:
        log("host cost, interleaved workers ...")
        commands = {
            name: [ctx.python, "-m", "gpucheck.workloads", "bench", "--allocator", name]
            for name in ("native", "ferrocache")
        }
        try:
            result = bench.interleaved(
                commands, BENCH_SIZES, args.bench_repetitions, args.bench_iterations,
                ctx.logs, env=ctx.env(), cwd=ctx.work, timeout=BENCH_REPLY_SECONDS,
                deadline=time.monotonic() + max(ctx.step_left(), 0.0),
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
        timeout = max(ctx.step_left(), 1.0)
        try:
            code = processes.run_logged([ctx.python, example, "--steps", "5"], log_file, env=env, cwd=ctx.work,
                                        timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return CheckResult("example", checks.TITLES["example"], ERROR, f"stopped at the step's cap, after {timeout:.0f} s")
        output = log_file.read_text(errors="replace")
        if code != 0 and ctx.on_fake and any(sign in output for sign in workloads.FAKE_CANNOT_RUN):
            return checks.skipped_on_fake("example", checks.TITLES["example"], "examples/train.py needs kernels")
        return checks.example(code, output)

    guarded(ctx, "example", example_run)


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
    ctx.report.environment["CPUs"] = os.cpu_count()
    ctx.report.environment["nvidia-smi"] = nvidia_smi()
    python = install(ctx)
    ctx.report.environment["commit"] = commit(ctx)
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
            "A rehearsal on the fake CUDA (tests/fake-cuda), not a GPU: its kernels compute nothing, so "
            "the work that needs kernels is reported as skipped on the fake, and no figure means anything."
        )
    ctx.report.notes.append(
        "The children run with PYTORCH_CUDA_ALLOC_CONF and the other allocator variables "
        "cleared, with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS) and TORCH_DISABLE_ADDR2LINE=1."
    )
    ctx.report.notes.append(
        f"Per-step logs and raw figures: {LOGS_ARCHIVE} (logs/, raw/). The replay and the tune of the native "
        "snapshot run afterwards, off the GPU: scripts/gpu-check --analyse DIR."
    )
    run_checks(ctx)
    return 1 if ctx.report.failed() else 0


def probe_ferrocache(python: str, env: dict[str, str]) -> str:
    code = "import ferrocache; print(ferrocache.__version__, ferrocache.library_path())"
    try:
        process = processes.run_captured([python, "-c", code], timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return "error: importing ferrocache took over 60 s"
    if process.returncode != 0:
        lines = process.stderr.strip().splitlines() or ["(no output)"]
        return "error: " + lines[-1]
    return process.stdout.strip()


def nvidia_smi() -> str:
    """The driver's view of the GPUs (name, driver version, memory), or why there is none."""
    command = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        process = processes.run_captured(command, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"n/a ({type(err).__name__})"
    return "; ".join(process.stdout.strip().splitlines()) or f"n/a (exit status {process.returncode})"


def commit(ctx: Context) -> str:
    """The commit of the wheel: ``--commit``, else the file scripts/build-wheel writes beside
    it, else git here (the GPU machine's copy of the checkout may have neither .git nor git)."""
    if ctx.args.commit:
        return f"{ctx.args.commit} (--commit)"
    if ctx.wheel is not None:
        written = ctx.wheel.parent / COMMIT_FILE
        if written.is_file():
            return f"{written.read_text().strip()} (the wheel's, from {written.name})"
    return f"{_git_commit()} (git, here)"


def _git_commit() -> str:
    try:
        process = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
        return process.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# ------------------------------------------------------------------------------------------------
# --analyse DIR: the replay and the tune, off the GPU, on what came back
# ------------------------------------------------------------------------------------------------


def analyse(args: argparse.Namespace) -> int:
    """Reads a GPU run's files (``report.json``, ``snapshots.tar.gz``, ``logs.tar.gz``) from
    ``args.analyse``, replays and tunes its native snapshot with this machine's ``ferrocache``
    command, and writes the report with both items added to ``--results`` and ``--out``."""
    source = args.analyse.resolve()
    try:
        data = json.loads((source / REPORT_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        log(f"no GPU report in {source}: {err}")
        return 2
    report = report_from_json(data)
    report.checks = [check for check in report.checks if check.key not in ("replay", "tune")]
    out = args.out.resolve()
    ctx = Context(args, report, out, python=sys.executable)
    work = ctx.work_directory()
    try:
        runs = {}
        if (source / LOGS_ARCHIVE).is_file():
            with tarfile.open(source / LOGS_ARCHIVE) as archive:
                for member in archive.getmembers():
                    name = Path(member.name).name
                    if member.isfile() and name.startswith("train-") and name.endswith(".json"):
                        handle = archive.extractfile(member)
                        if handle is not None:
                            runs[name[len("train-"):-len(".json")]] = json.loads(handle.read())
        snapshot = work / NATIVE_SNAPSHOT
        if (source / SNAPSHOTS_ARCHIVE).is_file():
            with tarfile.open(source / SNAPSHOTS_ARCHIVE) as archive:
                member = next((m for m in archive.getmembers() if m.name == NATIVE_SNAPSHOT and m.isfile()), None)
                handle = archive.extractfile(member) if member is not None else None
                if handle is not None:
                    snapshot.write_bytes(handle.read())
        ctx.out.mkdir(parents=True, exist_ok=True)
        ctx.report.checks.append(checks.replay(run_replay(ctx, snapshot), runs))
        ctx.report.checks.append(checks.tune(run_tune(ctx, snapshot)))
        ctx.report.notes.append(f"Replay and tune: scripts/gpu-check --analyse on {source.name}/, off the GPU.")
        report.write(out, args.results.resolve())
        archive_logs(ctx)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"results: {args.results} (and {out / RESULTS_NAME}, {out / REPORT_NAME}, {out / LOGS_ARCHIVE})")
    print(report.summary_line(), flush=True)
    return 1 if any(c.key in ("replay", "tune") and c.status in ("FAIL", "ERROR") for c in report.checks) else 0


def report_from_json(data: dict[str, Any]) -> Report:
    """A Report again, from its ``report.json``."""
    from .report import Table

    fields = {k: v for k, v in data.items() if k in Report.__dataclass_fields__ and k != "checks"}
    report = Report(**fields)
    for check in data.get("checks", []):
        tables = [Table(**table) for table in check.get("tables", [])]
        report.checks.append(CheckResult(**{**check, "tables": tables}))
    return report


# ------------------------------------------------------------------------------------------------


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.analyse is not None:
        return analyse(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    ctx = Context(args, Report(started=started), out)
    log(f"output in {out}, budget {args.budget:.0f} s")
    handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 1
    try:
        code = run(ctx)
    except Stopped as stop:
        ctx.report.stopped = f"stopped by {stop.signal_name} after {time.monotonic() - ctx.started:.0f} s"
        log(ctx.report.stopped)
        code = 1
    finally:
        # Finish without being interrupted again: the children's groups end, the report is
        # written with every step (those not reached say why), the temporary files go.
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)
        processes.end_all()
        if ctx.steps_began:
            done = {check.key for check in ctx.report.checks}
            for key in (key for key in STEPS if key not in done):
                if key == ctx.running:
                    ran = time.monotonic() - ctx.running_since
                    why = f"cut short: {ctx.report.stopped or 'the check ended'} while it ran, after {ran:.0f} s"
                    ctx.report.checks.append(CheckResult(key, checks.TITLES[key], ERROR, why))
                else:
                    why = f"not run: {ctx.report.stopped}" if ctx.report.stopped else "not run"
                    ctx.report.checks.append(CheckResult(key, checks.TITLES[key], SKIPPED, why))
        ctx.report.finished = True
        checkpoint(ctx, final=True)
        for directory in (ctx.site, ctx.work):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    for problem in output_problems(out):
        log(f"warning: {problem}: it would not come back from the GPU machine")
    log(f"results: {args.results} (and {', '.join(str(out / name) for name in OUTPUT_FILES[:-1])})")
    print(ctx.report.summary_line(), flush=True)
    return code
