"""ferrocache.region, sleep and wake from Python, on the fake libcuda (without PyTorch): the
memory goes back to the driver and comes again at the same addresses with the same bytes."""

from __future__ import annotations

import pytest
from conftest import GIB, memory_env, run_json

pytestmark = pytest.mark.usefixtures("fake_libcuda")


def test_a_region_sleeps_with_its_bytes_kept_while_another_sleeps_without() -> None:
    out = run_json(
        """
        import ctypes, ferrocache
        MIB = 1 << 20
        cuda = ctypes.CDLL("libcuda.so")
        # Another user of the device: the primary context current on this thread.
        context = ctypes.c_void_p()
        assert cuda.cuInit(0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0
        assert cuda.cuCtxSetCurrent(context) == 0
        def free_memory():
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
            return free.value
        def fill(ptr, size, byte):
            ctypes.memset(ptr, byte, size)   # the fake's device memory is host memory
        def holds(ptr, size, byte):
            return ctypes.string_at(ptr, size) == bytes([byte]) * size
        with ferrocache.region("weights"):
            weights = [ferrocache.caching_allocator_alloc(s) for s in (4096, 3 * MIB, 40 * MIB)]
            with ferrocache.region("kv_cache"):
                cache = ferrocache.caching_allocator_alloc(64 * MIB)
            after_inner = ferrocache.caching_allocator_alloc(MIB)
        for i, p in enumerate(weights):
            fill(p, 4096, 10 + i)
        fill(cache, 4096, 99)
        out = {}
        reserved = ferrocache.memory_reserved()
        free_before = free_memory()
        report = ferrocache.sleep("kv_cache", backup=False)
        out["kv slept bytes"] = report.bytes
        out["kv blocks"] = report.blocks
        out["weights intact while kv sleeps"] = all(holds(p, 4096, 10 + i) for i, p in enumerate(weights))
        both = ferrocache.sleep(["weights", "kv_cache"])
        out["weights blocks"] = both.blocks
        out["reserved asleep"] = ferrocache.memory_reserved()
        out["free grew by what slept"] = free_memory() - free_before >= report.bytes + both.bytes
        out["stats agree"] = ferrocache.memory_stats()["reserved_bytes.all.current"]
        out["sleep again"] = ferrocache.sleep().segments
        out["snapshot segments asleep"] = len(ferrocache.snapshot()["segments"])
        woke = ferrocache.wake()
        out["woke bytes"] = woke.bytes == report.bytes + both.bytes
        out["reserved awake"] = ferrocache.memory_reserved() == reserved
        out["weights restored"] = all(holds(p, 4096, 10 + i) for i, p in enumerate(weights))
        out["wake again"] = ferrocache.wake().segments
        try:
            ferrocache.sleep(["weights", ""])
        except ValueError as err:
            out["bad tag"] = str(err)
        for p in weights + [cache, after_inner]:
            ferrocache.caching_allocator_delete(p)
        result(out)
        """,
        env=memory_env(GIB),
    )
    assert out == {
        "kv slept bytes": 64 << 20,
        "kv blocks": 1,
        "weights intact while kv sleeps": True,
        "weights blocks": 4,
        "reserved asleep": 0,
        "free grew by what slept": True,
        "stats agree": 0,
        "sleep again": 0,
        "snapshot segments asleep": 0,
        "woke bytes": True,
        "reserved awake": True,
        "weights restored": True,
        "wake again": 0,
        "bad tag": "a tag is a non-empty string without newlines, not ''",
    }


def test_a_wake_that_fails_on_one_device_reports_the_devices_done() -> None:
    out = run_json(
        """
        import ferrocache
        MIB = 1 << 20
        first = ferrocache.caching_allocator_alloc(64 * MIB, device=0)
        second = ferrocache.caching_allocator_alloc(64 * MIB, device=1)
        slept = ferrocache.sleep()
        out = {"slept per device": [(d.device, d.segments) for d in slept.devices]}
        ferrocache.set_per_process_memory_fraction(0.01, device=1)
        try:
            ferrocache.wake()
            out["refused"] = "no"
        except ferrocache.SleepError as err:
            out["refused"] = isinstance(err, RuntimeError) and "memory fraction" in str(err)
            out["failed device"] = err.device
            out["woke before the failure"] = err.report.segments
            out["per device"] = [(d.device, d.segments) for d in err.report.devices]
        ferrocache.set_per_process_memory_fraction(1.0, device=1)
        rest = ferrocache.wake()
        out["the rest"] = [(d.device, d.segments) for d in rest.devices]
        for p in (first, second):
            ferrocache.caching_allocator_delete(p)
        result(out)
        """,
        env=memory_env(GIB, FAKE_LIBCUDA_DEVICE_COUNT="2", FERROCACHE_SLEEP="1"),
    )
    assert out == {
        "slept per device": [[0, 1], [1, 1]],
        "refused": True,
        "failed device": 1,
        "woke before the failure": 1,
        "per device": [[0, 1], [1, 0]],
        "the rest": [[0, 0], [1, 1]],
    }
