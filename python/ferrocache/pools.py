"""Private memory pools: ``torch.cuda.MemPool`` / ``torch.cuda.use_mem_pool`` for ferrocache.

PyTorch refuses ``torch.cuda.MemPool()`` with a plugged-in allocator ("pluggable does not yet
support createOrIncrefPool"), so :func:`ferrocache.install` puts :class:`TorchMemPool` and
:func:`use_mem_pool` in place of ``torch.cuda.MemPool`` and ``torch.cuda.use_mem_pool``: PyTorch's
names and semantics over the pools ferrocache keeps for CUDA graph captures. :class:`MemPool`
and :func:`mem_pool` are the same pools without PyTorch::

    pool = ferrocache.MemPool()
    with ferrocache.mem_pool(pool):
        x = torch.empty(1 << 20, device="cuda")   # from the pool's own segments
    y = torch.empty(1 << 20, device="cuda")       # from the ordinary pools
    del x
    pool.release()                                # the pool's memory goes back on empty_cache
    torch.cuda.empty_cache()

Allocations made by the thread inside the ``with`` block come from the pool, as with
``torch.cuda.use_mem_pool``; other threads' do not. A block freed in the pool goes back to the
pool only, and the pool keeps its memory (``empty_cache`` does not release it) until the
:class:`MemPool` is released (or garbage collected) and no block in it is live.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator, Optional

from . import _lib, _torch
from ._torch import Device
from .errors import library_error

#: ferrocache's pool ids are ``(0, FIRST_POOL_ID + n)``: PyTorch numbers its own from 1 in
#: either half (``(n, 0)`` for graphs, ``(0, n)`` for user pools), so they never meet.
FIRST_POOL_ID = 1 << 63

_ids = itertools.count(FIRST_POOL_ID)
_ids_lock = threading.Lock()


def _new_pool_id() -> tuple[int, int]:
    with _ids_lock:
        return (0, next(_ids))


class MemPool:
    """A private pool of ferrocache on ``device`` (the current device by default), as
    ``torch.cuda.MemPool`` is for PyTorch's allocator. Allocate into it with :func:`mem_pool`.

    Holding the object holds a reference to the pool; :meth:`release` (or the object's garbage
    collection) drops it, after which ``empty_cache`` gives the pool's memory back once no block
    in it is live.
    """

    def __init__(self, device: Device = None) -> None:
        self._open(_torch.device_index(device), _new_pool_id())

    def _open(self, device: int, pool_id: tuple[int, int]) -> None:
        """Creates the pool ``pool_id`` on ``device`` with this object's reference."""
        self.device = device
        #: The pool id, a pair as PyTorch's ``MemPool.id``; ``snapshot()`` segments carry it as
        #: ``segment_pool_id``.
        self.id = pool_id
        self._lock = threading.Lock()
        self._held = False
        _lib.call_status("ferrocache_create_or_incref_pool", self.device, *self.id)
        self._held = True

    def use_count(self) -> int:
        """The references the pool holds: this object's, and one per :func:`mem_pool` block
        under way (PyTorch's ``MemPool.use_count()``). 0 once released."""
        count = _lib.function("ferrocache_pool_use_count")(self.device, *self.id)
        return max(int(count), 0)

    def release(self) -> None:
        """Drops this object's reference to the pool (once; later calls do nothing)."""
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._drop_reference()

    def _drop_reference(self) -> None:
        _lib.call_status("ferrocache_release_pool", self.device, *self.id)

    def snapshot(self) -> list[dict[str, Any]]:
        """The pool's segments, as in :func:`ferrocache.snapshot` (PyTorch's
        ``MemPool.snapshot()``)."""
        from .snapshot import snapshot

        return [s for s in snapshot()["segments"] if s["segment_pool_id"] == self.id]

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter exit the library may already be gone
            pass

    def __repr__(self) -> str:
        return f"ferrocache.MemPool(id={self.id}, device={self.device})"


#: PyTorch numbers the pools of ``torch.cuda.MemPool()`` ``(0, 1)``, ``(0, 2)``, ... (and those
#: of graphs ``(1, 0)``, ``(2, 0)``, ...); :class:`TorchMemPool` does the same.
_torch_ids = itertools.count(1)


