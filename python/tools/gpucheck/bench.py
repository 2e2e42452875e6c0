"""Host cost side by side: one long-lived worker process per allocator (an allocator cannot be
swapped once CUDA is initialised), asked in turn to time a batch, so that the two are measured
interleaved under the same conditions; the medians of the repetitions are compared.

A worker speaks a line protocol on stdin/stdout: it prints one JSON line when ready, then
answers each ``run <size> <iterations>`` with ``{"ns_per_op": ...}``, and exits on ``quit``
(see :func:`gpucheck.workloads.bench_worker`).
"""

from __future__ import annotations

import json
import queue
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence

from . import processes


class BenchError(RuntimeError):
    """A worker failed, answered nonsense, or did not answer in time."""


@dataclass
class _Worker:
    name: str
    process: subprocess.Popen[str]
    log: Path
    log_handle: IO[str]
    lines: "queue.Queue[Optional[str]]" = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def pump(stream: IO[str]) -> None:
            for line in stream:
                self.lines.put(line)
            self.lines.put(None)

        assert self.process.stdout is not None
        threading.Thread(target=pump, args=(self.process.stdout,), daemon=True).start()

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name} worker gave no answer in {timeout:.0f} s") from None
        if line is None:
            self.process.wait(timeout=10)
            raise BenchError(
                f"{self.name} worker exited with status {self.process.returncode}: "
                f"{last_line(self.log)}"
            )
        try:
            return dict(json.loads(line))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise BenchError(f"{self.name} worker answered {line.strip()!r}") from None

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(text + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.name} worker is gone: {last_line(self.log)}") from None


def last_line(path: Path) -> str:
    """The last non-empty line of a log: for a traceback, the exception."""
    lines = [line.strip() for line in tail(path, 4000).splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def tail(path: Path, characters: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-characters:].strip() or "(no output)"
    except OSError:
        return "(no log)"


def interleaved(
    commands: Mapping[str, Sequence[str]],
    sizes: Sequence[int],
    repetitions: int,
    iterations: int,
    logs: Path,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Path] = None,
    timeout: float = 30.0,
    deadline: Optional[float] = None,
) -> dict[str, Any]:
    """Starts one worker per entry of ``commands``, then for each repetition and size asks
    each worker in turn for a batch of ``iterations`` operations; the order of the workers
    alternates from one repetition to the next. Each reply may take ``timeout`` seconds (the
    first, CUDA's start, three times that), and all of it must end by ``deadline`` (monotonic
    seconds): past either, BenchError.

    Returns ``{"samples": {name: {size: [ns per op, ...]}}, "order": [[rep, size, name], ...]}``.
    """
    logs.mkdir(parents=True, exist_ok=True)
    workers: list[_Worker] = []

    def within(seconds: float) -> float:
        """A reply's wait: its own cap, never past the deadline."""
        if deadline is None:
            return seconds
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError("the step's cap was reached before the benchmark ended")
        return min(seconds, left)

    try:
        for name, command in commands.items():
            log = logs / f"bench-{name}.log"
            log_handle = open(log, "w")  # noqa: SIM115 - closed in the finally below
            process = processes.popen(
                list(command),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_handle,
                text=True,
                bufsize=1,
                env=None if env is None else dict(env),
                cwd=cwd,
            )
            workers.append(_Worker(name, process, log, log_handle))
        for worker in workers:  # after every fork: the readers are threads
            worker.start_reader()
        for worker in workers:
            ready = worker.reply(within(3 * timeout))
            if not ready.get("ready"):
                raise BenchError(f"{worker.name} worker did not say it was ready: {ready}")
        samples: dict[str, dict[int, list[float]]] = {w.name: {s: [] for s in sizes} for w in workers}
        order: list[list[Any]] = []
        for repetition in range(repetitions):
            turn = workers if repetition % 2 == 0 else workers[::-1]
            for size in sizes:
                for worker in turn:
                    worker.send(f"run {size} {iterations}")
                    answer = worker.reply(within(timeout))
                    value = answer.get("ns_per_op")
                    if not isinstance(value, (int, float)) or value < 0:
                        raise BenchError(f"{worker.name} worker answered {answer}")
                    samples[worker.name][size].append(float(value))
                    order.append([repetition, size, worker.name])
        return {"samples": samples, "order": order}
    finally:
        for worker in workers:
            if worker.process.poll() is None:
                try:
                    worker.send("quit")
                    worker.process.wait(timeout=10)
                except (BenchError, subprocess.TimeoutExpired, OSError):
                    pass
            processes.end(worker.process)
            worker.log_handle.close()


def medians(samples: Mapping[str, Mapping[int, Sequence[float]]]) -> dict[str, dict[int, float]]:
    """The median of each worker's samples, size by size."""
    return {
        name: {size: statistics.median(values) for size, values in by_size.items() if values}
        for name, by_size in samples.items()
    }
