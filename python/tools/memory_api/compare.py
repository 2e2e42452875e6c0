"""Every public memory function of ``torch.cuda``, called the same way under PyTorch's own
allocator and under ferrocache, side by side.

The functions are PyTorch's list: ``torch.cuda.memory.__all__``, the memory functions that
``torch.cuda`` re-exports from it, and the private ones that libraries call
(:data:`PRIVATE_NAMES`). Each has a scenario (:data:`SCENARIOS`) that uses it as a new user
would; all scenarios run in order in one program, once per allocator, each program in a fresh
process (PyTorch chooses its allocator once per process). Each scenario's outcome is what it
returned, or the exception it raised (its type and first line). Addresses, times and process
ids never enter an outcome, so the same program gives the same outcomes in two processes.

    python python/tools/memory_api/compare.py --markdown   # the table, on the GPU at hand
    python python/tools/memory_api/compare.py --json       # every outcome in full

On the fake CUDA run it under ``scripts/with-fake-cuda``. :func:`compare` returns the rows:
``(name, native outcome, ferrocache outcome, same?)``. Exit status 0 when the programs ran
(whatever they found), 1 when one of them could not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

MIB = 1 << 20

#: Private memory functions of ``torch.cuda.memory`` that libraries call, compared too.
PRIVATE_NAMES = (
    "_set_allocator_settings",
    "_set_memory_metadata",
    "_get_memory_metadata",
    "_memory_metadata_supported",
    "_record_memory_history",
    "_snapshot",
    "_dump_snapshot",
)

# ------------------------------------------------------------------------------------------------
# The child: one program under one allocator
# ------------------------------------------------------------------------------------------------


def _public_names(torch: Any) -> list[str]:
    """2.15's list: memory.py's ``__all__``, then what ``torch.cuda`` re-exports from it, then
    :data:`PRIVATE_NAMES`."""
    memory = torch.cuda.memory
    names = list(memory.__all__)
    names += [
        n for n in torch.cuda.__all__
        if n not in names and getattr(getattr(memory, n, None), "__module__", None) == memory.__name__
    ]  # fmt: skip
    names += [n for n in PRIVATE_NAMES if hasattr(memory, n)]
    return names


def _scenarios(torch: Any, scratch: Path) -> dict[str, Callable[[], Any]]:
    """name -> a function that uses it and returns its outcome (JSON-able, free of addresses)."""
    cuda = torch.cuda
    memory = cuda.memory
    kept: dict[str, Any] = {}

    def tensor(size: int) -> Any:
        return torch.empty(size, dtype=torch.uint8, device="cuda")

    def layout() -> list[Any]:
        """The segments by size, kind and blocks, in address order (no addresses)."""
        segments = sorted(memory.memory_snapshot(), key=lambda s: s["address"])
        return [
            [s["total_size"], s["segment_type"], bool(s.get("is_expandable")),
             [[b["size"], b["state"]] for b in s["blocks"]]]
            for s in segments
        ]  # fmt: skip

    def counts() -> dict[str, int]:
        stats = memory.memory_stats()
        return {
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "device_allocs": stats.get("num_device_alloc", 0),
        }

    def alloc_and_delete() -> Any:
        pointer = memory.caching_allocator_alloc(3 * MIB)
        kept["raw"] = pointer
        return [memory.memory_allocated(), memory.memory_reserved()]

    def delete() -> Any:
        memory.caching_allocator_delete(kept.pop("raw"))
        return [memory.memory_allocated(), memory.memory_reserved()]

    def enable() -> Any:
        memory.caching_allocator_enable(True)
        return torch._C._cuda_cudaCachingAllocator_is_enabled()

    def disabled() -> Any:
        with memory.caching_allocator_disabled():
            inside = torch._C._cuda_cudaCachingAllocator_is_enabled()
            t = tensor(MIB)
            del t
            reserved_inside = memory.memory_reserved()
        return [inside, torch._C._cuda_cudaCachingAllocator_is_enabled(), reserved_inside]

    def set_fraction() -> Any:
        memory.set_per_process_memory_fraction(0.5)
        return None

    def get_fraction() -> Any:
        fraction = memory.get_per_process_memory_fraction()
        memory.set_per_process_memory_fraction(1.0)
        return [round(fraction, 9), memory.get_per_process_memory_fraction()]

    def empty_cache() -> Any:
        kept["small"] = tensor(5 * MIB)
        big = tensor(30 * MIB)
        del big
        before = memory.memory_reserved()
        memory.empty_cache()
        return [before, memory.memory_reserved()]

    def stats() -> Any:
        return dict(memory.memory_stats())

    def nested() -> Any:
        return memory.memory_stats_as_nested_dict()

    def reset_accumulated() -> Any:
        memory.reset_accumulated_memory_stats()
        stats = memory.memory_stats()
        return [stats["allocation.all.allocated"], stats["allocation.all.current"]]

    def reset_peak() -> Any:
        t = tensor(8 * MIB)
        del t
        before = memory.max_memory_allocated()
        memory.reset_peak_memory_stats()
        return [before, memory.max_memory_allocated()]

    def warned(function: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = function()
            # Not the function's own: the fake CUDA has no NVML fabric query, which PyTorch's
            # allocator asks about when it makes its first expandable segment.
            own = [w for w in caught if "nvmlDeviceGetGpuFabricInfo" not in str(w.message)]
            return [value, sorted({w.category.__name__ for w in own})]

        return call

    def processes() -> Any:
        import re

        # Each program is a process of its own, with its own pid and its own use of the GPU.
        text = re.sub(r"process\s+\d+", "process PID", memory.list_gpu_processes())
        return re.sub(r"uses\s+[\d.]+ MB", "uses N MB", text)

    def mem_get_info() -> Any:
        free, total = memory.mem_get_info()
        return [0 <= free <= total, total == cuda.get_device_properties(0).total_memory]

    def pluggable() -> Any:
        import ferrocache

        allocator = memory.CUDAPluggableAllocator(str(ferrocache.library_path()), "rust_malloc", "rust_free")
        kept["pluggable"] = allocator
        return type(allocator).__name__

    def change() -> Any:
        memory.change_current_allocator(kept["pluggable"])
        return "changed"

    def mem_pool() -> Any:
        pool = memory.MemPool()
        kept["pool"] = pool
        return [list(pool.id), pool.use_count(), pool.snapshot()]

    def use_mem_pool() -> Any:
        pool = kept["pool"]
        reserved = memory.memory_reserved()
        with memory.use_mem_pool(pool):
            inside = pool.use_count()
            kept["in pool"] = tensor(4 * MIB)
            scratch = tensor(MIB)
            del scratch
        outside = tensor(MIB)
        del outside
        segments = [[s["total_size"], list(s["segment_pool_id"])] for s in pool.snapshot()]
        memory.empty_cache()
        kept_after_empty = [s["total_size"] for s in pool.snapshot()]
        # The pool's lifetime: dropped while a tensor of it lives, its memory stays until the
        # tensor goes, and then returns with empty_cache.
        del kept["pool"], pool
        held = memory.memory_reserved() - reserved
        del kept["in pool"]
        memory.empty_cache()
        return [inside, segments, kept_after_empty, held, memory.memory_reserved() - reserved]

    def pool_arguments() -> Any:
        """use_on_oom and no_split, under a memory fraction that leaves 300 MiB to allocate
        (so that running out of memory costs little on a real GPU too)."""
        memory.empty_cache()
        total = cuda.get_device_properties(0).total_memory
        memory.set_per_process_memory_fraction((memory.memory_reserved() + 300 * MIB) / total)
        last_resort = memory.MemPool(use_on_oom=True)
        whole = memory.MemPool(no_split=True)
        outcome: list[Any] = [list(last_resort.id), list(whole.id), last_resort.use_count()]
        with memory.use_mem_pool(last_resort):
            t = tensor(200 * MIB)
        del t
        try:
            u = tensor(150 * MIB)  # fits only in the pool's cached 200 MiB
            outcome.append(["ok", [[s["total_size"], [[b["size"], b["state"]] for b in s["blocks"]]]
                                   for s in last_resort.snapshot()]])
            del u
        except RuntimeError as err:
            outcome.append([type(err).__name__, str(err).splitlines()[0][:60]])
        with memory.use_mem_pool(whole):
            a, b = tensor(100_000), tensor(100_000)
            outcome.append([[s["total_size"], [[x["size"], x["state"]] for x in s["blocks"]]]
                            for s in sorted(whole.snapshot(), key=lambda s: s["address"])])
        del a, b
        memory.set_per_process_memory_fraction(1.0)
        del last_resort, whole
        memory.empty_cache()
        outcome.append(memory.memory_reserved())
        return outcome

    def settings() -> Any:
        # The two scenarios, with the device's decisions after each change.
        memory.empty_cache()
        steps = []
        a = tensor(30 * MIB)
        memory._set_allocator_settings("expandable_segments:True")
        b = tensor(30 * MIB)
        steps.append([counts(), layout()])
        memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
        del a, b
        memory.empty_cache()
        c = tensor(100 * MIB)
        del c
        d = tensor(10 * MIB)
        steps.append([counts(), layout()])
        del d
        refusals = []
        for bad in ("max_split_size_mb:10", "expandable_segments:true", "no_such_key:1"):
            try:
                memory._set_allocator_settings(bad)
                refusals.append("accepted")
            except (RuntimeError, ValueError) as err:
                refusals.append([type(err).__name__, str(err).splitlines()[0]])
        memory._set_allocator_settings("")
        memory.empty_cache()
        return [steps, refusals]

    def set_metadata() -> Any:
        memory._record_memory_history(max_entries=10000)
        memory._set_memory_metadata({"step": 1, "phase": "forward"})
        t = tensor(2 * MIB)
        memory._set_memory_metadata("")
        u = tensor(2 * MIB)
        del t, u
        return None

    def get_metadata() -> Any:
        memory._set_memory_metadata("layer 3")
        value = memory._get_memory_metadata()
        memory._set_memory_metadata("")
        return [value, memory._get_memory_metadata()]

    def record_history() -> Any:
        memory._record_memory_history(max_entries=10000)
        return None

    def trace() -> list[Any]:
        entries = memory._snapshot()["device_traces"][0]
        return [[e["action"], e["size"], e.get("user_metadata", "")] for e in entries]

    def snapshot() -> Any:
        s = memory._snapshot()
        return [sorted(s), trace()]

    def dump_snapshot() -> Any:
        import pickle

        path = scratch / "snapshot.pickle"
        memory._dump_snapshot(str(path))
        with open(path, "rb") as f:
            dumped = pickle.load(f)
        memory._record_memory_history(enabled=None)
        return sorted(dumped)

    def supported() -> Any:
        return memory._memory_metadata_supported()

    host = {
        name: (lambda name=name: _host_outcome(getattr(memory, name)()))
        for name in ("host_memory_stats", "host_memory_stats_as_nested_dict",
                     "reset_accumulated_host_memory_stats", "reset_peak_host_memory_stats")
    }  # fmt: skip
    return {
        "get_allocator_backend": memory.get_allocator_backend,
        "caching_allocator_alloc": alloc_and_delete,
        "caching_allocator_delete": delete,
        "caching_allocator_enable": enable,
        "caching_allocator_disabled": disabled,
        "set_per_process_memory_fraction": set_fraction,
        "get_per_process_memory_fraction": get_fraction,
        "empty_cache": empty_cache,
        "memory_stats": stats,
        "memory_stats_as_nested_dict": nested,
        "reset_accumulated_memory_stats": reset_accumulated,
        "reset_peak_memory_stats": reset_peak,
        "reset_max_memory_allocated": warned(lambda: memory.reset_max_memory_allocated()),
        "reset_max_memory_cached": warned(lambda: memory.reset_max_memory_cached()),
        **host,
        "memory_allocated": memory.memory_allocated,
        "max_memory_allocated": memory.max_memory_allocated,
        "memory_reserved": memory.memory_reserved,
        "max_memory_reserved": memory.max_memory_reserved,
        "memory_cached": warned(lambda: memory.memory_cached()),
        "max_memory_cached": warned(lambda: memory.max_memory_cached()),
        "memory_snapshot": layout,
        "memory_summary": memory.memory_summary,
        "list_gpu_processes": processes,
        "mem_get_info": mem_get_info,
        "MemPool": mem_pool,
        "use_mem_pool": use_mem_pool,
        "_set_allocator_settings": warned(settings),
        "_record_memory_history": record_history,
        "_set_memory_metadata": set_metadata,
        "_get_memory_metadata": get_metadata,
        "_memory_metadata_supported": supported,
        "_snapshot": snapshot,
        "_dump_snapshot": dump_snapshot,
        "CUDAPluggableAllocator": pluggable,
        "change_current_allocator": change,
        # Not a name of PyTorch's list: use_on_oom and no_split, MemPool's other arguments.
        "MemPool(use_on_oom, no_split)": pool_arguments,
    }


def _host_outcome(value: Any) -> Any:
    """Host (pinned) statistics: their keys, without the times."""
    if isinstance(value, dict):
        return sorted(k for k in value if "time" not in k)
    return value


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return {"value": _plain(call())}
    except Exception as err:  # every outcome is recorded, errors included
        lines = str(err).strip().splitlines()
        return {"error": type(err).__name__, "message": lines[0] if lines else ""}


def _plain(value: Any) -> Any:
    """A JSON-able copy: tuples as lists, keys as strings, floats rounded."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return round(value, 9)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def run_child(allocator: str, scratch: Path) -> dict[str, Any]:
    """Runs every scenario in this process under ``allocator`` ("native" or "ferrocache")."""
    import torch

    if allocator == "ferrocache":
        import ferrocache

        ferrocache.install()
    torch.cuda.init()
    names = _public_names(torch)
    scenarios = _scenarios(torch, scratch)
    outcomes = {name: _outcome(call) for name, call in scenarios.items()}
    return {"names": names, "outcomes": outcomes}


