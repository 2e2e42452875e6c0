"""One rank of a torchrun job (python/tests/real_torch/test_distributed.py): ferrocache installed,
this rank's own device, a gloo group, collectives on tensors from ferrocache, a collective on a
communication stream with record_stream, ranks that allocate different amounts, and a snapshot
per rank. Writes what it saw to OUT/report_rank<N>.json.

No kernel runs on the fake CUDA: values are made on the host and copied, and gloo reduces on the
host (it copies CUDA tensors to pinned host memory and back, on streams of its own).
"""

import ctypes
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import ferrocache

MIB = 1 << 20
out = sys.argv[1]
rank, local_rank, world = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
with open(os.path.join(out, f"pid_rank{rank}"), "w") as f:
    f.write(str(os.getpid()))

fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_thread_context_entries.restype = ctypes.c_int64
fake.fake_cuda_thread_context_entries.argtypes = [ctypes.c_int]


def entries_of_this_thread(devices):
    """How often this thread retained or made current each device's primary context (the
    fake's count, per thread)."""
    return [fake.fake_cuda_thread_context_entries(d) for d in devices]


def devices_with_a_context():
    """The devices whose primary context this process holds (cuDevicePrimaryCtxGetState)."""
    active = []
    for device in range(torch.cuda.device_count()):
        flags, state = ctypes.c_uint(), ctypes.c_int()
        fake.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state))
        if state.value:
            active.append(device)
    return active


ferrocache.install()
ferrocache.record_memory_history("all", max_entries=100_000)
torch.cuda.set_device(local_rank)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
report = {"rank": rank, "world": world, "device_count": torch.cuda.device_count()}


def on_device(values):
    """A CUDA tensor holding ``values`` (made on the host, copied: no kernel)."""
    return torch.tensor(values, dtype=torch.float32).cuda()


# Ranks allocate different amounts: rank r keeps r + 1 buffers of 3 MiB.
before = torch.cuda.memory_allocated()
kept = [torch.empty(3 * MIB, dtype=torch.uint8, device="cuda") for _ in range(rank + 1)]
report["allocated_for_kept"] = torch.cuda.memory_allocated() - before
report["kept_bytes"] = sum(t.nbytes for t in kept)
report["device_of_tensors"] = sorted({t.device.index for t in kept})

# Collectives on tensors from ferrocache.
total = on_device([float(rank + 1)] * 1024)
dist.all_reduce(total)
report["all_reduce"] = sorted(set(total.cpu().tolist()))
source = on_device(list(range(8)) if rank == 0 else [0.0] * 8)
dist.broadcast(source, src=0)
report["broadcast"] = source.cpu().tolist()
gathered = [torch.empty(4, device="cuda") for _ in range(world)]
dist.all_gather(gathered, on_device([float(rank)] * 4))
report["all_gather"] = [t.cpu().tolist() for t in gathered]

# Each rank's statistics are its own device's; asking about another device opens nothing there.
# Counted for this thread alone: meanwhile gloo's worker threads may make device 0 current (see
# "main_thread_other_device_entries" below), which a count for the whole process would take for
# the asking.
others = [d for d in range(torch.cuda.device_count()) if d != local_rank]
entries_before = entries_of_this_thread(others)
report["other_devices_allocated"] = [
    torch.cuda.memory_stats(d).get("allocated_bytes.all.current", 0) for d in others
]
report["contexts_opened_by_asking"] = sum(
    after - before for before, after in zip(entries_before, entries_of_this_thread(others))
)
report["segments_devices"] = sorted({s["device"] for s in torch.cuda.memory._snapshot()["segments"]})

# A collective on a communication stream; record_stream keeps its buffer from reuse until the
# stream's work is done. FAKE_LIBCUDA_EVENT_DELAY makes that "later".
comm = torch.cuda.Stream()
bucket = on_device([float(rank)] * (256 * 1024))  # 1 MiB, the same size on every rank
comm.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(comm):
    dist.all_reduce(bucket)
    bucket_sum = bucket.cpu()[0].item()
bucket.record_stream(comm)
address = bucket.data_ptr()
del bucket
again = torch.empty(256 * 1024, dtype=torch.float32, device="cuda")
report["bucket_sum"] = bucket_sum
report["reused_while_comm_busy"] = again.data_ptr() == address
del again
torch.cuda.synchronize()

# Over the whole job, this thread (ferrocache's allocations, the collectives' calls) entered no
# other device's context. The process may hold device 0's: a gloo worker thread that destroys a
# finished work's CUDA event restores its own current device, 0 by default, with cudaSetDevice
# (c10's CUDAGuardImpl::destroyEvent), which creates device 0's primary context on a GPU too
# (CUDA 12 and later; pytorch/pytorch#135279 found the same in ProcessGroupNCCL). Whether that
# thread or this one drops a work last, and when, is thread timing (tests/fake-cuda/README.md,
# "Contexts").
report["main_thread_other_device_entries"] = entries_of_this_thread(others)
report["main_thread_own_device_entries"] = entries_of_this_thread([local_rank])[0]
report["devices_with_a_context"] = devices_with_a_context()

report["snapshot"] = ferrocache.dump_snapshot(os.path.join(out, "job.pickle"))
report["snapshot_with_placeholders"] = ferrocache.dump_snapshot(
    os.path.join(out, "local{local_rank}", "pid{pid}-rank{rank}.pickle")
)
with open(os.path.join(out, f"report_rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.barrier()
dist.destroy_process_group()
