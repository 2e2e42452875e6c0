"""ferrocache under ``torchrun``: real ``torch.distributed`` (gloo) on the fake CUDA, one fake GPU
per rank. The ranks' scripts are in ``torchrun_workers/``; each job runs in a process group of
its own, killed whole if it outlives the test's limit, so that no rank outlives a failed test.

gloo runs on the fake because it moves CUDA tensors through pinned host memory with copies,
on streams of its own, and reduces on the host: no kernel runs.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Union

import pytest

from torch_env import GIB, MIB, TORCH_VERSION, require_real_torch, run_torch, torch_env

require_real_torch()

WORKERS = Path(__file__).resolve().parent / "torchrun_workers"
#: A job's limit: torch's import costs seconds per rank on two shared cores.
JOB_LIMIT_S = 300


def torchrun(
    script: Union[str, Path],
    ranks: int,
    *args: Union[str, Path],
    env: Optional[dict[str, str]] = None,
    torchrun_args: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs ``torchrun --standalone --nproc-per-node RANKS WORKERS/script args...`` (the
    workers take their output folder first; an absolute ``script`` is run as it is) with one
    fake GPU per rank; returns the finished launcher and when it finished (``time.time()``).
    ``--standalone`` picks a free port: other test runs may share the machine."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", *torchrun_args, str(WORKERS / script), *map(str, args),
    ]  # fmt: skip
    full_env = dict(os.environ)
    full_env.pop("FERROCACHE_LIBRARY", None)
    full_env.update(torch_env(FAKE_LIBCUDA_DEVICE_COUNT=str(ranks), OMP_NUM_THREADS="1"))
    full_env.update(env or {})
    launcher = subprocess.Popen(
        command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = launcher.communicate(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate()
        pytest.fail(f"the job ran past {JOB_LIMIT_S} s\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    finished = time.time()
    return subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr), finished


def still_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def rank_pids(out: Path, ranks: int) -> list[int]:
    return [int((out / f"pid_rank{rank}").read_text()) for rank in range(ranks)]


def explain(job: subprocess.CompletedProcess[str]) -> str:
    return f"exit {job.returncode}\n--- stdout\n{job.stdout}\n--- stderr\n{job.stderr}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_own_their_devices_and_collectives_are_right(tmp_path: Path, ranks: int) -> None:
    logs = tmp_path / "logs"
    job, _ = torchrun(
        "collectives.py", ranks, tmp_path,
        env={"FAKE_LIBCUDA_EVENT_DELAY": "1000", "TORCH_CUDA_ALLOC_LOG_LEVEL": "INFO"},
        torchrun_args=("--tee=3", f"--log-dir={logs}"),
    )  # fmt: skip
    assert job.returncode == 0, explain(job)
    reports = [json.loads((tmp_path / f"report_rank{rank}.json").read_text()) for rank in range(ranks)]
    for rank, report in enumerate(reports):
        assert report["world"] == ranks and report["device_count"] == ranks
        assert report["device_of_tensors"] == [rank], "each rank on its own device"
        assert report["segments_devices"] == [rank]
        assert report["all_reduce"] == [ranks * (ranks + 1) / 2]
        assert report["broadcast"] == [float(i) for i in range(8)]
        assert report["all_gather"] == [[float(r)] * 4 for r in range(ranks)]
        assert report["bucket_sum"] == sum(range(ranks))
        assert not report["reused_while_comm_busy"], "record_stream kept the bucket from reuse"
        assert report["other_devices_allocated"] == [0] * (ranks - 1)
        assert report["contexts_opened_by_asking"] == 0, "asking about other GPUs opened them"
        # The main thread (ferrocache's allocations among its calls) never entered another
        # device's context; the process holds its own device's and, at most, device 0's, which
        # gloo's worker threads open when they destroy a CUDA event (collectives.py says why).
        assert report["main_thread_other_device_entries"] == [0] * (ranks - 1)
        assert report["main_thread_own_device_entries"] > 0, "the fake counts this thread's entries"
        assert rank in report["devices_with_a_context"]
        assert set(report["devices_with_a_context"]) <= {rank, 0}, report["devices_with_a_context"]
        # Each snapshot is its rank's, in its own file.
        assert report["snapshot"] == str(tmp_path / f"job_rank{rank}.pickle")
        with open(report["snapshot"], "rb") as f:
            snapshot = pickle.load(f)
        assert {segment["device"] for segment in snapshot["segments"]} == {rank}
        assert any(entry["action"] == "alloc" for entry in snapshot["device_traces"][rank])
        pid = rank_pids(tmp_path, ranks)[rank]
        assert report["snapshot_with_placeholders"] == str(
            tmp_path / f"local{rank}" / f"pid{pid}-rank{rank}.pickle"
        )
        assert Path(report["snapshot_with_placeholders"]).is_file()
    # The ranks allocate different amounts; each one's statistics count its own.
    kept = [report["kept_bytes"] for report in reports]
    assert len(set(kept)) == ranks
    assert [report["allocated_for_kept"] for report in reports] == kept
    # Logs: every ferrocache line says its rank; torchrun's --tee adds its own prefix, and its
    # --log-dir keeps each rank's lines apart.
    ours = [line for line in job.stderr.splitlines() if "Allocator:" in line]
    assert ours, explain(job)
    for rank in range(ranks):
        assert f"[default{rank}]:[rank{rank}]:[INFO] Allocator: ferrocache " in job.stderr
    assert all(line.startswith("[default") and "]:[rank" in line for line in ours), ours[:20]
    for rank in range(ranks):
        (own,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        lines = [line for line in own.read_text().splitlines() if "Allocator:" in line]
        assert lines and all(line.startswith(f"[rank{rank}]:[") for line in lines), lines[:5]


def test_an_oom_on_one_rank_ends_the_job_as_torch_distributed_does(tmp_path: Path) -> None:
    group_timeout_s = 30
    job, finished = torchrun(
        "oom.py", 2, tmp_path, str(group_timeout_s),
        env={"FERROCACHE_SNAPSHOT_ON_OOM": str(tmp_path / "oom.pickle"),
             "FAKE_LIBCUDA_TOTAL_MEM": str(GIB)},
    )  # fmt: skip
    assert job.returncode != 0, explain(job)
    # Rank 1 raised PyTorch's error with PyTorch's message; rank 0 never got its sum.
    # PyTorch puts the same prefix on the traceback: one grep finds all of a rank's lines.
    raised = "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 GiB"
    assert raised in job.stderr, explain(job)
    assert "[rank1]:[ERROR] Allocator: CUDA out of memory. Tried to allocate 1024.00 GiB" in job.stderr
    assert "[rank0]:[ERROR] Allocator" not in job.stderr
    assert "finished its all-reduce" not in job.stdout
    # torchrun names the failed rank, and ended the job well within the group's timeout.
    root_cause = job.stderr[job.stderr.find("Root Cause") :]
    assert "ChildFailedError" in job.stderr, explain(job)
    assert "rank      : 1 (local_rank: 1)" in root_cause, explain(job)
    ended_after = finished - float((tmp_path / "oom_at").read_text())
    assert ended_after < group_timeout_s, f"the job hung {ended_after:.0f} s after the OOM"
    # No rank is left running.
    assert not [pid for pid in rank_pids(tmp_path, 2) if still_running(pid)]
    # The failed rank left its snapshot, written before the exception; the other none.
    assert not (tmp_path / "oom_rank0.pickle").exists()
    written = tmp_path / "oom_rank1.pickle"
    note = f"[rank1]:[ERROR] Allocator: out of memory on device 1: snapshot written to {written}"
    assert note in job.stderr
    with open(written, "rb") as f:
        snapshot = pickle.load(f)
    (oom,) = [entry for entry in snapshot["device_traces"][1] if entry["action"] == "oom"]
    assert oom["size"] == 1 << 40
    assert "grow_activations" in [frame["name"] for frame in oom["frames"]]


def test_the_ddp_example_reports_every_rank(tmp_path: Path) -> None:
    """examples/ddp_memory.py as docs/distributed.md runs it (``--out`` aside)."""
    example = WORKERS.parents[3] / "examples" / "ddp_memory.py"
    job, _ = torchrun(example, 2, "--out", tmp_path / "out")
    assert job.returncode == 0, explain(job)
    rows = [line.split() for line in job.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[:2] for row in rows] == [["0", "cuda:0"], ["1", "cuda:1"]], job.stdout
    assert "job: worst rank 1 (" in job.stdout, "the rank with the bigger batch"
    snapshots = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert snapshots == ["ddp_memory_rank0.pickle", "ddp_memory_rank1.pickle"]
    assert "$ ferrocache replay --job " in job.stdout
    # Each rank's snapshot replayed (by --job, or one by one where this ferrocache lacks it).
    assert "ddp_memory_rank0.pickle" in job.stdout.split("$ ferrocache replay")[1]


# ------------------------------------------------------------------------------------------------
# What needs PyTorch's own allocator (docs/distributed.md)
# ------------------------------------------------------------------------------------------------


def test_a_mempool_of_another_allocator_is_accepted_and_ipc_is_answered() -> None:
    out = run_torch(
        """
        import torch.multiprocessing
        from multiprocessing.reduction import ForkingPickler
        ferrocache.install()
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        out = {"mempool": list(torch.cuda.MemPool().id)}  # ferrocache's pool under PyTorch's name
        # NCCL's buffers come from such a pool, with NCCL's allocator (a pluggable one): its
        # segments come from that allocator (test_nccls_memory_pool_gets_its_segments_from_...).
        other = torch.cuda.memory.CUDAPluggableAllocator(
            str(ferrocache.library_path()), "rust_malloc", "rust_free"
        )
        out["mempool_with_its_own_allocator"] = list(torch.cuda.MemPool(other.allocator()).id)
        ForkingPickler.dumps(x)  # what torch.multiprocessing does to send a CUDA tensor
        out["ipc"] = "shared"  # in PyTorch's handle format (test_ipc_frontend_real.py)
        pool = ferrocache.MemPool()
        with ferrocache.mem_pool(pool):
            y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        out["ferrocache_pool"] = len(pool.snapshot())
        result(out)
        """
    )
    assert out == {
        "mempool": [0, 1],
        "mempool_with_its_own_allocator": [0, 2],
        "ipc": "shared",
        "ferrocache_pool": 1,
    }


#: The NCCL backends that register the caching allocator's segments with their communicators:
#: the stock ProcessGroupNCCL with its register hook on, and torch 2.15's default (nccl2), whose
#: hook is always on (for the ordinary pools, unless expandable segments are on). Before 2.15,
#: "nccl" is the stock one.
HOOK = {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"}
NCCL_REGISTERING = [
    pytest.param("nccl-legacy", HOOK, id="stock-with-hook"),
    pytest.param("nccl", {}, id="default-nccl2"),
] if TORCH_VERSION >= (2, 15) else [pytest.param("nccl", HOOK, id="stock-with-hook")]  # fmt: skip


@pytest.mark.parametrize(("backend", "env"), NCCL_REGISTERING)
def test_the_nccl_register_hook_registers_the_segments_pytorchs_allocator_registers(
    tmp_path: Path, backend: str, env: dict[str, str]
) -> None:
    """Two ranks on two fake GPUs, under PyTorch's allocator and under ferrocache: the fake NCCL
    holds the same registrations at each step (a segment made before the group, one made while
    it lives, both freed, the group destroyed), each a live segment of the allocator, and none
    is deregistered after its memory went back to the device."""
    reports = {}
    for allocator in ("native", "ferrocache"):
        job, _ = torchrun("nccl_register.py", 2, tmp_path, backend, allocator, env=env)
        assert job.returncode == 0, explain(job)
        reports[allocator] = [
            json.loads((tmp_path / f"report_{allocator}_rank{rank}.json").read_text()) for rank in range(2)
        ]  # fmt: skip
    for native, ours in zip(reports["native"], reports["ferrocache"]):
        assert (native["allocator"], ours["allocator"]) == ("native", "ferrocache")
        for step in ("after_init", "after_alloc", "after_free"):
            assert [size for _, size in ours[step]] == [size for _, size in native[step]], step
            live = {tuple(segment) for segment in ours[f"segments_{step}"]}
            assert {tuple(r) for r in ours[step]} <= live, f"{step}: a registration of no segment"
        assert len(ours["after_alloc"]) == len(ours["after_init"]) + 1, ours
        # The stock backend leaves registered what was made after the collectives (its barrier's
        # segment): the communicator's destruction takes them (NCCL's rule).
        assert ours["after_destroy"] == native["after_destroy"] == []
        assert ours["registrations_made"] == native["registrations_made"] > 0
        assert ours["deregistered_after_free"] == native["deregistered_after_free"] == 0


#: NCCL backends with ``mem_allocator`` and ``register_mem_pool``: the stock ProcessGroupNCCL
#: without the register hook, and torch 2.15's default.
NCCL_MEM_POOL = [
    pytest.param("nccl-legacy", {}, id="stock"),
    pytest.param("nccl", {}, id="default-nccl2"),
] if TORCH_VERSION >= (2, 15) else [pytest.param("nccl", {}, id="stock")]  # fmt: skip


@pytest.mark.parametrize(("backend", "env"), NCCL_MEM_POOL)
def test_nccls_memory_pool_gets_its_segments_from_ncclmemalloc_as_under_pytorch(
    tmp_path: Path, backend: str, env: dict[str, str]
) -> None:
    """``MemPool(backend.mem_allocator)`` and ``register_mem_pool``, on two fake GPUs, under
    PyTorch's allocator and under ferrocache: the pool's segments come from ``ncclMemAlloc``
    (the fake NCCL counts its calls), are what register_mem_pool registers, and go back through
    ``ncclMemFree`` once the pool is gone, alike."""
    reports = {}
    for allocator in ("native", "ferrocache"):
        # PyTorch offers NCCL's allocator only on devices with multicast (NVLS), as an H100's.
        job_env = {**env, "FAKE_LIBCUDA_MULTICAST": "1"}
        job, _ = torchrun("nccl_mem_pool.py", 2, tmp_path, backend, allocator, env=job_env)
        assert job.returncode == 0, explain(job)
        reports[allocator] = [
            json.loads((tmp_path / f"pool_{allocator}_rank{rank}.json").read_text()) for rank in range(2)
        ]  # fmt: skip
    for native, ours in zip(reports["native"], reports["ferrocache"]):
        assert (native["allocator"], ours["allocator"]) == ("native", "ferrocache")
        assert {**ours, "allocator": None} == {**native, "allocator": None}
        assert native["nccl calls for the pool"] == [2, 0], "a small and a large segment"
        assert native["pool segments"] == [[2 * MIB, 4096], [24 * MIB, 24 * MIB]]
        assert native["tensors in the pool's segments"] and native["registered the pool's segments"]
        assert native["registered"] == [2 * MIB, 24 * MIB]
        assert native["registered after deregister"] == []
        assert native["nccl calls while the pool lives"] == [2, 0]
        assert native["nccl calls after the pool went"] == [2, 2]
