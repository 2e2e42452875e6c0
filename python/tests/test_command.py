"""The ``ferrocache`` command that the package installs: the cargo binary's program, run as a
user runs it (``ferrocache replay ...``, ``ferrocache check-config ...``), from the virtual
environment's bin directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ferrocache
import pytest
from conftest import REPO, TRACES, _skip_or_fail

#: Where pip puts the command: beside the interpreter of the environment it installed into.
COMMAND = Path(sys.executable).parent / "ferrocache"
#: cargo's binaries of this checkout, release first (`cargo test` leaves the debug one).
CARGO_BINARIES = [
    Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target") / profile / "ferrocache"
    for profile in ("release", "debug")
]


@pytest.fixture(scope="module")
def command() -> Path:
    if not COMMAND.is_file():
        _skip_or_fail(f"no ferrocache command at {COMMAND}: install the package (scripts/python-tests)")
    return COMMAND


def run(program: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(program), *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_the_demo_compares_four_settings(command: Path) -> None:
    done = run(command, "replay", "--demo")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("demo ")]
    assert len(rows) == 4 and "expandable_segments:True" in rows[1], done.stdout
    assert "Columns:" in done.stdout and "The demo is a training loop" in done.stdout


def test_check_config_accepts_or_rejects_with_pytorchs_words(command: Path) -> None:
    done = run(command, "check-config", "expandable_segments:True,max_split_size_mb:128")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("accepted") and "max_split_size: 128 MiB" in done.stdout
    done = run(command, "check-config", "max_split_size_mb:10")
    assert done.returncode == 2 and done.stdout == ""
    assert "max_split_size_mb too small, must be >= 20" in done.stderr


def test_an_unreadable_trace_prints_its_error_and_nothing_else(command: Path, tmp_path: Path) -> None:
    trace = tmp_path / "run.pickle"
    trace.write_bytes(b"\x80\x04not a snapshot")
    done = run(command, "replay", str(trace), "--conf", "expandable_segments:True",
               "--plot", str(tmp_path / "memory.svg"))
    assert done.returncode == 1
    assert done.stdout == "", "no table, column key or notes after the error"
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ")
    assert str(trace) in done.stderr
    assert not (tmp_path / "memory.svg").exists()


def test_a_recorded_trace_replays_with_a_plot(command: Path, tmp_path: Path) -> None:
    trace = TRACES / "eor_nn.pickle"
    if not trace.is_file():
        pytest.skip(f"{trace} is absent (the shared traces)")
    done = run(command, "replay", str(trace), "--conf", "", "--conf", "expandable_segments:True",
               "--plot", "memory.svg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("eor_nn.pickle") for line in done.stdout.splitlines()) == 2
    assert (tmp_path / "memory.svg").read_text().startswith("<svg")


def test_the_command_is_the_packages_version(command: Path) -> None:
    done = run(command, "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"ferrocache {ferrocache.__version__}"


def test_the_command_is_cargos_program(command: Path) -> None:
    """The installed command and `cargo run --release --` answer alike (one implementation)."""
    built = [binary for binary in CARGO_BINARIES if binary.is_file()]
    if not built:
        pytest.skip(f"no cargo build at {' or '.join(map(str, CARGO_BINARIES))}")
    cargo_binary = built[0]

    def rows(program: Path) -> list[dict[str, object]]:
        done = run(program, "replay", "--demo", "--json", "--conf", "", "--conf", "expandable_segments:True")
        assert done.returncode == 0, done.stderr
        parsed = [json.loads(line) for line in done.stdout.splitlines()]
        for row in parsed:
            row.pop("events_per_second")  # a speed, not a result
        return parsed

    assert rows(command) == rows(cargo_binary)
    assert run(command, "replay", "--help").stdout == run(cargo_binary, "replay", "--help").stdout
