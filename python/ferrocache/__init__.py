"""ferrocache: a CUDA caching allocator in Rust for PyTorch.

Use::

    import ferrocache
    ferrocache.install()          # before the first CUDA tensor
    ...
    print(ferrocache.memory_summary())
    ferrocache.dump_snapshot("run.pickle")   # opens in https://pytorch.org/memory_viz

The functions carry the names of ``torch.cuda``'s memory API and mean the same; all but
:func:`install` work without PyTorch. Settings come from ``PYTORCH_CUDA_ALLOC_CONF`` as in
PyTorch; see docs/python.md.
"""

from ._lib import LIBRARY_ENV, library_path
from .advise import Advice, NoHistoryError, advise
from ._version import __version__
from .config import check_config, describe_config
from .errors import LibraryNotFoundError, LibraryVersionError, OutOfMemoryError
from .install import install, is_installed
from .oom import attach_out_of_memory_observer
from .pools import MemPool, mem_pool
from .memory import (
    caching_allocator_alloc,
    caching_allocator_delete,
    empty_cache,
    extra_memory_stats,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from .snapshot import dump_snapshot, memory_snapshot, record_memory_history, snapshot
from .sleep import DeviceSleepReport, SleepError, SleepReport, region, sleep, wake


def library_version() -> str:
    """The version the loaded library reports (``ferrocache_version()``); loads the library."""
    from . import _lib

    return (_lib.load().ferrocache_version() or b"").decode()


__all__ = [
    "Advice",
    "DeviceSleepReport",
    "LIBRARY_ENV",
    "LibraryNotFoundError",
    "LibraryVersionError",
    "MemPool",
    "NoHistoryError",
    "OutOfMemoryError",
    "SleepError",
    "SleepReport",
    "__version__",
    "advise",
    "attach_out_of_memory_observer",
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "check_config",
    "describe_config",
    "dump_snapshot",
    "empty_cache",
    "extra_memory_stats",
    "install",
    "is_installed",
    "library_path",
    "library_version",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_pool",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "record_memory_history",
    "region",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "sleep",
    "snapshot",
    "wake",
]
