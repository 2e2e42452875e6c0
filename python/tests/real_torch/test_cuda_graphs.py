"""CUDA graphs with ferrocache under real PyTorch: ``torch.cuda.graph`` captures allocate from
the graph's private pool (PyTorch's pool hooks, ``docs/cuda-graphs.md``), and that memory is
never handed to anyone else while a graph may replay into it."""

from __future__ import annotations

import textwrap

import pytest

from torch_env import MIB, require_real_torch, run_torch

require_real_torch()

#: Shared by every scenario: a capture stream, and a check that this torch can capture on the
#: fake CUDA (torch < 2.9 launches a kernel when a capture begins, and the fake runs none).
SETUP = """
    ferrocache.install()
    s = torch.cuda.Stream()
    N = 1 << 20

    def pool_of(ptr):
        for seg in ferrocache.snapshot()["segments"]:
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return list(seg.get("segment_pool_id") or (0, 0))
        return None

    try:
        probe = torch.cuda.CUDAGraph()
        with torch.cuda.graph(probe, stream=s):
            pass
        del probe
    except RuntimeError as err:  # torch.AcceleratorError from 2.8 on, a RuntimeError before
        if "no kernel image" not in str(err):
            raise
        result({"cannot_capture": str(err)})
        sys.exit(0)
"""


def run_graphs(code: str) -> dict:
    out = run_torch(textwrap.dedent(SETUP) + textwrap.dedent(code))
    if "cannot_capture" in out:
        pytest.skip(f"this torch launches a kernel to begin a capture: {out['cannot_capture'][:80]}")
    return out


def test_allocations_inside_a_capture_come_from_the_graphs_pool() -> None:
    out = run_graphs(
        """
        g = torch.cuda.CUDAGraph()
        before = ferrocache.memory_allocated()
        with torch.cuda.graph(g, stream=s):
            x = torch.empty(N, dtype=torch.uint8, device="cuda")
        outside = torch.empty(N, dtype=torch.uint8, device="cuda")
        result({"pool": list(g.pool()), "x_pool": pool_of(x.data_ptr()),
                "outside_pool": pool_of(outside.data_ptr()),
                "counted": ferrocache.memory_allocated() - before})
        """
    )
    assert out["pool"] != [0, 0]
    assert out["x_pool"] == out["pool"]
    assert out["outside_pool"] == [0, 0]
    # Memory in private pools counts as allocated memory, as in PyTorch (torch 2.12 and 2.13
    # make a small allocation of their own inside every capture).
    assert 2 * MIB <= out["counted"] <= 2 * MIB + 4096


def test_a_block_freed_during_capture_is_not_handed_out_until_the_graph_is_reset() -> None:
    out = run_graphs(
        """
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            tmp = torch.empty(N, dtype=torch.uint8, device="cuda")
            freed = tmp.data_ptr()
            del tmp
            keep = torch.empty(16, dtype=torch.uint8, device="cuda")
        graph_pool = pool_of(freed)
        got = []
        for _ in range(4):
            with torch.cuda.stream(s):
                t = torch.empty(N, dtype=torch.uint8, device="cuda")
            got.append([t.data_ptr(), pool_of(t.data_ptr())])
            del t
        torch.cuda.empty_cache()
        reserved_with_graph = ferrocache.memory_reserved()
        with torch.cuda.stream(s):
            t = torch.empty(N, dtype=torch.uint8, device="cuda")
        got.append([t.data_ptr(), pool_of(t.data_ptr())])
        del t, keep
        g.reset()
        torch.cuda.empty_cache()
        result({"freed": freed, "graph_pool": graph_pool, "got": got,
                "reserved_with_graph": reserved_with_graph,
                "reserved_after_reset": ferrocache.memory_reserved(),
                "segments_after_reset": ferrocache.memory_stats()["segment.all.current"]})
        """
    )
    assert out["graph_pool"] != [0, 0]
    for pointer, pool in out["got"]:
        # Never the graph's block, nor anything else of its pool, also after empty_cache().
        assert pointer != out["freed"] and pool == [0, 0]
    # empty_cache() keeps the pool's segment while the graph holds it.
    assert out["reserved_with_graph"] >= 2 * MIB
    assert out["reserved_after_reset"] == 0 and out["segments_after_reset"] == 0


