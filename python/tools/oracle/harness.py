"""PyTorch's own allocator as the oracle: the same allocation program, run once under PyTorch's
caching allocator and once under ferrocache, each in a fresh process on the same fake GPU with
the same ``PYTORCH_CUDA_ALLOC_CONF``, must give the same device calls, the same
``memory_stats()`` after every op, the same out-of-memory points and the same final segment
layout.

A program is a list of ops (JSON): ``alloc`` (``torch.empty`` of ``size`` bytes on stream
``stream``, named ``id``), ``free``, ``record_stream``, ``empty_cache``, ``fraction``
(``set_per_process_memory_fraction``). :func:`random_program` draws one from a seed;
:func:`compare` runs it both ways and returns the first divergence, or None.

Needs real PyTorch on the fake CUDA: run under ``scripts/with-fake-cuda`` (``scripts/oracle``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

MIB = 1 << 20
GIB = 1 << 30
CHILD = Path(__file__).with_name("child.py")

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
    """One random program under one setting."""

    seed: int
    setting: str
    conf: str
    capacity: int
    streams: int
    event_delay: int
    ops: list[dict[str, Any]]
    #: Named departures met while comparing (see :data:`EVENT_ORDER`), with their op.
    departures: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"seed {self.seed}, setting {self.setting} (PYTORCH_CUDA_ALLOC_CONF={self.conf!r}), "
            f"capacity {self.capacity >> 20} MiB, {self.streams} streams, event delay "
            f"{self.event_delay}, {len(self.ops)} ops"
        )


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


def run_program(case: Case, allocator: str, history: Optional[str] = None, timeout: float = 300) -> dict[str, Any]:
    """Runs ``case`` in a fresh process under ``allocator`` ("native" or "ferrocache")."""
    with tempfile.TemporaryDirectory(prefix="oracle-") as scratch:
        env = dict(os.environ)
        env.update(
            {
                "PYTORCH_CUDA_ALLOC_CONF": case.conf,
                "FAKE_LIBCUDA_TOTAL_MEM": str(case.capacity),
                "FAKE_LIBCUDA_EVENT_DELAY": str(case.event_delay),
                "FAKE_CUDA_CALL_LOG": str(Path(scratch) / "calls.log"),
                "FAKE_CUDA_QUIET": "1",
                "TORCH_CUDA_ALLOC_LOG_LEVEL": "ERROR",
            }
        )
        env.pop("PYTORCH_ALLOC_CONF", None)
        (Path(scratch) / "calls.log").touch()
        program = {"allocator": allocator, "streams": case.streams, "ops": case.ops, "history": history}
        process = subprocess.run(
            [sys.executable, str(CHILD)],
            input=json.dumps(program),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    if process.returncode != 0:
        raise RuntimeError(f"the {allocator} run failed ({case.describe()}):\n{process.stderr[-4000:]}")
    return json.loads(process.stdout)


@dataclass
class Divergence:
    """The first op at which the two runs differ, and both sides' state there."""

    case: Case
    step: Optional[int]  # None: only the final snapshots differ
    what: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        where = "the final snapshot" if self.step is None else f"op {self.step}: {self.case.ops[self.step]}"
        lines = [f"{self.case.describe()}", f"first divergence at {where}"]
        if self.step is not None:
            lines.append(f"ops before it: {self.case.ops[max(0, self.step - 5):self.step]}")
        lines += [f"  {w}" for w in self.what]
        return "\n".join(lines)


#: Departure "event order": when one malloc (or empty_cache) finds the record_stream events of
#: blocks on two or more streams complete, PyTorch frees those blocks in the order of its
#: per-stream event queues, a ska::flat_hash_map keyed by stream (hash order), ferrocache in its
#: own order. The blocks and every current value end the same; only the transient high-water
#: marks of the inactive-split statistics can differ (by a block and its bytes), and then their
#: peaks stay different. Pinned by test_oracle.py::test_the_event_order_departure_is_recognised.
EVENT_ORDER = "event order"
EVENT_ORDER_KEYS = frozenset(
    f"{name}.{pool}.peak" for name in ("inactive_split", "inactive_split_bytes") for pool in ("all", "large_pool", "small_pool")
)


def blocks_released_by_events(case: Case, index: int, steps: list[dict[str, Any]]) -> int:
    """How many blocks waiting for events the op at ``index`` freed (PyTorch's run)."""
    before = steps[index - 1]["stats"].get("active.all.current", 0) if index else 0
    after = steps[index]["stats"].get("active.all.current", 0)
    op = case.ops[index]
    allocated = 1 if op["op"] == "alloc" and not steps[index]["oom"] else 0
    freed = 1 if op["op"] == "free" else 0
    return before + allocated - freed - after


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


