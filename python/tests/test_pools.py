"""Private pools from Python: ferrocache.MemPool / mem_pool (torch.cuda.MemPool / use_mem_pool
for ferrocache), and the CUDA graph pool hooks install() gives PyTorch."""

from __future__ import annotations

import pytest
from conftest import GIB, MIB, memory_env, run_json

pytestmark = pytest.mark.usefixtures("fake_libcuda")

POOL_HOOKS = {
    "set_begin_allocate_to_pool": "rust_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "rust_end_allocate_to_pool",
    "set_release_pool": "rust_release_pool",
}


def test_allocations_inside_mem_pool_come_from_the_pool_and_stay_its_own() -> None:
    out = run_json(
        """
        import threading, ferrocache
        MIB = 1 << 20
        def pool_of(ptr):
            for s in ferrocache.snapshot()["segments"]:
                if s["address"] <= ptr < s["address"] + s["total_size"]:
                    return list(s["segment_pool_id"])
        out = {}
        pool = ferrocache.MemPool()
        out["count at creation"] = pool.use_count()
        with ferrocache.mem_pool(pool) as same:
            out["yields the pool"] = same is pool
            out["count inside"] = pool.use_count()
            inside = ferrocache.caching_allocator_alloc(MIB)
            scratch = ferrocache.caching_allocator_alloc(4096)
            ferrocache.caching_allocator_delete(scratch)
            again = ferrocache.caching_allocator_alloc(4096)
            out["reused inside"] = again == scratch
            ferrocache.caching_allocator_delete(again)
            theirs = []
            worker = threading.Thread(target=lambda: theirs.append(ferrocache.caching_allocator_alloc(MIB)))
            worker.start(); worker.join()
        out["count after"] = pool.use_count()
        outside = ferrocache.caching_allocator_alloc(4096)
        out["pools"] = [pool_of(inside), pool_of(theirs[0]), pool_of(outside)]
        out["outside is not the freed block"] = outside != scratch
        out["pool id"] = list(pool.id)
        out["pool segments"] = [s["total_size"] for s in pool.snapshot()]
        for ptr in (inside, theirs[0], outside):
            ferrocache.caching_allocator_delete(ptr)
        ferrocache.empty_cache()
        out["reserved while held"] = ferrocache.memory_reserved()
        pool.release(); pool.release()
        ferrocache.empty_cache()
        out["reserved after release"] = ferrocache.memory_reserved()
        out["count at the end"] = pool.use_count()
        result(out)
        """,
        env=memory_env(GIB),
    )
    pool_id = out.pop("pool id")
    assert pool_id[0] == 0 and pool_id[1] >= 1 << 63
    assert out == {
        "count at creation": 1,
        "yields the pool": True,
        "count inside": 2,
        "reused inside": True,
        "count after": 1,
        "pools": [pool_id, [0, 0], [0, 0]],
        "outside is not the freed block": True,
        "pool segments": [2 * MIB],
        "reserved while held": 2 * MIB,
        "reserved after release": 0,
        "count at the end": 0,
    }


def test_mem_pool_blocks_on_one_pool_do_not_nest_and_bad_calls_change_nothing() -> None:
    out = run_json(
        """
        import ferrocache
        out = {}
        with ferrocache.mem_pool() as pool:
            try:
                with ferrocache.mem_pool(pool):
                    pass
            except RuntimeError as err:
                out["nested"] = str(err)
            out["count"] = pool.use_count()
            try:
                with ferrocache.mem_pool(pool, device=1):
                    pass
            except ValueError as err:
                out["device"] = "is on device 0" in str(err)
        out["count after"] = pool.use_count()
        pool.release()
        ferrocache.empty_cache()
        out["gone"] = pool.use_count()
        result(out)
        """,
        env=memory_env(GIB),
    )
    assert out["nested"].startswith("beginAllocateToPool: already recording to mempool_id (0, ")
    assert out == {**out, "count": 2, "device": True, "count after": 1, "gone": 0}


def test_install_gives_pytorch_the_three_pool_hooks() -> None:
    out = run_json(
        """
        import ctypes, ferrocache
        hooks = ferrocache.install().allocator().hooks
        library = ctypes.CDLL(str(ferrocache.library_path()))
        address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        result({k: hooks.get(k) == address(v) for k, v in %r.items()})
        """
        % POOL_HOOKS,
        fake_torch=True,
        env=memory_env(GIB),
    )
    assert out == {name: True for name in POOL_HOOKS}


def test_a_pytorch_without_pool_hooks_gets_none_and_a_warning() -> None:
    out = run_json(
        """
        import warnings, ferrocache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hooks = ferrocache.install().allocator().hooks
        result([sorted(hooks), [str(w.message) for w in caught]])
        """,
        fake_torch=True,
        env=memory_env(GIB, FAKE_TORCH_NO_POOL_HOOKS="1"),
    )
    hooks, messages = out
    assert not set(POOL_HOOKS) & set(hooks)
    assert len(messages) == 1, messages
    assert "set_begin_allocate_to_pool" in messages[0]
    assert "do not use torch.cuda.graph with ferrocache" in messages[0]


def test_the_pool_hooks_end_and_release_as_pytorch_calls_them() -> None:
    """PyTorch passes the pool id as a std::pair<unsigned long long, unsigned long long> by
    value, which the ABI passes as a two-field struct: ctypes can stand in for it."""
    out = run_json(
        """
        import ferrocache
        from ctypes import CFUNCTYPE, Structure, c_int, c_ulonglong
        class MempoolId(Structure):
            _fields_ = [("first", c_ulonglong), ("second", c_ulonglong)]
        hooks = ferrocache.install().allocator().hooks
        end = CFUNCTYPE(None, c_int, MempoolId)(hooks["set_end_allocate_to_pool_fn"])
        release = CFUNCTYPE(None, c_int, MempoolId)(hooks["set_release_pool"])
        lib = ferrocache._lib
        pool = (0, 77)
        lib.call_status("ferrocache_begin_allocate_current_thread_to_pool", 0, *pool)
        inside = ferrocache.caching_allocator_alloc(4096)
        end(0, MempoolId(*pool))       # capture_end
        outside = ferrocache.caching_allocator_alloc(4096)
        count = lib.function("ferrocache_pool_use_count")(0, *pool)
        release(0, MempoolId(*pool))   # g.reset()
        release(0, MempoolId(*pool))   # once too often: logged, nothing changes
        ferrocache.caching_allocator_delete(inside)
        ferrocache.caching_allocator_delete(outside)
        ferrocache.empty_cache()
        result([inside != outside, count, ferrocache.memory_reserved(),
                lib.function("ferrocache_pool_use_count")(0, *pool)])
        """,
        fake_torch=True,
        env=memory_env(GIB),
    )
    assert out == [True, 1, 0, -1]
