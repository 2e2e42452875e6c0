"""Allocation history and snapshots in the format of ``torch.cuda.memory._snapshot()``, which
PyTorch's memory viewer (https://pytorch.org/memory_viz, ``torch/cuda/_memory_viz.py``) reads.

The library gives the snapshot as JSON; :func:`snapshot` turns it into the Python objects
PyTorch's snapshot holds (tuples where PyTorch has tuples), and :func:`dump_snapshot` pickles
it with protocol 4, the newest the viewer's own unpickler reads.

ferrocache sees allocations from the driver side, not from Python, so ``frames`` (stack traces)
are always empty lists: the viewer shows the memory over time, segment by segment and block by
block, without saying which line of Python made each allocation.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Iterable, Optional, Union

from . import _lib
from ._torch import Device

#: The trace actions PyTorch's allocator records (``skip_actions`` takes these).
TRACE_ACTIONS = frozenset(
    {
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    }
)
#: Keys whose values PyTorch's snapshot holds as tuples (JSON has only lists).
TUPLE_KEYS = frozenset({"segment_pool_id", "pool_id"})
#: The pickle protocol of :func:`dump_snapshot`: the memory viewer reads protocols 2 to 4.
PICKLE_PROTOCOL = 4

_skipped_actions: frozenset[str] = frozenset()


def _set_recording(record: bool, max_entries: int, clear_history: bool) -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be a non-negative int, not {max_entries!r}")
    record_history = _lib.function("ferrocache_record_history")
    if record and clear_history:
        record_history(0, 0)  # stopping clears the history
    if record_history(1 if record else 0, min(max_entries, sys.maxsize)) != 0:
        raise RuntimeError(_lib.last_error())


def _check_skip_actions(skip_actions: Optional[Iterable[str]]) -> frozenset[str]:
    skipped = frozenset(skip_actions or ())
    unknown = sorted(skipped - TRACE_ACTIONS)
    if unknown:
        raise ValueError(
            f"unknown trace action(s) in skip_actions: {', '.join(unknown)}; "
            f"valid ones are {', '.join(sorted(TRACE_ACTIONS))}"
        )
    return skipped


def _record_memory_history_impl(
    enabled: Optional[str] = "all",
    context: Optional[str] = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device: Device = None,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: Optional[Iterable[str]] = None,
    record_pinned_host_memory: bool = False,
    record_cuda: bool = True,
) -> None:
    global _skipped_actions
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
    if context not in (None, "state", "alloc", "all"):
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', not {context!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', not {stacks!r}")
    skipped = _check_skip_actions(skip_actions)
    # "state" keeps only what a snapshot's segments show anyway (ferrocache has no stack traces
    # to keep), so only "all" records the history of events.
    _set_recording(enabled == "all" and record_cuda, max_entries, clear_history)
    _skipped_actions = skipped


def _record_memory_history_legacy(
    enabled: bool,
    record_context: bool = True,
    trace_alloc_max_entries: int = 1,
    trace_alloc_record_context: bool = False,
    device: Device = None,
    record_context_cpp: bool = False,
    clear_history: bool = False,
    compile_context: bool = False,
    global_record_annotations: bool = False,
    skip_actions: Optional[Iterable[str]] = None,
    record_pinned_host_memory: bool = False,
    record_cuda: bool = True,
) -> None:
    global _skipped_actions
    skipped = _check_skip_actions(skip_actions)
    _set_recording(enabled and record_cuda, trace_alloc_max_entries, clear_history)
    _skipped_actions = skipped


#: Keyword arguments that only PyTorch's older, boolean form of the call has.
_LEGACY_ONLY = frozenset(
    {"record_context", "trace_alloc_max_entries", "trace_alloc_record_context", "record_context_cpp"}
)


def record_memory_history(enabled: Union[str, bool, None] = "all", *args: Any, **kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history``: starts (or stops) recording allocator events
    for :func:`snapshot`'s ``device_traces``, on every device.

    Accepts PyTorch's forms: ``enabled`` ``"all"`` (record, the default), ``"state"`` or None
    (do not record), with ``max_entries`` (default ``sys.maxsize``: keep everything; otherwise
    the newest entries are kept), ``clear_history``, ``skip_actions``, ``record_cuda``;
    ``context`` and ``stacks`` are accepted and have nothing to act on. The older boolean form
    works too: ``record_memory_history(True, trace_alloc_max_entries=100000)``, and
    ``record_memory_history(True, max_entries=100000)`` (True meaning "all", False None).
    Stopping clears the recorded history.
    """
    if isinstance(enabled, bool):
        if args or _LEGACY_ONLY & kwargs.keys():
            _record_memory_history_legacy(enabled, *args, **kwargs)
            return
        enabled = "all" if enabled else None
    _record_memory_history_impl(enabled, *args, **kwargs)


def _tuples(value: Any, key: Optional[str] = None) -> Any:
    """JSON lists back into tuples where PyTorch's snapshot has tuples."""
    if isinstance(value, dict):
        return {k: _tuples(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_tuples(v) for v in value]
        return tuple(items) if key in TUPLE_KEYS else items
    return value


def snapshot(device: Device = None) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: the allocator's state on every device.

    ``segments`` (each with its ``blocks``, which tile the segment in address order),
    ``device_traces`` (one list of recorded events per device, oldest first; see
    :func:`record_memory_history`), ``allocator_settings`` and ``external_annotations``.
    ``device`` is accepted as PyTorch accepts it; all devices are always included.
    """
    raw = _lib.call_json("ferrocache_snapshot")
    result: dict[str, Any] = _tuples(raw)
    result.setdefault("segments", [])
    traces: list[list[dict[str, Any]]] = list(result.get("device_traces") or [])
    # The viewer lists a device only where device_traces has an entry for it.
    devices = [int(segment.get("device", 0)) for segment in result["segments"]]
    while len(traces) <= max(devices, default=-1):
        traces.append([])
    for trace in traces:
        for entry in trace:
            # PyTorch's OOM entry says how much memory the device had free where other entries
            # have the address; ferrocache's JSON carries that number under "addr".
            if entry.get("action") == "oom" and "device_free" not in entry:
                entry["device_free"] = entry.pop("addr", 0)
    if _skipped_actions:
        traces = [[e for e in trace if e.get("action") not in _skipped_actions] for trace in traces]
    result["device_traces"] = traces
    result.setdefault("external_annotations", [])
    return result


def memory_snapshot() -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot()``: the ``segments`` of :func:`snapshot`."""
    return list(snapshot()["segments"])


def dump_snapshot(filename: Union[str, "os.PathLike[str]"] = "dump_snapshot.pickle") -> None:
    """``torch.cuda.memory._dump_snapshot(filename)``: pickles :func:`snapshot` to ``filename``,
    for https://pytorch.org/memory_viz or ``python -m torch.cuda._memory_viz``."""
    data = snapshot()
    with open(filename, "wb") as f:
        pickle.dump(data, f, protocol=PICKLE_PROTOCOL)


__all__ = ["dump_snapshot", "memory_snapshot", "record_memory_history", "snapshot"]