def test_graphs_sharing_a_pool_reuse_each_others_blocks_and_nobody_else_gets_them() -> None:
    out = run_graphs(
        """
        handle = torch.cuda.graph_pool_handle()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=handle, stream=s):
            a = torch.empty(N, dtype=torch.uint8, device="cuda")
        a_ptr = a.data_ptr()
        del a
        ordinary = []
        with torch.cuda.stream(s):
            t = torch.empty(N, dtype=torch.uint8, device="cuda")
            ordinary.append(pool_of(t.data_ptr()))
            del t
        with torch.cuda.graph(g2, pool=handle, stream=s):
            b = torch.empty(N, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(s):
            t = torch.empty(N, dtype=torch.uint8, device="cuda")
            ordinary.append(pool_of(t.data_ptr()))
            del t
        result({"a": a_ptr, "b": b.data_ptr(), "pools": [list(g1.pool()), list(g2.pool())],
                "b_pool": pool_of(b.data_ptr()), "ordinary": ordinary})
        """
    )
    assert out["pools"][0] == out["pools"][1] == out["b_pool"]
    assert out["b"] == out["a"], "the second capture reuses the block the first one freed"
    assert out["ordinary"] == [[0, 0], [0, 0]]


def test_torch_mem_pool_and_ferrocache_mem_pool_are_ferrocaches_private_pools() -> None:
    """PyTorch refuses its own MemPool with a plugged-in allocator; install() puts ferrocache's
    in its place (test_memory_api_real.py compares it with PyTorch's allocator)."""
    out = run_graphs(
        """
        theirs = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(theirs):
            u = torch.empty(N, dtype=torch.uint8, device="cuda")
        with ferrocache.mem_pool() as pool:
            t = torch.empty(N, dtype=torch.uint8, device="cuda")
        outside = torch.empty(N, dtype=torch.uint8, device="cuda")
        result({"torch pool": list(theirs.id), "u_pool": pool_of(u.data_ptr()), "pool": list(pool.id),
                "t_pool": pool_of(t.data_ptr()), "outside": pool_of(outside.data_ptr())})
        """
    )
    assert out["u_pool"] == out["torch pool"] == [0, 1]
    assert out["t_pool"] == out["pool"] != [0, 0]
    assert out["outside"] == [0, 0]


def test_a_capture_over_two_streams_replays_its_work_into_the_graphs_memory() -> None:
    # The fake keeps captured copies and memsets as the graph's nodes and runs them at replay,
    # checking each against the ordering rules (tests/fake-cuda/README.md, "Capture").
    out = run_graphs(
        """
        side = torch.cuda.Stream()
        host = torch.arange(256, dtype=torch.uint8).repeat(N // 256)
        src = torch.zeros(N, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            x = torch.empty(N, dtype=torch.uint8, device="cuda")
            x.copy_(src)
            side.wait_stream(s)
            with torch.cuda.stream(side):
                y = torch.zeros(N, dtype=torch.uint8, device="cuda")
                y.copy_(x)
            s.wait_stream(side)
        src.copy_(host)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        result({"replayed": torch.equal(y.cpu(), host), "y_pool": pool_of(y.data_ptr()),
                "pool": list(g.pool())})
        """
    )
    assert out["replayed"], "replaying the graph ran its copies, on both streams"
    assert out["y_pool"] == out["pool"], "the side stream's allocation is the graph's"


def test_a_capture_whose_side_stream_is_not_joined_back_fails_as_on_a_gpu() -> None:
    out = run_graphs(
        """
        side = torch.cuda.Stream()
        source = torch.zeros(N, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=s):
                x = torch.zeros(N, dtype=torch.uint8, device="cuda")
                side.wait_stream(s)
                with torch.cuda.stream(side):
                    x.copy_(source)
            error = ""
        except RuntimeError as err:
            error = str(err)
        result({"error": error})
        """
    )
    assert "capture was not joined" in out["error"], out["error"]
