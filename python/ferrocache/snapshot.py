"""Allocation history and snapshots in the format of ``torch.cuda.memory._snapshot()``, which
PyTorch's memory viewer (https://pytorch.org/memory_viz, ``torch/cuda/_memory_viz.py``) reads.

The library gives the snapshot as JSON; :func:`snapshot` turns it into the Python objects
PyTorch's snapshot holds (tuples where PyTorch has tuples), and :func:`dump_snapshot` pickles
it with protocol 4, the newest the viewer's own unpickler reads.

Stack frames: with ``context`` set (the default ``"all"``), every allocation calls back into
Python, before the library takes any lock, to record the calling thread's Python frames; the
library keeps only an id (``stack_id``) with the block and the trace entries, and
:func:`snapshot` turns the ids into PyTorch's ``frames`` (``{"filename", "line", "name"}``,
innermost first). ``stacks="all"`` records the same Python frames: ferrocache records no C++
frames. With recording off, allocations do not call back at all.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Iterable, Optional, Union

from . import _lib, _ranks
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

# ------------------------------------------------------------------------------------------------
# Python stacks
# ------------------------------------------------------------------------------------------------

#: A recorded stack: (code, instruction offset) per frame, innermost first.
_Stack = tuple[tuple[CodeType, int], ...]
#: The C type of the library's stack gatherer: event (0 alloc, 1 free) -> stack id.
_GATHERER_TYPE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_int)
#: The ``context`` values that record stacks, and whether frees record them too.
_CONTEXT_ON_FREE = {"state": False, "alloc": False, "all": True}


def _line_of(code: CodeType, offset: int) -> int:
    """The source line of the instruction at byte ``offset`` of ``code`` (what ``f_lineno``
    says, worked out only when a snapshot asks)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or code.co_firstlineno
    return code.co_firstlineno


class _StackTable:
    """Stacks by id, each recorded once. The look-up key is cheap to hash: ``(id(code),
    offset, ...)``; every code object of a recorded stack is kept alive by the table, so its
    ``id`` cannot name another code object while the key is in use. Ids are never reused, so an
    id the library still holds from an earlier recording never names another stack."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[tuple[int, ...], int] = {}
        self._stacks: dict[int, _Stack] = {}
        self._frames: dict[int, list[dict[str, Any]]] = {}
        self._next_id = 1

    def lookup(self, key: tuple[int, ...]) -> Optional[int]:
        return self._ids.get(key)

    def intern(self, key: tuple[int, ...], stack: _Stack) -> int:
        with self._lock:
            found = self._ids.get(key)
            if found is None:
                found = self._next_id
                self._next_id += 1
                self._ids[key] = found
                self._stacks[found] = stack
            return found

    def frames(self, stack_id: int) -> list[dict[str, Any]]:
        """PyTorch's frames for a stack (a fresh list each call: callers may change it)."""
        with self._lock:
            frames = self._frames.get(stack_id)
            if frames is None:
                stack = self._stacks.get(stack_id, ())
                frames = [
                    {"filename": code.co_filename, "line": _line_of(code, offset), "name": code.co_name}
                    for code, offset in stack
                ]
                self._frames[stack_id] = frames
        return [dict(f) for f in frames]

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()
            self._stacks.clear()
            self._frames.clear()


_stacks = _StackTable()


def _gather_python_stack(event: int) -> int:
    """The library's stack gatherer: the calling thread's Python frames, as a stack id. ctypes
    takes the GIL around it; the library calls it before taking any lock of its own. Kept
    small: it runs at every allocation while stacks are recorded."""
    try:
        key: list[int] = []
        frame: Optional[FrameType] = sys._getframe(1)
        while frame is not None:
            key.append(id(frame.f_code))
            key.append(frame.f_lasti)
            frame = frame.f_back
        if not key:
            return 0
        frozen = tuple(key)
        found = _stacks.lookup(frozen)
        if found is not None:
            return found
        stack = []
        frame = sys._getframe(1)
        while frame is not None:
            stack.append((frame.f_code, frame.f_lasti))
            frame = frame.f_back
        return _stacks.intern(frozen, tuple(stack))
    except BaseException:  # nothing may escape into the allocator
        return 0


#: Kept for the life of the process: the library may call it from any thread at any time.
_gatherer = _GATHERER_TYPE(_gather_python_stack)
_gatherer_registered = False


def _set_stack_recording(context: Optional[str]) -> None:
    """Registers the gatherer for ``context`` ("state", "alloc", "all"), or unregisters it."""
    global _gatherer_registered
    set_gatherer = _lib.function("ferrocache_set_stack_gatherer")
    if context in _CONTEXT_ON_FREE:
        address = ctypes.cast(_gatherer, ctypes.c_void_p).value
        set_gatherer(address, 1 if _CONTEXT_ON_FREE[context] else 0)
        if not _gatherer_registered:
            # After interpreter shutdown began, a callback into Python could hang.
            atexit.register(_stop_stack_recording)
        _gatherer_registered = True
    elif _gatherer_registered:
        set_gatherer(None, 0)


def _stop_stack_recording() -> None:
    try:
        _lib.function("ferrocache_set_stack_gatherer")(None, 0)
    except Exception:
        pass


#: What the latest record_memory_history asked for: context, and whether trace entries keep it.
_trace_context = False


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
    record = enabled is not None and record_cuda
    # "state" keeps stacks with live blocks but no history of events.
    _set_recording(enabled == "all" and record_cuda, max_entries, clear_history)
    _apply_context(context if record else None, trace=context in ("alloc", "all"))
    _skipped_actions = skipped


