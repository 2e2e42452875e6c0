"""Out-of-memory observers, and the snapshot a job leaves when it runs out of memory.

PyTorch's allocator calls the observers attached with
``torch._C._cuda_attach_out_of_memory_observer`` at each out of memory, before it throws; a
plugged-in allocator gets none (PyTorch refuses the call). ferrocache calls its own the same
way: the library, on the allocating thread, with the device's lock released, before
``rust_malloc`` throws (``ferrocache_attach_oom_observer``). :func:`attach_out_of_memory_observer`
attaches a Python callable there (``install()`` also puts it in place of PyTorch's), and
:func:`snapshot_on_oom` is one such observer: history recorded from the start, the snapshot
written at the first out of memory, one file per rank.

Why there and not elsewhere: the exception must reach Python with the snapshot already on disk
(a job dies of it, and torchrun then stops the other ranks), so it cannot be written by a
Python ``except``; and a pickle cannot be written under the allocator's lock, because writing
it needs the GIL, which another thread waiting for that lock may hold. With the lock released,
the observer takes the GIL like any ctypes callback, exactly where PyTorch's own observers do.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import traceback
from typing import Any, Callable, Optional, Union

from . import _env, _lib, _ranks, snapshot

#: The variable that names the snapshot to write at the first out of memory.
SNAPSHOT_ON_OOM_VAR = _env.SNAPSHOT_ON_OOM.name
#: How many trace entries the history keeps while it waits for an out of memory: the bound of
#: PyTorch's own recipe for a snapshot at out of memory (``_record_memory_history(max_entries=
#: 100000)`` in "Understanding GPU Memory"); ``_record_memory_history``'s own default keeps
#: everything, which a recording left on for a whole training job cannot afford.
#: ``torch.cuda.memory._record_memory_history(max_entries=N)`` after ``install()`` changes it.
SNAPSHOT_ON_OOM_MAX_ENTRIES = 100_000

#: An observer: (device, bytes that could not be allocated, device total or the memory-fraction
#: limit, device free bytes), as PyTorch calls its own.
Observer = Callable[[int, int, int, int], Any]
_OBSERVER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)

_lock = threading.Lock()
#: The ctypes callbacks attached: the library may call them for the life of the process.
_attached: list[Any] = []


def _detach_all() -> None:
    """At exit: after interpreter shutdown began, a callback into Python could hang."""
    detach = _lib.function("ferrocache_detach_oom_observer")
    for callback in _attached:
        try:
            detach(ctypes.cast(callback, ctypes.c_void_p).value)
        except Exception:
            pass


def attach_out_of_memory_observer(observer: Observer) -> None:
    """``torch._C._cuda_attach_out_of_memory_observer(observer)``: at each out of memory, before
    the exception is raised, ``observer(device, alloc_size, device_total, device_free)`` is called
    on the allocating thread (``device_total`` is the limit ``set_per_process_memory_fraction``
    set, when one is). It may take a snapshot. An exception it raises is printed and the out of
    memory is raised as usual (PyTorch would raise the observer's exception instead)."""
    if not callable(observer):
        raise TypeError(f"the observer must be callable, not {type(observer).__name__}")

    def call(device: int, alloc_size: int, device_total: int, device_free: int) -> None:
        try:
            observer(device, alloc_size, device_total, device_free)
        except BaseException:  # nothing may escape into the allocator
            _ranks.log(
                "ERROR", "an out-of-memory observer raised (the out of memory is raised as usual):"
            )
            traceback.print_exc()

    callback = _OBSERVER_TYPE(call)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    with _lock:
        _lib.call_status("ferrocache_attach_oom_observer", address)
        if not _attached:
            atexit.register(_detach_all)
        _attached.append(callback)


def snapshot_on_oom(path: Union[str, "os.PathLike[str]"]) -> None:
    """Records history from now on (stacks included, the newest
    :data:`SNAPSHOT_ON_OOM_MAX_ENTRIES` entries) and writes the snapshot to ``path`` at the first
    out of memory, before the exception is raised. ``path`` takes ``{rank}``, ``{local_rank}``
    and ``{pid}``; without them, one rank of several adds its rank before the extension
    (:func:`ferrocache.dump_snapshot`'s rule). A path with an unknown placeholder is refused here
    (``ValueError``); a snapshot that cannot be written is logged at ERROR, and the out of memory
    is raised as usual."""
    template = _ranks.check_path(path)
    snapshot.record_memory_history(
        "all", context="all", stacks="python", max_entries=SNAPSHOT_ON_OOM_MAX_ENTRIES
    )
    first = threading.Lock()  # taken by the first out of memory, never released

    def write_snapshot(device: int, alloc_size: int, device_total: int, device_free: int) -> None:
        if not first.acquire(blocking=False):
            return
        target = template
        try:
            target = _ranks.per_rank_path(template)
            snapshot._dump_to(target)
        except Exception as err:
            _ranks.log("ERROR", f"could not write the out-of-memory snapshot {target}: {err}")
            return
        _ranks.log(
            "ERROR",
            f"out of memory on device {device}: snapshot written to {target} "
            "(open it at https://pytorch.org/memory_viz)",
        )

    attach_out_of_memory_observer(write_snapshot)


def snapshot_on_oom_from_environment() -> Optional[str]:
    """``FERROCACHE_SNAPSHOT_ON_OOM``, when set and not empty."""
    value = os.environ.get(SNAPSHOT_ON_OOM_VAR, "").strip()
    return value or None


__all__ = [
    "SNAPSHOT_ON_OOM_MAX_ENTRIES",
    "SNAPSHOT_ON_OOM_VAR",
    "attach_out_of_memory_observer",
    "snapshot_on_oom",
]