# ------------------------------------------------------------------------------------------------
# The parent: both programs, and the table
# ------------------------------------------------------------------------------------------------


def run_program(allocator: str, env: Optional[dict[str, str]] = None, timeout: float = 600) -> dict[str, Any]:
    """One program in a fresh process; raises RuntimeError with its stderr when it fails."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", allocator, "--scratch", scratch],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the {allocator} program failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(env: Optional[dict[str, str]] = None) -> list[tuple[str, Any, Any, bool]]:
    """Both programs; one row per name, PyTorch's list first: ``(name, native outcome,
    ferrocache outcome, same?)``. A name of PyTorch's list without a scenario has the outcome
    ``{"error": "NoScenario"}`` on both sides and counts as different."""
    native = run_program("native", env)
    ours = run_program("ferrocache", env)
    names = list(native["names"]) + [n for n in native["outcomes"] if n not in native["names"]]
    missing = {"error": "NoScenario", "message": "no scenario in compare.py"}
    rows = []
    for name in names:
        theirs = native["outcomes"].get(name, missing)
        mine = ours["outcomes"].get(name, missing)
        rows.append((name, theirs, mine, theirs == mine and theirs is not missing))
    return rows


def short(outcome: Any, width: int = 70) -> str:
    """An outcome in a table cell."""
    if "error" in outcome:
        text = f"{outcome['error']}: {outcome['message']}"
    else:
        value = outcome["value"]
        if isinstance(value, dict):
            text = f"dict of {len(value)} keys"
        else:
            text = json.dumps(value)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(rows: list[tuple[str, Any, Any, bool]]) -> str:
    same = sum(1 for row in rows if row[3])
    lines = [
        f"{same} of {len(rows)} behave identically.",
        "",
        "| function | PyTorch's allocator | ferrocache | same |",
        "|---|---|---|---|",
    ]
    for name, theirs, mine, equal in rows:
        cell = "same as PyTorch's" if equal else short(mine)
        lines.append(f"| `{name}` | {short(theirs)} | {cell} | {'yes' if equal else '**no**'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the table (the default)")
    parser.add_argument("--json", action="store_true", help="print every outcome in full")
    parser.add_argument("--child", choices=("native", "ferrocache"), help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, Path(args.scratch))))
        return 0
    try:
        rows = compare()
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"compare.py: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"name": n, "native": a, "ferrocache": b, "same": s} for n, a, b, s in rows], indent=1))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
