"""ferrocache's own allocator object (python/ferrocache/frontend.cpp) under real PyTorch: each
answer reaches PyTorch's C++ callers through PyTorch's own functions (``torch._C``), not through
ferrocache's Python replacements, with the figures PyTorch's allocator gives for the same work.

Every test here fails when install() fell back to CUDAPluggableAllocator, so that a silent
fallback is seen (scripts/with-fake-cuda provides the CUDA headers the build needs).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from torch_env import MIB, require_real_torch, run_torch, run_torch_process, torch_env

require_real_torch()

INSTALL = """
ferrocache.install()
from ferrocache import frontend
assert frontend.is_installed(), "install() fell back to CUDAPluggableAllocator"
"""

#: The same work under either allocator; its figures come from PyTorch's C++ statistics.
WORK = """
def flat(nested, prefix=""):
    out = {}
    for key, value in nested.items():
        name = prefix + "." + key if prefix else key
        out.update(flat(value, name) if isinstance(value, dict) else {name: value})
    return out

def figures():
    stats = flat(torch._C._cuda_memoryStats(0))
    keys = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
            "reserved_bytes.all.peak", "segment.all.current", "allocation.all.current",
            "allocation.all.allocated", "active_bytes.large_pool.peak", "requested_bytes.all.peak")
    return {key: stats[key] for key in keys}

a = torch.empty(1000, device="cuda")
b = torch.empty(3 * (1 << 20), device="cuda")
c = torch.empty(25 * (1 << 20), dtype=torch.uint8, device="cuda")
del b
d = torch.empty(1 << 20, device="cuda")
before_reset = figures()
torch._C._cuda_resetPeakMemoryStats(0)
after_reset = figures()
"""


def installed(code: str) -> str:
    """``code`` run after install() put the front end in place."""
    return INSTALL + textwrap.dedent(code)


def run_both(code: str, check: bool = True, **env: str) -> tuple[Any, Any]:
    native = run_torch(textwrap.dedent(code), env=torch_env(**env), check=check)
    ours = run_torch(installed(code), env=torch_env(**env), check=check)
    return native, ours


def test_install_puts_ferrocaches_own_allocator_object_in_place_of_pytorchs() -> None:
    done = run_torch_process(
        installed(
        """
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({"backend": torch._C._cuda_getAllocatorBackend(),
                          "served": ferrocache.memory_allocated() == x.nbytes}))
        """
        )
    )
    assert done.returncode == 0, done.stderr
    assert "CUDAPluggableAllocator is used instead" not in done.stderr
    assert '{"backend": "ferrocache", "served": true}' in done.stdout


def test_without_cuda_headers_install_falls_back_to_the_pluggable_allocator_with_one_warning(tmp_path) -> None:
    done = run_torch_process(
        """
        allocator = ferrocache.install()
        from ferrocache import frontend
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({"type": type(allocator).__name__, "front end": frontend.is_installed(),
                          "served": ferrocache.memory_allocated() == x.nbytes,
                          "mem_pool": type(torch.cuda.MemPool()).__module__}))
        """,
        env=torch_env(FERROCACHE_CUDA_INCLUDE=str(tmp_path / "none"), FERROCACHE_CACHE_DIR=str(tmp_path)),
    )
    warnings = [line for line in done.stderr.splitlines() if "[WARN]" in line]
    assert len(warnings) == 1 and "CUDAPluggableAllocator is used instead" in warnings[0], done.stderr
    assert "cuda_runtime.h" in warnings[0]
    expected = {"type": "CUDAPluggableAllocator", "front end": False, "served": True, "mem_pool": "ferrocache.pools"}
    assert json.dumps(expected) in done.stdout, done.stdout


def test_pytorchs_own_statistics_functions_read_ferrocaches_figures_as_pytorchs_allocator_gives_them() -> None:
    native, ours = run_both(WORK + "result({'before': before_reset, 'after': after_reset})")
    assert ours == native


def test_pytorchs_own_snapshot_function_reads_ferrocaches_segments_and_blocks() -> None:
    code = """
    a = torch.empty(1000, device="cuda")
    b = torch.empty(3 * (1 << 20), device="cuda")
    c = torch.empty(100, device="cuda")
    del a
    segments = torch._C._cuda_memorySnapshot(None)["segments"]
    result(sorted((s["total_size"], s["allocated_size"], s["active_size"], s["segment_type"],
                   [(b["size"], b["state"]) for b in s["blocks"]]) for s in segments))
    """
    native, ours = run_both(code)
    assert ours == native


def test_a_second_swap_is_refused_once_cuda_is_initialised() -> None:
    out = run_torch(
        installed(
        """
        torch.empty(1, device="cuda")
        try:
            torch.cuda.memory.change_current_allocator(
                torch.cuda.memory.CUDAPluggableAllocator(str(ferrocache._lib.library_path()), "rust_malloc", "rust_free"))
            result("swapped")
        except RuntimeError as err:
            result(str(err))
        """
        )
    )
    assert "Can't swap an already initialized allocator" in out


def test_pytorchs_own_mem_pool_class_serves_from_a_ferrocache_pool() -> None:
    code = """
    pool = torch.cuda.MemPool()
    own_class = type(pool).__module__ == "torch.cuda.memory" and isinstance(pool, torch._C._MemPool)
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(1 << 20, device="cuda")
        y = torch.empty(1 << 10, device="cuda")
    outside = torch.empty(1 << 20, device="cuda")
    live = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, {x.data_ptr(), y.data_ptr()})
    partial = torch._C._cuda_checkPoolLiveAllocations(0, pool.id, {x.data_ptr()})
    in_pool = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == pool.id]
    count = pool.use_count()
    del x, y
    reserved = torch._C._cuda_memoryStats(0)["reserved_bytes"]["all"]["current"]
    del pool
    torch.cuda.empty_cache()
    result({"own_class": own_class, "live": live, "partial": partial, "segments": len(in_pool),
            "use_count": count, "released": reserved - torch._C._cuda_memoryStats(0)["reserved_bytes"]["all"]["current"]})
    """
    native, ours = run_both(code)
    assert ours["own_class"] and ours["live"] and not ours["partial"], ours
    assert ours == native


def test_a_private_pool_unknown_to_the_allocator_is_an_error_not_a_crash() -> None:
    out = run_torch(
        installed(
        """
        torch.empty(1, device="cuda")
        try:
            torch._C._cuda_checkPoolLiveAllocations(0, (0, 12345), set())
            result("answered")
        except RuntimeError as err:
            result(str(err))
        """
        )
    )
    assert "checkPoolLiveAllocations" in out and "(0, 12345)" in out


def test_an_out_of_memory_observer_attached_through_pytorch_is_called_by_ferrocache() -> None:
    out = run_torch(
        installed(
        """
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args[1]))
        try:
            torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        result(seen)
        """
        ),
        env=torch_env(1 << 30),
    )
    assert out == [1 << 40]


def test_the_largest_cached_block_is_what_pytorchs_allocator_reports_to_cudnn() -> None:
    """cacheInfo has no Python binding; cuDNN in benchmark mode is its caller. On the fake, the
    convolution's workspace search asks it, and must not raise (CUDAPluggableAllocator's
    refusal would). The exit status is not checked: after cuDNN ran, the process on the fake
    sometimes aborts at exit ("terminate called without an active exception") under PyTorch's
    own allocator too, after the result was sent."""
    code = """
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
    conv(x).sum().backward()
    stats = torch._C._cuda_memoryStats(0)
    result({"peak": stats["allocated_bytes"]["all"]["peak"], "segments": stats["segment"]["all"]["current"]})
    """
    native, ours = run_both(code, check=False)
    assert ours == native


#: A pool's checkpoint and its restore through PyTorch's own functions, as CUDA graph trees
#: call them: a first capture leaves two tensors and a hole, a second fills the hole and adds a
#: segment, and the restore frees the second capture's tensor (its storage, passed as stale,
#: loses its deleter) and gives the first capture's blocks back.
#: PyTorch's C++ statistics (with private pools, torch._C._cuda_memoryStats holds more than
#: the flat keys of WORK).
POOL_FIGURES = """
def figures():
    stats = torch._C._cuda_memoryStats(0)
    return {f"{name}.all.{field}": stats[name]["all"][field]
            for name in ("allocated_bytes", "reserved_bytes", "segment", "allocation", "requested_bytes")
            for field in ("current", "peak", "allocated")}
