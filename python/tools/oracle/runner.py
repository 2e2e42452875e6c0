"""The client side of :mod:`oracle.server`: one server process per harness (started at the first
run, ended at exit), which forks a child per run. :func:`run_programs` runs several programs at
once (PyTorch's run and ferrocache's side by side: the machine has two cores or more).

Must run under ``scripts/with-fake-cuda``: the server inherits this process's environment (the
fake CUDA preloaded, the venv's torch and ferrocache).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

SERVER = Path(__file__).with_name("server.py")


class Runner:
    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(SERVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: a timeout ends it and its children
            )
        return self.process

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        self.process = None

    def run(self, jobs: list[tuple[dict[str, Optional[str]], dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
        """Runs each ``(environment changes, program)`` in a child of its own, all at once; their
        results in order. Each child logs the fake driver's memory calls to a file of its own
        (``FAKE_CUDA_CALL_LOG``). A child that fails raises RuntimeError with the end of its
        output."""
        process = self.start()
        assert process.stdin is not None and process.stdout is not None
        with tempfile.TemporaryDirectory(prefix="oracle-") as scratch:
            sent = []
            for i, (env, program) in enumerate(jobs):
                out = str(Path(scratch) / f"{i}.json")
                log = str(Path(scratch) / f"{i}.log")
                # Each run's own log of the fake driver's memory calls (oracle.child reads it).
                calls = Path(scratch) / f"{i}.calls"
                calls.touch()
                env = {**env, "FAKE_CUDA_CALL_LOG": str(calls)}
                sent.append({"env": env, "program": program, "out": out, "log": log})
            process.stdin.write(json.dumps({"jobs": sent}) + "\n")
            process.stdin.flush()
            selector = selectors.DefaultSelector()
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                self.stop()
                raise TimeoutError(f"the oracle's runs took more than {timeout:.0f} s")
            line = process.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError("the oracle's server ended unexpectedly")
            status = json.loads(line)["status"]
            results = []
            for job, code in zip(sent, status):
                if code != 0:
                    output = Path(job["log"]).read_text(errors="replace")
                    raise RuntimeError(f"a {job['program']['allocator']} run failed (exit {code}):\n{output[-4000:]}")
                with open(job["out"], encoding="utf-8") as result:
                    results.append(json.load(result))
        return results


_RUNNER = Runner()
atexit.register(_RUNNER.stop)


def run_programs(jobs: list[tuple[dict[str, Optional[str]], dict[str, Any]]], timeout: float = 900) -> list[dict[str, Any]]:
    """:meth:`Runner.run` on the process's one server."""
    return _RUNNER.run(jobs, timeout)
