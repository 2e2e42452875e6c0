"""The fault sweep under real PyTorch, behind ``scripts/torch-fault-sweep``: the training-shaped
loop of the real-PyTorch suite (two streams, ``record_stream``, pinned host copies,
``empty_cache``) runs once to count the driver calls it makes after start-up, then once per call
and error kind with that call failing (the fake driver's sweep, ``fake_cuda_sweep_arm``). The
runtime is layered on the driver, so a failed driver call is a failed runtime call too for every
runtime function that reaches the driver (all but the per-thread ones: current device, last
error). Each run must end with the process alive and not hung, and the failure must have
reached Python as an exception or ferrocache's log as an ERROR line, unless the call's failure
had no effect to report (the loop's result is then checked to be intact)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KINDS = {
    "out_of_memory": (2, 0),
    "invalid_value": (1, 0),
    "invalid_handle": (400, 0),
    "capture_unsupported": (900, 0),
    "illegal_address_sticky": (700, 1),
}

CHILD = r"""
import ctypes, json, sys
import numpy as np
import torch, ferrocache
ferrocache.install()
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_sweep_calls.restype = ctypes.c_uint64
torch.empty(1, device="cuda")  # start-up is not swept
fail_at, code, sticky = (int(a) for a in sys.argv[1:4])
fake.fake_cuda_sweep_arm(ctypes.c_uint64(fail_at), ctypes.c_uint32(code), ctypes.c_int(sticky))
errors = []
checked = 0
side = None
host = np.arange(4 * 64 * 256, dtype=np.float32).reshape(4, 64, 256)
for step in range(3):
    try:
        side = side or torch.cuda.Stream()
        x = torch.from_numpy(host).pin_memory().to("cuda", non_blocking=True)
        acts = [torch.empty(4, 64, 256, device="cuda") for _ in range(4)]
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            grads = [torch.empty(256, 256, device="cuda") for _ in range(4)]
        for g in grads:
            g.record_stream(torch.cuda.current_stream())
        back = x.cpu().numpy()
        assert (back == host).all(), "the bytes changed"
        checked += 1
        del acts, grads, x
        if step == 1:
            torch.cuda.empty_cache()
    except Exception as err:
        errors.append(f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
print("RESULT:" + json.dumps({"calls": fake.fake_cuda_sweep_calls(),
                              "fired": fake.fake_cuda_sweep_fired(),
                              "errors": errors, "checked": checked}), flush=True)
"""


def run_child(fail_at: int, code: int, sticky: int, timeout: float) -> dict:
    env = {**os.environ, "FAKE_CUDA_QUIET": "1", "FAKE_LIBCUDA_TOTAL_MEM": str(4 << 30)}
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(fail_at), str(code), str(sticky)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"verdict": "HUNG"}
    result = next((json.loads(line[7:]) for line in child.stdout.splitlines()
                   if line.startswith("RESULT:")), None)
    if child.returncode != 0 or result is None:
        return {"verdict": f"DIED (exit {child.returncode})", "stderr": child.stderr[-600:]}
    logged = "[ERROR] Allocator:" in child.stderr
    result["logged"] = logged
    if not result["fired"]:
        result["verdict"] = "not reached"
    elif result["errors"] or logged:
        result["verdict"] = "reported"
    elif result["checked"] == 3:
        result["verdict"] = "no effect"  # the loop completed intact
    else:
        result["verdict"] = "SILENT"
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--stride", type=int, default=1, help="sweep every Nth call")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.time()
    clean = run_child(0, 0, 0, args.timeout)
    if clean.get("checked") != 3:
        print(f"the clean run failed: {clean}")
        return 1
    total = clean["calls"]
    print(f"the loop makes {total} driver calls after start-up", flush=True)
    counts: dict[str, dict[str, int]] = {}
    bad = []
    for kind in args.kinds.split(","):
        code, sticky = KINDS[kind]
        for index in range(1, total + 1, args.stride):
            outcome = run_child(index, code, sticky, args.timeout)
            verdict = outcome["verdict"]
            counts.setdefault(kind, {}).setdefault(verdict, 0)
            counts[kind][verdict] += 1
            if verdict in ("HUNG", "SILENT") or verdict.startswith("DIED"):
                bad.append((kind, index, outcome))
        print(f"{kind}: {counts[kind]}", flush=True)
    summary = {"calls": total, "stride": args.stride, "counts": counts,
               "bad": [(k, i, o.get("verdict")) for k, i, o in bad],
               "seconds": round(time.time() - started)}
    print(json.dumps(summary, indent=1))
    for kind, index, outcome in bad:
        print(f"  {kind} at call {index}: {outcome}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