"""
CHECKPOINT = POOL_FIGURES + """
pool = torch.cuda.graph_pool_handle()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
first, second, third = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(first, pool=pool, stream=side):
    a = torch.empty(1000, device="cuda")
    hole = torch.empty(4000, device="cuda")
    hole_ptr = hole.data_ptr()
    del hole
    b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
state = torch._C._cuda_getCheckpointState(0, pool)
at_checkpoint = figures()
with torch.cuda.graph(second, pool=pool, stream=side):
    c = torch.empty(4000, device="cuda")
    d = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
c_in_hole = c.data_ptr() == hole_ptr
del d
torch._C._cuda_setCheckpointPoolState(0, state, [c.untyped_storage()._cdata], [])
live = torch._C._cuda_checkPoolLiveAllocations(0, pool, {a.data_ptr(), b.data_ptr()})
restored = figures()
del c
with torch.cuda.graph(third, pool=pool, stream=side):
    e = torch.empty(4000, device="cuda")
try:
    torch._C._cuda_getCheckpointState(0, (0, 12345))
    unknown = "answered"
except RuntimeError:
    unknown = "refused"
result({"c_in_hole": c_in_hole, "live": live, "e_in_hole": e.data_ptr() == hole_ptr,
        "at_checkpoint": at_checkpoint, "restored": restored, "end": figures(), "unknown": unknown})
"""


def test_a_pools_checkpoint_is_restored_through_pytorchs_functions_as_by_pytorchs_allocator() -> None:
    native, ours = run_both(CHECKPOINT)
    assert ours["c_in_hole"] and ours["live"] and ours["e_in_hole"], ours
    assert ours["unknown"] == "refused"
    # The checkpoint's allocations again; the second capture's segment stays, wholly free.
    for key in ("allocated_bytes.all.current", "allocation.all.current"):
        assert ours["restored"][key] == ours["at_checkpoint"][key], key
    assert ours == native


def test_cuda_graph_trees_record_and_replay_two_branches_as_under_pytorchs_allocator() -> None:
    """torch.compile(backend="cudagraphs") over two shapes: the second shape's recording
    restores the pool to the checkpoint taken after the first's."""
    code = POOL_FIGURES + textwrap.dedent("""
    g = torch.compile(lambda x: torch.relu(x) + 1, backend="cudagraphs", dynamic=False)
    restores = []
    real = torch._C._cuda_setCheckpointPoolState
    torch._C._cuda_setCheckpointPoolState = lambda *args: restores.append(1) or real(*args)
    outputs = []
    for rows in (8, 8, 8, 16, 16, 16, 8):
        outputs.append(g(torch.ones(rows, 16, device="cuda")).data_ptr())
    result({"outputs": outputs, "restores": len(restores), "figures": figures()})
    """)
    native, ours = run_both(code)
    assert ours["restores"] > 0, ours
    assert ours == native


__all__ = ["MIB"]
