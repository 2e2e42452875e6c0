#!/usr/bin/env python3
"""The memory of every rank of a data-parallel job, with ferrocache, under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/ddp_memory.py     # --steps 3 --out DIR
    # without a GPU, on the project's fake CUDA:
    FAKE_LIBCUDA_DEVICE_COUNT=2 scripts/with-fake-cuda torchrun --standalone --nproc-per-node 2 examples/ddp_memory.py

Each rank (one process per GPU, as torchrun starts them):

- installs ferrocache with ``snapshot_on_oom``: the allocation history, with Python stacks, is
  recorded from the start, and a rank that runs out of memory leaves ``DIR/oom_rank<N>.pickle``;
- runs a few steps with the memory pattern of a DDP training step: parameters, DDP's gradient
  buckets (25 MiB each), Adam's two moments, activations kept for the backward pass, each bucket
  all-reduced on a communication stream as the backward pass fills it. The ranks get batches of
  different sizes, as uneven data gives them, so their peaks differ;
- dumps its snapshot with ``ferrocache.dump_snapshot("DIR/ddp_memory.pickle")``, which adds the
  rank: ``DIR/ddp_memory_rank<N>.pickle``.

Rank 0 then prints the job: every rank's peaks (gathered with ``all_gather_object``), the worst
rank, the spread, and ``ferrocache replay --job`` on the snapshots.

No kernel runs (``torch.empty``/``torch.zeros``, copies and collectives only), so it also runs
on the fake CUDA. For a real model, keep the ferrocache lines and put your training loop in
place of ``train_step``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ferrocache

MIB = 1 << 20
LAYERS = 8
HIDDEN = 1024  # a layer's weight: HIDDEN x HIDDEN floats, 4 MiB
SEQUENCE = 128
BUCKET_BYTES = 25 * MIB  # DDP's default bucket_cap_mb


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--out", default="ddp-memory-out", help="where the snapshots go")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo, nccl)")
    return parser.parse_args()


def buckets_of(sizes: list[int]) -> list[list[int]]:
    """Layer indices grouped into DDP buckets, last layer first (the order gradients arrive)."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for layer in reversed(range(len(sizes))):
        if buckets[-1] and filled + sizes[layer] > BUCKET_BYTES:
            buckets.append([])
            filled = 0
        buckets[-1].append(layer)
        filled += sizes[layer]
    return buckets


def train_step(
    params, buckets, bucket_layers, optimizer_state, batch: int, comm: torch.cuda.Stream
) -> None:
    """One step's allocations, in DDP's order (``bucket_layers``: each bucket's layers, as
    :func:`buckets_of` groups them)."""
    # Forward: each layer's output is kept for the backward pass.
    activations = [torch.empty(batch * SEQUENCE * HIDDEN, device="cuda") for _ in params]
    # Backward, last layer first: the gradient of each activation is a temporary; a bucket is
    # all-reduced on the communication stream once all its layers have their gradients.
    for bucket, layers in zip(buckets, bucket_layers):
        for layer in layers:
            grad_input = torch.empty_like(activations[layer])
            del grad_input
            activations[layer] = None
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            dist.all_reduce(bucket)
    torch.cuda.current_stream().wait_stream(comm)
    # Optimizer: Adam's moments appear at the first step and stay.
    if not optimizer_state:
        optimizer_state.extend(torch.zeros_like(p) for p in params for _ in range(2))


def main() -> int:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    out = Path(args.out)
    # Before the first CUDA tensor. History from the start; a snapshot per rank at an OOM.
    ferrocache.install(snapshot_on_oom=out / "oom.pickle")
    torch.cuda.set_device(local_rank)
    dist.init_process_group(args.backend, timeout=timedelta(minutes=2))

    params = [torch.empty(HIDDEN * HIDDEN, device="cuda") for _ in range(LAYERS)]
    sizes = [p.nbytes for p in params]
    bucket_layers = buckets_of(sizes)
    buckets = [
        torch.zeros(sum(sizes[i] for i in layers) // 4, device="cuda") for layers in bucket_layers
    ]
    optimizer_state: list[torch.Tensor] = []
    comm = torch.cuda.Stream()
    batch = 8 + 4 * rank  # uneven data: each rank's batch differs
    for _ in range(args.steps):
        train_step(params, buckets, bucket_layers, optimizer_state, batch, comm)
    torch.cuda.synchronize()

    snapshot = ferrocache.dump_snapshot(out / "ddp_memory.pickle")  # ddp_memory_rank<N>.pickle
    stats = torch.cuda.memory_stats()
    peaks = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
    mine = (rank, local_rank, *peaks, snapshot)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(everyone)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(ranks: list) -> None:
    print(f"{'rank':>4}  {'device':<7} {'peak allocated':>15} {'peak reserved':>14}  snapshot")
    for rank, local_rank, allocated, reserved, snapshot in ranks:
        print(
            f"{rank:>4}  cuda:{local_rank:<2} {allocated / MIB:>11.1f} MiB "
            f"{reserved / MIB:>10.1f} MiB  {snapshot}"
        )
    peaks = [reserved for _, _, _, reserved, _ in ranks]
    worst = max(range(len(ranks)), key=lambda i: peaks[i])
    print(
        f"job: worst rank {ranks[worst][0]} ({peaks[worst] / MIB:.1f} MiB reserved at its peak), "
        f"spread {max(peaks) / max(min(peaks), 1):.2f}x, sum {sum(peaks) / MIB:.1f} MiB\n"
    )
    replay_job([snapshot for *_, snapshot in ranks])


def replay_job(snapshots: list[str]) -> None:
    """``ferrocache replay --job``: the snapshots replayed as the ranks of one job."""
    command = shutil.which("ferrocache")
    if command is None:
        print("the `ferrocache` command is not on the PATH (pip install ferrocache puts it there); "
              f"replay the job later with: ferrocache replay --job {' '.join(snapshots)}")
        return
    print(f"$ ferrocache replay --job {' '.join(snapshots)}", flush=True)
    done = subprocess.run([command, "replay", "--job", *snapshots], capture_output=True, text=True)
    if done.returncode == 2 and "--job" in done.stderr:
        print("this ferrocache's `replay` has no --job (a newer ferrocache has it); "
              "the ranks replayed one by one instead:", flush=True)
        done = subprocess.run([command, "replay", *snapshots], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)


if __name__ == "__main__":
    sys.exit(main())
