"""torch.cuda's memory API through real PyTorch, under PyTorch's allocator and under ferrocache
(issue 28): settings changed at run time, the memory fraction asked back, memory metadata in
snapshots, ``torch.cuda.MemPool`` / ``use_mem_pool``, caching turned off, and every public
memory function side by side (python/tools/memory_api/compare.py, whose table is in
docs/python.md).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from torch_env import GIB, MIB, TORCH_VERSION, require_real_torch, run_torch, torch_env

require_real_torch()

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from memory_api import compare as memory_api  # noqa: E402
from oracle import harness  # noqa: E402

pytestmark = pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="PyTorch 2.15's memory API")

#: The names whose outcomes still differ, and why each stays (docs/python.md says the same).
REMAINING_DIFFERENCES = {
    "get_allocator_backend": "a plugged-in allocator is 'pluggable' to PyTorch; that is the truth",
    "_snapshot": "host_segments and host_traces (pinned host memory) come only from PyTorch's "
    "own device snapshot, which a plugged-in allocator cannot call",
    "_dump_snapshot": "the same snapshot, pickled",
}


def test_every_public_memory_function_behaves_as_under_pytorchs_allocator() -> None:
    rows = memory_api.compare(torch_env(GIB))
    differing = {name: (theirs, ours) for name, theirs, ours, same in rows if not same}
    assert set(differing) == set(REMAINING_DIFFERENCES), differing
    names = [row[0] for row in rows]
    # PyTorch 2.15's list, and the private names of the issue, are all there.
    for name in ("MemPool", "use_mem_pool", "get_per_process_memory_fraction", "caching_allocator_disabled",
                 "_set_allocator_settings", "_set_memory_metadata", "_get_memory_metadata"):  # fmt: skip
        assert name in names
    assert len(names) >= 40
    markdown = memory_api.markdown(rows)
    assert f"{len(rows) - len(REMAINING_DIFFERENCES)} of {len(rows)} behave identically." in markdown


# ------------------------------------------------------------------------------------------------
# 1. Settings changed at run time: both allocators' decisions compared after every op
# ------------------------------------------------------------------------------------------------


def alloc(n: int, size: int, stream: int = 0) -> dict[str, Any]:
    return {"op": "alloc", "id": n, "size": size, "stream": stream}


def free(n: int) -> dict[str, Any]:
    return {"op": "free", "id": n}


def settings(value: str) -> dict[str, Any]:
    return {"op": "settings", "value": value}


#: The issue's two scenarios, one after the other.
ISSUE_SCENARIOS = [
    alloc(1, 30 * MIB),
    settings("expandable_segments:True"),
    alloc(2, 30 * MIB),
    settings("expandable_segments:False,max_split_size_mb:40"),
    free(1), free(2), {"op": "empty_cache"},
    alloc(3, 100 * MIB), free(3),
    alloc(4, 10 * MIB),
]  # fmt: skip

#: Expandable segments turned on and off around allocations of both pools, with cached blocks
#: of each kind left behind for the next requests.
EXPANDABLE_TOGGLED = [
    alloc(1, 30 * MIB), settings("expandable_segments:True"),
    alloc(2, 5 * MIB), alloc(3, 100_000), alloc(4, 50 * MIB), free(2), alloc(5, 3 * MIB),
    settings("expandable_segments:False"),
    alloc(6, 30 * MIB), free(4), alloc(7, 20 * MIB), free(3), alloc(8, 200_000), free(1),
    settings("expandable_segments:True,roundup_power2_divisions:4"),
    alloc(9, 7 * MIB), alloc(10, 200_000), free(7), alloc(11, 45 * MIB), {"op": "empty_cache"},
    *[free(n) for n in (5, 6, 8, 9, 10, 11)], {"op": "empty_cache"},
    settings("max_split_size_mb:40"), alloc(12, 60 * MIB), free(12), alloc(13, 10 * MIB),
]  # fmt: skip

#: Each other key that PyTorch 2.15 reads at run time, changed between allocations.
RUNTIME_KEYS = [
    "max_split_size_mb:40",
    "max_non_split_rounding_mb:40,max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[64:8,>:2]",
    "garbage_collection_threshold:0.6",
    "throw_on_cudamalloc_oom:True",
    "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True",
    "large_segment_size_mb:40",
    "",
]


def with_settings_changes(seed: int, fraction: Optional[float] = None) -> harness.Case:
    """A random program of the oracle with a setting of :data:`RUNTIME_KEYS` changed every 20
    ops (fixed seed), under a memory fraction when one is given (garbage collection acts only
    under one).

    No request exceeds half the device, and expandable segments are toggled only in
    :data:`EXPANDABLE_TOGGLED`, which never runs out of memory: once ``max_split_size_mb`` was
    lowered at run time below a free remainder of a split segment, PyTorch's own allocator
    answers a request the device refuses with "CUDA error: invalid argument" (it hands cuMemFree
    an address inside a segment, on a GPU as on the fake; test_settings_real.py::
    test_a_lowered_max_split_size_makes_pytorch_free_the_middle_of_a_segment), which leaves
    nothing to compare. Under a fraction, the fraction's limit still runs out."""
    case = harness.random_program(seed, ("defaults", "", fraction), length=160)
    rng = random.Random(seed)
    ops: list[dict[str, Any]] = []
    for index, op in enumerate(case.ops):
        if index and index % 20 == 0:
            ops.append(settings(rng.choice(RUNTIME_KEYS)))
        if op["op"] == "alloc":
            op = dict(op, size=min(op["size"], case.capacity // 2))
        ops.append(op)
    case.ops = ops
    under = f" under fraction {fraction}" if fraction else ""
    case.program = f"random program {seed}{under} with a setting changed every 20 ops"
    return case


@pytest.mark.parametrize(
    "case",
    [harness.Case(0, "issue 28", "", GIB, 1, 0, ISSUE_SCENARIOS, program="issue 28's two scenarios"),
     harness.Case(0, "toggled", "", GIB, 1, 0, EXPANDABLE_TOGGLED, program="expandable segments toggled")]
    + [with_settings_changes(seed) for seed in (1, 2, 3)]
    + [with_settings_changes(seed, 0.8) for seed in (4, 5)],
    ids=lambda case: case.program,
)
def test_settings_changed_at_run_time_make_pytorchs_decisions(case: harness.Case) -> None:
    """The same device calls, addresses, statistics and block layout after every op."""
    divergence = harness.compare(case)
    assert divergence is None, str(divergence)


def test_the_issues_scenarios_end_as_pytorchs_do() -> None:
    case = harness.Case(0, "issue 28", "", GIB, 1, 0, ISSUE_SCENARIOS, layout="changes")
    ours = harness.run_program(case, "ferrocache")
    layout = ours["steps"][2]["layout"]
    assert [segment[4] for segment in layout] == [False, True], "the next segment is expandable"
    stats = harness.full_stats(ours)[-1]
    assert stats["reserved_bytes.all.current"] == 110 * MIB
    assert stats["num_device_alloc"] == 4


def test_bad_settings_at_run_time_are_refused_in_pytorchs_words_and_change_nothing() -> None:
    code = """
    import warnings
    warnings.simplefilter("ignore")
    INSTALL
    torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")
    out = []
    for bad in ("max_split_size_mb:10", "expandable_segments:true", "nonsense:1", "garbage_collection_threshold:2"):
        try:
            torch.cuda.memory._set_allocator_settings(bad)
            out.append(None)
        except (RuntimeError, ValueError) as err:
            out.append([type(err).__name__, str(err).splitlines()[0]])
    # Still max_split_size_mb:64 for ferrocache: a 100 MiB cached block may not serve 10 MiB.
    t = torch.empty(100 << 20, dtype=torch.uint8, device="cuda"); del t
    u = torch.empty(10 << 20, dtype=torch.uint8, device="cuda")
    out.append(torch.cuda.memory_stats()["num_device_alloc"])
    result(out)
    """
    native = run_torch(code.replace("INSTALL", ""), env=torch_env(GIB))
    ours = run_torch(code.replace("INSTALL", "ferrocache.install()"), env=torch_env(GIB))
    # PyTorch refuses them all, in its words, and ferrocache passes its words on.
    assert ours[:4] == native[:4]
    assert all(refusal is not None for refusal in native[:4]), native
    # PyTorch resets max_split_size_mb before it parses, even a refused setting; ferrocache
    # keeps every setting of a refused one (docs/python.md).
    assert ours[4] == 2


# ------------------------------------------------------------------------------------------------
# 2, 3. The memory fraction asked back; memory metadata in snapshots and _memory_viz
# ------------------------------------------------------------------------------------------------


def test_get_per_process_memory_fraction_answers_what_was_set() -> None:
    code = """
    INSTALL
    out = [torch.cuda.get_per_process_memory_fraction()]
    torch.cuda.set_per_process_memory_fraction(0.3)
    out.append(torch.cuda.get_per_process_memory_fraction())
    out.append(torch.cuda.memory.get_per_process_memory_fraction(0))
    result(out)
    """
    env = torch_env(GIB, PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.6")
    native = run_torch(code.replace("INSTALL", ""), env=env)
    ours = run_torch(code.replace("INSTALL", "ferrocache.install()"), env=env)
    assert ours == native
    assert native[0] == pytest.approx(0.6) and native[1] == pytest.approx(0.3)


def test_memory_metadata_is_kept_per_thread_and_carried_by_trace_entries() -> None:
    code = """
    import threading
    INSTALL
    memory = torch.cuda.memory
    memory._record_memory_history(max_entries=1000)
    memory._set_memory_metadata({"layer": 3})
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    seen = []
    other = threading.Thread(target=lambda: seen.append(memory._get_memory_metadata()))
    other.start(); other.join()
    out = {"get": memory._get_memory_metadata(), "other thread": seen[0]}
    memory._set_memory_metadata("")
    del t
    snapshot = memory._snapshot()
    out["entries"] = [[e["action"], e["user_metadata"]] for e in snapshot["device_traces"][0]]
    import base64, pickle
    html = torch.cuda._memory_viz.trace_plot(snapshot)
    shown = pickle.loads(base64.b64decode(html.split('"base64": "')[1].split('"')[0]))
    out["viz"] = [e["user_metadata"] for e in shown["device_traces"][0] if e["action"] == "alloc"]
    result(out)
    """
    native = run_torch(code.replace("INSTALL", ""), env=torch_env(GIB))
    ours = run_torch(code.replace("INSTALL", "ferrocache.install()"), env=torch_env(GIB))
    assert ours == native
    assert native["get"] == '{"layer":3}' and native["other thread"] == ""
    assert ["alloc", '{"layer":3}'] in native["entries"]
    assert ["free_requested", ""] in native["entries"]
    assert native["viz"] == ['{"layer":3}'], "what the viewer gets"


# ------------------------------------------------------------------------------------------------
# 4. torch.cuda.MemPool and use_mem_pool
# ------------------------------------------------------------------------------------------------

MEM_POOL = """
INSTALL
import gc
memory = torch.cuda.memory
def E(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")
def layout(segments):
    return sorted([s["total_size"], list(s["segment_pool_id"]), [[b["size"], b["state"]] for b in s["blocks"]]]
                  for s in segments)
out = {}
pool = torch.cuda.MemPool()
out["ids"] = [list(pool.id), list(torch.cuda.MemPool().id)]
out["count"] = [pool.use_count()]
with torch.cuda.use_mem_pool(pool):
    out["count"].append(pool.use_count())
    kept = E(30 << 20)
    scratch = E(4096)
out["count"].append(pool.use_count())
del scratch
other = E(4096)
out["pool snapshot"] = layout(pool.snapshot())
out["by id"] = layout(torch.cuda.memory_snapshot(pool.id)) == out["pool snapshot"]
torch.cuda.empty_cache()
out["kept by empty_cache"] = layout(pool.snapshot())
del pool; gc.collect()
out["after the pool went"] = [memory.memory_reserved(), layout(memory.memory_snapshot())]
del kept
torch.cuda.empty_cache()
out["after its tensor went"] = memory.memory_reserved()
result(out)
"""


def test_torch_mem_pool_and_use_mem_pool_work_as_with_pytorchs_allocator() -> None:
    native = run_torch(MEM_POOL.replace("INSTALL", ""), env=torch_env(GIB))
    ours = run_torch(MEM_POOL.replace("INSTALL", "ferrocache.install()"), env=torch_env(GIB))
    assert ours == native
    assert native["ids"] == [[0, 1], [0, 2]]
    assert native["count"] == [1, 2, 1]
    # The pool's free small segment goes with the pool; the segment of its live tensor stays
    # until the tensor goes.
    assert native["after the pool went"][0] == 32 * MIB
    assert native["after its tensor went"] == 2 * MIB


def test_mem_pool_with_another_allocator_is_accepted() -> None:
    """Its segments come from that allocator: test_pool_allocator_real.py compares it with
    PyTorch's allocator."""
    out = run_torch(
        """
        ferrocache.install()
        torch.cuda.init()
        other = torch.cuda.memory.CUDAPluggableAllocator(str(ferrocache.library_path()), "rust_malloc", "rust_free")
        pool = torch.cuda.MemPool(other.allocator())
        result([list(pool.id), type(pool).__module__])
        """,
        env=torch_env(GIB),
    )
    assert out == [[0, 1], "torch.cuda.memory"]


# ------------------------------------------------------------------------------------------------
# caching_allocator_disabled
# ------------------------------------------------------------------------------------------------


def test_caching_allocator_disabled_goes_to_the_driver_as_pytorchs_does() -> None:
    code = """
    INSTALL
    torch.cuda.init()
    before = fake_stat("cuMemAlloc_v2")
    with torch.cuda.memory.caching_allocator_disabled():
        inside = torch._C._cuda_cudaCachingAllocator_is_enabled()
        t = torch.empty(1000, dtype=torch.uint8, device="cuda")
        calls = fake_stat("cuMemAlloc_v2") - before
        del t
        live = fake_stat("live_allocations")
    stats = torch.cuda.memory_stats()
    result([inside, torch._C._cuda_cudaCachingAllocator_is_enabled(), calls, live,
            stats.get("num_device_alloc", 0), torch.cuda.memory_reserved()])
    """
    native = run_torch(code.replace("INSTALL", ""), env=torch_env(GIB))
    ours = run_torch(code.replace("INSTALL", "ferrocache.install()"), env=torch_env(GIB))
    assert ours == native
    assert native[:3] == [False, True, 1]
