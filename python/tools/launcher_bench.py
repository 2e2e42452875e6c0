"""What ``ferrocache run`` adds to a Python process that never imports torch, measured in one run
side by side (a small hyperfine): ``python -c pass`` plain, with only the startup hook on
``PYTHONPATH`` (what every Python process of the command pays), and under ``ferrocache run``
(the launcher's own start as well). The commands alternate, so that a busy machine slows them
alike; the medians and their ratios are printed.

    python python/tools/launcher_bench.py                       # target/release/ferrocache
    python python/tools/launcher_bench.py --runs 100 --ferrocache "$(which ferrocache)"

Speed is measured here, never asserted in a test (docs/launcher.md has the figures).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def default_ferrocache() -> str:
    built = REPO / "target" / "release" / "ferrocache"
    if built.is_file():
        return str(built)
    found = shutil.which("ferrocache")
    if found is None:
        sys.exit("no ferrocache command: build it (cargo build --release) or pass --ferrocache")
    return found


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs of each command (default 40)")
    parser.add_argument("--ferrocache", default=None, help="the ferrocache command to measure")
    parser.add_argument("--python", default=sys.executable, help="the Python to start")
    args = parser.parse_args()
    ferrocache = args.ferrocache or default_ferrocache()
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The startup hook this launcher gives its processes (the installed package's, whose
    # bytecode pip compiled, or the checkout's).
    startup = subprocess.run(
        [ferrocache, "run", "--", args.python, "-c",
         "import os; print(os.environ['PYTHONPATH'].split(os.pathsep)[0])"],
        env=plain_env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    hook_env = dict(plain_env, PYTHONPATH=startup)
    python = [args.python, "-c", "pass"]
    commands = {
        "python -c pass": (python, plain_env),
        "python -c pass, startup hook only": (python, hook_env),
        "ferrocache run -- python -c pass": ([ferrocache, "run", "--", *python], plain_env),
    }
    for command, env in commands.values():  # warm the page cache
        timed(command, env)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, (command, env) in commands.items():
            times[name].append(timed(command, env))
    base = statistics.median(times["python -c pass"])
    print(f"{args.runs} runs each, alternating; ferrocache = {ferrocache}; hook = {startup}")
    print(f"{'command':<36} {'median':>10} {'min':>10} {'ratio':>7} {'added':>10}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<36} {median * 1e3:>8.1f}ms {min(samples) * 1e3:>8.1f}ms "
              f"{median / base:>6.2f}x {(median - base) * 1e3:>+8.1f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
