"""Runs one allocation program in this process, under PyTorch's allocator or ferrocache, and
prints what happened as one JSON document on stdout.

Run by :mod:`oracle.harness` under ``scripts/with-fake-cuda`` with the program on stdin:
``{"allocator": "native" | "ferrocache", "streams": N, "ops": [...], "history": PATH?}``.
The fake driver logs its memory calls to ``FAKE_CUDA_CALL_LOG`` (set by the harness); after
each op this reads the lines the op added, so every device call is attributed to its op.

Out: ``{"steps": [{"calls": [...], "oom": bool, "stats": {...}}, ...], "segments": [...]}``,
one step per op; ``segments`` is the final snapshot's layout without addresses.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

OOM_TEXT = "CUDA out of memory."


def main() -> None:
    program = json.load(sys.stdin)
    use_ferrocache = program["allocator"] == "ferrocache"
    if use_ferrocache:
        import ferrocache

        ferrocache.install()
        stats_of = ferrocache.memory_stats
        segments_of = lambda: ferrocache.snapshot()["segments"]  # noqa: E731
        record_history = ferrocache.record_memory_history
        dump_snapshot = ferrocache.dump_snapshot
    else:
        stats_of = torch.cuda.memory_stats
        segments_of = torch.cuda.memory_snapshot
        record_history = torch.cuda.memory._record_memory_history
        dump_snapshot = torch.cuda.memory._dump_snapshot

    torch.cuda.init()
    streams = [torch.cuda.default_stream()] + [torch.cuda.Stream() for _ in range(program["streams"] - 1)]
    stream_index = {s.cuda_stream: i for i, s in enumerate(streams)}
    log = open(os.environ["FAKE_CUDA_CALL_LOG"], encoding="utf-8")
    log.read()  # what CUDA's initialisation did is not the program's

    tensors: dict[int, Any] = {}
    steps = []
    for op in program["ops"]:
        oom = False
        kind = op["op"]
        if kind == "alloc":
            try:
                with torch.cuda.stream(streams[op["stream"]]):
                    tensors[op["id"]] = torch.empty(op["size"], dtype=torch.uint8, device="cuda")
            except RuntimeError as err:  # torch.OutOfMemoryError is one
                if OOM_TEXT not in str(err):
                    raise
                oom = True
        elif kind == "free":
            tensors.pop(op["id"], None)
        elif kind == "record_stream":
            tensor = tensors.get(op["id"])
            if tensor is not None:
                tensor.record_stream(streams[op["stream"]])
        elif kind == "empty_cache":
            torch.cuda.empty_cache()
        elif kind == "fraction":
            torch.cuda.set_per_process_memory_fraction(op["value"])
        elif kind == "history":
            if op.get("stacks", True):
                record_history(max_entries=1_000_000)
            else:  # no stack frames: small recordings, for committed test data
                record_history(context=None, stacks="python", max_entries=1_000_000)
        else:
            raise ValueError(f"unknown op {kind!r}")
        calls = log.read().splitlines()
        steps.append({"calls": calls, "oom": oom, "stats": dict(stats_of())})

    if program.get("history"):
        dump_snapshot(program["history"])
    segments = [layout(s, stream_index) for s in segments_of()]
    segments.sort(key=lambda s: json.dumps(s, sort_keys=True))
    json.dump({"steps": steps, "segments": segments}, sys.stdout)


def layout(segment: dict[str, Any], stream_index: dict[int, int]) -> dict[str, Any]:
    """A snapshot segment without addresses: its size, kind, stream and blocks by offset."""
    base = segment["address"]
    return {
        "total_size": segment["total_size"],
        "segment_type": segment.get("segment_type"),
        "stream": stream_index.get(segment["stream"], segment["stream"]),
        "is_expandable": bool(segment.get("is_expandable", False)),
        "blocks": [
            [block["address"] - base, block["size"], block["state"], block.get("requested_size", 0)]
            for block in segment["blocks"]
        ],
    }


if __name__ == "__main__":
    main()
