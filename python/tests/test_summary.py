"""memory_summary: PyTorch's table (header, rows, column widths, units), by its layout rules."""

from __future__ import annotations

import pytest
from conftest import GIB, MIB, memory_env, run_json
from ferrocache import memory

WIDTH = 75 + 2  # PyTorch's 75 columns between the outer bars
INNER_BARS = [24, 37, 50, 63]  # where every table row has its column separators


def zero_stats() -> dict[str, int]:
    stats = {key: 0 for key in memory.PYTORCH_STAT_KEYS}
    stats.update(num_splits=0, num_merges=0, max_split_size=-1)
    return stats


def rows(text: str) -> list[str]:
    assert text.endswith("|\n")
    return text[:-1].split("\n")


@pytest.mark.parametrize("abbreviated, count", [(False, 48), (True, 30)])
def test_every_line_is_pytorchs_width_and_the_columns_line_up(abbreviated: bool, count: int) -> None:
    lines = rows(memory.format_summary(zero_stats(), 0, abbreviated))
    assert len(lines) == count
    for line in lines:
        assert len(line) == WIDTH and line[0] == line[-1] == "|", repr(line)
    table = [line for line in lines[6:] if not set(line[1:-1]) <= {"-", "="}]
    for line in table:
        assert [i for i, ch in enumerate(line) if ch == "|"][1:-1] == INNER_BARS, repr(line)


def test_the_header() -> None:
    stats = zero_stats()
    stats.update(num_ooms=3, num_alloc_retries=12, num_splits=7, num_merges=5)
    lines = rows(memory.format_summary(stats, 2))
    assert lines[:8] == [
        "|" + "=" * 75 + "|",
        "|               ferrocache CUDA memory summary, device ID 2                 |",
        "|" + "-" * 75 + "|",
        "|            CUDA OOMs: 3            |        cudaMalloc retries: 12        |",
        "|         Block splits: 7            |        Block merges: 5               |",
        "|" + "=" * 75 + "|",
        "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |",
        "|" + "-" * 75 + "|",
    ]
    assert lines[-1] == "|" + "=" * 75 + "|"


def test_row_labels_in_pytorchs_order() -> None:
    labels = [line[2:23].rstrip() for line in rows(memory.format_summary(zero_stats(), 0, True))[7:]]
    labels = [label for label in labels if label.strip("-=")]
    assert labels == [
        "Allocated memory",
        "Active memory",
        "Requested memory",
        "GPU reserved memory",
        "Non-releasable memory",
        "Allocations",
        "Active allocs",
        "GPU reserved segments",
        "Non-releasable allocs",
        "Oversize allocations",
        "Oversize GPU segments",
    ]


def test_units_follow_the_all_pools_value() -> None:
    stats = zero_stats()
    stats.update(
        {
            # Current: 3.5 GiB in all, so every pool's cell is in MiB.
            "allocated_bytes.all.current": 3 * GIB + 512 * MIB,
            "allocated_bytes.large_pool.current": 3 * GIB,
            "allocated_bytes.small_pool.current": 512 * MIB,
            # Peak: below 768 KiB stays in bytes; Tot Alloc: 768 KiB exactly goes to KiB.
            "allocated_bytes.all.peak": 700 * 1024,
            "allocated_bytes.small_pool.peak": 700 * 1024,
            "allocated_bytes.all.allocated": 768 * 1024,
            "allocated_bytes.small_pool.allocated": 768 * 1024,
            # Counts: K from 750 000, M from 750 000 K, rounded down.
            "allocation.all.current": 1_234_567,
            "allocation.large_pool.current": 999,
            "allocation.all.peak": 749_999,
            "allocation.all.allocated": 2_000_000_000,
            "oversize_segments.current": 750_000,
        }
    )
    lines = rows(memory.format_summary(stats, 0))
    assert "| Allocated memory      |   3584 MiB | 716800 B   |    768 KiB |      0 B   |" in lines
    assert "|       from large pool |   3072 MiB |      0 B   |      0 KiB |      0 B   |" in lines
    assert "|       from small pool |    512 MiB | 716800 B   |    768 KiB |      0 B   |" in lines
    assert "| Allocations           |    1234 K  |  749999    |    2000 M  |       0    |" in lines
    assert "|       from large pool |       0 K  |       0    |       0 M  |       0    |" in lines
    assert "| Oversize GPU segments |     750 K  |       0    |       0    |       0    |" in lines


@pytest.mark.usefixtures("fake_libcuda")
def test_the_summary_of_a_real_allocator_state() -> None:
    out = run_json(
        """
        import ferrocache as fc
        a = fc.caching_allocator_alloc(1000)
        b = fc.caching_allocator_alloc(5 * 2**20)
        result([fc.memory_summary(), fc.memory_summary(device=0, abbreviated=True)])
        """,
        env=memory_env(GIB),
    )
    full, short = rows(out[0]), rows(out[1])
    assert "| Allocated memory      |   5121 KiB |   5121 KiB |   5121 KiB |      0 B   |" in full
    assert "|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |" in full
    assert "| GPU reserved memory   |  22528 KiB |  22528 KiB |  22528 KiB |      0 B   |" in full
    assert "| Non-releasable memory |  17407 KiB |  17407 KiB |  17407 KiB |      0 B   |" in full
    assert "| GPU reserved segments |       2    |       2    |       2    |       0    |" in full
    assert "|         Block splits: 2            |        Block merges: 0               |" in full
    assert len(full) == 48 and len(short) == 30
    assert not any("from large pool" in line for line in short)
