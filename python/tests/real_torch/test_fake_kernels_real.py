"""Real programs on the fake CUDA: kernels launch and do nothing, and cuBLAS, cuDNN and NCCL
succeed and do nothing (tests/fake-cuda/README.md, "Kernels and libraries"). Each test runs real
PyTorch under its own allocator (no ferrocache: the fake is what is tested here), with the
ordering check fatal, as the suite runs it.

These fail if kernel launches or the libraries are refused again: arithmetic, a matmul, a
training step, a convolution and a collective all need them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_env import MIB, require_real_torch, run_torch, torch_env

require_real_torch()

# The cuDNN and SDPA children run their CUDA backward on their own thread
# (torch.autograd.set_multithreading_enabled(False)). With PyTorch's default, the backward runs on
# the autograd engine's thread for the device, which drops its last reference to the finished
# graph task after the caller has its result; the graph task holds a Python object (the
# contextvars.Context that torch.autograd stashes for that thread), and a decref there after the
# interpreter began to finalize makes CPython end the thread with pthread_exit, whose unwinding
# through a noexcept destructor aborts the process at exit ("terminate called without an active
# exception"). A PyTorch race, on a GPU too (pytorch/pytorch#117762); it struck this file's SDPA
# test in 6 runs of 220 under load (docs/real-clients.md, "Three tests that were flaky").


def test_kernels_and_cublas_run_a_training_step_and_their_work_stays_pending() -> None:
    out = run_torch(
        """
        x = torch.ones(64, 32, device="cuda")
        y = x * 2 + 1
        product = y @ torch.randn(32, 16, device="cuda")
        pending_after_launches = fake_stat("order_pending_uses")
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        ).cuda()
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        kernels_before_sync = fake_stat("order_kernels")
        torch.cuda.synchronize()
        result({
            "shape": list(product.shape),
            "pending_after_launches": pending_after_launches,
            "pending_after_sync": fake_stat("order_pending_uses"),
            "kernels": kernels_before_sync,
            "launches": fake_stat("kernel_launches"),
            "pointer_arguments": fake_stat("kernel_pointer_arguments"),
            "without_parameter_info": fake_stat("kernels_without_parameter_info"),
            "violations": fake_stat("order_violations"),
            "peak": torch.cuda.max_memory_allocated(),
        })
        """
    )
    assert out["shape"] == [64, 16]
    assert out["pending_after_launches"] > 0, "kernel work is pending until a synchronization"
    assert out["pending_after_sync"] == 0
    assert out["kernels"] >= 20
    assert out["launches"] >= out["kernels"] > 0
    # The parameter layouts come from torch's own fat binaries: every argument is scanned.
    assert out["pointer_arguments"] > out["kernels"]
    assert out["without_parameter_info"] == 0
    assert out["violations"] == 0
    # cuBLAS's workspace comes from PyTorch's allocator, as on a GPU.
    assert out["peak"] >= MIB


def test_a_kernel_on_another_stream_without_a_wait_is_an_order_violation() -> None:
    out = run_torch(
        """
        x = torch.ones(1 << 16, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y = x * 3  # reads x while the fill on the default stream may still run
        torch.cuda.synchronize()
        ordered = torch.ones(1 << 16, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            z = ordered * 3
        torch.cuda.synchronize()
        result({"violations": fake_stat("order_violations")})
        """,
        # Counted, not fatal; and left out of the suite's report (it is made on purpose).
        env=torch_env(FAKE_CUDA_ORDER_FATAL="0", FAKE_CUDA_ORDER_REPORT=""),
    )
    assert out["violations"] == 1


def test_cudnn_benchmark_asks_the_allocator_for_each_plans_workspace() -> None:
    out = run_torch(
        """
        torch.autograd.set_multithreading_enabled(False)  # backward on this thread (see top)

        def peak_of_conv(benchmark, size):
            torch.backends.cudnn.benchmark = benchmark
            conv = torch.nn.Conv2d(3, 8, 3, padding=1).cuda()
            x = torch.randn(2, 3, size, size, device="cuda", requires_grad=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            conv(x).sum().backward()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base

        launches = fake_stat("kernel_launches")
        heuristic = peak_of_conv(False, 16)
        benchmarked = peak_of_conv(True, 17)
        result({
            "heuristic": heuristic,
            "benchmarked": benchmarked,
            "cudnn_version": torch.backends.cudnn.version(),
            "work": fake_stat("kernel_launches") - launches,
            "stats": torch.cuda.memory_stats()["allocation.all.allocated"],
        })
        """
    )
    assert out["cudnn_version"] == 92600
    assert out["work"] > 0
    # Benchmarking runs every plan with the workspace it reports (up to 1 MiB here); the
    # heuristic's first plan needs none.
    assert out["heuristic"] < MIB <= out["benchmarked"]


def test_sdpa_runs_forward_and_backward_on_each_of_its_cuda_backends() -> None:
    # The memory-efficient backward asks cudaFuncGetAttributes which architecture its kernel was
    # built for (checkBinaryArchMatches): the fake answers the cubin a 9.0 device runs.
    out = run_torch(
        """
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.autograd.set_multithreading_enabled(False)  # backward on this thread (see top)

        def attend(backend, dtype):
            q, k, v = (
                torch.randn(2, 4, 16, 32, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
            return [list(out.shape)] + [list(t.grad.shape) for t in (q, k, v)]

        launches = fake_stat("kernel_launches")
        shapes = {
            "efficient": attend(SDPBackend.EFFICIENT_ATTENTION, torch.float32),
            "flash": attend(SDPBackend.FLASH_ATTENTION, torch.float16),
            "math": attend(SDPBackend.MATH, torch.float32),
        }
        torch.cuda.synchronize()
        result({
            "shapes": shapes,
            "launches": fake_stat("kernel_launches") - launches,
            "violations": fake_stat("order_violations"),
        })
        """
    )
    for backend, shapes in out["shapes"].items():
        assert shapes == [[2, 4, 16, 32]] * 4, backend
    assert out["launches"] > 0
    assert out["violations"] == 0


def test_cholesky_and_a_sparse_product_take_their_workspaces_from_the_allocator() -> None:
    # cuSOLVER's and cuSPARSE's size queries answer a workspace that grows with the problem
    # (tests/fake-cuda/README.md, "Kernels and libraries"), which PyTorch allocates.
    out = run_torch(
        """
        a = torch.eye(64, device="cuda") * 2
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        factor = torch.linalg.cholesky(a)
        torch.cuda.synchronize()
        cholesky_peak = torch.cuda.max_memory_allocated() - base

        sparse = torch.eye(64, device="cuda").to_sparse_csr()
        dense = torch.ones(64, 32, device="cuda")
        torch.cuda.synchronize()
        product = torch.sparse.mm(sparse, dense)
        torch.cuda.synchronize()
        result({
            "factor": list(factor.shape),
            "product": list(product.shape),
            "cholesky_peak": cholesky_peak,
            "violations": fake_stat("order_violations"),
        })
        """
    )
    assert out["factor"] == [64, 64]
    assert out["product"] == [64, 32]
    # The factor, and cuSOLVER's workspace of one 64 x 64 float matrix.
    assert out["cholesky_peak"] >= 2 * 64 * 64 * 4
    assert out["violations"] == 0


def test_a_captured_graph_of_kernels_replays_them() -> None:
    out = run_torch(
        """
        import warnings
        x = torch.ones(1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.cuda.graph(g, stream=s):
                y = x * 2 + 1
        torch.cuda.synchronize()
        before = fake_stat("order_kernels")
        g.replay()
        g.replay()
        after_replays = fake_stat("order_kernels")
        torch.cuda.synchronize()
        result({
            "replayed_kernels": after_replays - before,
            "warnings": [str(w.message) for w in caught],
            "violations": fake_stat("order_violations"),
        })
        """
    )
    assert not any("empty" in w for w in out["warnings"]), out["warnings"]
    assert out["replayed_kernels"] >= 4  # two kernels, replayed twice
    assert out["violations"] == 0


#: One rank of a job on two fake devices with backend="nccl": an all_reduce, an all_gather
#: into a list, one DDP step, then one FSDP2 step (all-gathers and reduce-scatters). Prints its
#: figures as one JSON line.
NCCL_RANK = """
import json, sys
import torch, torch.distributed as dist

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(rank)
dist.init_process_group(
    "nccl", init_method=f"file://{store}", rank=rank, world_size=world,
    device_id=torch.device("cuda", rank),
)
t = torch.full((1000,), float(rank + 1), device="cuda")
dist.all_reduce(t)
gathered = [torch.empty(1, dtype=torch.long, device="cuda") for _ in range(world)]
dist.all_gather(gathered, torch.tensor([7], device="cuda"))
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
ddp(torch.randn(8, 32, device="cuda")).sum().backward()
optimizer.step()
from torch.distributed.fsdp import fully_shard
sharded = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)).cuda()
for layer in sharded:
    fully_shard(layer)
fully_shard(sharded)
sharded_optimizer = torch.optim.AdamW(sharded.parameters())
sharded(torch.randn(8, 32, device="cuda")).sum().backward()
sharded_optimizer.step()
torch.cuda.synchronize()
print(json.dumps({
    "rank": rank,
    "gathered": [g.item() for g in gathered],
    "device": torch.cuda.current_device(),
    "peak": torch.cuda.max_memory_allocated(),
}), flush=True)
dist.destroy_process_group()
"""


def test_nccl_collectives_a_ddp_step_and_an_fsdp2_step_run_on_two_fake_devices(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(NCCL_RANK))
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(FAKE_LIBCUDA_DEVICE_COUNT="2", OMP_NUM_THREADS="1"))
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(store)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    outputs = []
    try:
        for process in ranks:
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, f"rank failed:\n{stdout}\n{stderr}"
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert [o["rank"] for o in outputs] == [0, 1]
    assert [o["device"] for o in outputs] == [0, 1]
    # Every rank sees the others hold what it holds (the fake's NCCL moves bytes that way).
    assert all(o["gathered"] == [7, 7] for o in outputs)
    assert all(o["peak"] > 0 for o in outputs)


def test_torch_compile_default_mode_compiles_with_triton_and_launches_through_the_driver() -> None:
    # Triton is not among the suite's dependencies (scripts/with-fake-cuda): install the version
    # torch pins (`pip install triton==3.9.0` into the venv) to run this.
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed in this venv (torch 2.15 pins triton~=3.9.0)")
    out = run_torch(
        """
        def f(x, y):
            return (x.sin() + y * 2).relu().sum(dim=0)

        compiled = torch.compile(f)
        x = torch.randn(128, 64, device="cuda")
        y = torch.randn(128, 64, device="cuda")
        out = compiled(x, y)
        torch.cuda.synchronize()
        result({
            "shape": list(out.shape),
            "module_launches": fake_stat("cuLaunchKernel") + fake_stat("cuLaunchKernelEx"),
            "without_parameter_info": fake_stat("kernels_without_parameter_info"),
            "violations": fake_stat("order_violations"),
        })
        """,
        timeout=600,
    )
    assert out["shape"] == [64]
    # Triton's kernels are cubins its own ptxas built, loaded and launched through the driver,
    # their parameters read from the cubin.
    assert out["module_launches"] >= 1
    assert out["without_parameter_info"] == 0
    assert out["violations"] == 0
