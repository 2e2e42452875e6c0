"""One rank of a torchrun job (python/tests/real_torch/test_distributed.py): NCCL's memory pool,
``torch.cuda.MemPool(backend.mem_allocator)`` (a pluggable allocator over ``ncclMemAlloc`` and
``ncclMemFree``) with ``backend.register_mem_pool(pool)``, under PyTorch's allocator or
ferrocache's. The fake NCCL counts its allocator's calls and keeps what is registered
(tests/fake-cuda/libs/src/nccl.rs); the rank writes what it saw at each step to
OUT/pool_<ALLOCATOR>_rank<N>.json.

Usage: nccl_mem_pool.py OUT BACKEND native|ferrocache
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

MIB = 1 << 20
out, backend_name, allocator = sys.argv[1:4]
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

from _fake_nccl import nccl, registered


def nccl_memory_calls() -> list[int]:
    """ncclMemAlloc and ncclMemFree calls so far."""
    return [nccl.fake_nccl_registration_count(2), nccl.fake_nccl_registration_count(3)]


def pool_segments(pool) -> list[list[int]]:
    return sorted([s["address"], s["total_size"], s["allocated_size"]] for s in pool.snapshot())


if allocator == "ferrocache":
    import ferrocache

    ferrocache.install()
    assert ferrocache.frontend.is_installed(), "the front end is not in place"
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
report = {"allocator": torch.cuda.get_allocator_backend()}

dist.init_process_group(backend_name, timeout=timedelta(seconds=60), device_id=device)
warm = torch.ones(1024, device="cuda")
dist.all_reduce(warm)  # the communicator exists from here on
torch.cuda.synchronize()
backend = dist.group.WORLD._get_backend(device)
registered_before = registered()
calls_before = nccl_memory_calls()

pool = torch.cuda.MemPool(backend.mem_allocator)
with torch.cuda.use_mem_pool(pool):
    small = torch.ones(1000, device="cuda")
    large = torch.ones(6 * MIB, device="cuda")  # 24 MiB
report["nccl calls for the pool"] = [a - b for a, b in zip(nccl_memory_calls(), calls_before)]
segments = pool_segments(pool)
report["pool segments"] = [[size, allocated] for _, size, allocated in segments]
report["tensors in the pool's segments"] = all(
    any(base <= t.data_ptr() < base + size for base, size, _ in segments) for t in (small, large)
)
backend.register_mem_pool(pool)
new = [r for r in registered() if r not in registered_before]
report["registered"] = sorted(size for _, size in new)
report["registered the pool's segments"] = sorted(b for b, _ in new) == [b for b, _, _ in segments]
dist.all_reduce(large)
torch.cuda.synchronize()
backend.deregister_mem_pool(pool)
report["registered after deregister"] = [r for r in registered() if r not in registered_before]

stats = torch.cuda.memory_stats()
report["figures"] = {k: stats[k] for k in ("segment.all.current", "reserved_bytes.all.current")}
del small, large
torch.cuda.empty_cache()
report["nccl calls while the pool lives"] = [a - b for a, b in zip(nccl_memory_calls(), calls_before)]
del pool
report["nccl calls after the pool went"] = [a - b for a, b in zip(nccl_memory_calls(), calls_before)]
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"pool_{allocator}_rank{rank}.json"), "w") as f:
    json.dump(report, f)
