"""PyTorch 2.15's ``is_capture_context()`` under real PyTorch on the fake CUDA: a private pool
recording inside ``torch.cuda.use_mem_pool`` with no graph capture under way does not make the
allocator act as in a capture. The out-of-memory path still releases every cached block and
retries, and a free used on another stream waits for an event that the next allocation
processes. Each program runs under PyTorch's allocator and under ferrocache's front end, and
both must answer the same (docs/cuda-graphs.md, "Capture or not").
"""

from __future__ import annotations

import textwrap

from torch_env import MIB, TORCH_VERSION, require_real_torch, run_torch, torch_env

require_real_torch()

# PyTorch 2.13 on (pytorch#175374); before it a recording pool acts as a capture, and ferrocache
# models that too (src/config/modelled.rs): on those versions only the agreement is checked.
IS_CAPTURE_CONTEXT = TORCH_VERSION >= (2, 13)


def prelude(use_ferrocache: bool) -> str:
    return textwrap.dedent(
        f"""
        if {use_ferrocache}:
            ferrocache.install()
            assert ferrocache.frontend.is_installed(), "install() fell back"
        torch.cuda.init()

        def figures():
            stats = torch.cuda.memory_stats()
            keys = ("reserved_bytes.all.current", "allocated_bytes.all.current",
                    "segment.all.current", "num_device_alloc", "num_device_free", "num_ooms",
                    "num_alloc_retries", "num_sync_all_streams")
            return {{key: stats[key] for key in keys}}

        def pool_segments(pool_id):
            return sorted([s["total_size"], s["allocated_size"]]
                          for s in torch.cuda.memory_snapshot()
                          if tuple(s["segment_pool_id"]) == tuple(pool_id))
        """
    )


def under_both(program: str, total_bytes: int) -> tuple[dict, dict]:
    answers = []
    for use_ferrocache in (False, True):
        code = prelude(use_ferrocache) + textwrap.dedent(program)
        answers.append(run_torch(code, env=torch_env(total_bytes)))
    return answers[0], answers[1]


LAST_RETRY = """
out = {}
cached = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
del cached  # 40 MiB cached in the ordinary pool
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    try:
        inside = torch.empty(50 << 20, dtype=torch.uint8, device="cuda")
        out["inside"] = "allocated"
    except torch.OutOfMemoryError as err:
        out["inside"] = str(err).split(".")[0]
out["figures"] = figures()
out["pool"] = pool_segments(pool.id)
result(out)
"""


def test_inside_use_mem_pool_the_last_out_of_memory_retry_releases_the_cached_blocks() -> None:
    native, ours = under_both(LAST_RETRY, 80 * MIB)
    assert ours == native
    if not IS_CAPTURE_CONTEXT:
        return
    # PyTorch's last retry ran: the ordinary cache went back and the pool got its segment.
    assert native["inside"] == "allocated"
    assert native["figures"]["num_alloc_retries"] == 1
    assert native["figures"]["num_device_free"] == 1
    assert native["pool"] == [[50 * MIB, 50 * MIB]]


EVENTS = """
out = {}
pool = torch.cuda.MemPool()
side = torch.cuda.Stream()
with torch.cuda.use_mem_pool(pool):
    used = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    at = used.data_ptr()
    with torch.cuda.stream(side):
        used.record_stream(side)
        used.fill_(1)
    del used  # waits for an event on the side stream
    out["pending"] = [b["state"] for s in torch.cuda.memory_snapshot()
                      if tuple(s["segment_pool_id"]) == tuple(pool.id) for b in s["blocks"]]
    torch.cuda.synchronize()
    again = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    out["reused"] = again.data_ptr() == at
out["figures"] = figures()
out["pool"] = pool_segments(pool.id)
result(out)
"""


def test_inside_use_mem_pool_a_free_used_on_another_stream_is_reused_once_its_event_completed() -> None:
    native, ours = under_both(EVENTS, 1 << 30)
    assert ours == native
    if not IS_CAPTURE_CONTEXT:
        return
    # Not deferred as in a capture: its event was recorded at once and processed by the next
    # allocation, which got the block back.
    assert "active_pending_free" in native["pending"]
    assert native["reused"]


EMPTY_CACHE = """
out = {}
cached = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
del cached  # 40 MiB cached in the ordinary pool
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.empty_cache()
    out["inside"] = figures()
out["pool"] = pool_segments(pool.id)
del kept
result(out)
"""


def test_inside_use_mem_pool_empty_cache_releases_the_ordinary_pools_as_pytorch_does() -> None:
    native, ours = under_both(EMPTY_CACHE, 1 << 30)
    assert ours == native
    if not IS_CAPTURE_CONTEXT:
        return
    # The front end tells ferrocache the current stream, which does not capture: the ordinary
    # cache went back; the pool kept its segment.
    assert native["inside"]["num_device_free"] == 1
    assert native["pool"] == [[2 << 20, 1 << 20]]
