"""PyTorch's C++ callers of the allocator beyond allocation, under real PyTorch on the fake CUDA:
an allocator trace tracker (``attachAllocatorTraceTracker``, what NCCL's register hook attaches)
and ``getExpandableSegmentSizes``. Python cannot reach either, so a small C++ probe, built here
against the running PyTorch like ferrocache's front end, attaches a tracker and asks for the
sizes; each program runs under PyTorch's allocator and under ferrocache (the front end), and
what the probe saw must be the same.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from torch_env import require_real_torch, run_torch, torch_env

require_real_torch()

PROBE = r"""
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace alloc = c10::cuda::CUDACachingAllocator;

namespace {
struct Seen {
    int64_t action, device;
    uint64_t addr, size, pool_first, pool_second;
};
std::mutex seen_lock;
std::vector<Seen> seen;
}  // namespace

extern "C" __attribute__((visibility("default"))) void probe_attach() {
    alloc::attachAllocatorTraceTracker([](const alloc::TraceEntry& e) {
        std::lock_guard<std::mutex> guard(seen_lock);
        seen.push_back({static_cast<int64_t>(e.action_), static_cast<int64_t>(e.device_),
                        static_cast<uint64_t>(e.addr_), static_cast<uint64_t>(e.size_),
                        static_cast<uint64_t>(e.mempool_.first),
                        static_cast<uint64_t>(e.mempool_.second)});
    });
}

// Copies up to `capacity` entries seen so far (6 words each) and forgets them; returns how many.
extern "C" __attribute__((visibility("default"))) int probe_take(uint64_t* out, int capacity) {
    std::lock_guard<std::mutex> guard(seen_lock);
    int n = 0;
    for (const auto& s : seen) {
        if (n == capacity) break;
        uint64_t words[6] = {static_cast<uint64_t>(s.action), static_cast<uint64_t>(s.device),
                             s.addr, s.size, s.pool_first, s.pool_second};
        for (int k = 0; k < 6; ++k) out[6 * n + k] = words[k];
        ++n;
    }
    seen.clear();
    return n;
}

// getExpandableSegmentSizes(device): (stream, is_small_pool, total_size) triples.
extern "C" __attribute__((visibility("default"))) int probe_segment_sizes(int device, uint64_t* out,
                                                                         int capacity) {
    auto sizes = alloc::get()->getExpandableSegmentSizes(static_cast<c10::DeviceIndex>(device));
    int n = 0;
    for (const auto& s : sizes) {
        if (n == capacity) break;
        out[3 * n] = reinterpret_cast<uintptr_t>(s.stream);
        out[3 * n + 1] = s.is_small_pool ? 1 : 0;
        out[3 * n + 2] = s.total_size;
        ++n;
    }
    return n;
}
"""

#: PyTorch's TraceEntry::Action names, by value.
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom"]  # fmt: skip


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """The probe, built against the running PyTorch with the front end's flags."""
    folder = tmp_path_factory.mktemp("probe")
    source = folder / "probe.cpp"
    source.write_text(PROBE)
    built = folder / "probe.so"
    run_torch(
        f"""
        import subprocess
        from ferrocache import frontend, torch_api
        include, lib = torch_api._torch_paths(torch)
        command = [
            torch_api._compiler(), "-std=c++20", "-O1", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={{torch_api._cxx11_abi(torch)}}", f"-I{{include}}",
            *(f"-I{{folder}}" for folder in frontend.cuda_include_dirs(torch)),
            {str(source)!r}, "-o", {str(built)!r}, f"-L{{lib}}", "-lc10", "-lc10_cuda",
            f"-Wl,-rpath,{{lib}}",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        result(True)
        """,
        timeout=300,
    )
    return built


