"""The environment variables ferrocache reads or sets: one table, the library's own
(``src/env.rs``, ``TABLE``), kept here in the same order with the same words;
``tests/env.rs`` checks that the two agree. Every other module of the package takes the names
from here.

Stdlib only, so that ``_startup/sitecustomize.py`` and a package that cannot load its library
can use it.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


class Variable(NamedTuple):
    """One environment variable."""

    name: str
    #: What it does, in one sentence.
    meaning: str
    #: How its value is read: flag (see :func:`parse_flag`), alloc_conf, log_level,
    #: pytorch_version, number, path, rank_path (``{rank}``, ``{local_rank}``, ``{pid}``
    #: replaced), path_list.
    parsing: str
    #: library, package or library_and_package.
    read_by: str
    #: The ``ferrocache run`` option that sets it in the command's environment, if one does.
    run_option: Optional[str]


ALLOC_CONF = Variable(
    name="PYTORCH_CUDA_ALLOC_CONF",
    meaning=(
        "PyTorch's allocator settings (max_split_size_mb, expandable_segments, ...), read as "
        "PyTorch reads them; the first of the three that is set is used"
    ),
    parsing="alloc_conf",
    read_by="library_and_package",
    run_option="--conf",
)

HIP_ALLOC_CONF = Variable(
    name="PYTORCH_HIP_ALLOC_CONF",
    meaning="PyTorch's allocator settings when PYTORCH_CUDA_ALLOC_CONF is not set",
    parsing="alloc_conf",
    read_by="library_and_package",
    run_option=None,
)

ANY_ALLOC_CONF = Variable(
    name="PYTORCH_ALLOC_CONF",
    meaning=(
        "PyTorch's allocator settings when neither PYTORCH_CUDA_ALLOC_CONF nor "
        "PYTORCH_HIP_ALLOC_CONF is set"
    ),
    parsing="alloc_conf",
    read_by="library_and_package",
    run_option=None,
)

LOG_LEVEL = Variable(
    name="TORCH_CUDA_ALLOC_LOG_LEVEL",
    meaning="ferrocache's log level on stderr: OFF, ERROR, WARN (the default), INFO, DEBUG, TRACE",
    parsing="log_level",
    read_by="library_and_package",
    run_option="--log-level",
)

EXPANDABLE_SEGMENTS_IPC = Variable(
    name="TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC",
    meaning=(
        "0 creates expandable and sleep-able segments' physical memory without a shareable handle "
        "type (no CUDA IPC of it), as PyTorch's; on by default where the device supports POSIX "
        "file descriptors"
    ),
    parsing="flag",
    read_by="library",
    run_option=None,
)

CROSS_STREAM = Variable(
    name="FERROCACHE_CROSS_STREAM",
    meaning=(
        "cross-stream reuse: a request that misses its stream's cache may take a block cached on "
        "another stream, after a device-side wait"
    ),
    parsing="flag",
    read_by="library",
    run_option="--cross-stream",
)

EXPANDABLE_IGNORE_MAX_SPLIT = Variable(
    name="FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT",
    meaning=(
        "max_split_size_mb does not apply to blocks of expandable segments, which always split "
        "(pytorch#123548)"
    ),
    parsing="flag",
    read_by="library",
    run_option=None,
)

PYTORCH_VERSION = Variable(
    name="FERROCACHE_PYTORCH_VERSION",
    meaning=(
        "the PyTorch ferrocache decides like where its rules changed between versions (tie rule, "
        "out-of-memory wording, run-time settings); install() sets it from torch.__version__; "
        "unset, PyTorch 2.15's"
    ),
    parsing="pytorch_version",
    read_by="library_and_package",
    run_option=None,
)

SLEEP = Variable(
    name="FERROCACHE_SLEEP",
    meaning=(
        "every segment is made so that it can sleep from the start, so that sleep() with no tag "
        "gives back all memory; without it, only memory allocated after the first region() can"
    ),
    parsing="flag",
    read_by="library",
    run_option=None,
)

SNAPSHOT_ON_OOM = Variable(
    name="FERROCACHE_SNAPSHOT_ON_OOM",
    meaning='record the allocation history and write a snapshot to this file at the first out-of-memory',
    parsing="rank_path",
    read_by="package",
    run_option="--snapshot-on-oom",
)

LIBRARY = Variable(
    name="FERROCACHE_LIBRARY",
    meaning=(
        "the libferrocache.so the Python package loads; ferrocache run sets it to its own library "
        "when it is not set"
    ),
    parsing="path",
    read_by="package",
    run_option=None,
)

OOM_SHIM = Variable(
    name="FERROCACHE_OOM_SHIM",
    meaning='a prebuilt shim that raises torch.OutOfMemoryError, loaded instead of building one',
    parsing="path",
    read_by="package",
    run_option=None,
)

CACHE_DIR = Variable(
    name="FERROCACHE_CACHE_DIR",
    meaning='where built shims are kept (default $XDG_CACHE_HOME/ferrocache or ~/.cache/ferrocache)',
    parsing="path",
    read_by="package",
    run_option=None,
)

FRONTEND = Variable(
    name="FERROCACHE_FRONTEND",
    meaning="off (0, false, no): install PyTorch's CUDAPluggableAllocator instead of ferrocache's own allocator object for PyTorch (on by default)",
    parsing="flag",
    read_by="package",
    run_option=None,
)

CUDA_INCLUDE = Variable(
    name="FERROCACHE_CUDA_INCLUDE",
    meaning="a folder with CUDA's cuda_runtime.h (and crt/), searched first when the front end is built",
    parsing="path",
    read_by="package",
    run_option=None,
)

RUN_REPORT = Variable(
    name="FERROCACHE_RUN_REPORT",
    meaning='ferrocache run: each process prints its report at exit (on unless set to off)',
    parsing="flag",
    read_by="package",
    run_option="--quiet",
)

RUN_RECORD = Variable(
    name="FERROCACHE_RUN_RECORD",
    meaning='ferrocache run: keep the allocation history, so that the report advises a setting',
    parsing="flag",
    read_by="package",
    run_option="--record",
)

RUN_REPORT_JSON = Variable(
    name="FERROCACHE_RUN_REPORT_JSON",
    meaning='ferrocache run: each process also writes its report as JSON to this file',
    parsing="rank_path",
    read_by="package",
    run_option="--report",
)

RUN_DIR = Variable(
    name="FERROCACHE_RUN_DIR",
    meaning=(
        "ferrocache run: the launcher's folder, where every process leaves its JSON report for the "
        "job's rows"
    ),
    parsing="path",
    read_by="package",
    run_option="(always)",
)

WORLD_SIZE = Variable(
    name="WORLD_SIZE",
    meaning='torchrun: the number of processes of the job; above 1, log lines start with [rankN]:',
    parsing="number",
    read_by="library_and_package",
    run_option=None,
)

RANK = Variable(
    name="RANK",
    meaning="torchrun: this process's rank in the job (log lines, per-rank file names)",
    parsing="number",
    read_by="library_and_package",
    run_option=None,
)

LOCAL_RANK = Variable(
    name="LOCAL_RANK",
    meaning="torchrun: this process's rank on its machine (per-rank file names)",
    parsing="number",
    read_by="package",
    run_option=None,
)

PYTHONPATH = Variable(
    name="PYTHONPATH",
    meaning=(
        "ferrocache run puts the package's startup hook (_startup/) first, before the environment's"
        " own entries"
    ),
    parsing="path_list",
    read_by="package",
    run_option="(always)",
)

#: Every variable, in the library's order.
TABLE = (
    ALLOC_CONF,
    HIP_ALLOC_CONF,
    ANY_ALLOC_CONF,
    LOG_LEVEL,
    EXPANDABLE_SEGMENTS_IPC,
    CROSS_STREAM,
    EXPANDABLE_IGNORE_MAX_SPLIT,
    PYTORCH_VERSION,
    SLEEP,
    SNAPSHOT_ON_OOM,
    LIBRARY,
    OOM_SHIM,
    CACHE_DIR,
    FRONTEND,
    CUDA_INCLUDE,
    RUN_REPORT,
    RUN_RECORD,
    RUN_REPORT_JSON,
    RUN_DIR,
    WORLD_SIZE,
    RANK,
    LOCAL_RANK,
    PYTHONPATH,
)

#: The variables that hold PyTorch's allocator settings, in the order PyTorch reads them: the
#: first one that is set (even to an empty string) is used.
ALLOC_CONF_VARS = (ALLOC_CONF.name, HIP_ALLOC_CONF.name, ANY_ALLOC_CONF.name)


def parse_flag(value: str) -> Optional[bool]:
    """An on/off value as the library reads it: True for ``1``/``true``/``yes``/``on``, False for
    ``0``/``false``/``no``/``off``/empty (any case, white space around ignored), None for
    anything else."""
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("", "0", "false", "no", "off"):
        return False
    return None


def flag_is_on(variable: Variable, default: bool = False) -> bool:
    """Whether an on/off variable is on in the environment; unset or not understood gives
    ``default``."""
    value = os.environ.get(variable.name)
    on = None if value is None else parse_flag(value)
    return default if on is None else on


def table() -> list[dict]:
    """The table as the library's ``env::table_json`` writes it."""
    return [variable._asdict() for variable in TABLE]
