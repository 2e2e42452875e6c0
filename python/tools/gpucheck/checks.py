"""Verdicts: the workloads' raw results (plain dicts, see gpucheck.workloads) turned into the
report's items. Pure functions, tested without a GPU."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional, Sequence

from .report import ERROR, FAIL, MEASURED, PASS, SKIPPED, CheckResult, Table, mib, milliseconds, nanoseconds

OOM_PREFIX = "CUDA out of memory."
#: NVML's figure for this process, which PyTorch's out-of-memory message carries where NVML answers.
OOM_THIS_PROCESS = "Including non-PyTorch memory, this process has "
#: Steps left out of the step-time median (CUDA and cuBLAS warm up in the first ones).
WARMUP_STEPS = 5
#: The step-time median is taken over at least this many steps.
TIMED_STEPS = 50


#: The report's items, in order, with their titles.
TITLES = {
    "real_torch": "Real-PyTorch tests (python/tests/real_torch) on the GPU",
    "step_time": "Training step time, ferrocache / native (interleaved runs, medians, noise floor)",
    "losses": "Same training, same losses (native vs ferrocache)",
    "host_cost": "Host cost of torch.empty + free (interleaved, medians)",
    "peaks": "Peak reserved and step time (training run)",
    "streams": "Two streams with record_stream",
    "oom": "Out of memory: an exception with PyTorch's message, then carry on",
    "empty_cache": "torch.cuda.empty_cache() gives memory back",
    "expandable": "expandable_segments:True: streams, CUDA graphs, empty_cache, out of memory",
    "cross_stream": "Cross-stream reuse (FERROCACHE_CROSS_STREAM=1): the device waits",
    "graphs": "CUDA graphs: captured forward replayed among other allocations",
    "peer": "Peer copy, device 0 -> 1 -> 0 (also under expandable_segments:True)",
    "sleep": "ferrocache.sleep(backup=True) and wake(): GiB/s against a plain pinned copy",
    "memory_api": "Every public torch.cuda memory function, both allocators (compare.py)",
    "example": "examples/train.py runs and prints the summary",
    "replay": "Replay of the native run's snapshot (ferrocache replay)",
    "tune": "ferrocache tune on the native run's snapshot, its answer replayed",
}


ON_FAKE = "skipped_on_fake"


def _part(features: Mapping[str, Mapping[str, Any]], allocator: str, name: str) -> Mapping[str, Any]:
    """One part of a features run; the run's own error (or skip) where the process did not get
    that far."""
    run = features.get(allocator, {"error": f"no {allocator} run"})
    for word in ("error", ON_FAKE):
        if word in run:
            return {word: run[word]}
    part: Mapping[str, Any] = run.get(name, {"error": f"{allocator} run has no {name!r} result"})
    return part


def _error(key: str, title: str, raw: Mapping[str, Any]) -> Optional[CheckResult]:
    """The item for a raw result that is an error, or was skipped on the fake; None otherwise."""
    if "error" in raw:
        first = str(raw["error"]).strip().splitlines()[-1:] or ["(no message)"]
        return CheckResult(key, title, ERROR, first[0], data=dict(raw))
    if ON_FAKE in raw:
        return skipped_on_fake(key, title, str(raw[ON_FAKE]))
    return None


def _cell(part: Mapping[str, Any], name: str) -> str:
    """A table cell: the part's value, or why there is none."""
    if "error" in part:
        return "error: " + ((str(part["error"]).strip().splitlines() or [""])[-1])[:100]
    if ON_FAKE in part:
        return "skipped on the fake"
    return str(part.get(name, "-"))


def skipped_on_fake(key: str, title: str, why: str) -> CheckResult:
    return CheckResult(key, title, SKIPPED, f"skipped on the fake: {why}")


#: The second native run (with history recording), the control of the loss comparison.
CONTROL = "native-history"


