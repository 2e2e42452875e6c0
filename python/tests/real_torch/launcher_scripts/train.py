"""A training-like script that never imports ferrocache: it allocates and frees CUDA tensors,
then writes what torch.cuda says (and whether ferrocache answered) to the JSON file given first
({rank} in its name is the rank).
Options: --exit N (exit with N), --wait-for-sigterm (say "ready" in the output folder, then wait;
SIGTERM writes "sigterm" there and exits 42; with --default-sigterm, torch's default handling)."""

import json
import os
import signal
import sys
import time

import torch

out = sys.argv[1].replace("{rank}", os.environ.get("RANK", "0"))
args = sys.argv[2:]
device = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(device)
kept = []
for step in range(6):
    # Growing activations, as a sequence length that grows: a fragmenting pattern.
    batch = [torch.empty((step + 1) * (3 << 20), dtype=torch.uint8, device="cuda") for _ in range(4)]
    kept.append(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
    del batch
stats = torch.cuda.memory_stats()
ferrocache = sys.modules.get("ferrocache")  # looked up, never imported
answer = {
    "rank": int(os.environ.get("RANK", "0")),
    "device": device,
    "ferrocache_loaded": ferrocache is not None,
    "installed": bool(ferrocache and ferrocache.is_installed()),
    "allocated_current": stats.get("allocated_bytes.all.current", 0),
    "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
    "stats_are_ferrocache": bool(ferrocache) and dict(ferrocache.memory_stats(device)) == dict(stats),
    "kept_bytes": sum(t.numel() for t in kept),
}
with open(out, "w") as f:
    json.dump(answer, f)

if "--wait-for-sigterm" in args:
    folder = os.path.dirname(out)
    if "--default-sigterm" not in args:
        def on_sigterm(signum, frame):
            open(os.path.join(folder, "sigterm"), "w").close()
            sys.exit(42)

        signal.signal(signal.SIGTERM, on_sigterm)
    open(os.path.join(folder, "ready"), "w").close()
    while True:
        time.sleep(0.1)
if "--exit" in args:
    sys.exit(int(args[args.index("--exit") + 1]))
