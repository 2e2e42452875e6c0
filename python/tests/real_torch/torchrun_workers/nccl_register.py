"""One rank of a torchrun job (python/tests/real_torch/test_distributed.py): an NCCL process group
that registers the caching allocator's segments with its communicator (the stock backend with
TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, or torch 2.15's default backend, whose hook is
always on), under PyTorch's allocator or ferrocache's. The fake NCCL keeps what is registered
(tests/fake-cuda/libs/src/nccl.rs); the rank writes what was registered at each step to
OUT/report_<ALLOCATOR>_rank<N>.json.

Usage: nccl_register.py OUT BACKEND native|ferrocache
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

MIB = 1 << 20
out, backend, allocator = sys.argv[1:4]
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])

from _fake_nccl import nccl, registered


def segments() -> list[list[int]]:
    return sorted([s["address"], s["total_size"]] for s in torch.cuda.memory._snapshot()["segments"])


if allocator == "ferrocache":
    import ferrocache

    ferrocache.install()
    assert ferrocache.frontend.is_installed(), "the front end is not in place"
torch.cuda.set_device(local_rank)
report = {"backend": backend, "allocator": torch.cuda.get_allocator_backend()}

# A segment made before the group: registered from the allocator's snapshot when the
# communicator is made.
early = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
dist.init_process_group(backend, timeout=timedelta(seconds=60), device_id=torch.device("cuda", local_rank))
total = torch.ones(1024, device="cuda")
dist.all_reduce(total)  # the stock backend makes its communicator here
torch.cuda.synchronize()
report["after_init"] = registered()
report["segments_after_init"] = segments()

# A segment made while the group lives: registered by the allocator's trace tracker.
late = torch.empty(30 * MIB, dtype=torch.uint8, device="cuda")
report["after_alloc"] = registered()
report["segments_after_alloc"] = segments()

# Freed and given back: deregistered before the memory goes.
del early, late, total
torch.cuda.synchronize()
torch.cuda.empty_cache()
report["after_free"] = registered()
report["segments_after_free"] = segments()
dist.barrier()
dist.destroy_process_group()
report["after_destroy"] = registered()
report["registrations_made"] = nccl.fake_nccl_registration_count(0)
report["deregistered_after_free"] = nccl.fake_nccl_registration_count(1)
with open(os.path.join(out, f"report_{allocator}_rank{rank}.json"), "w") as f:
    json.dump(report, f)
