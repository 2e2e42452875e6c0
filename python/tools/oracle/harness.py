"""PyTorch's own allocator as the oracle: the same allocation program, run once under PyTorch's
caching allocator and once under ferrocache, each in a process of its own on the same fake GPU
with the same ``PYTORCH_CUDA_ALLOC_CONF``, must give, after every op, the same device calls (with
their offsets in the fake's address range), the same address for each allocation, the same
``memory_stats()``, the same out-of-memory points, and the same segment and block layout.

A program is a list of ops (JSON): ``alloc`` (``torch.empty`` of ``size`` bytes on stream
``stream``, named ``id``), ``free``, ``record_stream``, ``empty_cache``, ``fraction``
(``set_per_process_memory_fraction``), ``settings`` (``_set_allocator_settings`` of ``value``,
the settings changed at run time). :func:`random_program` draws one from a seed,
:mod:`oracle.shapes` draws one shaped like training, :mod:`oracle.traces` makes one of a recorded
snapshot; :func:`compare` runs it both ways and returns the first divergence, or None.

Needs real PyTorch on the fake CUDA: run under ``scripts/with-fake-cuda`` (``scripts/oracle``).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from .runner import run_programs

MIB = 1 << 20
GIB = 1 << 30

#: The settings the random programs run under: (name, PYTORCH_CUDA_ALLOC_CONF, fraction or None).
#: A fraction is set by the program's first op (garbage collection acts only under one).
SETTINGS: tuple[tuple[str, str, Optional[float]], ...] = (
    ("defaults", "", None),
    ("max_split_64", "max_split_size_mb:64", None),
    ("max_split_300_rounding_40", "max_split_size_mb:300,max_non_split_rounding_mb:40", None),
    ("roundup_4", "roundup_power2_divisions:4", None),
    ("roundup_list", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", None),
    ("gc_0.6_fraction_0.7", "garbage_collection_threshold:0.6", 0.7),
    ("gc_0.8_max_split_100", "garbage_collection_threshold:0.8,max_split_size_mb:100", 0.9),
    ("fraction_0.5", "", 0.5),
    ("expandable", "expandable_segments:True", None),
    ("expandable_roundup_2", "expandable_segments:True,roundup_power2_divisions:2", None),
    # PyTorch 2.15's keys: a smaller address range per expandable segment; device allocations
    # past the whole device, or past a configured fraction below the one set at run time,
    # refused at once (throw_on_cudamalloc_oom).
    ("expandable_reserve_0.3", "expandable_segments:True,expandable_segments_reserve:0.3", None),
    ("throw_on_oom", "throw_on_cudamalloc_oom:True", None),
    ("throw_on_oom_fraction_0.5", "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True", 0.8),
)


@dataclass
class Case:
    """One program under one setting."""

    seed: int
    setting: str
    conf: str
    capacity: int
    streams: int
    event_delay: int
    ops: list[dict[str, Any]]
    #: Named departures met while comparing (see :data:`EVENT_ORDER`), with their op.
    departures: list[str] = field(default_factory=list)
    #: What the program is, when not a random program of :func:`random_program`.
    program: str = ""
    #: When the block layouts are compared: "every" op, the ops that made device "changes", or
    #: only the "end" (always compared too).
    layout: str = "every"
    #: ferrocache runs with sleep-ability on from the start (``FERROCACHE_SLEEP=1``), never
    #: used: its ordinary segments are VMM-backed, its decisions must stay PyTorch's.
    sleep_ability: bool = False

    def describe(self) -> str:
        what = self.program or f"seed {self.seed}"
        sleep = ", FERROCACHE_SLEEP=1" if self.sleep_ability else ""
        return (
            f"{what}, setting {self.setting} (PYTORCH_CUDA_ALLOC_CONF={self.conf!r}{sleep}), "
            f"capacity {self.capacity >> 20} MiB, {self.streams} streams, event delay "
            f"{self.event_delay}, {len(self.ops)} ops"
        )


def capacity_for_peak(peak: int) -> int:
    """A fake GPU's memory for a program whose peak is ``peak`` bytes: twice it, in whole GiB,
    at least 1 GiB."""
    return max(GIB, -(-2 * peak // GIB) * GIB)


def random_size(rng: random.Random, capacity: int) -> int:
    """1 byte to a few GiB, log-uniform, with PyTorch's boundaries (1 MiB, 10 MiB) common."""
    roll = rng.random()
    if roll < 0.05:
        return rng.choice([1, 511, 512, 513, MIB - 1, MIB, MIB + 1, 10 * MIB, 10 * MIB + 1])
    if roll < 0.08:
        return rng.randint(capacity // 2, capacity + capacity // 2)  # near or past the capacity
    return max(1, int(2 ** rng.uniform(0, 29.5)))


def random_program(seed: int, setting: tuple[str, str, Optional[float]], length: int = 160) -> Case:
    """A program shaped like training: bursts of allocations, most of them freed soon after,
    some kept; on several streams, with record_stream and the odd empty_cache."""
    name, conf, fraction = setting
    rng = random.Random(f"{seed}/{name}")
    capacity = rng.choice([1, 2, 3]) * GIB
    streams = rng.randint(1, 3)
    ops: list[dict[str, Any]] = []
    if fraction is not None:
        ops.append({"op": "fraction", "value": fraction})
    live: list[int] = []
    next_id = 0
    for _ in range(length):
        roll = rng.random()
        if roll < 0.5 or not live:
            ops.append({"op": "alloc", "id": next_id, "size": random_size(rng, capacity), "stream": rng.randrange(streams)})
            live.append(next_id)
            next_id += 1
        elif roll < 0.9:
            # Mostly the newest (activations freed in reverse), sometimes any.
            index = len(live) - 1 - min(len(live) - 1, int(rng.expovariate(0.7)))
            if rng.random() < 0.2:
                index = rng.randrange(len(live))
            ops.append({"op": "free", "id": live.pop(index)})
        elif roll < 0.95 and streams > 1:
            ops.append({"op": "record_stream", "id": rng.choice(live), "stream": rng.randrange(streams)})
        elif roll < 0.975:
            ops.append({"op": "empty_cache"})
        else:
            ops.append({"op": "fraction", "value": fraction or rng.choice([0.6, 0.8, 1.0])})
    event_delay = rng.choice([0, 0, 2])
    return Case(seed, name, conf, capacity, streams, event_delay, ops)


def environment(case: Case) -> dict[str, Optional[str]]:
    """What a run of ``case`` sets in its process's environment (None: unset)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": case.conf,
        "PYTORCH_ALLOC_CONF": None,
        "FAKE_LIBCUDA_TOTAL_MEM": str(case.capacity),
        "FAKE_LIBCUDA_EVENT_DELAY": str(case.event_delay),
        "FAKE_CUDA_QUIET": "1",
        "TORCH_CUDA_ALLOC_LOG_LEVEL": "ERROR",
        # Read by ferrocache only.
        "FERROCACHE_SLEEP": "1" if case.sleep_ability else None,
    }


def program_of(case: Case, allocator: str, history: Optional[str] = None, layout: Any = None) -> dict[str, Any]:
    """What :mod:`oracle.child` runs for ``case`` under ``allocator`` ("native" or "ferrocache")."""
    return {
        "allocator": allocator,
        "streams": case.streams,
        "ops": case.ops,
        "history": history,
        "capacity": case.capacity,
        "layout": case.layout if layout is None else layout,
        # With expandable segments, sleep-ability changes no device call: the segments are
        # reserved ranges either way.
        "vmm_segments_as_malloc": case.sleep_ability and "expandable_segments:True" not in case.conf,
    }


def run_program(case: Case, allocator: str, history: Optional[str] = None, timeout: float = 900) -> dict[str, Any]:
    """Runs ``case`` in a process of its own under ``allocator`` ("native" or "ferrocache")."""
    return run_programs([(environment(case), program_of(case, allocator, history))], timeout)[0]


def run_both(case: Case, layout: Any = None, timeout: float = 900) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``case`` under PyTorch's allocator and under ferrocache, side by side."""
    env = environment(case)
    native, ours = run_programs(
        [(env, program_of(case, "native", layout=layout)), (env, program_of(case, "ferrocache", layout=layout))],
        timeout,
    )
    return native, ours


@dataclass
class Divergence:
    """The first op at which the two runs differ, and both sides' state there."""

    case: Case
    step: Optional[int]  # None: only the final snapshots differ; -1: CUDA's start-up
    what: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.step is None:
            where = "the final snapshot"
        elif self.step < 0:
            where = "CUDA's start-up, before the first op"
        else:
            where = f"op {self.step}: {self.case.ops[self.step]}"
        lines = [f"{self.case.describe()}", f"first divergence at {where}"]
        if self.step is not None and self.step > 0:
            lines.append(f"ops before it: {self.case.ops[max(0, self.step - 5):self.step]}")
        lines += [f"  {w}" for w in self.what]
        return "\n".join(lines)


#: Departure "event order": when one malloc (or empty_cache) finds the record_stream events of
#: blocks on two or more streams complete, PyTorch frees those blocks in the order of its
#: per-stream event queues, a ska::flat_hash_map keyed by stream (hash order), ferrocache in its
#: own order. The blocks, the device calls and every current value end the same; what the order
#: of the merges leaves behind can differ: the inactive-split statistics' high-water marks and
#: accumulated counts (a merge counts a split block once more or less on the way), and the stale
#: requested size of the free block the merges made (PyTorch keeps the struct of the block freed
#: last). Once met, those keys and the requested sizes of inactive blocks are left out (a peak or a
#: count stays different). Pinned by test_oracle.py::test_the_event_order_departure_is_recognised.
EVENT_ORDER = "event order"
EVENT_ORDER_KEYS = frozenset(
    f"{name}.{pool}.{kind}"
    for name in ("inactive_split", "inactive_split_bytes")
    for pool in ("all", "large_pool", "small_pool")
    for kind in ("peak", "allocated", "freed")
)


def without_stale_sizes(layout: list[Any]) -> list[Any]:
    """The layout with the requested sizes of inactive blocks (stale: what the last request of
    the block's struct asked for) left out."""
    return [
        segment[:5] + [[[b[0], b[1], b[2], b[3] if b[2] != "inactive" else None] for b in segment[5]]]
        for segment in layout
    ]


def blocks_released_by_events(case: Case, index: int, before: dict[str, int], after: dict[str, int], oom: bool) -> int:
    """How many blocks waiting for events the op at ``index`` freed, from PyTorch's statistics
    ``before`` and ``after`` it."""
    op = case.ops[index]
    allocated = 1 if op["op"] == "alloc" and not oom else 0
    freed = 1 if op["op"] == "free" else 0
    return before.get("active.all.current", 0) + allocated - freed - after.get("active.all.current", 0)


def running_stats(result: dict[str, Any]) -> Iterator[dict[str, int]]:
    """Each step's whole ``memory_stats()`` in turn (a run's steps hold only what changed)."""
    stats = dict(result["initial"])
    for step in result["steps"]:
        stats = {**stats, **step["stats"]}
        yield stats


def full_stats(result: dict[str, Any]) -> list[dict[str, int]]:
    """Every step's whole ``memory_stats()`` (a run's steps hold only what changed)."""
    return list(running_stats(result))


def diff_stats(native: dict[str, int], ours: dict[str, int], ignored: frozenset[str] = frozenset()) -> list[str]:
    """Every key of PyTorch's memory_stats() whose value ferrocache does not have."""
    out = []
    for key, value in native.items():
        if key in ignored:
            continue
        if key not in ours:
            out.append(f"stat {key}: pytorch {value}, ferrocache has no such key")
        elif ours[key] != value:
            out.append(f"stat {key}: pytorch {value}, ferrocache {ours[key]}")
    return out


def collapsed(calls: list[str]) -> list[str]:
    """Runs of the same call as one entry ("cuMemCreate 20971520 ok x57")."""
    out: list[str] = []
    count = 0
    for i, call in enumerate(calls):
        count += 1
        if i + 1 == len(calls) or calls[i + 1] != call:
            out.append(call if count == 1 else f"{call} x{count}")
            count = 0
    return out


def diff_calls(native: list[str], ours: list[str]) -> list[str]:
    """Where the two lists of device calls part, with a little context, runs collapsed."""
    common = 0
    while common < min(len(native), len(ours)) and native[common] == ours[common]:
        common += 1
    start = max(0, common - 2)
    return [
        f"device calls agree for {common}, then: pytorch {collapsed(native[start:])[:12]}",
        f"  ferrocache {collapsed(ours[start:])[:12]}",
    ]


def offset(value: Optional[int]) -> str:
    return "none" if value is None else f"+{value:#x}"


def diff_layouts(native: list[Any], ours: list[Any], limit: int = 6) -> list[str]:
    """The segments (by offset from the fake's base) that the two layouts do not share."""
    theirs = {json.dumps(s) for s in ours}
    mine = {json.dumps(s) for s in native}
    only_native = [s for s in native if json.dumps(s) not in theirs]
    only_ours = [s for s in ours if json.dumps(s) not in mine]
    lines = [f"block layout: {len(native)} segments under pytorch, {len(ours)} under ferrocache; differing:"]
    lines += [f"  pytorch    {describe_segment(s)}" for s in only_native[:limit]]
    lines += [f"  ferrocache {describe_segment(s)}" for s in only_ours[:limit]]
    return lines


def describe_segment(segment: list[Any]) -> str:
    start, size, kind, stream, expandable, blocks = segment
    states = {"active_allocated": "A", "active_pending_free": "P", "inactive": "i"}
    shown = ", ".join(f"{b[0]:#x}:{b[1]}:{states.get(b[2], b[2])}:{b[3]}" for b in blocks[:24])
    more = f", ... {len(blocks) - 24} more" if len(blocks) > 24 else ""
    return (
        f"+{start:#x} {size} bytes, {kind}, stream {stream}{', expandable' if expandable else ''}: "
        f"[{shown}{more}] (offset:size:state:requested; A active, P pending free, i inactive)"
    )


def first_divergence(case: Case, native: dict[str, Any], ours: dict[str, Any]) -> Optional[Divergence]:
    """The first op after which the runs differ (None: they agree throughout)."""
    stats_native = dict(native["initial"])
    initial = diff_stats(stats_native, dict(ours["initial"]))
    if initial:
        return Divergence(case, -1, initial)
    ignored: frozenset[str] = frozenset()
    strip: Callable[[list[Any]], list[Any]] = lambda layout: layout  # noqa: E731
    steps = zip(native["steps"], ours["steps"], running_stats(native), running_stats(ours))
    for index, (a, b, after_native, stats_ours) in enumerate(steps):
        before, stats_native = stats_native, after_native
        what = []
        if a["calls"] != b["calls"]:
            what += diff_calls(a["calls"], b["calls"])
        if a["oom"] != b["oom"]:
            what.append(f"out of memory: pytorch {a['oom']}, ferrocache {b['oom']}")
        if a["addr"] != b["addr"]:
            what.append(f"the allocation's address (from the fake's base): pytorch {offset(a['addr'])}, ferrocache {offset(b['addr'])}")
        # Until here the runs agreed on every key, so only keys that changed can differ now.
        changed = a["stats"].keys() | b["stats"].keys()
        stats = diff_stats({k: stats_native[k] for k in changed if k in stats_native}, stats_ours, ignored)
        layouts_differ = "layout" in a and "layout" in b and strip(a["layout"]) != strip(b["layout"])
        only_event_order = all(line.split(":")[0][len("stat ") :] in EVENT_ORDER_KEYS for line in stats) and (
            stats or layouts_differ
        )
        if (
            not what
            and only_event_order
            and (not layouts_differ or without_stale_sizes(a["layout"]) == without_stale_sizes(b["layout"]))
            and blocks_released_by_events(case, index, before, stats_native, a["oom"]) >= 2
        ):
            case.departures.append(f"{EVENT_ORDER} at op {index}")
            ignored = EVENT_ORDER_KEYS
            strip = without_stale_sizes
            stats = []
            layouts_differ = False
        what += stats
        if layouts_differ:
            what += diff_layouts(a["layout"], b["layout"])
        if what:
            return Divergence(case, index, what)
    if strip(native["segments"]) != strip(ours["segments"]):
        return Divergence(case, None, diff_layouts(native["segments"], ours["segments"]))
    return None


def ops_compared(case: Case, divergence: Optional[Divergence]) -> int:
    """How many ops the comparison went through (all of them when the runs agree)."""
    if divergence is None or divergence.step is None:
        return len(case.ops)
    return max(0, divergence.step + 1)


def with_layouts(case: Case, divergence: Divergence) -> Divergence:
    """The divergence with both block layouts before and after its op, from a second pair of
    runs that take them there (the first compared layouts only where ``case.layout`` says)."""
    if divergence.step is None or divergence.step < 0:
        return divergence
    if any(line.startswith("block layout") for line in divergence.what):
        return divergence
    at = [i for i in (divergence.step - 1, divergence.step) if i >= 0]
    native, ours = run_both(case, layout=at)
    lines = []
    for i in at:
        a, b = native["steps"][i].get("layout"), ours["steps"][i].get("layout")
        label = "before the op" if i < divergence.step else "after the op"
        if a == b:
            lines.append(f"block layout {label}: the same ({len(a or [])} segments)")
        else:
            lines += [f"{label}: {line}" for line in diff_layouts(a or [], b or [])]
    return Divergence(divergence.case, divergence.step, divergence.what + lines)


def compare(case: Case, explain: bool = True) -> Optional[Divergence]:
    """Runs ``case`` under both allocators; the first divergence, or None when they agree. With
    ``explain``, a divergence carries both block layouts around its op."""
    native, ours = run_both(case)
    divergence = first_divergence(case, native, ours)
    if divergence is not None and explain:
        divergence = with_layouts(case, divergence)
    return divergence


def training_program(seed: int, setting: tuple[str, str, Optional[float]], steps: int = 6, streams: int = 1) -> Case:
    """A program shaped like training steps, for recordings: weights kept, then per step
    activations allocated and freed in reverse, gradients, an optimizer state; history
    recording starts after the first step and is followed at once by ``empty_cache()`` (so the
    recording begins with a burst of ``segment_free``). With several ``streams``, each
    allocation after the weights is on a stream drawn at random."""
    name, conf, fraction = setting
    rng = random.Random(f"training/{seed}/{name}")
    ops: list[dict[str, Any]] = []
    ids = iter(range(1_000_000))
    weights_done = False

    def alloc(size: int) -> int:
        i = next(ids)
        stream = rng.randrange(streams) if streams > 1 and weights_done else 0
        ops.append({"op": "alloc", "id": i, "size": size, "stream": stream})
        return i

    weights = [alloc(rng.choice([4, 16, 64]) * rng.randint(1, 8) * 1024 * rng.randint(1, 64)) for _ in range(12)]
    weights_done = True
    for step in range(steps):
        if step == 1:
            ops.append({"op": "history"})
            ops.append({"op": "empty_cache"})
        batch = rng.choice([1, 2, 3])
        activations = [alloc(batch * rng.randint(1, 40) * MIB // rng.choice([1, 3, 7])) for _ in range(10)]
        scratch = [alloc(rng.randint(1, 600_000)) for _ in range(6)]
        for i in scratch:
            ops.append({"op": "free", "id": i})
        grads = []
        for a in reversed(activations):
            grads.append(alloc(rng.randint(1, 30) * MIB))
            ops.append({"op": "free", "id": a})
        for g in grads:
            ops.append({"op": "free", "id": g})
    del weights
    return Case(seed, name, conf, 4 * GIB, streams, 0, ops)


def ferrocache_command() -> str:
    """The ``ferrocache`` command: the one on the PATH (the venv's), else the bare name."""
    return shutil.which("ferrocache") or "ferrocache"


def replay_native_recording(
    case: Case, conf: Optional[str] = None, extra_args: Sequence[str] = (), timeout: float = 300
) -> dict[str, Any]:
    """Records ``case`` under PyTorch's allocator and replays the recording with ferrocache
    (``ferrocache replay --json --conf CONF EXTRA_ARGS...``, ``CONF`` by default the case's);
    returns the replay's row and the native run."""
    with tempfile.TemporaryDirectory(prefix="oracle-replay-") as scratch:
        recording = str(Path(scratch) / "native.pickle")
        native = run_program(case, "native", history=recording)
        conf = case.conf if conf is None else conf
        command = [ferrocache_command(), "replay", recording, "--json", "--conf", conf, *extra_args]
        process = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if process.returncode != 0:
            raise RuntimeError(f"ferrocache replay failed:\n{process.stdout}\n{process.stderr}")
        rows = [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]
    return {"row": rows[0], "native": native}


#: The native recordings committed as replay test data (tests/data/oracle, see
#: tests/replay.rs), made by ``scripts/oracle --record tests/data/oracle``.
RECORDINGS = (("training_defaults", "defaults"), ("training_max_split_64", "max_split_64"), ("training_expandable", "expandable"))


def record(directory: str) -> None:
    """Writes the recordings of :data:`RECORDINGS`: training programs under PyTorch's allocator,
    recorded from just before an ``empty_cache()``, without stack frames."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, setting_name in RECORDINGS:
        setting = next(s for s in SETTINGS if s[0] == setting_name)
        case = training_program(1, setting)
        for op in case.ops:
            if op["op"] == "history":
                op["stacks"] = False
        run_program(case, "native", history=str(Path(directory) / f"{name}.pickle"))
        print(f"{directory}/{name}.pickle: {case.describe()}")


def shrink(case: Case, budget: int = 400) -> Case:
    """A shorter program that still diverges (delta debugging: drops runs of ops, halving their
    length, while some divergence remains), from at most ``budget`` comparisons. Dropping an
    alloc leaves its free (and record_stream) without a tensor, which the child skips; a leading
    ``fraction`` op is kept."""
    import dataclasses

    def diverges(ops: list[dict[str, Any]]) -> bool:
        trial = dataclasses.replace(case, ops=ops, departures=[], layout="end")
        return compare(trial, explain=False) is not None

    ops = list(case.ops)
    first = compare(dataclasses.replace(case, departures=[]), explain=False)
    if first is not None and first.step is not None and first.step >= 0:
        ops = ops[: first.step + 1]  # what follows the divergence cannot matter
    keep_first = 1 if ops and ops[0]["op"] == "fraction" else 0
    chunk = max(1, (len(ops) - keep_first) // 2)
    tries = 0
    while chunk >= 1 and tries < budget:
        start = keep_first
        removed = False
        while start < len(ops) and tries < budget:
            candidate = ops[:start] + ops[start + chunk :]
            tries += 1
            if diverges(candidate):
                ops = candidate
                removed = True
            else:
                start += chunk
        if not removed:
            chunk //= 2
    return dataclasses.replace(case, ops=ops, departures=[], program=f"{case.program or f'seed {case.seed}'}, shrunk")


def run_cases(cases: list[Case], keep_going: bool) -> tuple[int, int, int, int]:
    """Compares each case, printing a line per case; (runs, ops compared, failures, cases with a
    named departure)."""
    import time

    runs = ops = failures = departures = 0
    for case in cases:
        started = time.monotonic()
        divergence = compare(case)
        runs += 1
        ops += ops_compared(case, divergence)
        took = f"{time.monotonic() - started:.1f} s"
        if divergence is None:
            noted = f" (departures: {', '.join(case.departures)})" if case.departures else ""
            print(f"ok   {case.describe()}, {took}{noted}", flush=True)
            departures += bool(case.departures)
            continue
        failures += 1
        print(f"DIFF {divergence}", flush=True)
        if not keep_going:
            break
    return runs, ops, failures, departures


def replay_traces(paths: list[str], settings: list, keep_going: bool, started: float) -> int:
    """``scripts/oracle --trace ... --replay``: the replay in step with PyTorch (issue 20, item 5)."""
    import time

    from . import traces

    runs = failures = decisions = 0
    for path in paths:
        for program in traces.load(path):
            for setting in settings:
                row = traces.replay_in_step(program, setting)
                runs += 1
                decisions += row["native_segment_allocs"]
                ok = traces.in_step(row)
                failures += not ok
                figures = (
                    f"{row['matching_segment_allocs']}/{row['native_segment_allocs']} segment decisions "
                    f"({row['segment_allocs']} made), peak reserved {row['peak_reserved_bytes']} "
                    f"(PyTorch {row['native_peak_reserved_bytes']})"
                )
                # The replay's own self-check, under the setting the snapshot records (a memory
                # fraction set at run time is not among it, so limited runs may read NOT).
                check = row.get("self_check") or {}
                if check:
                    figures += (
                        f"; self-check {'reproduced' if check['reproduced'] else 'NOT reproduced'} "
                        f"({check['matching_segment_frees']}/{check['segment_frees']} segment_free, "
                        f"{check['placements_matching']}/{check['placements_checked']} placed)"
                    )
                print(f"{'ok  ' if ok else 'DIFF'} replay of trace {program.name}, setting {setting[0]}: {figures}", flush=True)
                if not ok and not keep_going:
                    return 1
    print(
        f"{runs} recordings x settings replayed, {decisions} segment decisions of PyTorch's, "
        f"{failures} not in step, {time.monotonic() - started:.0f} s"
    )
    return 1 if failures else 0


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import time

    from . import shapes, traces

    parser = argparse.ArgumentParser(prog="scripts/oracle", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", type=int, default=len(SETTINGS),
        help="seeds to run, cycling through the settings; each seed runs a random program and a "
        "shaped one (default: one seed per setting)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--length", type=int, default=160, help="ops per random program")
    parser.add_argument("--setting", action="append", help="only this setting (a name from the list; repeatable)")
    parser.add_argument("--trace", nargs="+", metavar="SNAPSHOT", help="drive these recorded snapshots instead of random programs")
    parser.add_argument(
        "--layout", choices=("every", "changes", "end"),
        help="compare block layouts after every op, after the ops that made device calls, or at "
        "the end (default: every for programs, changes for traces)",
    )
    parser.add_argument("--keep-going", action="store_true", help="run every case, even after a divergence")
    parser.add_argument(
        "--replay", action="store_true",
        help="with --trace: record each recording's run under PyTorch's allocator and replay that "
        "recording with `ferrocache replay` under the same setting; every segment decision and "
        "the peak reserved must be PyTorch's",
    )
    parser.add_argument(
        "--sleep-ability", action="store_true",
        help="run ferrocache with FERROCACHE_SLEEP=1 (sleep-ability on, never used: ordinary "
        "segments VMM-backed); its VMM calls are compared as the cuMemAlloc / cuMemFree they stand for",
    )
    parser.add_argument("--record", metavar="DIR", help="write the committed native recordings to DIR and stop")
    args = parser.parse_args(argv)
    if args.record:
        record(args.record)
        return 0
    started = time.monotonic()
    if args.replay and not args.trace:
        parser.error("--replay needs --trace")
    if args.trace:
        try:
            settings = traces.settings_named(args.setting)
        except ValueError as err:
            parser.error(str(err))
        if args.replay:
            return replay_traces(args.trace, settings, args.keep_going, started)
        cases = [
            traces.trace_case(program, setting, layout=args.layout or "changes")
            for path in args.trace
            for program in traces.load(path)
            for setting in settings
        ]
        what = "recordings x settings"
    else:
        settings = [s for s in SETTINGS if not args.setting or s[0] in args.setting]
        if not settings:
            parser.error(f"no setting {args.setting!r}; the settings are {[s[0] for s in SETTINGS]}")
        cases = []
        for i in range(args.cases):
            setting = settings[i % len(settings)]
            cases += [random_program(args.seed + i, setting, args.length), shapes.shaped_program(args.seed + i, setting)]
        cases += shapes.fixed_programs()
        if args.layout:
            for case in cases:
                case.layout = args.layout
        what = "programs x settings (random, shaped, and the fixed ties)"
    if args.sleep_ability:
        for case in cases:
            case.sleep_ability = True
    runs, ops, failures, departures = run_cases(cases, args.keep_going)
    print(
        f"{runs} {what}, {ops} ops compared, {failures} with unexplained differences, "
        f"{departures} with a named departure, {time.monotonic() - started:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
