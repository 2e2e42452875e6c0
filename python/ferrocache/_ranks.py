"""Which process of a job this is, and the names that keep the ranks' files and lines apart.

``torchrun`` starts one process per GPU and gives each ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE``; once ``torch.distributed`` is initialised its answers win. A process that is
not part of a job is rank 0 of 1. The library's log prefix follows the same rule from the
environment (``src/logging.rs``, ``rank_prefix``).
"""

from __future__ import annotations

import os
import string
import sys
from dataclasses import dataclass
from typing import Optional, Union

from . import _env
from .config import LOG_LEVEL_VAR

RANK_VAR = _env.RANK.name
LOCAL_RANK_VAR = _env.LOCAL_RANK.name
WORLD_SIZE_VAR = _env.WORLD_SIZE.name
#: The placeholders a snapshot path may hold.
PLACEHOLDERS = ("rank", "local_rank", "pid")


@dataclass(frozen=True)
class Process:
    """This process's place in its job."""

    rank: int
    local_rank: int
    world_size: int
    pid: int

    @property
    def in_a_job(self) -> bool:
        """Whether other ranks exist (``WORLD_SIZE`` > 1)."""
        return self.world_size > 1


def _number(name: str) -> Optional[int]:
    try:
        value = int(os.environ.get(name, "").strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def _initialised_group() -> Optional[tuple[int, int]]:
    """(rank, world size) from ``torch.distributed`` when this process already imported it and
    initialised the default group; never imports torch."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a half-torn-down group: the environment answers
        pass
    return None


def this_process() -> Process:
    """This process's rank, local rank, world size and pid (see the module's docs)."""
    group = _initialised_group()
    rank, world_size = group if group else (_number(RANK_VAR), _number(WORLD_SIZE_VAR))
    if rank is None or world_size is None or world_size < 1:
        rank, world_size = 0, 1
    local_rank = _number(LOCAL_RANK_VAR)
    return Process(rank, rank if local_rank is None else local_rank, world_size, os.getpid())


def check_path(path: Union[str, "os.PathLike[str]"]) -> str:
    """``path`` as a string, once its placeholders are known to be ``{rank}``, ``{local_rank}``
    and ``{pid}`` only (``{{`` and ``}}`` are braces); ``ValueError`` otherwise."""
    return _parse_path(path)[0]


def _parse_path(path: Union[str, "os.PathLike[str]"]) -> tuple[str, list[str]]:
    """:func:`check_path`'s string, and the placeholders it holds."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"a snapshot path must be a str or os.PathLike[str], not {type(text).__name__}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(text) if field is not None]
    except ValueError as err:
        raise ValueError(f"snapshot path {text!r}: {err} (write {{{{ and }}}} for braces)") from None
    unknown = [f"{{{field}}}" for field in fields if field not in PLACEHOLDERS]
    if unknown:
        raise ValueError(
            f"snapshot path {text!r} has unknown placeholder(s) {', '.join(unknown)}; "
            "the placeholders are {rank}, {local_rank} and {pid}"
        )
    return text, fields


def per_rank_path(path: Union[str, "os.PathLike[str]"], process: Optional[Process] = None) -> str:
    """The file this process writes for ``path``: its placeholders filled in, or, when it has
    none and the process is one rank of several, the rank added before the extension
    (``run.pickle`` -> ``run_rank3.pickle``), so that ranks never overwrite one another."""
    text, fields = _parse_path(path)
    process = process or this_process()
    if fields:
        return text.format(rank=process.rank, local_rank=process.local_rank, pid=process.pid)
    plain = text.replace("{{", "{").replace("}}", "}")
    if not process.in_a_job:
        return plain
    stem, extension = os.path.splitext(plain)
    return f"{stem}_rank{process.rank}{extension}"


def log_prefix() -> str:
    """``[rankN]:`` for rank N of a job of several (from ``WORLD_SIZE`` and ``RANK``, as the
    library's logger reads them), else nothing: the start of every ferrocache log line. It is
    the prefix ``torch.distributed`` puts on a rank's tracebacks."""
    world_size, rank = _number(WORLD_SIZE_VAR), _number(RANK_VAR)
    if world_size is not None and world_size > 1 and rank is not None:
        return f"[rank{rank}]:"
    return ""


def log(level: str, message: str) -> None:
    """One line on stderr in the library's format (``[rankN]:[LEVEL] Allocator: message``),
    unless ``TORCH_CUDA_ALLOC_LOG_LEVEL`` hides the level."""
    order = ("TRACE", "DEBUG", "INFO", "WARN", "ERROR")
    wanted = os.environ.get(LOG_LEVEL_VAR, "WARN").strip().upper()
    wanted = "WARN" if wanted == "WARNING" else wanted
    if wanted == "OFF":
        return
    if order.index(level) < order.index(wanted if wanted in order else "WARN"):
        return
    print(f"{log_prefix()}[{level}] Allocator: {message}", file=sys.stderr, flush=True)
