"""PyTorch's memory API on the fake GPU: statistics worked out from PyTorch's rules, resets,
empty_cache, caching_allocator_alloc/delete, out of memory, memory fraction, arguments."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import GIB, MIB, memory_env, run_json
from ferrocache import memory

pytestmark = pytest.mark.usefixtures("fake_libcuda")

SMALL_SEGMENT = 2 * MIB  # kSmallBuffer: segments of the small pool (requests up to 1 MiB)
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer: segments for large requests under kMinLargeAlloc (10 MiB)
SMALL_BLOCK = 1024  # 1000 bytes rounded up to a multiple of kMinBlockSize (512)
LARGE_BLOCK = 5 * MIB


def stat(current: int, peak: int, allocated: int, freed: int) -> dict[str, int]:
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def pools(all_: dict[str, int], large: dict[str, int], small: dict[str, int]) -> dict[str, Any]:
    return {"all": all_, "large_pool": large, "small_pool": small}


def nested_subset(stats: dict[str, int], names: list[str]) -> dict[str, Any]:
    """``{"allocation": {"all": {"current": ...}, ...}, ...}`` for the per-pool statistics."""
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {
            pool: {metric: stats[f"{name}.{pool}.{metric}"] for metric in memory.METRICS}
            for pool in memory.POOLS
        }
    return out


PER_POOL = list(memory.STAT_ARRAYS)

# One program, its statistics after each stage (see the expectations below).
SEQUENCE = """
import ferrocache as fc
stages = {}
def take(name):
    stages[name] = dict(fc.memory_stats())
    stages[name + "/extra"] = fc.extra_memory_stats()