def under_both(probe: Path, program: str, **env: str) -> dict[str, object]:
    """Runs ``program`` with the probe loaded (``probe``) under PyTorch's allocator and under
    ferrocache; returns each side's result()."""
    prelude = textwrap.dedent(
        f"""
        import ctypes
        probe = ctypes.CDLL({str(probe)!r})
        probe.probe_take.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        probe.probe_segment_sizes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        ACTIONS = {ACTIONS!r}

        def taken():
            room = (ctypes.c_uint64 * (6 * 4096))()
            n = probe.probe_take(room, 4096)
            return [dict(action=ACTIONS[room[6 * i]], device=room[6 * i + 1], addr=room[6 * i + 2],
                         size=room[6 * i + 3], pool=[room[6 * i + 4], room[6 * i + 5]])
                    for i in range(n)]

        def segment_sizes(device=0):
            room = (ctypes.c_uint64 * (3 * 64))()
            n = probe.probe_segment_sizes(device, room, 64)
            return sorted([room[3 * i], room[3 * i + 1], room[3 * i + 2]] for i in range(n))

        if USE_FERROCACHE:
            ferrocache.install()
            assert ferrocache.frontend.is_installed()
        """
    )
    answers = {}
    for side in ("native", "ferrocache"):
        code = f"USE_FERROCACHE = {side == 'ferrocache'}\n" + prelude + textwrap.dedent(program)
        answers[side] = run_torch(code, env=torch_env(**env))
    return answers


def without_addresses(events: list[dict]) -> list[tuple]:
    """The events less their addresses (the fake hands out the same ones to both, but which
    is not the question), with each segment's free matched to its allocation."""
    live: dict[int, int] = {}
    out = []
    for e in events:
        if e["action"] == "snapshot":
            continue
        entry = (e["action"], e["device"], e["size"], tuple(e["pool"]))
        if e["action"] == "segment_alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            assert live.pop(e["addr"]) == e["size"], f"a segment_free of no segment: {e}"
        out.append(entry)
    assert not live or all(size > 0 for size in live.values())
    return out


def test_a_trace_tracker_attached_from_cpp_sees_the_events_pytorchs_allocator_sends(probe) -> None:
    answers = under_both(
        probe,
        """
        torch.cuda.init()  # PyTorch's allocator attaches trackers to the devices it has
        probe.probe_attach()
        large = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        small = torch.empty(1000, device="cuda")
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            pooled = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        del large, small, pooled
        torch.cuda.empty_cache()
        del pool
        torch.cuda.empty_cache()
        result(dict(events=taken(), pool=list(torch.cuda.MemPool().id)))
        """,
    )
    native, ours = answers["native"], answers["ferrocache"]
    assert without_addresses(ours["events"]) == without_addresses(native["events"])
    actions = [e["action"] for e in ours["events"]]
    assert actions.count("segment_alloc") == actions.count("segment_free") == 3, actions
    pooled = [e for e in ours["events"] if e["action"] == "segment_alloc" and e["pool"] != [0, 0]]
    assert len(pooled) == 1, ours["events"]


def test_expandable_segments_send_a_map_and_an_unmap_per_range_and_report_their_sizes(probe) -> None:
    answers = under_both(
        probe,
        """
        torch.cuda.init()  # PyTorch's allocator attaches trackers to the devices it has
        probe.probe_attach()
        on_default = torch.empty(1000, device="cuda")  # PyTorch does not list its segment
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            small = torch.empty(1000, device="cuda")
            large = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
        sizes = segment_sizes()
        del on_default, small, large
        torch.cuda.empty_cache()
        result(dict(events=taken(), sizes=sizes, after=segment_sizes()))
        """,
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    native, ours = answers["native"], answers["ferrocache"]
    assert without_addresses(ours["events"]) == without_addresses(native["events"])
    assert ours["sizes"] == native["sizes"]
    assert [(small, size) for _, small, size in ours["sizes"]] == [(0, 40 << 20), (1, 2 << 20)]
    assert ours["after"] == native["after"]
    actions = [e["action"] for e in ours["events"]]
    assert actions.count("segment_map") == 3 and actions.count("segment_unmap") == 3, actions
