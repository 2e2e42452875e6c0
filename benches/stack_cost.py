"""Host cost per allocation of recording Python stacks: ferrocache against PyTorch's native
allocator, on real PyTorch and the fake CUDA, side by side in one run.

    scripts/with-fake-cuda python benches/stack_cost.py [--pairs 20000] [--rounds 7]

Each round runs every configuration once, in a fresh process each (the allocator is chosen once
per process), in turn, so that drift on a shared machine hits all of them alike. A measurement
is the time of `pairs` allocate-and-free pairs of a 4 KiB tensor (a cache hit: no device call)
made 12 Python frames deep; the figure is the median over the rounds, per pair, and the cost of
stacks is the difference against the same allocator with recording off. (Speed is never
asserted in tests; this is a benchmark. criterion benchmarks cannot drive PyTorch.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    mode, record, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "ferrocache":
        import ferrocache
        ferrocache.install()
    torch.empty(1, device="cuda")  # CUDA initialised, a segment cached
    if record == "stacks":
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=100000)

    def loop(n):
        start = time.perf_counter()
        for _ in range(n):
            x = torch.empty(4096, dtype=torch.uint8, device="cuda")
            del x
        return time.perf_counter() - start

    def deep(depth, n):
        return loop(n) if depth == 0 else deep(depth - 1, n)

    deep(10, 1000)  # warm up
    print(json.dumps(deep(10, pairs) / pairs))
    """
)

CONFIGS = [
    ("native", "off"),
    ("native", "stacks"),
    ("ferrocache", "off"),
    ("ferrocache", "stacks"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    env = dict(os.environ, FAKE_CUDA_QUIET="1")
    times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for mode, record in CONFIGS:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, record, str(args.pairs)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            times[(mode, record)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {c: statistics.median(v) * 1e6 for c, v in times.items()}
    print(f"{'allocator':<11} {'recording':<9} {'median us/pair':>15} {'min':>8} {'max':>8}")
    for (mode, record), value in median.items():
        samples = [t * 1e6 for t in times[(mode, record)]]
        print(f"{mode:<11} {record:<9} {value:15.2f} {min(samples):8.2f} {max(samples):8.2f}")
    for mode in ("native", "ferrocache"):
        cost = median[(mode, "stacks")] - median[(mode, "off")]
        print(f"cost of stacks, {mode}: {cost:.2f} us per alloc+free pair")
    ours = median[("ferrocache", "stacks")] - median[("ferrocache", "off")]
    theirs = median[("native", "stacks")] - median[("native", "off")]
    if theirs > 0:
        print(f"ratio ferrocache/native (cost of stacks): {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