def first_divergence(case: Case, native: dict[str, Any], ours: dict[str, Any]) -> Optional[Divergence]:
    ignored: frozenset[str] = frozenset()
    for index, (a, b) in enumerate(zip(native["steps"], ours["steps"])):
        what = []
        if a["calls"] != b["calls"]:
            what += diff_calls(a["calls"], b["calls"])
        if a["oom"] != b["oom"]:
            what.append(f"out of memory: pytorch {a['oom']}, ferrocache {b['oom']}")
        stats = diff_stats(a["stats"], b["stats"], ignored)
        only_event_order = stats and all(line.split(":")[0][len("stat ") :] in EVENT_ORDER_KEYS for line in stats)
        if not what and only_event_order and blocks_released_by_events(case, index, native["steps"]) >= 2:
            case.departures.append(f"{EVENT_ORDER} at op {index}")
            ignored = EVENT_ORDER_KEYS
            stats = []
        what += stats
        if what:
            return Divergence(case, index, what)
    if native["segments"] != ours["segments"]:
        what = [f"pytorch segments {native['segments']}", f"ferrocache segments {ours['segments']}"]
        return Divergence(case, None, what)
    return None


def compare(case: Case) -> Optional[Divergence]:
    """Runs ``case`` under both allocators; the first divergence, or None when they agree."""
    return first_divergence(case, run_program(case, "native"), run_program(case, "ferrocache"))


def cases(count: int, first_seed: int = 0, length: int = 160) -> list[Case]:
    """``count`` programs, cycling through the settings, seeds from ``first_seed``."""
    return [random_program(first_seed + i, SETTINGS[i % len(SETTINGS)], length) for i in range(count)]


def training_program(seed: int, setting: tuple[str, str, Optional[float]], steps: int = 6) -> Case:
    """A program shaped like training steps, for recordings: weights kept, then per step
    activations allocated and freed in reverse, gradients, an optimizer state; history
    recording starts after the first step and is followed at once by ``empty_cache()`` (so the
    recording begins with a burst of ``segment_free``)."""
    name, conf, fraction = setting
    rng = random.Random(f"training/{seed}/{name}")
    ops: list[dict[str, Any]] = []
    ids = iter(range(1_000_000))

    def alloc(size: int, stream: int = 0) -> int:
        i = next(ids)
        ops.append({"op": "alloc", "id": i, "size": size, "stream": stream})
        return i

    weights = [alloc(rng.choice([4, 16, 64]) * rng.randint(1, 8) * 1024 * rng.randint(1, 64)) for _ in range(12)]
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
    return Case(seed, name, conf, 4 * GIB, 1, 0, ops)


def replay_native_recording(case: Case) -> dict[str, Any]:
    """Records ``case`` under PyTorch's allocator and replays the recording with ferrocache
    (``ferrocache replay --json``); returns the replay's row and the native run."""
    with tempfile.TemporaryDirectory(prefix="oracle-replay-") as scratch:
        recording = str(Path(scratch) / "native.pickle")
        native = run_program(case, "native", history=recording)
        command = [shutil.which("ferrocache") or "ferrocache", "replay", recording, "--json", "--conf", case.conf]
        process = subprocess.run(command, capture_output=True, text=True, timeout=300)
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


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="scripts/oracle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=len(SETTINGS), help="random programs to run (default: one per setting)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--length", type=int, default=160, help="ops per program")
    parser.add_argument("--setting", help="only this setting (a name from the list)")
    parser.add_argument("--keep-going", action="store_true", help="run every case, even after a divergence")
    parser.add_argument("--record", metavar="DIR", help="write the committed native recordings to DIR and stop")
    args = parser.parse_args(argv)
    if args.record:
        record(args.record)
        return 0
    settings = [s for s in SETTINGS if args.setting in (None, s[0])]
    if not settings:
        parser.error(f"no setting {args.setting!r}; the settings are {[s[0] for s in SETTINGS]}")
    started = time.monotonic()
    failures = 0
    departures = 0
    for i in range(args.cases):
        case = random_program(args.seed + i, settings[i % len(settings)], args.length)
        divergence = compare(case)
        if divergence is None:
            noted = f" (departures: {', '.join(case.departures)})" if case.departures else ""
            print(f"ok   {case.describe()}{noted}", flush=True)
            departures += bool(case.departures)
            continue
        failures += 1
        print(f"DIFF {divergence}", flush=True)
        if not args.keep_going:
            break
    elapsed = time.monotonic() - started
    print(
        f"{args.cases} programs x settings, {failures} with unexplained differences, "
        f"{departures} with a named departure, {elapsed:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
