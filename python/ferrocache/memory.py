"""PyTorch's CUDA memory API (``torch.cuda.memory_stats``, ``memory_summary``, ...), answered
by ferrocache.

With ferrocache installed, PyTorch's own ``torch.cuda.memory_stats()`` and friends cannot
answer (a pluggable allocator has no statistics in PyTorch); these functions take their place,
with the same names, arguments and meanings. They work without PyTorch too: then the device is
0 unless given, and allocations are made on the default stream.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

from . import _lib, _torch
from ._torch import Device
from .errors import library_error

#: The statistics PyTorch keeps per pool kind ("all", "small_pool", "large_pool").
STAT_ARRAYS = (
    "active",
    "active_bytes",
    "allocated_bytes",
    "allocation",
    "inactive_split",
    "inactive_split_bytes",
    "requested_bytes",
    "reserved_bytes",
    "segment",
)
POOLS = ("all", "large_pool", "small_pool")
METRICS = ("allocated", "current", "freed", "peak")
#: Counters that are not split by pool.
COUNTERS = (
    "max_split_size",
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
    "num_oom_rejections",
    "num_sync_all_streams",
)
#: Counters of PyTorch's that ferrocache has no event for: always 0 (``num_oom_rejections``
#: counts allocations refused without trying the device), and the PyTorch version whose
#: allocator has them: with an older PyTorch imported, the key is left out, as its allocator
#: does.
ZERO_COUNTERS = {"num_oom_rejections": (2, 12)}
#: The keys of ``torch.cuda.memory_stats()`` for PyTorch's native allocator, sorted as it sorts.
PYTORCH_STAT_KEYS: tuple[str, ...] = tuple(
    sorted(
        [f"{array}.{pool}.{metric}" for array in STAT_ARRAYS for pool in POOLS for metric in METRICS]
        + [f"{name}.{metric}" for name in ("oversize_allocations", "oversize_segments") for metric in METRICS]
        + list(COUNTERS)
    )
)
#: ferrocache's own counters, kept out of :func:`memory_stats` (see :func:`extra_memory_stats`).
EXTRA_STAT_KEYS = ("num_merges", "num_splits")


def _library_stats(device: Device) -> dict[str, int]:
    index = _torch.device_index(device)
    stats = {str(k): int(v) for k, v in _lib.call_json("ferrocache_memory_stats", index).items()}
    torch_version = _torch.version()
    for name, since in ZERO_COUNTERS.items():
        if torch_version is None or torch_version >= since:
            stats.setdefault(name, 0)
        else:
            stats.pop(name, None)
    return stats


def memory_stats(device: Device = None) -> "collections.OrderedDict[str, int]":
    """``torch.cuda.memory_stats(device)``: the allocator's statistics for ``device``, under
    PyTorch's flat keys (``"allocated_bytes.all.current"``, ``"num_ooms"``, ...), sorted by key
    as PyTorch sorts them. ferrocache's own counters are in :func:`extra_memory_stats`."""
    stats = _library_stats(device)
    return collections.OrderedDict(
        sorted((k, v) for k, v in stats.items() if k not in EXTRA_STAT_KEYS)
    )


def extra_memory_stats(device: Device = None) -> dict[str, int]:
    """ferrocache's counters that PyTorch does not keep: ``num_splits`` (blocks split to serve a
    request) and ``num_merges`` (free blocks merged with a free neighbour)."""
    stats = _library_stats(device)
    return {k: stats[k] for k in EXTRA_STAT_KEYS if k in stats}


