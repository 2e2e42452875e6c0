"""What ``ferrocache run`` does in each Python process of its command, once ``torch`` has been
imported (``_startup/sitecustomize.py`` calls :func:`start`): ``install()`` with the settings
the launcher put in the environment, the history kept with ``--record``, and the report written
when the process exits.

The report is one block on stderr per process that used CUDA, each line with the rank prefix
of the logs (``[rank1]:``) in a job of several ranks; with ``--report json:PATH`` the same as
JSON, one file per rank (named as the out-of-memory snapshots are). Every process also leaves
its JSON in the launcher's folder (``FERROCACHE_RUN_DIR``), from which the launcher prints the
job's row at the end (``src/cli/launcher.rs``).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any, Optional

from . import _env, _ranks, _torch, config, oom

#: The launcher's variables (``src/cli/launcher.rs`` names the same).
RUN_REPORT_VAR = _env.RUN_REPORT.name
RUN_RECORD_VAR = _env.RUN_RECORD.name
RUN_REPORT_JSON_VAR = _env.RUN_REPORT_JSON.name
RUN_DIR_VAR = _env.RUN_DIR.name

#: The history ``--record`` keeps: PyTorch's own bound for a recording left on through a job
#: (the newest entries are kept), the same as for a snapshot at out of memory.
RECORD_MAX_ENTRIES = oom.SNAPSHOT_ON_OOM_MAX_ENTRIES

_GIB = float(1 << 30)
_MIB = float(1 << 20)


def start() -> None:
    """Installs ferrocache (the settings come from the environment) and arranges the report."""
    from .install import install

    install()
    record = _env.flag_is_on(_env.RUN_RECORD)
    if record and oom.snapshot_on_oom_from_environment() is None:
        # --snapshot-on-oom records already (with stacks); otherwise no stacks: advice needs
        # only the sizes and the order.
        from .snapshot import record_memory_history

        record_memory_history("all", context=None, max_entries=RECORD_MAX_ENTRIES)
    atexit.register(_report_at_exit, record)


def _format_bytes(value: int) -> str:
    """As ``ferrocache replay`` writes sizes (``tune::report::bytes``)."""
    return f"{value / _GIB:.2f} GiB" if value >= _GIB else f"{value / _MIB:.1f} MiB"


def _used_devices() -> list[int]:
    """The devices this process allocated on through ferrocache (none when CUDA never started)."""
    if not _torch.cuda_initialized():
        return []
    import torch

    from .memory import memory_stats

    used = []
    for index in range(torch.cuda.device_count()):
        try:
            stats = memory_stats(index)
        except Exception:
            continue
        if stats.get("allocation.all.allocated", 0) > 0 or stats.get("num_device_alloc", 0) > 0:
            used.append(index)
    return used


def _device_report(index: int, record: bool) -> dict[str, Any]:
    from .memory import memory_stats

    stats = memory_stats(index)
    reserved = stats.get("reserved_bytes.all.peak", 0)
    requested = stats.get("requested_bytes.all.peak", 0)
    report: dict[str, Any] = {
        "device": index,
        "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved_bytes": reserved,
        "peak_requested_bytes": requested,
        "utilization": requested / reserved if reserved else 0.0,
        "device_allocs": stats.get("num_device_alloc", 0),
        "retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
    }
    if record:
        report["advice"] = _advice(index)
    return report


def _advice(index: int) -> Optional[dict[str, Any]]:
    from .advise import advise

    try:
        advice = advise(index)
    except Exception as err:
        return {"error": str(err)}
    return {
        "recommended_conf": advice.recommended_conf,
        "recommended_env": advice.recommended_env,
        "current_peak_reserved_bytes": advice.current_peak_reserved_bytes,
        "recommended_peak_reserved_bytes": advice.recommended_peak_reserved_bytes,
        "saving_bytes": advice.saving_bytes,
        "exports": advice.exports,
    }


def process_report(record: bool) -> Optional[dict[str, Any]]:
    """This process's report as the JSON file holds it, or None when it allocated nothing."""
    devices = _used_devices()
    if not devices:
        return None
    process = _ranks.this_process()
    # As PyTorch and the library read it (install() wrote a given conf there); not from a
    # snapshot, which would carry the whole recorded history.
    conf = next((os.environ[v] for v in config.ALLOC_CONF_VARS if v in os.environ), "")
    return {
        "rank": process.rank,
        "local_rank": process.local_rank,
        "world_size": process.world_size,
        "pid": process.pid,
        "argv": list(sys.argv),
        "conf": conf,
        "devices": [_device_report(index, record) for index in devices],
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The block on stderr, without the rank prefix."""
    conf = report["conf"]
    lines = [
        f"ferrocache: pid {report['pid']} ({' '.join(report['argv']) or 'python'}) under "
        f"PYTORCH_CUDA_ALLOC_CONF={conf!r}" if conf else
        f"ferrocache: pid {report['pid']} ({' '.join(report['argv']) or 'python'}) under "
        "PyTorch's default settings"
    ]
    header = ("device", "peak allocated", "peak reserved", "utilization", "device allocs",
              "retries", "OOMs")  # fmt: skip
    rows = [header]
    for device in report["devices"]:
        rows.append((
            f"cuda:{device['device']}",
            _format_bytes(device["peak_allocated_bytes"]),
            _format_bytes(device["peak_reserved_bytes"]),
            f"{100 * device['utilization']:.1f}%",
            str(device["device_allocs"]),
            str(device["retries"]),
            str(device["ooms"]),
        ))  # fmt: skip
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    lines.append("  (utilization = peak requested / peak reserved, as in ferrocache replay)")
    for device in report["devices"]:
        lines.extend(_advice_lines(device))
    return lines


def _advice_lines(device: dict[str, Any]) -> list[str]:
    advice = device.get("advice")
    if advice is None:
        return []
    name = f"cuda:{device['device']}"
    if "error" in advice:
        return [f"  advice for {name}: none ({advice['error']})"]
    if advice["recommended_conf"] is None:
        return [f"  advice for {name}: no setting tried fits in this GPU's memory"]
    setting = advice["recommended_conf"] or "PyTorch's defaults"
    env = " ".join(f"{k}={v}" for k, v in advice["recommended_env"].items())
    lines = [f"  advice for {name}: {setting}{' with ' + env if env else ''} would have reserved "
             f"{_format_bytes(advice['recommended_peak_reserved_bytes'] or 0)} at the peak"]  # fmt: skip
    saving = advice["saving_bytes"]
    current = advice["current_peak_reserved_bytes"]
    if saving is not None and current:
        lines[0] += (f", {_format_bytes(saving)} ({100 * saving / current:.1f}%) less than "
                     f"this run's {_format_bytes(current)} replayed")  # fmt: skip
    lines += [f"  paste: {line}" for line in advice["exports"]]
    return lines


def _write_json(path: str, report: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def _report_at_exit(record: bool) -> None:
    try:
        report = process_report(record)
        if report is None:
            return
        run_dir = os.environ.get(RUN_DIR_VAR)
        if run_dir and os.path.isdir(run_dir):
            _write_json(os.path.join(run_dir, f"report-{report['pid']}.json"), report)
        user_json = os.environ.get(RUN_REPORT_JSON_VAR)
        if user_json:
            _write_json(_ranks.per_rank_path(user_json), report)
        if _env.flag_is_on(_env.RUN_REPORT, default=True):
            prefix = _ranks.log_prefix()
            text = "".join(f"{prefix}{line}\n" for line in report_lines(report))
            sys.stderr.write(text)
            sys.stderr.flush()
    except Exception as err:  # the report must not change how the program ends
        _ranks.log("WARN", f"ferrocache run: no report for this process: {err}")
