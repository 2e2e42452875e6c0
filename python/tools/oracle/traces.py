"""Recorded memory snapshots as oracle programs (``scripts/oracle --trace SNAPSHOT...``).

``ferrocache ops SNAPSHOT`` writes the program of a recording from the replayer's one
reconstruction (src/replay/program.rs): the allocations live when recording began, in address
order, then every alloc, free, ``empty_cache()`` and out-of-memory of the trace. Here each op
becomes an op of :mod:`oracle.child`: an alloc is ``torch.empty(size, dtype=torch.uint8)`` on its
recorded stream (handle 0 is the default stream; the others become ``torch.cuda.Stream()``s in
order of first use), a free drops the tensor, and a request PyTorch could not serve is tried
again (and its tensor dropped at once, should it succeed here). Both allocators run the program
on a fake GPU with room for it (:func:`capacity_for`), under each of :data:`TRACE_SETTINGS`.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .harness import GIB, Case, capacity_for_peak, ferrocache_command

#: The settings a recording runs under: (name, PYTORCH_CUDA_ALLOC_CONF, memory limit). The
#: limit is a multiple of the recording's own peak reserved bytes, set as a memory fraction by
#: the program's first op: 0.9 runs out of memory (retries, releases of cached blocks and
#: out-of-memory errors on the recording's own shapes); above 1, garbage collection runs.
TRACE_SETTINGS: tuple[tuple[str, str, Optional[float]], ...] = (
    ("defaults", "", None),
    ("expandable", "expandable_segments:True", None),
    ("max_split_200_rounding_64", "max_split_size_mb:200,max_non_split_rounding_mb:64", None),
    ("max_split_32", "max_split_size_mb:32", None),
    ("roundup_4", "roundup_power2_divisions:4", None),
    ("roundup_list", "roundup_power2_divisions:[256:1,512:2,>:8]", None),
    ("gc_0.6_limit_1.1", "garbage_collection_threshold:0.6", 1.1),
    ("gc_0.8_max_split_100_limit_1.05", "garbage_collection_threshold:0.8,max_split_size_mb:100", 1.05),
    ("limit_0.9", "", 0.9),
    ("expandable_limit_0.9", "expandable_segments:True", 0.9),
)


@dataclass
class TraceProgram:
    """One device's program of a recording, as ``ferrocache ops`` wrote it."""

    name: str
    ops: list[dict[str, Any]]
    streams: int
    figures: dict[str, Any]
    consistent: bool
    #: How many of the first ops allocate the blocks live when recording began.
    start_allocations: int = 0


def load(path: str) -> list[TraceProgram]:
    """The programs of the snapshot at ``path``, one per device it used."""
    process = subprocess.run([ferrocache_command(), "ops", path], capture_output=True, text=True, timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"ferrocache ops {path} failed:\n{process.stderr}")
    programs = []
    for line in process.stdout.splitlines():
        exported = json.loads(line)
        name = Path(path).name
        if exported["device"] != 0 or len(process.stdout.splitlines()) > 1:
            name += f" (device {exported['device']})"
        ops, streams = child_ops(exported["ops"])
        programs.append(
            TraceProgram(name, ops, streams, exported["figures"], exported["consistent"], exported["start_allocations"])
        )
    return programs


def child_ops(exported: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The exported ops as :mod:`oracle.child` ops, and how many streams they use."""
    streams = {0: 0}
    next_id = 1 + max((op["id"] for op in exported if "id" in op), default=0)
    ops: list[dict[str, Any]] = []
    for op in exported:
        kind = op["op"]
        if kind in ("alloc", "oom"):
            stream = streams.setdefault(op["stream"], len(streams))
            if kind == "alloc":
                ops.append({"op": "alloc", "id": op["id"], "size": op["size"], "stream": stream})
            else:  # tried again; should it succeed here, the program never had it
                ops.append({"op": "alloc", "id": next_id, "size": op["size"], "stream": stream})
                ops.append({"op": "free", "id": next_id})
                next_id += 1
        elif kind == "free":
            ops.append({"op": "free", "id": op["id"]})
        elif kind == "empty_cache":
            ops.append({"op": "empty_cache"})
        else:
            raise ValueError(f"ferrocache ops wrote an op this harness does not know: {op}")
    return ops, len(streams)


def capacity_for(program: TraceProgram) -> int:
    """The fake GPU's memory for a recording (a snapshot does not say which GPU it came from):
    twice the peak PyTorch reserved while recording, in whole GiB, at least 1 GiB. Settings other
    than the recorded ones, and a start laid out afresh, may need more than the recording did;
    fake memory costs only what is written, and nothing here writes."""
    peak = max(program.figures["peak_reserved"], program.figures["reserved_at_start"], 1)
    return capacity_for_peak(peak)


def trace_case(program: TraceProgram, setting: tuple[str, str, Optional[float]], layout: str = "changes") -> Case:
    """``program`` under ``setting``, ready for :func:`oracle.harness.compare`."""
    name, conf, limit = setting
    capacity = capacity_for(program)
    ops = list(program.ops)
    if limit is not None:
        peak = max(program.figures["peak_reserved"], 1)
        ops.insert(0, {"op": "fraction", "value": min(1.0, limit * peak / capacity)})
    return Case(0, name, conf, capacity, program.streams, 0, ops, program=f"trace {program.name}", layout=layout)


def settings_named(names: Optional[list[str]]) -> list[tuple[str, str, Optional[float]]]:
    if not names:
        return list(TRACE_SETTINGS)
    known = {s[0]: s for s in TRACE_SETTINGS}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"no trace setting {missing}; the settings are {list(known)}")
    return [known[n] for n in names]


def replay_in_step(program: TraceProgram, setting: tuple[str, str, Optional[float]]) -> dict[str, Any]:
    """Issue 20, item 5: the replay stays in step with PyTorch on the recording's own shapes.
    Drives ``program`` through PyTorch's allocator under ``setting``, recording history from the
    end of its start allocations (so the recording begins with the blocks live at the start, as
    a recording made mid-run does), then replays that recording with ``ferrocache replay --json``
    under the same setting, memory fraction and GPU size. Returns the replay's row: its
    ``matching_segment_allocs`` of ``native_segment_allocs`` and both peaks."""
    from .harness import replay_native_recording

    case = trace_case(program, setting)
    start = program.start_allocations + (1 if case.ops and case.ops[0]["op"] == "fraction" else 0)
    case.ops.insert(start, {"op": "history", "stacks": False})
    conf = case.conf
    if case.ops[0]["op"] == "fraction":
        fraction = case.ops[0]["value"]
        conf = ",".join(part for part in (conf, f"per_process_memory_fraction:{fraction!r}") if part)
    capacity = ("--capacity-gib", str(case.capacity // GIB))
    return replay_native_recording(case, conf, capacity, timeout=600)["row"]


def in_step(row: dict[str, Any]) -> bool:
    """Every segment decision PyTorch made, and no other, at PyTorch's peak."""
    return (
        row["matching_segment_allocs"] == row["native_segment_allocs"] == row["segment_allocs"]
        and row["peak_reserved_bytes"] == row["native_peak_reserved_bytes"]
    )