def memory_stats_as_nested_dict(device: Device = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict(device)``: :func:`memory_stats` as nested dicts
    (``stats["allocated_bytes"]["all"]["current"]``)."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    # PyTorch >= 2.13 lists the memory reserved by each private pool (CUDA graphs) here; it is
    # empty without private pools, and no flat key comes from it.
    torch_version = _torch.version()
    if torch_version is None or torch_version >= (2, 13):
        nested.setdefault("reserved_bytes_by_private_pools", {})
    return nested


def memory_allocated(device: Device = None) -> int:
    """``torch.cuda.memory_allocated(device)``: bytes occupied by tensors (``allocated_bytes.
    all.current``)."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Device = None) -> int:
    """``torch.cuda.max_memory_allocated(device)``: the peak of :func:`memory_allocated` since
    the start or the last :func:`reset_peak_memory_stats`."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Device = None) -> int:
    """``torch.cuda.memory_reserved(device)``: bytes held from the driver, in use or cached
    (``reserved_bytes.all.current``)."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Device = None) -> int:
    """``torch.cuda.max_memory_reserved(device)``: the peak of :func:`memory_reserved`."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Device = None) -> None:
    """``torch.cuda.reset_peak_memory_stats(device)``: every ``peak`` becomes ``current``."""
    _lib.call_status("ferrocache_reset_peak_stats", _torch.device_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """``torch.cuda.reset_accumulated_memory_stats(device)``: every ``allocated`` and ``freed``
    and the event counters (``num_ooms``, ``num_alloc_retries``, ...) become 0."""
    _lib.call_status("ferrocache_reset_accumulated_stats", _torch.device_index(device))


def empty_cache() -> None:
    """``torch.cuda.empty_cache()``: gives every wholly free cached segment of every device back
    to the driver. (With ferrocache installed, ``torch.cuda.empty_cache()`` does the same.)"""
    _lib.call_status("ferrocache_empty_cache")


def set_per_process_memory_fraction(fraction: float, device: Device = None) -> None:
    """``torch.cuda.set_per_process_memory_fraction(fraction, device)``: caps what the allocator
    reserves on ``device`` at ``fraction`` of its total memory; beyond it, allocations fail as
    out of memory."""
    index = _torch.device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _lib.call_status("ferrocache_set_memory_fraction", fraction, index)


def caching_allocator_alloc(size: int, device: Device = None, stream: Any = None) -> int:
    """``torch.cuda.caching_allocator_alloc(size, device, stream)``: ``size`` bytes from the
    caching allocator for ``stream`` (None: the current stream, or the default stream without
    PyTorch) on ``device``; returns the device address. Free it with
    :func:`caching_allocator_delete`.

    Out of memory raises :class:`ferrocache.OutOfMemoryError` with PyTorch's message (also a
    ``torch.cuda.OutOfMemoryError`` where PyTorch is importable); other failures RuntimeError.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError(f"size must be a non-negative int, not {size!r}")
    index = _torch.device_index(device)
    handle = _torch.stream_handle(stream, index)
    pointer = _lib.function("ferrocache_alloc")(size, index, handle)
    if pointer:
        return int(pointer)
    message = _lib.last_error()
    if not message and size == 0:
        return 0
    raise library_error(message, "caching_allocator_alloc")


def caching_allocator_delete(mem_ptr: int) -> None:
    """``torch.cuda.caching_allocator_delete(mem_ptr)``: frees an allocation of
    :func:`caching_allocator_alloc` (the allocator knows its device and stream). 0 does
    nothing; a pointer ferrocache did not hand out raises RuntimeError."""
    _lib.call_status("ferrocache_free", mem_ptr)


# ------------------------------------------------------------------------------------------------
# memory_summary
# ------------------------------------------------------------------------------------------------

#: Width of the summary table between its outer bars, as in PyTorch's.
SUMMARY_WIDTH = 75

_SIZE_UNITS = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (" ", "K", "M")

#: (statistic, row label, cell format) of the main table, in PyTorch's order.
_SUMMARY_ROWS = (
    ("allocated_bytes", "Allocated memory", "size"),
    ("active_bytes", "Active memory", "size"),
    ("requested_bytes", "Requested memory", "size"),
    ("reserved_bytes", "GPU reserved memory", "size"),
    ("inactive_split_bytes", "Non-releasable memory", "size"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "GPU reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
)
_OVERSIZE_ROWS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_COLUMNS = ("current", "peak", "allocated", "freed")


def _scaled(value: int, reference: float, step: int, threshold: int, units: int) -> tuple[int, int]:
    """``value`` in the unit that suits ``reference`` (the row's "all" value): one step up each
    time the reference, in the current unit, is at least ``threshold``."""
    unit = 0
    while unit + 1 < units and reference >= threshold:
        reference /= step
        value //= step
        unit += 1
    return value, unit


def format_size_cell(value: int, reference: int) -> str:
    """A byte count as PyTorch's summary shows it: 6 digits and a unit (``"   512 KiB"``)."""
    scaled, unit = _scaled(value, reference, 1024, 768 * 1024, len(_SIZE_UNITS))
    return f"{scaled:6d} {_SIZE_UNITS[unit]}"


def format_count_cell(value: int, reference: int) -> str:
    """A count as PyTorch's summary shows it: 7 digits and a unit (``"   1200 K "``)."""
    scaled, unit = _scaled(value, reference, 1000, 750 * 1000, len(_COUNT_UNITS))
    return f"{scaled:7d} {_COUNT_UNITS[unit]} "


def _row(label: str, cells: list[str]) -> str:
    return f" {label:<21} | " + " | ".join(cells) + " "


def format_summary(
    stats: dict[str, int], device: int, abbreviated: bool = False, layout: str = "ferrocache"
) -> str:
    """The text of :func:`memory_summary` for the statistics ``stats`` (flat keys). With
    ``layout="pytorch"``, PyTorch's text line for line (its title, no split and merge line),
    which is what ``torch.cuda.memory_summary()`` prints once ferrocache is installed."""
    if layout not in ("ferrocache", "pytorch"):
        raise ValueError(f"layout must be 'ferrocache' or 'pytorch', not {layout!r}")
    formats: dict[str, Callable[[int, int], str]] = {
        "size": format_size_cell,
        "count": format_count_cell,
    }
    rule, double_rule = "-" * SUMMARY_WIDTH, "=" * SUMMARY_WIDTH
    title = (
        f" {'':16} PyTorch CUDA memory summary, device ID {device:<17d} "
        if layout == "pytorch"
        else f" {'':13} ferrocache CUDA memory summary, device ID {device:<17d} "
    )
    lines = [
        double_rule,
        title,
        rule,
        (
            f"  {'':9} CUDA OOMs: {stats['num_ooms']:<12d} | "
            f"{'':6} cudaMalloc retries: {stats['num_alloc_retries']:<8d}  "
        ),
    ]
    if layout == "ferrocache":
        lines.append(
            f"  {'':6} Block splits: {stats.get('num_splits', 0):<12d} | "
            f"{'':6} Block merges: {stats.get('num_merges', 0):<14d}  "
        )
    lines += [
        double_rule,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    pools: list[tuple[str, Optional[str]]] = [("all", None)]
    if not abbreviated:
        pools += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
    for statistic, label, kind in _SUMMARY_ROWS:
        cell = formats[kind]
        lines.append(rule)
        references = [stats[f"{statistic}.all.{column}"] for column in _COLUMNS]
        for pool, pool_label in pools:
            values = [stats[f"{statistic}.{pool}.{column}"] for column in _COLUMNS]
            cells = [cell(v, r) for v, r in zip(values, references)]
            lines.append(_row(pool_label or label, cells))
    for statistic, label in _OVERSIZE_ROWS:
        lines.append(rule)
        values = [stats[f"{statistic}.{column}"] for column in _COLUMNS]
        lines.append(_row(label, [format_count_cell(v, v) for v in values]))
    lines.append(double_rule)
    return "|" + "|\n|".join(lines) + "|\n"


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary(device, abbreviated)``: the statistics of ``device`` as
    PyTorch's table (same rows, columns, units and widths), with one more line for ferrocache's
    block split and merge counts. ``abbreviated`` leaves out the per-pool rows."""
    index = _torch.device_index(device)
    stats = _library_stats(index)
    return format_summary(stats, index, abbreviated)


__all__ = [
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "empty_cache",
    "extra_memory_stats",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]