a = fc.caching_allocator_alloc(1000)          # small pool: new 2 MiB segment, split
b = fc.caching_allocator_alloc(5 * 2**20)     # large pool: new 20 MiB segment, split
take("two allocations")
fc.caching_allocator_delete(a)                # merges back: the small segment is whole again
take("small freed")
c = fc.caching_allocator_alloc(1000)          # reuses the cached small segment, splits it again
fc.caching_allocator_delete(b)
fc.caching_allocator_delete(c)
take("all freed")
fc.empty_cache()                              # both segments go back to the driver
take("cache emptied")
fc.reset_peak_memory_stats()
take("peaks reset")
fc.reset_accumulated_memory_stats()
take("accumulated reset")
result(stages)
"""


@pytest.fixture(scope="module")
def stages() -> dict[str, dict[str, int]]:
    return run_json(SEQUENCE, env=memory_env(GIB))


def test_the_keys_are_pytorchs(stages: dict[str, dict[str, int]]) -> None:
    for name, stats in stages.items():
        if name.endswith("/extra"):
            assert sorted(stats) == ["num_merges", "num_splits"]
        else:
            assert list(stats) == list(memory.PYTORCH_STAT_KEYS), name


def test_two_allocations(stages: dict[str, dict[str, int]]) -> None:
    stats = stages["two allocations"]
    one = stat(1, 1, 1, 0)
    assert nested_subset(stats, PER_POOL) == {
        "allocation": pools(stat(2, 2, 2, 0), one, one),
        "segment": pools(stat(2, 2, 2, 0), one, one),
        "active": pools(stat(2, 2, 2, 0), one, one),
        # Each new segment was split: its free remainder is an inactive split block.
        "inactive_split": pools(stat(2, 2, 2, 0), one, one),
        "allocated_bytes": pools(
            stat(*[SMALL_BLOCK + LARGE_BLOCK] * 3, 0),
            stat(*[LARGE_BLOCK] * 3, 0),
            stat(*[SMALL_BLOCK] * 3, 0),
        ),
        "active_bytes": pools(
            stat(*[SMALL_BLOCK + LARGE_BLOCK] * 3, 0),
            stat(*[LARGE_BLOCK] * 3, 0),
            stat(*[SMALL_BLOCK] * 3, 0),
        ),
        "requested_bytes": pools(
            stat(*[1000 + LARGE_BLOCK] * 3, 0),
            stat(*[LARGE_BLOCK] * 3, 0),
            stat(*[1000] * 3, 0),
        ),
        "reserved_bytes": pools(
            stat(*[SMALL_SEGMENT + LARGE_SEGMENT] * 3, 0),
            stat(*[LARGE_SEGMENT] * 3, 0),
            stat(*[SMALL_SEGMENT] * 3, 0),
        ),
        "inactive_split_bytes": pools(
            stat(*[SMALL_SEGMENT - SMALL_BLOCK + LARGE_SEGMENT - LARGE_BLOCK] * 3, 0),
            stat(*[LARGE_SEGMENT - LARGE_BLOCK] * 3, 0),
            stat(*[SMALL_SEGMENT - SMALL_BLOCK] * 3, 0),
        ),
    }
    assert stats["num_device_alloc"] == 2
    assert stats["num_device_free"] == 0
    assert stats["max_split_size"] == -1
    assert stats["num_ooms"] == stats["num_alloc_retries"] == stats["num_sync_all_streams"] == 0
    assert all(stats[f"oversize_{k}.{m}"] == 0 for k in ("allocations", "segments") for m in memory.METRICS)
    assert stages["two allocations/extra"] == {"num_splits": 2, "num_merges": 0}


def test_a_free_merges_the_split_block_back(stages: dict[str, dict[str, int]]) -> None:
    stats = stages["small freed"]
    small_rest = SMALL_SEGMENT - SMALL_BLOCK
    assert nested_subset(stats, ["allocation", "inactive_split", "inactive_split_bytes"]) == {
        "allocation": pools(stat(1, 2, 2, 1), stat(1, 1, 1, 0), stat(0, 1, 1, 1)),
        "inactive_split": pools(stat(1, 2, 2, 1), stat(1, 1, 1, 0), stat(0, 1, 1, 1)),
        "inactive_split_bytes": pools(
            stat(LARGE_SEGMENT - LARGE_BLOCK, small_rest + LARGE_SEGMENT - LARGE_BLOCK,
                 small_rest + LARGE_SEGMENT - LARGE_BLOCK, small_rest),
            stat(*[LARGE_SEGMENT - LARGE_BLOCK] * 3, 0),
            stat(0, small_rest, small_rest, small_rest),
        ),
    }
    assert stats["allocated_bytes.small_pool.current"] == 0
    assert stats["allocated_bytes.small_pool.freed"] == SMALL_BLOCK
    assert stats["requested_bytes.small_pool.freed"] == 1000
    assert stats["reserved_bytes.all.current"] == SMALL_SEGMENT + LARGE_SEGMENT  # still cached
    assert stages["small freed/extra"] == {"num_splits": 2, "num_merges": 1}


def test_everything_freed_keeps_the_cache(stages: dict[str, dict[str, int]]) -> None:
    stats = stages["all freed"]
    small_rest, large_rest = SMALL_SEGMENT - SMALL_BLOCK, LARGE_SEGMENT - LARGE_BLOCK
    assert nested_subset(stats, PER_POOL) == {
        "allocation": pools(stat(0, 2, 3, 3), stat(0, 1, 1, 1), stat(0, 1, 2, 2)),
        "active": pools(stat(0, 2, 3, 3), stat(0, 1, 1, 1), stat(0, 1, 2, 2)),
        "segment": pools(stat(2, 2, 2, 0), stat(1, 1, 1, 0), stat(1, 1, 1, 0)),
        "inactive_split": pools(stat(0, 2, 3, 3), stat(0, 1, 1, 1), stat(0, 1, 2, 2)),
        "allocated_bytes": pools(
            stat(0, SMALL_BLOCK + LARGE_BLOCK, 2 * SMALL_BLOCK + LARGE_BLOCK, 2 * SMALL_BLOCK + LARGE_BLOCK),
            stat(0, LARGE_BLOCK, LARGE_BLOCK, LARGE_BLOCK),
            stat(0, SMALL_BLOCK, 2 * SMALL_BLOCK, 2 * SMALL_BLOCK),
        ),
        "active_bytes": pools(
            stat(0, SMALL_BLOCK + LARGE_BLOCK, 2 * SMALL_BLOCK + LARGE_BLOCK, 2 * SMALL_BLOCK + LARGE_BLOCK),
            stat(0, LARGE_BLOCK, LARGE_BLOCK, LARGE_BLOCK),
            stat(0, SMALL_BLOCK, 2 * SMALL_BLOCK, 2 * SMALL_BLOCK),
        ),
        "requested_bytes": pools(
            stat(0, 1000 + LARGE_BLOCK, 2000 + LARGE_BLOCK, 2000 + LARGE_BLOCK),
            stat(0, LARGE_BLOCK, LARGE_BLOCK, LARGE_BLOCK),
            stat(0, 1000, 2000, 2000),
        ),
        "reserved_bytes": pools(
            stat(*[SMALL_SEGMENT + LARGE_SEGMENT] * 3, 0),
            stat(*[LARGE_SEGMENT] * 3, 0),
            stat(*[SMALL_SEGMENT] * 3, 0),
        ),
        "inactive_split_bytes": pools(
            stat(0, small_rest + large_rest, 2 * small_rest + large_rest, 2 * small_rest + large_rest),
            stat(0, large_rest, large_rest, large_rest),
            stat(0, small_rest, 2 * small_rest, 2 * small_rest),
        ),
    }
    assert stats["num_device_alloc"] == 2, "the second 1000-byte request came from the cache"
    assert stages["all freed/extra"] == {"num_splits": 3, "num_merges": 3}


def test_empty_cache_gives_the_segments_back(stages: dict[str, dict[str, int]]) -> None:
    stats = stages["cache emptied"]
    reserved = SMALL_SEGMENT + LARGE_SEGMENT
    assert nested_subset(stats, ["segment", "reserved_bytes"]) == {
        "segment": pools(stat(0, 2, 2, 2), stat(0, 1, 1, 1), stat(0, 1, 1, 1)),
        "reserved_bytes": pools(
            stat(0, reserved, reserved, reserved),
            stat(0, LARGE_SEGMENT, LARGE_SEGMENT, LARGE_SEGMENT),
            stat(0, SMALL_SEGMENT, SMALL_SEGMENT, SMALL_SEGMENT),
        ),
    }
    assert (stats["num_device_alloc"], stats["num_device_free"]) == (2, 2)


def test_resets(stages: dict[str, dict[str, int]]) -> None:
    before, peaks, accumulated = (
        stages["cache emptied"],
        stages["peaks reset"],
        stages["accumulated reset"],
    )
    for key, value in peaks.items():
        if key.endswith(".peak"):
            assert value == peaks[key[: -len("peak")] + "current"] == 0, key
        else:
            assert value == before[key], key
    for key, value in accumulated.items():
        if key.endswith((".allocated", ".freed")) or key in (
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
        ):
            assert value == 0, key
        else:
            assert value == peaks[key], key
    assert stages["accumulated reset/extra"] == {"num_splits": 0, "num_merges": 0}


def test_the_shortcuts_and_the_nested_dict() -> None:
    out = run_json(
        """
        import ferrocache as fc
        p = fc.caching_allocator_alloc(3 * 2**20)
        q = fc.caching_allocator_alloc(2 * 2**20)  # large pool (1 MiB would be small)
        fc.caching_allocator_delete(q)
        result({
            "allocated": fc.memory_allocated(), "max_allocated": fc.max_memory_allocated(),
            "reserved": fc.memory_reserved(), "max_reserved": fc.max_memory_reserved(),
            "nested": fc.memory_stats_as_nested_dict()["allocated_bytes"]["all"],
            "flat_device": fc.memory_stats("cuda:0")["allocated_bytes.all.current"],
        })
        """,
        env=memory_env(GIB),
    )
    assert out == {
        "allocated": 3 * MIB,
        "max_allocated": 5 * MIB,
        "reserved": LARGE_SEGMENT,  # both came from one 20 MiB segment
        "max_reserved": LARGE_SEGMENT,
        "nested": stat(3 * MIB, 5 * MIB, 5 * MIB, 2 * MIB),
        "flat_device": 3 * MIB,
    }


def test_out_of_memory_raises_pytorchs_message_and_the_program_goes_on() -> None:
    out = run_json(
        """
        import ferrocache as fc
        try:
            fc.caching_allocator_alloc(128 * 2**20)
            outcome = None
        except fc.OutOfMemoryError as err:
            outcome = [type(err).__name__, isinstance(err, RuntimeError), str(err)]
        p = fc.caching_allocator_alloc(2**20)
        fc.caching_allocator_delete(p)
        result({"outcome": outcome, "num_ooms": fc.memory_stats()["num_ooms"]})
        """,
        env=memory_env(64 * MIB),
    )
    name, is_runtime_error, message = out["outcome"]
    assert name == "OutOfMemoryError" and is_runtime_error
    assert message.startswith(
        "CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of "
        "64.00 MiB of which "
    ), message
    assert out["num_ooms"] == 1


def test_out_of_memory_is_also_torchs_exception_where_torch_is_importable() -> None:
    out = run_json(
        """
        import sys, ferrocache as fc
        assert "torch" not in sys.modules
        try:
            fc.caching_allocator_alloc(2**40)
        except Exception as err:
            import torch
            result([isinstance(err, torch.cuda.OutOfMemoryError),
                    isinstance(err, fc.OutOfMemoryError), str(err).split(".")[0]])
        """,
        env=memory_env(64 * MIB),
        fake_torch=True,
    )
    assert out == [True, True, "CUDA out of memory"]


def test_memory_fraction_caps_the_allocator() -> None:
    out = run_json(
        """
        import ferrocache as fc
        fc.set_per_process_memory_fraction(0.5)
        p = fc.caching_allocator_alloc(20 * 2**20)  # one 20 MiB segment: within 32 MiB
        try:
            fc.caching_allocator_alloc(20 * 2**20)  # a second would pass 32 MiB
            second = "allocated"
        except fc.OutOfMemoryError as err:
            second = str(err)
        errors = []
        for bad in (1.5, -0.1, 1):
            try:
                fc.set_per_process_memory_fraction(bad)
            except (TypeError, ValueError) as err:
                errors.append([type(err).__name__, str(err)])
        result({"second": second, "errors": errors})
        """,
        env=memory_env(64 * MIB),
    )
    assert out["second"].startswith("CUDA out of memory. Tried to allocate 20.00 MiB.")
    assert out["errors"] == [
        ["ValueError", "Invalid fraction value: 1.5. Allowed range: 0~1"],
        ["ValueError", "Invalid fraction value: -0.1. Allowed range: 0~1"],
        ["TypeError", "Invalid type for fraction argument, must be `float`"],
    ]


def test_alloc_and_delete_arguments() -> None:
    out = run_json(
        """
        import ferrocache as fc
        out = {"zero": fc.caching_allocator_alloc(0), "delete_null": fc.caching_allocator_delete(0)}
        p = fc.caching_allocator_alloc(4096, device=0, stream=0)
        out["aligned"] = p % 512 == 0
        fc.caching_allocator_delete(p)
        def error(call):
            try:
                call()
            except Exception as err:
                return [type(err).__name__, str(err)]
        out["double_free"] = error(lambda: fc.caching_allocator_delete(p))
        out["bad_stream"] = error(lambda: fc.caching_allocator_alloc(16, stream="s"))
        out["cpu"] = error(lambda: fc.memory_stats("cpu"))
        out["no_such_device"] = error(lambda: fc.memory_stats(3))
        result(out)
        """,
        env=memory_env(GIB),
    )
    assert out["zero"] == 0 and out["delete_null"] is None and out["aligned"]
    assert out["double_free"][0] == "RuntimeError" and "invalid device pointer" in out["double_free"][1]
    assert out["bad_stream"][0] == "TypeError" and "torch.cuda.Stream" in out["bad_stream"][1]
    assert out["cpu"] == ["ValueError", "Expected a cuda device, but got: cpu"]
    assert out["no_such_device"][0] == "RuntimeError" and "3" in out["no_such_device"][1]


def test_the_stream_is_the_one_given() -> None:
    out = run_json(
        """
        import ferrocache as fc
        fc.record_memory_history()
        p = fc.caching_allocator_alloc(4096, stream=0)
        fc.caching_allocator_delete(p)
        result([(e["action"], e["stream"]) for e in fc.snapshot()["device_traces"][0]])
        """,
        env=memory_env(GIB),
    )
    assert out == [["segment_alloc", 0], ["alloc", 0], ["free_requested", 0], ["free_completed", 0]]
