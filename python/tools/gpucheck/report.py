"""The GPU check's results, and the Markdown and JSON that report them."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

PASS, FAIL, MEASURED, SKIPPED, ERROR = "pass", "FAIL", "measured", "skipped", "ERROR"
#: Statuses that make the check as a whole fail.
FAILING = (FAIL, ERROR)
#: The results' file name, in docs/ and in the output directory.
RESULTS_NAME = "gpu-results.md"
REPORT_NAME = "report.json"


@dataclass
class Table:
    """A Markdown table: a title, column headers and rows of cells."""

    title: str
    headers: list[str]
    rows: list[list[str]]


@dataclass
class CheckResult:
    """One numbered item of the report."""

    key: str
    title: str
    status: str
    summary: str
    tables: list[Table] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    #: Markdown shown as it is, after the tables (compare.py's table).
    text: str = ""

    def counts(self) -> dict[str, int]:
        """What the item adds to the summary line: its tests where it ran several (the
        real-PyTorch tests), else itself."""
        if "counts" in self.data:
            return dict(self.data["counts"])
        outcome = "failed" if self.status in FAILING else "skipped" if self.status == SKIPPED else "passed"
        return {outcome: 1}


@dataclass
class Report:
    started: str
    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problem: Optional[str] = None  # why the check could not run at all
    seconds: float = 0.0
    #: False while the check runs (the page is rewritten after every step), True at the end.
    finished: bool = False
    #: Why the check ended before its last step (``stopped by SIGTERM``), or None.
    stopped: Optional[str] = None

    def failed(self) -> bool:
        return self.problem is not None or any(c.status in FAILING for c in self.checks)

    def summary_line(self) -> str:
        """One line: ``gpu-check: 23 passed, 0 failed, 2 skipped in 312 s; step time
        ferrocache/native 0.99`` (each real-PyTorch test counts, and each other item)."""
        if self.problem is not None:
            return f"gpu-check: could not run in {self.seconds:.0f} s: {self.problem}"
        totals = {"passed": 0, "failed": 0, "skipped": 0}
        for check in self.checks:
            for outcome, number in check.counts().items():
                totals[outcome] = totals.get(outcome, 0) + number
        counted = ", ".join(f"{n} {outcome}" for outcome, n in totals.items())
        if self.stopped:
            counted += f" ({self.stopped})"
        elif not self.finished:
            counted += " (still running when this was written)"
        step = next((c for c in self.checks if c.key == "step_time"), None)
        if step is not None and "ratio" in step.data:
            ratio = f"{step.data['ratio']:.3f}"
        elif step is not None and step.status == SKIPPED:
            ratio = f"n/a ({step.summary})"
        else:
            ratio = "n/a (the training failed: see the results page)" if step is not None else "n/a (not run)"
        return f"gpu-check: {counted} in {self.seconds:.0f} s; step time ferrocache/native {ratio}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False, default=str) + "\n"

    def to_markdown(self) -> str:
        lines = ["# ferrocache on a real GPU: scripts/gpu-check", ""]
        if self.finished:
            lines.append(f"Started {self.started}, took {self.seconds:.0f} s.")
        else:
            lines.append(f"Started {self.started}; still running after {self.seconds:.0f} s when this page was "
                         "written (it is rewritten after every step).")  # fmt: skip
        if self.stopped:
            lines += ["", f"**Stopped before the end: {self.stopped}.** The steps it did not reach say so."]
        lines += ["", f"`{self.summary_line()}`", ""]
        if self.problem is not None:
            lines += [f"**Could not run: {self.problem}**", ""]
        if self.environment:
            lines += markdown_table(
                ["environment", ""], [[str(k), str(v)] for k, v in self.environment.items()]
            )
            lines.append("")
        if self.checks:
            lines.append("| # | check | result | summary |")
            lines.append("|---|---|---|---|")
            for number, check in enumerate(self.checks, 1):
                status = check.status if check.status not in FAILING else f"**{check.status}**"
                lines.append(f"| {number} | {escape(check.title)} | {status} | {escape(check.summary)} |")
            lines.append("")
        for number, check in enumerate(self.checks, 1):
            if not check.tables and not check.text:
                continue
            lines += [f"## {number}. {check.title}", ""]
            for table in check.tables:
                if table.title:
                    lines += [table.title, ""]
                lines += markdown_table(table.headers, table.rows)
                lines.append("")
            if check.text:
                lines += [check.text, ""]
        if self.notes:
            lines += ["## Notes", ""]
            lines += [f"- {escape(note)}" for note in self.notes]
            lines.append("")
        return "\n".join(lines)

    def write(self, out: Path, results: Path) -> None:
        """The Markdown to ``results`` (docs/gpu-results.md) and, with the JSON, into ``out``;
        each file replaced whole (a kill halfway leaves the previous one)."""
        out.mkdir(parents=True, exist_ok=True)
        markdown = self.to_markdown()
        results.parent.mkdir(parents=True, exist_ok=True)
        replace_file(results, markdown.encode())
        if results.resolve() != (out / RESULTS_NAME).resolve():
            replace_file(out / RESULTS_NAME, markdown.encode())
        replace_file(out / REPORT_NAME, self.to_json().encode())


def replace_file(path: Path, data: bytes) -> None:
    """Writes ``path`` atomically: a temporary file beside it, then a rename over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def escape(text: str) -> str:
    """Text for a Markdown table cell: no bars or line breaks."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(escape(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return lines


def mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def milliseconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value * 1000:.2f} ms"


def nanoseconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:,.0f} ns"
