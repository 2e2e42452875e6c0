"""The soak test behind ``scripts/soak``: see that script. The parent draws the settings and
starts one child process after another; each child runs the loop on two threads and prints a
JSON sample line every few seconds; the parent writes them all to ``samples.jsonl`` and the
verdicts to ``report.md``."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.8",
    "expandable_segments:True,max_split_size_mb:256",
    "roundup_power2_divisions:[256:1,512:2,>:8],max_split_size_mb:64",
]
SAMPLE_SECONDS = 5
#: Samples of the first part of each process are warm-up and not judged.
WARM_UP = 0.2
#: Growth allowed after warm-up, from the first judged sample to the last (RSS wanders a little
#: with the Python heap; a leak per step grows without bound).
RSS_SLACK = 8 << 20

CHILD = r"""
import json, os, sys, threading, time
import numpy as np
import torch, ferrocache
native = os.environ.get("SOAK_NATIVE") == "1"
if not native:
    ferrocache.install()
if os.environ.get("SOAK_FRACTION"):
    torch.cuda.set_per_process_memory_fraction(float(os.environ["SOAK_FRACTION"]))
seconds = float(sys.argv[1])
steps = [0, 0]
stop = threading.Event()

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def loop(index):
    stream = torch.cuda.Stream()
    side = torch.cuda.Stream()
    hidden, layers, batch = 512, 6, 4
    with torch.cuda.stream(stream):
        params = [torch.empty(hidden, hidden, device="cuda") for _ in range(layers)]
    hosts = [np.ones((batch, seq, hidden), dtype=np.float32) for seq in (192, 256, 320)]
    while not stop.is_set():
        host = hosts[steps[index] % len(hosts)]
        with torch.cuda.stream(stream):
            inputs = torch.from_numpy(host).pin_memory().to("cuda", non_blocking=True)
            seq = host.shape[1]
            acts = [torch.empty(batch, seq, hidden, device="cuda") for _ in range(layers)]
            with torch.cuda.stream(side):
                side.wait_stream(stream)
                grads = [torch.empty_like(p) for p in params]
            for g in grads:
                g.record_stream(stream)
            del acts, grads, inputs
            stream.wait_stream(side)
        steps[index] += 1

threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
start = time.time()
while time.time() - start < seconds:
    time.sleep(SAMPLE_SECONDS)
    print(json.dumps({"t": round(time.time() - start, 1), "steps": sum(steps), "rss": rss(),
                      "reserved": torch.cuda.memory_reserved() if native else ferrocache.memory_reserved(),
                      "allocated": torch.cuda.memory_allocated() if native else ferrocache.memory_allocated()}), flush=True)
stop.set()
for t in threads:
    t.join()
""".replace("SAMPLE_SECONDS", str(SAMPLE_SECONDS))


def judge(samples: list[dict]) -> dict:
    judged = samples[int(len(samples) * WARM_UP):]
    if len(judged) < 2:
        return {"verdict": "too short"}
    first, last = judged[0], judged[-1]
    reserved = {s["reserved"] for s in judged}
    rss_growth = last["rss"] - first["rss"]
    steps = last["steps"] - first["steps"]
    flat = len(reserved) == 1 and rss_growth <= RSS_SLACK
    return {
        "verdict": "flat" if flat else "GROWS",
        "steps": last["steps"],
        "reserved_mib": sorted(r / 2**20 for r in reserved),
        "rss_first_mib": round(first["rss"] / 2**20, 1),
        "rss_last_mib": round(last["rss"] / 2**20, 1),
        "rss_bytes_per_step": round(rss_growth / steps, 1) if steps else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--process-minutes", type=float, default=5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    deadline = time.time() + args.minutes * 60
    rows, failures = [], 0
    with (args.out / "samples.jsonl").open("w") as log:
        number = 0
        while time.time() < deadline:
            number += 1
            seconds = min(args.process_minutes * 60, max(deadline - time.time(), 30))
            conf = rng.choice(SETTINGS)
            fraction = "0.9" if "garbage_collection" in conf else ""
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "SOAK_FRACTION": fraction,
                   "FAKE_LIBCUDA_TOTAL_MEM": str(8 << 30), "FAKE_CUDA_QUIET": "1"}
            print(f"process {number}: PYTORCH_CUDA_ALLOC_CONF={conf!r} for {seconds:.0f} s", flush=True)
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(seconds)], env=env,
                                     stdout=subprocess.PIPE, text=True)
            samples = []
            assert child.stdout is not None
            for line in child.stdout:
                sample = json.loads(line)
                samples.append(sample)
                log.write(json.dumps({"process": number, "conf": conf, **sample}) + "\n")
            code = child.wait()
            verdict = judge(samples) if code == 0 else {"verdict": f"exited {code}"}
            failures += verdict["verdict"] != "flat"
            rows.append((number, conf, verdict))
            print(f"  {verdict}", flush=True)
    lines = [
        f"# Soak: {args.minutes:g} minutes, seed {args.seed}",
        "",
        f"Sampled every {SAMPLE_SECONDS} s; the first {WARM_UP:.0%} of each process is warm-up.",
        "",
        "| process | PYTORCH_CUDA_ALLOC_CONF | verdict | steps | reserved (MiB) | RSS first → last (MiB) | RSS bytes/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, conf, v in rows:
        lines.append(
            f"| {number} | `{conf}` | {v['verdict']} | {v.get('steps', '')} | {v.get('reserved_mib', '')} | "
            f"{v.get('rss_first_mib', '')} → {v.get('rss_last_mib', '')} | {v.get('rss_bytes_per_step', '')} |"
        )
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
