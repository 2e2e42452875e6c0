"""One rank of a torchrun job that runs out of memory on one rank
(python/tests/real_torch/test_distributed.py). ferrocache is installed with FERROCACHE_SNAPSHOT_ON_OOM
from the environment; every rank joins a gloo group with a short timeout, the last rank asks for
more than its GPU holds, the others wait for it in an all-reduce. Each rank writes its pid to
OUT/pid_rank<N> first, so the test can check that none is left running.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ferrocache

out = sys.argv[1]
group_timeout = float(sys.argv[2])
rank, local_rank, world = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
with open(os.path.join(out, f"pid_rank{rank}"), "w") as f:
    f.write(str(os.getpid()))

ferrocache.install()
torch.cuda.set_device(local_rank)
dist.init_process_group("gloo", timeout=timedelta(seconds=group_timeout))
activations = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(rank + 2)]
dist.barrier()


def grow_activations():
    # More than the whole GPU: PyTorch's out-of-memory message, raised on this rank only.
    return torch.empty(1 << 40, dtype=torch.uint8, device="cuda")


if rank == world - 1:
    with open(os.path.join(out, "oom_at"), "w") as f:
        f.write(repr(time.time()))
    activations.append(grow_activations())
total = torch.tensor([1.0]).cuda()
dist.all_reduce(total)  # the other ranks wait here for the rank that failed
print(f"rank {rank} finished its all-reduce", flush=True)
