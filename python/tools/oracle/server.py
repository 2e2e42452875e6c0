"""Runs the oracle's programs, each in a process of its own, without paying for ``import torch``
each time: this process imports torch (and the ferrocache package, not installed) once and never
starts CUDA; each run is a child forked from it, which sets its environment
(``PYTORCH_CUDA_ALLOC_CONF``, the fake GPU's settings), installs ferrocache or not, and starts
CUDA itself. PyTorch reads ``PYTORCH_CUDA_ALLOC_CONF`` and the fake driver its settings when CUDA
starts, so each child is a fresh process as far as either allocator and the GPU can tell (the
child checks the fake GPU's capacity). A fork costs about 0.1 s where a fresh interpreter costs
3-5 s.

Protocol, one JSON document per line: the client (:class:`oracle.runner.Runner`) sends
``{"jobs": [{"env": {...}, "program": {...}, "out": PATH, "log": PATH}, ...]}``; the jobs run at
once, side by side, and when all have ended the answer is ``{"status": [exit status, ...]}``.
Each child writes its result (see :mod:`oracle.child`) as JSON to ``out`` and its stdout and
stderr to ``log``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ferrocache  # noqa: E402,F401 - imported once here, installed (or not) in each child
import torch  # noqa: E402,F401 - imported once here; CUDA starts in the children

from oracle import child  # noqa: E402


def run_job(job: dict) -> None:
    """In the forked child: runs the job's program; never returns."""
    try:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for name, value in job["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        result = child.run(job["program"])
        with open(job["out"], "w", encoding="utf-8") as out:
            json.dump(result, out)
    except BaseException:  # noqa: BLE001 - whatever it is, the child must not return
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    sys.stdout.flush()
    sys.stderr.flush()
    write_fake_cuda_report()
    os._exit(0)


def write_fake_cuda_report() -> None:
    """_exit runs no exit handlers: the fake CUDA's ordering-check counts are written now."""
    try:
        ctypes.CDLL(None).fake_cuda_write_order_report()
    except (OSError, AttributeError):
        pass  # not on the fake CUDA


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        jobs = json.loads(line)["jobs"]
        pids = []
        for job in jobs:
            pid = os.fork()
            if pid == 0:
                run_job(job)
            pids.append(pid)
        status = []
        for pid in pids:
            _, code = os.waitpid(pid, 0)
            status.append(os.waitstatus_to_exitcode(code))
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    main()