def _apply_context(context: Optional[str], trace: bool) -> None:
    global _trace_context
    _set_stack_recording(context)
    _trace_context = trace and context is not None
    if context is None:
        _stacks.clear()


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
    # PyTorch's legacy form: record_context keeps stacks with blocks, trace_alloc_record_context
    # with trace entries too.
    context = None
    if enabled and record_cuda and (record_context or trace_alloc_record_context):
        context = "all" if trace_alloc_record_context else "state"
    _apply_context(context, trace=bool(trace_alloc_record_context))
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
    ``context`` (None, "state": stacks of live blocks, "alloc": also of alloc events, "all":
    also of frees) records Python stacks, whichever ``stacks`` says. The older boolean form
    works too: ``record_memory_history(True, trace_alloc_max_entries=100000)``, and
    ``record_memory_history(True, max_entries=100000)`` (True meaning "all", False None).
    Stopping clears the recorded history and the stacks.
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


def _resolve_stacks(item: dict[str, Any], keep: bool) -> None:
    """Replaces the library's ``stack_id`` with PyTorch's ``frames``."""
    stack_id = item.pop("stack_id", 0)
    item["frames"] = _stacks.frames(stack_id) if keep and stack_id else []


def snapshot(device: Device = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()``: the allocator's state on every device.

    ``segments`` (each with its ``blocks``, which tile the segment in address order),
    ``device_traces`` (one list of recorded events per device, oldest first; see
    :func:`record_memory_history`), ``allocator_settings`` and ``external_annotations``.
    ``device`` is accepted as PyTorch accepts it; all devices are always included.
    ``augment_with_fx_traces`` is accepted and does nothing (ferrocache records no FX frames).
    """
    raw = _lib.call_json("ferrocache_snapshot")
    result: dict[str, Any] = _tuples(raw)
    result.setdefault("segments", [])
    traces: list[list[dict[str, Any]]] = list(result.get("device_traces") or [])
    # The viewer lists a device only where device_traces has an entry for it.
    devices = [int(segment.get("device", 0)) for segment in result["segments"]]
    while len(traces) <= max(devices, default=-1):
        traces.append([])
    for segment in result["segments"]:
        for block in segment.get("blocks", []):
            _resolve_stacks(block, keep=True)
    for trace in traces:
        for entry in trace:
            _resolve_stacks(entry, keep=_trace_context)
            # PyTorch's OOM entry says how much memory the device had free where other entries
            # have the address; ferrocache's JSON carries that number under "addr".
            if entry.get("action") == "oom" and "device_free" not in entry:
                entry["device_free"] = entry.pop("addr", 0)
    if _skipped_actions:
        traces = [[e for e in trace if e.get("action") not in _skipped_actions] for trace in traces]
    result["device_traces"] = traces
    result.setdefault("external_annotations", [])
    return result


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot()``: the ``segments`` of :func:`snapshot`. With
    ``mempool_id`` (a pool id pair), only that pool's segments."""
    segments = list(snapshot()["segments"])
    if mempool_id is not None:
        wanted = tuple(mempool_id)
        segments = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) == wanted]
    return segments


def allocation_traceback(data_ptr: int) -> Optional[list[dict[str, Any]]]:
    """``torch.cuda.memory._allocation_traceback(data_ptr)``: the frames recorded when the live
    allocation that starts at ``data_ptr`` was made, or None (no such allocation, or no stack
    recorded)."""
    for segment in snapshot()["segments"]:
        for block in segment.get("blocks", []):
            if block.get("address") == data_ptr and block.get("state") == "active_allocated":
                return block["frames"] or None
    return None


def _write_snapshot(path: str) -> None:
    """Pickles :func:`snapshot` to ``path`` through a temporary file beside it, so that a
    process killed while it writes leaves no half-written snapshot."""
    data = snapshot()
    folder = os.path.dirname(path) or "."
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            pickle.dump(data, f, protocol=PICKLE_PROTOCOL)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _dump_to(path: str) -> None:
    """Writes the snapshot to ``path`` exactly, making its missing folders first."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    _write_snapshot(path)


def dump_snapshot(
    filename: Union[str, "os.PathLike[str]"] = "dump_snapshot.pickle",
    augment_with_fx_traces: bool = False,
) -> str:
    """Pickles :func:`snapshot` for https://pytorch.org/memory_viz or
    ``python -m torch.cuda._memory_viz``, as ``torch.cuda.memory._dump_snapshot`` does, with
    one file per rank: ``{rank}``, ``{local_rank}`` and ``{pid}`` in ``filename`` are replaced
    by this process's; with none of them, in a job of several ranks (``WORLD_SIZE`` > 1), the
    rank goes before the extension (``run.pickle`` -> ``run_rank3.pickle``). Missing folders
    are made. Returns the path written. (``torch.cuda.memory._dump_snapshot``, once installed,
    writes ``filename`` exactly, as PyTorch's does.)"""
    path = _ranks.per_rank_path(filename)
    _dump_to(path)
    return path


def torch_dump_snapshot(
    filename: Union[str, "os.PathLike[str]"] = "dump_snapshot.pickle",
    augment_with_fx_traces: bool = False,
) -> None:
    """``torch.cuda.memory._dump_snapshot(filename)``: pickles :func:`snapshot` to exactly
    ``filename``, as PyTorch's does (no placeholders, no rank added)."""
    _write_snapshot(os.fspath(filename))


__all__ = [
    "allocation_traceback",
    "dump_snapshot",
    "memory_snapshot",
    "record_memory_history",
    "snapshot",
    "torch_dump_snapshot",
]