class TorchMemPool(MemPool):
    """``torch.cuda.MemPool`` once ferrocache is installed (PyTorch's own refuses a plugged-in
    allocator: "pluggable does not yet support createOrIncrefPool"), with PyTorch 2.15's
    constructor and semantics, over a private pool of ferrocache:

    - the pool is made on the current device; its ``id`` is ``(0, n)``, numbered from 1 as
      PyTorch numbers the pools of ``MemPool()``; ``use_count()`` counts this object and each
      ``torch.cuda.use_mem_pool`` block under way;
    - ``snapshot(include_traces=True)`` is ``torch.cuda.memory_snapshot(pool.id)``: the pool's
      segments;
    - when the object goes, the pool loses its reference and its cached memory goes back to the
      device (PyTorch's destructor calls ``emptyCache`` on the pool); blocks still live stay
      valid and the pool's memory returns at the ``empty_cache()`` after they are freed;
    - ``use_on_oom=True``: an allocation outside every pool that would run out of memory takes
      a cached block of this pool instead, as a last resort; ``no_split=True``: the pool hands
      its blocks out whole, never split;
    - ``allocator`` (a pool served by another allocator) is refused: ferrocache serves every
      pool from its own segments.
    """

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False) -> None:
        if allocator is not None:
            raise RuntimeError(
                "torch.cuda.MemPool(allocator=...) with ferrocache installed: ferrocache serves "
                "every pool from its own segments, so a pool backed by another allocator needs "
                "PyTorch's own allocator (do not call ferrocache.install())"
            )
        with _ids_lock:
            pool_id = (0, next(_torch_ids))
        self._open(_torch.current_device(), pool_id)
        if use_on_oom or no_split:
            _lib.call_status("ferrocache_set_pool_options", self.device, *self.id, int(bool(use_on_oom)), int(bool(no_split)))

    @property
    def allocator(self) -> None:
        """PyTorch's ``MemPool.allocator``: None, the pool is ferrocache's."""
        return None

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:  # type: ignore[override]
        """PyTorch's ``MemPool.snapshot()``: ``torch.cuda.memory_snapshot(self.id)``."""
        from .snapshot import memory_snapshot

        return memory_snapshot(self.id, include_traces=include_traces)

    def _drop_reference(self) -> None:
        super()._drop_reference()
        _lib.call_status("ferrocache_empty_pool_cache", self.device, *self.id)

    def __repr__(self) -> str:
        return f"torch.cuda.MemPool(id={self.id}) (ferrocache's private pool on device {self.device})"


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: Device = None) -> Iterator[None]:
    """``torch.cuda.use_mem_pool`` once ferrocache is installed: this thread's allocations on
    ``device`` (the current one by default) come from ``pool`` inside the block, which holds one
    more reference to the pool meanwhile. Yields nothing, as PyTorch's."""
    index = _torch.current_device() if device is None else _torch.device_index(device)
    begin = _lib.function("ferrocache_begin_allocate_current_thread_to_pool")
    if begin(index, *pool.id) != 0:
        raise library_error(_lib.last_error(), "use_mem_pool")
    try:
        yield
    finally:
        _lib.call_status("ferrocache_end_allocate_to_pool", index, *pool.id)
        # The block's own reference, taken by the begin.
        _lib.call_status("ferrocache_release_pool", index, *pool.id)


@contextlib.contextmanager
def mem_pool(pool: Optional[MemPool] = None, device: Device = None) -> Iterator[MemPool]:
    """``torch.cuda.use_mem_pool`` for ferrocache: inside the block, allocations this thread
    makes on the pool's device come from ``pool`` (a new :class:`MemPool` on ``device`` when
    None, which the block yields). Blocks on one pool do not nest (a RuntimeError says so)."""
    if pool is None:
        pool = MemPool(device)
    elif device is not None and _torch.device_index(device) != pool.device:
        raise ValueError(f"{pool!r} is on device {pool.device}, not {device!r}")
    with use_mem_pool(pool, pool.device):
        yield pool


__all__ = ["FIRST_POOL_ID", "MemPool", "TorchMemPool", "mem_pool", "use_mem_pool"]
