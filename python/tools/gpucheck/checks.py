"""Verdicts: the workloads' raw results (plain dicts, see gpucheck.workloads) turned into the
report's items. Pure functions, tested without a GPU."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional

from .report import ERROR, FAIL, MEASURED, PASS, SKIPPED, CheckResult, Table, mib, milliseconds, nanoseconds

OOM_PREFIX = "CUDA out of memory."
#: NVML's figure for this process, which PyTorch's out-of-memory message carries where NVML answers.
OOM_THIS_PROCESS = "Including non-PyTorch memory, this process has "
#: Steps left out of the step-time median (CUDA and cuBLAS warm up in the first ones).
WARMUP_STEPS = 3


#: The report's items, in order, with their titles.
TITLES = {
    "losses": "Same training, same losses (native vs ferrocache)",
    "host_cost": "Host cost of torch.empty + free (interleaved, medians)",
    "peaks": "Peak reserved and step time (training run)",
    "streams": "Two streams with record_stream",
    "oom": "Out of memory: an exception with PyTorch's message, then carry on",
    "empty_cache": "torch.cuda.empty_cache() gives memory back",
    "example": "examples/train.py runs and prints the summary",
    "replay": "Replay of the native run's snapshot (ferrocache replay)",
    "tune": "ferrocache tune on the native run's snapshot, its answer replayed",
}


def _part(features: Mapping[str, Mapping[str, Any]], allocator: str, name: str) -> Mapping[str, Any]:
    """One part of a features run; the run's own error where the process failed."""
    run = features.get(allocator, {"error": f"no {allocator} run"})
    if "error" in run:
        return {"error": run["error"]}
    part: Mapping[str, Any] = run.get(name, {"error": f"{allocator} run has no {name!r} result"})
    return part


def _error(key: str, title: str, raw: Mapping[str, Any]) -> Optional[CheckResult]:
    if "error" in raw:
        first = str(raw["error"]).strip().splitlines()[-1:] or ["(no message)"]
        return CheckResult(key, title, ERROR, first[0], data=dict(raw))
    return None


#: The second native run (with history recording), the control of the loss comparison.
CONTROL = "native-history"


def losses(runs: Mapping[str, Mapping[str, Any]], control: str = CONTROL) -> CheckResult:
    """(1) The same deterministic training under each allocator gives identical losses.

    ``runs[control]``, a second native run, shows whether the run is deterministic at all here:
    if even two native runs differ, a difference under ferrocache proves nothing.
    """
    key, title = "losses", TITLES["losses"]
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


def streams(features: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """(4) record_stream on a second stream: the data read there stays right."""
    key, title = "streams", TITLES["streams"]
    ours = _part(features, "ferrocache", "streams")
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


def out_of_memory(features: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """(5) An impossible allocation raises PyTorch's out-of-memory message and the run goes on."""
    key, title = "oom", TITLES["oom"]
    ours = _part(features, "ferrocache", "oom")
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


def empty_cache(features: Mapping[str, Mapping[str, Any]]) -> CheckResult:
    """(6) torch.cuda.empty_cache() gives the cached memory back (torch.cuda.mem_get_info)."""
    key, title = "empty_cache", TITLES["empty_cache"]
    ours = _part(features, "ferrocache", "empty_cache")
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
