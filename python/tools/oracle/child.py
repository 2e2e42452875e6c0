"""Runs one allocation program in this process, under PyTorch's allocator or ferrocache, and
says what happened after every op.

:func:`run` is called in a process of its own that has not started CUDA yet: a child that
:mod:`oracle.server` forked for the run (the usual way), or a fresh interpreter
(``python child.py`` with the program on stdin and the result on stdout). The program is
``{"allocator": "native" | "ferrocache", "streams": N, "ops": [...], "history": PATH?,
"layout": "end" | "changes" | "every" | [op indices]}``. The fake driver logs its memory calls
to ``FAKE_CUDA_CALL_LOG`` (set by the harness); after each op this reads the lines the op added,
so every device call is attributed to its op.

The result: ``{"initial": {stats}, "steps": [...], "segments": [layout]}``, one step per op:
``{"calls": [...], "oom": bool, "stats": {keys that changed}, "addr": offset | None,
"layout": [...]?}``. ``addr`` is where an allocation's tensor lies, as an offset from the fake
CUDA's block of device addresses (the same in any process that made the same driver calls;
tests/fake-cuda/README.md); ``stats`` holds only the ``memory_stats()`` keys whose value
changed since the step before (``initial`` for the first). A layout is the segments in address
order, each ``[offset, total_size, segment_type, stream, is_expandable, blocks]`` with blocks
``[offset in segment, size, state, requested_size]``; it is taken after the ops that made device
calls (``changes``), after every op (``every``), after the listed ops, and always at the end.

``"vmm_segments_as_malloc": true`` (ferrocache with ``FERROCACHE_SLEEP=1`` and ordinary
segments): each segment is then a reserved range with one physical allocation mapped into it,
where PyTorch makes one ``cuMemAlloc``. :class:`VmmSegmentsAsMalloc` writes those calls as the
``cuMemAlloc`` / ``cuMemFree`` they stand for, and addresses count from the fake's arena of
reservations: both arenas place by lowest-address first fit, and segments are whole 2 MiB
granules, so the same decisions give the same offsets in either.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any, Callable

import torch

OOM_TEXT = "CUDA out of memory."


def fake_address_base() -> int:
    """The start of the fake CUDA's block of device addresses."""
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_address_base.restype = ctypes.c_uint64
    return int(fake.fake_cuda_address_base())


def fake_reservation_base() -> int:
    """The start of the fake CUDA's arena of ``cuMemAddressReserve`` ranges."""
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_reservation_base.restype = ctypes.c_uint64
    return int(fake.fake_cuda_reservation_base())