def losses(runs: Mapping[str, Mapping[str, Any]], control: str = CONTROL) -> CheckResult:
    """(1) The same deterministic training under each allocator gives identical losses.

    ``runs[control]``, a second native run, shows whether the run is deterministic at all here:
    if even two native runs differ, a difference under ferrocache proves nothing.
    """
    key, title = "losses", TITLES["losses"]
    skipped = _skipped_runs(key, title, runs)
    if skipped:
        return skipped
    native = runs.get("native", {}).get("losses")
    if not native:
        why = runs.get("native", {}).get("error", "no losses")
        return CheckResult(key, title, ERROR, f"native run: {why}")
    rows, verdicts, control_identical = [], [], None
    for name, run in runs.items():
        if name == "native":
            continue
        values = run.get("losses")
        if values is None:
            rows.append([name, "-", "run failed", str(run.get("error", "no losses"))])
            if name != control:
                verdicts.append(False)
            continue
        identical = list(values) == list(native)
        worst = max((abs(a - b) for a, b in zip(values, native)), default=float("nan"))
        rows.append([name, str(len(values)), "yes" if identical else "no", f"{worst:.3g}"])
        if name == control:
            control_identical = identical
        else:
            verdicts.append(identical)
    if not verdicts:
        return CheckResult(key, title, ERROR, "no ferrocache run")
    differing = ", ".join(
        f"{r[0]} (failed: {r[3]})" if r[2] == "run failed" else f"{r[0]} (max |diff| {r[3]})"
        for r in rows
        if r[2] != "yes"
    )
    if all(verdicts):
        status = PASS
        summary = f"{len(native)} steps, bit-identical losses ({native[0]:.4f} -> {native[-1]:.4f})"
    elif control_identical is False:
        status = ERROR
        summary = f"inconclusive: two native runs differ too, the run is not deterministic here ({differing})"
    else:
        status = FAIL
        summary = f"losses differ from native: {differing}"
    table = Table("", ["run", "steps", "identical to native", "max abs difference"], rows)
    compared = [name for name, run in runs.items() if name != "native" and run.get("losses")]
    per_step = Table(
        "Losses, step by step:",
        ["step", "native", *compared],
        [
            [str(i), f"{native[i]:.6f}"]
            + [f"{runs[n]['losses'][i]:.6f}" if i < len(runs[n]["losses"]) else "-" for n in compared]
            for i in range(len(native))
        ],
    )
    return CheckResult(key, title, status, summary, [table, per_step])


def host_cost(result: Mapping[str, Any], native: str = "native", ours: str = "ferrocache") -> CheckResult:
    """(2) Host time of one torch.empty + free, ferrocache / native, medians of interleaved
    repetitions."""
    key, title = "host_cost", TITLES["host_cost"]
    if "error" in result:
        return CheckResult(key, title, ERROR, str(result["error"]), data=dict(result))
    samples = result["samples"]
    rows, ratios = [], []
    for size in sorted(samples[native], key=int):
        base = statistics.median(samples[native][size])
        mine = statistics.median(samples[ours][size])
        ratio = mine / base if base else float("nan")
        ratios.append((int(size), ratio))
        rows.append(
            [
                _size_name(int(size)),
                nanoseconds(base),
                nanoseconds(mine),
                f"{ratio:.2f}",
                str(len(samples[native][size])),
            ]
        )
    summary = ", ".join(f"{_size_name(s)}: x{r:.2f}" for s, r in ratios) + " (ferrocache / native)"
    table = Table("", ["size", "native", "ferrocache", "ratio", "repetitions"], rows)
    return CheckResult(key, title, MEASURED, summary, [table], data={"ratios": dict(ratios)})


