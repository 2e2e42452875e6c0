"""The check's child processes: each in a process group of its own (so that a step's cap ends
pytest's children too), each told by the kernel to die with gpu-check (``PR_SET_PDEATHSIG``:
a SIGKILL of gpu-check must not leave a workload holding the GPU until the machine goes
back), and all of them listed, so that SIGTERM and SIGINT end every group still running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

#: prctl(2)'s option: the signal this process gets when the thread that forked it ends.
PR_SET_PDEATHSIG = 1

#: The children still running (or not yet reaped).
RUNNING: "set[subprocess.Popen[Any]]" = set()


def _prctl() -> Optional[Any]:
    """libc's prctl, looked up here: the child, between fork and exec, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _in_child() -> None:
    """Runs in the child between fork and exec: die with the parent."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def popen(command: Sequence[str], **kwargs: Any) -> "subprocess.Popen[Any]":
    """``subprocess.Popen`` in a new session (a process group of its own), listed in RUNNING."""
    process = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_in_child, **kwargs)
    RUNNING.add(process)
    return process


def end(process: "subprocess.Popen[Any]") -> Optional[int]:
    """Kills the process's whole group (pytest's children, which hold the GPU, too) and reaps
    it; its exit status where it had already ended by itself, else None."""
    code = process.poll()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    RUNNING.discard(process)
    return code


def end_all() -> None:
    """Ends every child's group (SIGTERM, SIGINT, or the end of the check)."""
    for process in list(RUNNING):
        end(process)


def wait(process: "subprocess.Popen[Any]", timeout: Optional[float], grace: float = 0.0) -> Optional[int]:
    """The exit status, or None after ``timeout`` seconds, the group then killed; with a
    ``grace``, SIGINT first and that many seconds to finish (pytest then writes its report
    of the tests that ran)."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if grace > 0:
            try:
                os.killpg(process.pid, signal.SIGINT)
                process.wait(timeout=grace)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        end(process)
        return None
    # The child is done; anything it left in its group (a daemon, a stray worker) goes too.
    end(process)
    return code


def run_all_logged(
    commands: Sequence[tuple[Sequence[str], Path]], timeout: Optional[float] = None, grace: float = 0.0, **kwargs: Any
) -> list[Optional[int]]:
    """Runs the commands side by side, each with its output in its log file; their exit
    statuses, None for each one still running after ``timeout`` seconds (its group killed,
    after SIGINT and ``grace`` seconds where one is given)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    started = []
    try:
        for command, log_file in commands:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_file, "w")  # noqa: SIM115 - closed below
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            started.append((popen(command, stdout=out, stderr=subprocess.STDOUT, **kwargs), out))
        codes: list[Optional[int]] = []
        for process, _ in started:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            codes.append(wait(process, left, grace))
        return codes
    finally:
        for process, out in started:
            if process in RUNNING:
                end(process)
            out.close()


def run_logged(command: Sequence[str], log_file: Path, timeout: Optional[float] = None, **kwargs: Any) -> int:
    """Runs ``command`` with its output in ``log_file``; TimeoutExpired after ``timeout``."""
    (code,) = run_all_logged([(command, log_file)], timeout, **kwargs)
    if code is None:
        raise subprocess.TimeoutExpired(list(command), timeout or 0.0)
    return code


def run_captured(command: Sequence[str], timeout: float, **kwargs: Any) -> "subprocess.CompletedProcess[str]":
    """``subprocess.run(capture_output=True, text=True)`` as a listed child in its own group;
    TimeoutExpired after ``timeout`` seconds, the group killed."""
    process = popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end(process)
        raise
    finally:
        if process in RUNNING:
            end(process)
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
