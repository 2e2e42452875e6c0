"""Data parallelism on two fake GPUs with ``backend="nccl"``, run by torchrun: DDP (gradient
buckets, their all-reduce on NCCL's stream, ``record_stream``) for two steps, then FSDP2
(``torch.distributed.fsdp.fully_shard``: parameters all-gathered and gradients reduce-scattered
on communication streams) for two steps. Each rank writes its figures.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import _figures


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    ).cuda()  # fmt: skip


def train(model, label):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.ones(4, 32, device="cuda")
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The figures after a step are the same in every run only where no other thread frees
        # the step's tensors: the stock ProcessGroupNCCL frees some of FSDP2's from its watchdog
        # thread once it sees their work complete, unless TORCH_NCCL_BLOCKING_WAIT=1 (which
        # test_clients_real.py sets; docs/real-clients.md).
        _figures.step(f"{label} {step}")


# The backward runs on the calling thread, not on the autograd engine's thread for the device:
# that thread may drop its last reference to a finished graph task (which holds a Python object)
# after the interpreter began to finalize, and CPython's pthread_exit through a noexcept
# destructor then aborts the rank at exit ("terminate called without an active exception"),
# under either allocator: PyTorch's race pytorch/pytorch#117762, seen once in CI under PyTorch's
# own allocator (docs/real-clients.md, "Three tests that were flaky"). Both runs use the same.
torch.autograd.set_multithreading_enabled(False)
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
torch.manual_seed(0)
train(DistributedDataParallel(mlp(), device_ids=[rank], bucket_cap_mb=1), "ddp")
model = mlp()
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
train(model, "fsdp2")
dist.barrier()
_figures.write(rank)
dist.destroy_process_group()
