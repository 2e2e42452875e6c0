"""PyTorch's own allocator as the oracle (python/tools/oracle): fixed seeds of random allocation
programs, one per setting, must run identically under PyTorch's caching allocator and under
ferrocache (device calls, every memory_stats() key after every op, out-of-memory points, final
segment layout); native recordings replayed with ferrocache must make every segment decision
PyTorch made, at the same peak reserved. ``scripts/oracle --cases N`` runs more seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch_env import TORCH_VERSION, require_real_torch

require_real_torch()
if TORCH_VERSION < (2, 15):
    # ferrocache follows PyTorch 2.15's rules (a fraction of 1, expandable address ranges, ...);
    # older allocators decide some cases differently, which is not a fault of ferrocache.
    pytest.skip("the oracle is PyTorch >= 2.15's allocator", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from oracle import harness  # noqa: E402

#: The seeds CI runs, per setting (about 10 s per program pair on 2 cores).
CI_SEEDS = (0,)


@pytest.mark.parametrize("setting", harness.SETTINGS, ids=[s[0] for s in harness.SETTINGS])
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_pytorch_and_ferrocache_agree(seed: int, setting: tuple) -> None:
    divergence = harness.compare(harness.random_program(seed, setting))
    assert divergence is None, str(divergence)


def test_a_divergence_is_found_and_reported() -> None:
    # The harness must be able to fail: a program compared with a different one diverges.
    case = harness.random_program(3, harness.SETTINGS[0])
    native = harness.run_program(case, "native")
    ours = harness.run_program(case, "ferrocache")
    assert harness.first_divergence(case, native, ours) is None
    altered = dict(ours, steps=list(ours["steps"]))
    first_alloc = next(i for i, op in enumerate(case.ops) if op["op"] == "alloc")
    step = dict(altered["steps"][first_alloc])
    step["stats"] = dict(step["stats"], **{"num_device_alloc": step["stats"]["num_device_alloc"] + 1})
    altered["steps"][first_alloc] = step
    divergence = harness.first_divergence(case, native, altered)
    assert divergence is not None and divergence.step == first_alloc
    assert "stat num_device_alloc" in str(divergence)


def test_the_event_order_departure_is_recognised() -> None:
    # Seed 0 under max_split_size_mb:64: at op 37 one malloc finds the events of three blocks on
    # three streams complete; PyTorch frees them in hash order, ferrocache in stream order, and the
    # inactive-split peak differs by one. Named departure "event order" (harness.EVENT_ORDER).
    setting = next(s for s in harness.SETTINGS if s[0] == "max_split_64")
    case = harness.random_program(0, setting)
    native = harness.run_program(case, "native")
    ours = harness.run_program(case, "ferrocache")
    assert harness.first_divergence(case, native, ours) is None
    assert case.departures == [f"{harness.EVENT_ORDER} at op 37"]
    differing = harness.diff_stats(native["steps"][37]["stats"], ours["steps"][37]["stats"])
    assert differing == ["stat inactive_split.small_pool.peak: pytorch 3, ferrocache 4"] or (
        differing and all(line.split(":")[0][5:] in harness.EVENT_ORDER_KEYS for line in differing)
    ), differing
    assert harness.blocks_released_by_events(case, 37, native["steps"]) == 3


REPLAY_SETTINGS = [s for s in harness.SETTINGS if s[0] in ("defaults", "max_split_64", "expandable")]


@pytest.mark.parametrize("setting", REPLAY_SETTINGS, ids=[s[0] for s in REPLAY_SETTINGS])
def test_native_recordings_replay_with_every_segment_decision(setting: tuple) -> None:
    # Recording starts, then empty_cache(): the recording begins with a burst of segment_free.
    result = harness.replay_native_recording(harness.training_program(1, setting))
    row = result["row"]
    assert row["native_segment_allocs"] > 0
    assert row["matching_segment_allocs"] == row["native_segment_allocs"], row
    assert row["segment_allocs"] == row["native_segment_allocs"], row
    assert row["peak_reserved_bytes"] == row["native_peak_reserved_bytes"], row