class VmmSegmentsAsMalloc:
    """Rewrites the call log of a run whose ordinary segments are VMM-backed (ferrocache's
    sleep-ability) as the calls PyTorch makes for them: ``cuMemAddressReserve rN S +O``,
    ``cuMemCreate S ok``, ``cuMemMap rN 0 S`` is ``cuMemAlloc_v2 S ok +O``; the same with
    ``cuMemCreate S oom`` and ``cuMemAddressFree rN S`` is ``cuMemAlloc_v2 S oom``; and
    ``cuMemUnmap rN 0 S``, ``cuMemAddressFree rN S`` of such a segment is ``cuMemFree_v2 S +O``.
    Any other call stays as it is, so a difference in what was called still shows."""

    def __init__(self) -> None:
        #: Live VMM-backed segments: range name -> (size, offset).
        self.segments: dict[str, tuple[str, str]] = {}

    def __call__(self, calls: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(calls):
            words = calls[i].split()
            following = calls[i + 1 : i + 3]
            if words[0] == "cuMemAddressReserve" and len(words) == 4:
                _, name, size, offset = words
                if following == [f"cuMemCreate {size} ok", f"cuMemMap {name} 0 {size}"]:
                    self.segments[name] = (size, offset)
                    out.append(f"cuMemAlloc_v2 {size} ok {offset}")
                    i += 3
                    continue
                if following == [f"cuMemCreate {size} oom", f"cuMemAddressFree {name} {size}"]:
                    out.append(f"cuMemAlloc_v2 {size} oom")
                    i += 3
                    continue
            if words[0] == "cuMemUnmap" and len(words) == 4 and words[1] in self.segments:
                size, offset = self.segments[words[1]]
                if words[2:] == ["0", size] and following[:1] == [f"cuMemAddressFree {words[1]} {size}"]:
                    del self.segments[words[1]]
                    out.append(f"cuMemFree_v2 {size} {offset}")
                    i += 2
                    continue
            out.append(calls[i])
            i += 1
        return out


def run(program: dict[str, Any]) -> dict[str, Any]:
    use_ferrocache = program["allocator"] == "ferrocache"
    if use_ferrocache:
        import ferrocache
        from ferrocache import _lib

        ferrocache.install()
        stats_of = ferrocache.memory_stats
        # The segments of ferrocache.memory_snapshot(), without resolving stack frames (the
        # programs record none), which costs most of its time.
        raw_segments: Callable[[], list[dict[str, Any]]] = lambda: _lib.call_json("ferrocache_snapshot")["segments"]  # noqa: E731
        record_history = ferrocache.record_memory_history
        dump_snapshot = ferrocache.dump_snapshot
    else:
        stats_of = torch.cuda.memory_stats
        raw_segments = torch.cuda.memory_snapshot
        record_history = torch.cuda.memory._record_memory_history
        dump_snapshot = torch.cuda.memory._dump_snapshot

    torch.cuda.init()
    capacity = program.get("capacity")
    if capacity is not None and torch.cuda.mem_get_info()[1] != capacity:
        raise RuntimeError(f"the fake GPU has {torch.cuda.mem_get_info()[1]} bytes, not {capacity}")
    base = fake_address_base()
    as_malloc = VmmSegmentsAsMalloc() if use_ferrocache and program.get("vmm_segments_as_malloc") else None
    if as_malloc is not None:
        base = fake_reservation_base()
    streams = [torch.cuda.default_stream()] + [torch.cuda.Stream() for _ in range(program["streams"] - 1)]
    stream_index = {s.cuda_stream: i for i, s in enumerate(streams)}
    log = open(os.environ["FAKE_CUDA_CALL_LOG"], encoding="utf-8")
    log.read()  # what CUDA's initialisation did is not the program's

    def layout() -> list[Any]:
        segments = [segment_layout(s, base, stream_index) for s in raw_segments()]
        segments.sort(key=lambda s: s[0])
        return segments

    mode = program.get("layout", "end")
    layout_at = set(mode) if isinstance(mode, list) else set()
    tensors: dict[int, Any] = {}
    steps = []
    previous = dict(stats_of())
    initial = previous
    for index, op in enumerate(program["ops"]):
        oom = False
        address = None
        kind = op["op"]
        if kind == "alloc":
            try:
                with torch.cuda.stream(streams[op["stream"]]):
                    # Held by the table only: a free must release it at once.
                    tensors[op["id"]] = torch.empty(op["size"], dtype=torch.uint8, device="cuda")
                address = tensors[op["id"]].data_ptr() - base
            except RuntimeError as err:  # torch.OutOfMemoryError is one
                if OOM_TEXT not in str(err):
                    raise
                oom = True
        elif kind == "free":
            tensors.pop(op["id"], None)
        elif kind == "record_stream":
            if op["id"] in tensors:
                tensors[op["id"]].record_stream(streams[op["stream"]])
        elif kind == "empty_cache":
            torch.cuda.empty_cache()
        elif kind == "fraction":
            torch.cuda.set_per_process_memory_fraction(op["value"])
        elif kind == "settings":
            torch.cuda.memory._set_allocator_settings(op["value"])
        elif kind == "history":
            if op.get("stacks", True):
                record_history(max_entries=1_000_000)
            else:  # no stack frames: small recordings, for committed test data
                record_history(context=None, stacks="python", max_entries=1_000_000)
        else:
            raise ValueError(f"unknown op {kind!r}")
        calls = log.read().splitlines()
        if as_malloc is not None:
            calls = as_malloc(calls)
        stats = dict(stats_of())
        step: dict[str, Any] = {
            "calls": calls,
            "oom": oom,
            "stats": {k: v for k, v in stats.items() if previous.get(k) != v},
            "addr": address,
        }
        previous = stats
        if mode == "every" or index in layout_at or (mode == "changes" and calls):
            step["layout"] = layout()
        steps.append(step)

    if program.get("history"):
        dump_snapshot(program["history"])
    return {"initial": initial, "steps": steps, "segments": layout()}


def segment_layout(segment: dict[str, Any], base: int, stream_index: dict[int, int]) -> list[Any]:
    """A snapshot segment by offsets from the fake's base: ``[offset, total_size, segment_type,
    stream, is_expandable, [[offset in segment, size, state, requested_size], ...]]``."""
    start = segment["address"]
    return [
        start - base,
        segment["total_size"],
        segment.get("segment_type"),
        stream_index.get(segment["stream"], segment["stream"]),
        bool(segment.get("is_expandable", False)),
        [[b["address"] - start, b["size"], b["state"], b.get("requested_size", 0)] for b in segment["blocks"]],
    ]


def main() -> None:
    json.dump(run(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
