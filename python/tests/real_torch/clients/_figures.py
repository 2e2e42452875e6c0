"""What every client writes: its memory figures, the same under PyTorch's allocator and under
ferrocache (``ferrocache run`` answers ``torch.cuda.memory_stats`` once it has installed itself).

A client calls :func:`step` after each step of its work and :func:`write` at the end; the JSON
goes to the path in ``argv[1]`` or ``CLIENT_FIGURES``, where ``{rank}`` is the rank of a job.
The client's code never names ferrocache: which allocator served is read here, from whether
``ferrocache run`` imported and installed it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

_steps: list[dict[str, Any]] = []
_extra: dict[str, Any] = {}


def step(label: str) -> None:
    """Records the bytes allocated after a step, once the device has finished it."""
    torch.cuda.synchronize()
    _steps.append({"step": label, "allocated": torch.cuda.memory_allocated()})


def note(key: str, value: Any) -> None:
    """A figure of the client's own (addresses a replay used, tokens generated, ...)."""
    _extra[key] = value


def figures(device: int = 0) -> dict[str, Any]:
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "peak_requested": stats["requested_bytes.all.peak"],
        "allocations": stats["allocation.all.allocated"],
        "segments": stats["segment.all.allocated"],
        "peak_segments": stats["segment.all.peak"],
        "device_allocs": stats["num_device_alloc"],
        "device_frees": stats["num_device_free"],
        "retries": stats["num_alloc_retries"],
        "ooms": stats["num_ooms"],
        "allocated_at_end": stats["allocated_bytes.all.current"],
        "reserved_at_end": stats["reserved_bytes.all.current"],
    }


def write(device: int = 0) -> None:
    torch.cuda.synchronize(device)
    ferrocache = sys.modules.get("ferrocache")
    installed = ferrocache is not None and ferrocache.is_installed()
    out = {
        "allocator": "ferrocache" if installed else "native",
        "figures": figures(device),
        "steps": _steps,
        "extra": _extra,
    }
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ["CLIENT_FIGURES"]
    # One file per rank in a job of several (torchrun sets RANK).
    path = path.replace("{rank}", os.environ.get("RANK", "0"))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