def _size_name(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def peaks(runs: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """(3) Peak reserved memory and step time of the training run, per allocator."""
    key, title = "peaks", TITLES["peaks"]
    skipped = _skipped_runs(key, title, runs)
    if skipped:
        return skipped
    broken = [f"{name}: {run['error']}" for name, run in runs.items() if "error" in run]
    if not runs or broken:
        return CheckResult(key, title, ERROR, "; ".join(broken) or "no training run")
    rows = []
    for name, run in runs.items():
        if "error" in run or "step_seconds" not in run:
            rows.append([name, "n/a", "n/a", "n/a", "n/a"])
            continue
        timed = run["step_seconds"][WARMUP_STEPS:] or run["step_seconds"]
        rows.append(
            [
                name,
                mib(run.get("peak_reserved")),
                mib(run.get("peak_allocated")),
                milliseconds(statistics.median(timed)),
                str(run.get("num_device_alloc", "n/a")),
            ]
        )
    native = runs.get("native", {})
    parts = []
    for name, run in runs.items():
        if name == "native" or not native.get("peak_reserved") or not run.get("peak_reserved"):
            continue
        parts.append(f"{name}: reserved x{run['peak_reserved'] / native['peak_reserved']:.2f}")
    summary = "; ".join(parts) + " of native" if parts else "no comparison"
    headers = ["allocator", "peak reserved", "peak allocated", "median step", "device allocations"]
    return CheckResult(key, title, MEASURED, summary, [Table("", headers, rows)])


def _skipped_runs(key: str, title: str, runs: Mapping[str, Mapping[str, Any]]) -> Optional[CheckResult]:
    """Skipped on the fake where the first run stopped at a kernel (the others did not start)."""
    why = next((str(run[ON_FAKE]) for run in runs.values() if ON_FAKE in run), None)
    return skipped_on_fake(key, title, why) if why is not None else None


#: The second native run of each step-time round: native against native, the noise floor.
NOISE = "native-again"
#: The step-time runs are at least this many steps after the warm-up.
STEP_TIME_STEPS = 150
#: How the step is timed: on the host (the step and a synchronize), and between CUDA events.
TIMINGS = (("host_seconds", "host"), ("event_seconds", "CUDA events"))


def _run_medians(runs: Sequence[Mapping[str, Any]], model: str, timing: str, warmup: int) -> list[float]:
    """Each run's median step time (after the warm-up) for one model and timing."""
    medians = []
    for run in runs:
        values = ((run.get("models") or {}).get(model) or {}).get(timing) or []
        timed = values[warmup:]
        if timed:
            medians.append(statistics.median(timed))
    return medians


def step_time(runs: Mapping[str, Sequence[Mapping[str, Any]]], warmup: int = 20, ours: str = "ferrocache") -> CheckResult:
    """The step time of native and ferrocache from interleaved runs, round by round (native,
    ferrocache, native again; backwards in odd rounds): per model and timing, each run's median
    step, the median of those with their minimum and maximum, ferrocache's over native's
    (``data["ratio"]``: the launch-bound model on the host, which the summary line quotes), and
    native-again's over native's, the noise floor: a difference below it is not one."""
    key, title = "step_time", TITLES["step_time"]
    flat = {name: list(series) for name, series in runs.items()}
    skipped = _skipped_runs(key, title, {f"{n}-{i}": r for n, s in flat.items() for i, r in enumerate(s)})
    if skipped:
        return skipped
    broken = [f"{name} round {run.get('round', '?')}: {run['error']}" for name, series in flat.items()
              for run in series if "error" in run]  # fmt: skip
    good = {name: [run for run in series if "models" in run] for name, series in flat.items()}
    if not good.get("native") or not good.get(ours):
        return CheckResult(key, title, ERROR, "; ".join(broken) or "no step-time run of native or ferrocache")
    models = list(good["native"][0]["models"])
    rows: list[list[str]] = []
    ratios: dict[str, dict[str, float]] = {}
    noise: dict[str, dict[str, float]] = {}
    timed_steps = None
    for model in models:
        ratios[model], noise[model] = {}, {}
        for timing, timing_name in TIMINGS:
            medians = {name: _run_medians(series, model, timing, warmup) for name, series in good.items()}
            if not medians.get("native") or not medians.get(ours):
                continue
            native = statistics.median(medians["native"])
            for name, values in medians.items():
                if not values:
                    continue
                middle = statistics.median(values)
                rows.append([model, timing_name, name, str(len(values)), milliseconds(middle),
                             milliseconds(min(values)), milliseconds(max(values)), f"{middle / native:.4f}"])  # fmt: skip
            ratios[model][timing_name] = statistics.median(medians[ours]) / native
            if medians.get(NOISE):
                noise[model][timing_name] = statistics.median(medians[NOISE]) / native
        counts = [len(run["models"][model]["host_seconds"][warmup:]) for series in good.values() for run in series
                  if model in run["models"]]  # fmt: skip
        timed_steps = min(counts + ([timed_steps] if timed_steps is not None else []))
    first = models[0]
    if "host" not in ratios.get(first, {}):
        return CheckResult(key, title, ERROR, "; ".join(broken) or "no timed steps")
    ratio = ratios[first]["host"]

    def said(model: str) -> str:
        parts = [f"{ratios[model][t]:.3f} {t}" for _, t in TIMINGS if t in ratios[model]]
        floor = [f"{noise[model][t]:.3f}" for _, t in TIMINGS if t in noise[model]]
        return f"{model}: {', '.join(parts)}" + (f" (native/native {', '.join(floor)})" if floor else "")

    rounds = max(len(series) for series in good.values())
    summary = f"ferrocache/native {'; '.join(said(model) for model in models if ratios[model])}; " \
              f"{rounds} rounds of {timed_steps} timed steps"  # fmt: skip
    if timed_steps is not None and timed_steps < STEP_TIME_STEPS:
        summary += f"; fewer than {STEP_TIME_STEPS} steps timed"
    if broken:
        summary += f"; {len(broken)} run(s) failed: {broken[0]}"
    headers = ["model", "timing", "allocator", "runs", "median of the runs' medians", "min", "max", "to native"]
    table = Table("Each run's median step after the warm-up; the runs interleaved N F N', N' F N, ...:", headers, rows)
    data = {"ratio": ratio, "ratios": ratios, "noise_floor": noise}
    return CheckResult(key, title, ERROR if broken else MEASURED, summary, [table], data=data)


def streams(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache") -> CheckResult:
    """(4) record_stream on a second stream: the data read there stays right."""
    key, title = "streams", TITLES["streams"]
    ours = _part(features, ours_name, "streams")
    failed = _error(key, title, ours)
    if failed:
        return failed
    rows = [
        [name, str(part.get("correct")), str(part.get("reused_while_pending")), str(part.get("reused_after_sync"))]
        for name, result in features.items()
        for part in [result.get("streams", {})]
    ]
    ok = ours.get("correct") is True and ours.get("reused_while_pending") is False
    summary = (
        "side stream read the right values; the block was not reused while pending"
        if ok
        else f"wrong: correct={ours.get('correct')}, reused while pending={ours.get('reused_while_pending')}"
    )
    table = Table("", ["allocator", "values correct", "reused while pending", "reused after sync"], rows)
    return CheckResult(key, title, PASS if ok else FAIL, summary, [table])


def out_of_memory(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache") -> CheckResult:
    """(5) An impossible allocation raises PyTorch's out-of-memory message and the run goes on."""
    key, title = "oom", TITLES["oom"]
    ours = _part(features, ours_name, "oom")
    failed = _error(key, title, ours)
    if failed:
        return failed
    native = features.get("native", {}).get("oom", {})
    message = str(ours.get("message", ""))
    first = message.split(" GPU ")[0]
    native_message = str(native.get("message", ""))
    native_first = native_message.split(" GPU ")[0]
    # Both ask NVML for the processes on the GPU: both say what this process uses, or neither.
    same_process_sentences = not native_message or (OOM_THIS_PROCESS in native_message) == (
        OOM_THIS_PROCESS in message
    )
    ok = (
        ours.get("raised") is not None
        and message.startswith(OOM_PREFIX)
        and ours.get("continued") is True
        and (not native_first or first == native_first)
        and same_process_sentences
    )
    rows = [
        [name, str(part.get("raised")), str(part.get("is_torch_oom")), str(part.get("continued")),
         str(part.get("message", ""))[:160]]
        for name, result in features.items()
        for part in [result.get("oom", {})]
    ]  # fmt: skip
    summary = f"{ours.get('raised')}: {first!r}; continued: {ours.get('continued')}"
    table = Table("", ["allocator", "exception", "torch OOM class", "continued", "message"], rows)
    return CheckResult(key, title, PASS if ok else FAIL, summary, [table])


def empty_cache(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache") -> CheckResult:
    """(6) torch.cuda.empty_cache() gives the cached memory back (torch.cuda.mem_get_info)."""
    key, title = "empty_cache", TITLES["empty_cache"]
    ours = _part(features, ours_name, "empty_cache")
    failed = _error(key, title, ours)
    if failed:
        return failed
    rows = []
    for name, result in features.items():
        part = result.get("empty_cache", {})
        if "free_emptied" not in part:
            continue
        rows.append(
            [name, mib(part["free_holding"] - part["free_start"]), mib(part["free_cached"] - part["free_holding"]),
             mib(part["free_emptied"] - part["free_cached"]), mib(part["reserved_cached"]), mib(part["reserved_emptied"])]
        )  # fmt: skip
    released = ours["free_emptied"] - ours["free_cached"]
    ok = released >= 0.9 * ours["size"] and ours["reserved_emptied"] < ours["reserved_cached"]
    summary = f"device free memory rose by {mib(released)} after freeing a {mib(ours['size'])} tensor"
    headers = ["allocator", "free change: alloc", "free change: del", "free change: empty_cache",
               "reserved before", "reserved after"]  # fmt: skip
    return CheckResult(key, title, PASS if ok else FAIL, summary, [Table("", headers, rows)])


def graphs(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache") -> CheckResult:
    """A captured forward replayed among other allocations gives the eager results, under
    native (the control) and ferrocache."""
    key, title = "graphs", TITLES["graphs"]
    ours = _part(features, ours_name, "graphs")
    failed = _error(key, title, ours)
    if failed:
        return failed
    rows = [[name, _cell(part, "replays"), _cell(part, "correct"), _cell(part, "others_intact")]
            for name, run in features.items() for part in [_part(features, name, "graphs")]]  # fmt: skip
    ok = ours.get("correct") is True and ours.get("others_intact") is True and ours.get("pool") not in (None, [0, 0])
    summary = (
        f"{ours.get('replays')} replays, each equal to the eager forward, other tensors untouched"
        if ok
        else f"wrong: {dict(ours)}"
    )
    table = Table("", ["allocator", "replays", "outputs equal eager", "other tensors untouched"], rows)
    return CheckResult(key, title, PASS if ok else FAIL, summary, [table])


def cross_stream(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache-cross-stream") -> CheckResult:
    """With cross-stream reuse, the block freed on s1 serves s2 and s2's write wins; without
    (native, ferrocache: the controls), s2 gets another block. Right values everywhere."""
    key, title = "cross_stream", TITLES["cross_stream"]
    ours = _part(features, ours_name, "cross_stream")
    failed = _error(key, title, ours)
    if failed:
        return failed
    rows, controls_ok = [], True
    for name, run in features.items():
        part = _part(features, name, "cross_stream")
        rows.append([name, _cell(part, "reused"), _cell(part, "correct")])
        if name != ours_name and "reused" in part:
            controls_ok = controls_ok and part.get("correct") is True and part.get("reused") is False
    ok = ours.get("reused") is True and ours.get("correct") is True and controls_ok
    summary = (
        "the block moved to the other stream and its data are the new stream's"
        if ok
        else f"wrong: reused={ours.get('reused')}, correct={ours.get('correct')}, controls ok={controls_ok}"
    )
    table = Table("", ["allocator", "block reused across streams", "values correct"], rows)
    return CheckResult(key, title, PASS if ok else FAIL, summary, [table])


def expandable(features: Mapping[str, Mapping[str, Any]], ours_name: str = "ferrocache-expandable") -> CheckResult:
    """The features run under expandable_segments:True: each part judged as for ferrocache."""
    key, title = "expandable", TITLES["expandable"]
    verdicts = [judge(features, ours_name) for judge in (streams, graphs, empty_cache, out_of_memory)]
    rows = [[verdict.title, verdict.status, verdict.summary] for verdict in verdicts]
    table = Table("", ["part", "result", "summary"], rows)
    if all(v.status == SKIPPED for v in verdicts):
        return CheckResult(key, title, SKIPPED, verdicts[0].summary, [table])
    worst = next((v for v in verdicts if v.status in (FAIL, ERROR)), None)
    if worst is not None:
        return CheckResult(key, title, worst.status, f"{worst.title}: {worst.summary}", [table])
    passed = sum(v.status == PASS for v in verdicts)
    skipped = [v.title for v in verdicts if v.status == SKIPPED]
    summary = f"{passed} of {len(verdicts)} parts passed" + (f" ({len(skipped)} skipped)" if skipped else "")
    return CheckResult(key, title, PASS, summary, [table])


def peer(results: Mapping[str, Mapping[str, Any]], device_count: int) -> CheckResult:
    """Device 0 -> 1 -> 0 under each allocator, with and without expandable segments: every
    copy comes back bit for bit (a crash of the process is an error)."""
    key, title = "peer", TITLES["peer"]
    if device_count < 2:
        return CheckResult(key, title, SKIPPED, f"needs 2 GPUs, this machine has {device_count}")
    rows: list[list[str]] = []
    wrong: list[str] = []  # copies that came back different: FAIL
    broken: list[str] = []  # processes or parts that failed: ERROR
    skipped: list[str] = []
    for name, run in results.items():
        cells = [name]
        for part, fields in (("copies", ("before_peer_access", "after_peer_access")), ("converting", ("correct",))):
            raw = run if ("error" in run or ON_FAKE in run) else run.get(part, {"error": "no result"})
            if "error" in raw:
                cells += ["error"] * len(fields)
                broken.append(f"{name} {part}: {(str(raw['error']).strip().splitlines() or [''])[-1]}")
            elif ON_FAKE in raw:
                cells += ["skipped on the fake"] * len(fields)
                skipped.append(str(raw[ON_FAKE]))
            else:
                cells += [str(raw.get(f)) for f in fields]
                wrong += [f"{name}: {part} {f} differs" for f in fields if raw.get(f) is not True]
        rows.append(cells)
    table = Table("", ["allocator", "copied before peer access", "copied after", "converting copy"], rows)
    if wrong or broken:
        return CheckResult(key, title, FAIL if wrong else ERROR, "; ".join(wrong + broken)[:400], [table])
    if skipped and not any(cell == "True" for row in rows for cell in row):
        return CheckResult(key, title, SKIPPED, f"skipped on the fake: {skipped[0]}", [table])
    summary = "every copy came back bit for bit" + ("; the converting copy skipped on the fake" if skipped else "")
    return CheckResult(key, title, PASS, summary, [table])


#: Sleep's goal: this share of a plain pinned copy's bandwidth (issue 34), shown, not judged.
SLEEP_GOAL = 0.8
#: The rows of the sleep check: (operation, part of the run's timings).
SLEEP_ROWS = (
    ("plain pinned device-to-host copy (the bus)", "d2h_pinned"),
    ("ferrocache.sleep(backup=True), pinned memory kept", "sleep"),
    ("ferrocache.sleep(backup=True), first (allocates it)", "sleep_first"),
    ("plain pageable device-to-host copy", "d2h_pageable"),
    ("plain pinned host-to-device copy (the bus)", "h2d_pinned"),
    ("ferrocache.wake()", "wake"),
    ("ferrocache.wake(), first", "wake_first"),
    ("plain pageable host-to-device copy", "h2d_pageable"),
)


def sleep_bandwidth(runs: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """Sleep with backup and wake, against plain copies of the same blocks in the same process
    (pinned: the bus's speed; pageable), once per allocator setting (VMM-backed segments, and
    expandable segments): every byte back at its address after each wake, the memory given back
    while asleep, and the bandwidths side by side in GiB/s with sleep's and wake's share of the
    pinned copy (reported against the 80% goal, not judged: on the fake it means nothing)."""
    key, title = "sleep", TITLES["sleep"]
    if not runs:
        return CheckResult(key, title, ERROR, "no run")
    tables, problems, shares, errors = [], [], [], []
    for name, run in runs.items():
        if "error" in run:
            errors.append(f"{name}: " + str(run["error"]).strip().splitlines()[-1][:300])
            continue
        if ON_FAKE in run:
            return CheckResult(key, title, SKIPPED, f"skipped on the fake: {run[ON_FAKE]}")
        rates, seconds = run.get("gib_per_s", {}), run.get("seconds", {})
        bus = {"d2h": rates.get("d2h_pinned", 0.0), "h2d": rates.get("h2d_pinned", 0.0)}

        def share(part: str, rates: Mapping[str, Any] = rates, bus: Mapping[str, float] = bus) -> str:
            base = bus["d2h" if part.startswith(("d2h", "sleep")) else "h2d"]
            return f"{rates.get(part, 0.0) / base:.0%}" if base else "n/a"

        rows = [[label, f"{seconds.get(part, 0.0) * 1e3:.1f}", f"{rates.get(part, 0.0):.2f}", share(part)]
                for label, part in SLEEP_ROWS]  # fmt: skip
        tables.append(Table(f"{name}: {run.get('bytes', 0) / (1 << 30):.2f} GiB in {run.get('blocks')} blocks, "
                            f"{run.get('cycles', 1)} cycles (host waits: sleep "
                            f"{run.get('host_synchronizations', {}).get('sleep')}, wake "
                            f"{run.get('host_synchronizations', {}).get('wake')})",
                            ["operation", "ms", "GiB/s", "of the pinned copy"], rows))  # fmt: skip
        if run.get("intact") is not True:
            problems.append(f"{name}: a block's bytes or address changed across sleep and wake")
        if run.get("skipped_bytes"):
            problems.append(f"{name}: {run['skipped_bytes']} bytes could not sleep")
        if int(run.get("freed_while_asleep", 0)) < int(run.get("bytes", 0)):
            problems.append(f"{name}: mem_get_info gained {run.get('freed_while_asleep')} bytes while asleep, "
                            f"not {run.get('bytes')}")  # fmt: skip
        if run.get("host_memory_pinned") is not True:
            problems.append(f"{name}: the backup did not go to pinned host memory")
        shares.append(f"{name}: sleep {share('sleep')}, wake {share('wake')} of a pinned copy")
    if errors:
        return CheckResult(key, title, ERROR, "; ".join(errors), tables)
    if problems:
        return CheckResult(key, title, FAIL, "; ".join(problems), tables)
    goal = f"goal {SLEEP_GOAL:.0%}"
    return CheckResult(key, title, PASS, f"every byte back at its address; {'; '.join(shares)} ({goal})", tables)


def memory_api(outcome: Mapping[str, Any]) -> CheckResult:
    """compare.py's side-by-side table of the public torch.cuda memory functions, verbatim."""
    key, title = "memory_api", TITLES["memory_api"]
    if outcome.get("skipped"):
        return CheckResult(key, title, SKIPPED, str(outcome["skipped"]))
    if outcome.get("returncode") != 0:
        return CheckResult(key, title, ERROR, f"compare.py failed (exit {outcome.get('returncode')}): "
                           f"{outcome.get('stderr_tail', '')}")  # fmt: skip
    table = str(outcome.get("stdout", "")).strip()
    if not table:
        return CheckResult(key, title, ERROR, "compare.py printed nothing")
    rows = sum(1 for line in table.splitlines() if line.startswith("|")) - 2
    return CheckResult(key, title, MEASURED, f"{max(rows, 0)} rows side by side", text=table)


def real_torch(cases: Sequence[Mapping[str, Any]], problem: str = "") -> CheckResult:
    """The chosen real-PyTorch tests, each counted in the summary (``data["counts"]``); a
    ``problem`` (a pytest stopped or broken) counts as one more failure."""
    key, title = "real_torch", TITLES["real_torch"]
    counts = {outcome: sum(c["outcome"] == outcome for c in cases) for outcome in ("passed", "failed", "skipped")}
    rows = [[str(c["name"]), str(c["outcome"]), f"{float(c['seconds']):.1f} s", str(c.get("why", ""))] for c in cases]
    summary = ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n) or "no test ran"
    table = Table("", ["test", "outcome", "time", "why"], rows)
    if problem:
        counts["failed"] += 1
        return CheckResult(key, title, ERROR, f"{summary}; {problem}", [table], data={"counts": counts})
    status = FAIL if counts["failed"] else PASS if counts["passed"] else SKIPPED
    return CheckResult(key, title, status, summary, [table], data={"counts": counts})


def example(returncode: Optional[int], output: str) -> CheckResult:
    key, title = "example", TITLES["example"]
    if returncode is None:
        return CheckResult(key, title, SKIPPED, output)
    ok = returncode == 0 and "CUDA memory summary" in output
    last = ([line.strip() for line in output.splitlines() if line.strip()] or ["(no output)"])[-1]
    summary = "ok" if ok else f"exit status {returncode}: {last}"
    return CheckResult(key, title, PASS if ok else FAIL, summary)


#: Which GPU run each replayed setting corresponds to.
REPLAY_RUNS = {"": "ferrocache", "expandable_segments:True": "ferrocache-expandable"}


def replay(outcome: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """The replayer on the native run's snapshot (``--json``: one object per setting), its
    figures next to those measured on the GPU."""
    key, title = "replay", TITLES["replay"]
    if outcome.get("skipped"):
        return CheckResult(key, title, SKIPPED, str(outcome["skipped"]))
    if outcome.get("returncode") != 0:
        return CheckResult(
            key, title, SKIPPED,
            f"replay not available or failed (exit {outcome.get('returncode')}): {outcome.get('stderr_tail', '')}",
        )  # fmt: skip
    rows_in = outcome.get("rows")
    if not rows_in or not all(isinstance(row, dict) for row in rows_in):
        return CheckResult(key, title, ERROR, "the replay printed no JSON rows", data=dict(outcome))
    native = runs.get("native", {})
    rows, notes = [], []
    for row in rows_in:
        conf = str(row.get("conf", ""))
        measured = runs.get(REPLAY_RUNS.get(conf, ""), {})
        rows.append(
            [
                repr(conf) if conf else '"" (defaults)',
                mib(row.get("peak_reserved_bytes")),
                mib(measured.get("peak_reserved")),
                mib(row.get("native_peak_reserved_bytes")),
                mib(native.get("peak_reserved")),
                f"{row.get('matching_segment_allocs')}/{row.get('native_segment_allocs')}",
                str(row.get("ooms")),
            ]
        )
        if conf == "" and row.get("native_segment_allocs") is not None:
            notes.append(
                f"PyTorch's segment decisions reproduced: {row.get('matching_segment_allocs')} of "
                f"{row.get('native_segment_allocs')}"
            )
    headers = [
        "setting", "replayed peak reserved", "ferrocache on the GPU", "PyTorch (from the trace)",
        "PyTorch on the GPU", "matching segment allocs", "replay OOMs",
    ]  # fmt: skip
    summary = "; ".join(notes) or f"{len(rows)} setting(s) replayed"
    return CheckResult(key, title, MEASURED, summary, [Table("", headers, rows)], data={"rows": list(rows_in)})


def tune(outcome: Mapping[str, Any]) -> CheckResult:
    """``ferrocache tune`` on the native run's snapshot (within the GPU's memory): what it
    recommends and saves; PASS when ``ferrocache replay`` of the recommendation reaches exactly
    the peak tune reported, FAIL when not."""
    key, title = "tune", TITLES["tune"]
    if outcome.get("skipped"):
        return CheckResult(key, title, SKIPPED, str(outcome["skipped"]))
    tuned = outcome.get("tuned")
    if outcome.get("returncode") != 0 or not isinstance(tuned, dict):
        return CheckResult(
            key, title, ERROR,
            f"ferrocache tune failed (exit {outcome.get('returncode')}): {outcome.get('stderr_tail', '')}",
            data=dict(outcome),
        )  # fmt: skip
    conf = tuned.get("recommended_conf")
    defaults = tuned.get("defaults_peak_reserved_bytes")
    if conf is None:
        return CheckResult(key, title, MEASURED, "no setting fits in the GPU's memory", data={"tuned": tuned})
    peak = tuned.get("peak_reserved_bytes")
    env = tuned.get("recommended_env") or {}
    setting = (repr(conf) if conf else '"" (defaults)') + "".join(f" +{k}={v}" for k, v in env.items())
    saved = (defaults - peak) if isinstance(defaults, int) and isinstance(peak, int) else None
    percent = f"{100.0 * saved / defaults:.1f}%" if saved is not None and defaults else "-"
    rows_in = outcome.get("confirm_rows") or []
    replayed = rows_in[0].get("peak_reserved_bytes") if rows_in and isinstance(rows_in[0], dict) else None
    rows = [[setting, mib(peak), mib(defaults), f"{mib(saved)} ({percent})", mib(replayed),
             str(len(tuned.get("candidates") or []))]]  # fmt: skip
    headers = ["recommended", "peak reserved", "PyTorch's defaults", "saving", "replayed", "settings tried"]
    table = [Table("", headers, rows)]
    data = {"tuned": {k: v for k, v in tuned.items() if k != "candidates"}, "replayed": replayed}
    if replayed is None:
        why = outcome.get("confirm_error") or "no JSON row"
        return CheckResult(key, title, ERROR, f"the replay of the recommendation failed: {why}", table, data=data)
    if replayed != peak:
        return CheckResult(
            key, title, FAIL,
            f"the replay of {setting} reserves {mib(replayed)} at the peak, tune said {mib(peak)}", table, data=data,
        )  # fmt: skip
    summary = f"recommended {setting}: {mib(peak)} at the peak, {mib(saved)} ({percent}) less than the defaults; replay agrees"
    return CheckResult(key, title, PASS, summary, table, data=data)
