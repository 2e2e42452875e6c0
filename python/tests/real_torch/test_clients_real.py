"""The programs our users run, on the fake CUDA, under PyTorch's allocator and under ferrocache.

Each client in ``clients/`` is a program as a user writes it (a model library's decoder, a
convolutional network with cuDNN's benchmark mode, ``torch.compile``, CUDA graphs by hand, a
trainer library, processes that share CUDA tensors, DDP and FSDP2); none names ferrocache. It
runs twice, with the fake's ordering check fatal: ``python client.py`` (PyTorch's allocator)
and ``ferrocache run -- python client.py`` (nothing edited). Each run writes its figures
(``clients/_figures.py``): peak allocated and reserved, segments, allocations, retries, the
bytes allocated after every step, and the client's own (the addresses a CUDA graph's replays
use). Both must agree.

Where ferrocache fails because PyTorch's ``CUDAPluggableAllocator`` refuses a question that
PyTorch's C++ asks of the allocator (issue 35 answers them), the test is an expected failure
that names PyTorch's message, and checks that exact message: any other failure fails the test.
The list, with each client's figures side by side, is in docs/real-clients.md.

``FERROCACHE_CLIENT_FIGURES=DIR`` keeps each run's figures there (``CLIENT.native.json``,
``CLIENT.ferrocache.json``), for the table of the docs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from torch_env import GIB, TORCH_VERSION, require_real_torch, torch_env

require_real_torch()
if TORCH_VERSION < (2, 15):
    # The clients and their pinned libraries are written for PyTorch 2.15, the spec; other
    # versions (scripts/torch-versions) are not the question here.
    pytest.skip("the real clients are written for PyTorch 2.15", allow_module_level=True)

CLIENTS = Path(__file__).resolve().parent / "clients"
#: A run's limit: torch's import costs seconds per process on two shared cores.
LIMIT_S = 300


class RefusedByPluggable(Exception):
    """The client failed under ferrocache with the refusal of PyTorch's pluggable allocator
    that its mark names (an expected failure: issue 35 answers that question)."""


@dataclass(frozen=True)
class Client:
    script: str
    #: Python packages it needs beyond torch (scripts/with-fake-cuda installs them).
    packages: tuple[str, ...] = ()
    #: Ranks of a torchrun job; 0 runs ``python client.py``.
    ranks: int = 0
    #: PyTorch's message when ferrocache fails for a refusal of CUDAPluggableAllocator.
    refusal: Optional[str] = None
    #: Figures of the client's own that every run must show (what it read back, ...).
    expected: dict[str, object] = field(default_factory=dict)
    #: Settings of its environment.
    env: dict[str, str] = field(default_factory=dict)


#: ferrocache's allocator object for PyTorch (python/ferrocache/frontend.cpp) refuses none of the
#: clients' questions. Under PyTorch's CUDAPluggableAllocator they were "... does not yet support
#: cacheInfo / checkPoolLiveAllocations / shareIPcHandle / snapshot"; the front end answers all
#: four, the checkpoints of graph trees, and an allocator trace tracker.

DECODER = Client("decoder_transformers.py", packages=("transformers",),
                 expected={"generated_shape": [2, 12]})  # fmt: skip
#: The same decoder on a fake GPU of 35 MiB, 1 MiB less than its peak reserved: both allocators
#: must free cached segments and retry, at the same moments.
DECODER_TIGHT = Client("decoder_transformers.py", packages=("transformers",),
                       expected={"generated_shape": [2, 12]},
                       env={"FAKE_LIBCUDA_TOTAL_MEM": str(35 << 20)})  # fmt: skip
CONV = Client("conv_cudnn_benchmark.py")
#: The CUDA graph tree restores its pool to a checkpoint once, to record the second shape's
#: branch after replaying the first's.
COMPILE = Client("compile_cudagraphs.py", expected={"checkpoint_restores": 1})
#: The same through Inductor (mode="reduce-overhead"), where Triton is installed (not in CI).
COMPILE_REDUCE_OVERHEAD = Client("compile_cudagraphs.py",
                                 env={"CLIENT_COMPILE_MODE": "reduce-overhead"})  # fmt: skip
GRAPHED = Client("graphed_callables.py")
LIGHTNING = Client("lightning_trainer.py", packages=("lightning",))
#: The bytes each side reads back show that the memory is shared between the processes (with
#: the fake's FAKE_LIBCUDA_IPC_PRIVATE_COPY=1, "child_wrote" and "loader_read" differ).
IPC = Client("multiprocessing_ipc.py", expected={
    "child_read": [1, 2, 3], "child_wrote": [4, 5, 6], "parent_read": [7, 8, 9], "child_exit": 0,
    "loader_read": [[i] * 4 for i in range(4)],
})  # fmt: skip
#: torch 2.15's default "nccl" backend (ProcessGroupNCCL2) attaches an allocator trace tracker
#: when it makes its communicator, in init_process_group, and registers the segments it hears of
#: (the front end sends them: src/ffi/trace_tracker.rs).
DISTRIBUTED = Client("ddp_fsdp2.py", ranks=2)
#: The stock ProcessGroupNCCL, which torch 2.15 keeps behind TORCH_DIST_USE_NCCL2=0, asks for no
#: snapshot: the same job runs under both allocators. By default its watchdog thread (a poll
#: about every 100 ms) drops the tensors of a collective once it sees the work complete, so
#: what is allocated after a step, and the peaks, depend on that thread's timing under either
#: allocator, on a GPU too. With TORCH_NCCL_BLOCKING_WAIT=1 (PyTorch's documented setting)
#: there is no watchdog thread: wait() blocks until the work is complete and the tensors are
#: let go by the thread that waits, so every figure is the same in every run.
DISTRIBUTED_STOCK_NCCL = Client("ddp_fsdp2.py", ranks=2, env={
    "TORCH_DIST_USE_NCCL2": "0", "TORCH_NCCL_BLOCKING_WAIT": "1",
})  # fmt: skip


def _ferrocache_command() -> str:
    found = shutil.which("ferrocache")
    if found is None:
        pytest.fail("no `ferrocache` command on PATH: run under scripts/with-fake-cuda")
    return found


def _run(
    client: Client, tmp_path: Path, under_ferrocache: bool
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Runs the client in ``tmp_path``; returns the finished process and its figures' path
    (``{rank}`` in it for a job)."""
    name = "ferrocache" if under_ferrocache else "native"
    figures = tmp_path / (f"{name}_{{rank}}.json" if client.ranks else f"{name}.json")
    if client.ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={client.ranks}", str(CLIENTS / client.script),
                   str(figures)]  # fmt: skip
    else:
        command = [sys.executable, str(CLIENTS / client.script), str(figures)]
    if under_ferrocache:
        command = [_ferrocache_command(), "run", "--quiet", "--", *command]
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(
        4 * GIB, FAKE_LIBCUDA_DEVICE_COUNT=str(max(client.ranks, 1)), FAKE_CUDA_ORDER_FATAL="1",
        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"), PYTHONWARNINGS="ignore",
        **client.env,
    ))  # fmt: skip
    process = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), figures


def _explain(process: subprocess.CompletedProcess[str]) -> str:
    return (f"{' '.join(process.args)}\nexit {process.returncode}\n--- stdout\n"
            f"{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-8000:]}")  # fmt: skip


def _figures(path: Path, ranks: int) -> dict:
    if not ranks:
        return json.loads(path.read_text())
    return {rank: json.loads(Path(str(path).replace("{rank}", str(rank))).read_text())
            for rank in range(ranks)}  # fmt: skip


def _keep(client: Client, name: str, figures: dict) -> None:
    keep = os.environ.get("FERROCACHE_CLIENT_FIGURES")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        settings = "".join(f"+{key}={value}" for key, value in client.env.items())
        stem = client.script.removesuffix(".py") + settings
        (Path(keep) / f"{stem}.{name}.json").write_text(json.dumps(figures, indent=1))


def runs_alike(client: Client, tmp_path: Path) -> dict:
    """The client under PyTorch's allocator, then under ferrocache: the same figures (returns
    the native run's)."""
    for package in client.packages:
        if importlib.util.find_spec(package) is None:
            pytest.fail(f"{package} is not installed: scripts/with-fake-cuda installs it")
    native_run, native_path = _run(client, tmp_path, under_ferrocache=False)
    assert native_run.returncode == 0, _explain(native_run)
    native = _figures(native_path, client.ranks)
    _keep(client, "native", native)
    for one in native.values() if client.ranks else [native]:
        assert {k: one["extra"].get(k) for k in client.expected} == client.expected, one

    ours_run, ours_path = _run(client, tmp_path, under_ferrocache=True)
    if ours_run.returncode != 0 and client.refusal and client.refusal in ours_run.stderr:
        raise RefusedByPluggable(client.refusal)
    assert ours_run.returncode == 0, _explain(ours_run)
    ours = _figures(ours_path, client.ranks)
    _keep(client, "ferrocache", ours)

    for one_native, one_ours in zip(*(
        (f.values() if client.ranks else [f]) for f in (native, ours)
    )):  # fmt: skip
        assert one_native["allocator"] == "native" and one_ours["allocator"] == "ferrocache"
        assert one_ours["figures"] == one_native["figures"]
        assert one_ours["steps"] == one_native["steps"]
        assert one_ours["extra"] == one_native["extra"]
    return native


def expected_refusal(client: Client):
    return pytest.mark.xfail(raises=RefusedByPluggable, strict=True, reason=client.refusal)


def test_a_decoder_from_transformers_trains_and_generates_alike(tmp_path):
    runs_alike(DECODER, tmp_path)


def test_the_decoder_on_a_gpu_too_small_for_its_cache_frees_and_retries_alike(tmp_path):
    figures = runs_alike(DECODER_TIGHT, tmp_path)["figures"]
    assert figures["retries"] > 0 and figures["device_frees"] > 0, figures


def test_a_convolutional_network_in_cudnn_benchmark_mode_trains_alike(tmp_path):
    runs_alike(CONV, tmp_path)


def test_torch_compile_with_cuda_graphs_records_two_branches_and_replays_alike(tmp_path):
    runs_alike(COMPILE, tmp_path)


def test_torch_compile_in_reduce_overhead_mode_records_two_branches_and_replays_alike(tmp_path):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: Inductor's kernels (mode=\"reduce-overhead\") need it")
    figures = runs_alike(COMPILE_REDUCE_OVERHEAD, tmp_path)
    assert figures["extra"]["checkpoint_restores"] > 0, figures["extra"]


def test_cuda_graphs_made_by_hand_replay_at_the_same_addresses_alike(tmp_path):
    runs_alike(GRAPHED, tmp_path)


def test_lightnings_trainer_fits_with_mixed_precision_alike(tmp_path):
    runs_alike(LIGHTNING, tmp_path)


def test_cuda_tensors_travel_between_processes_and_from_dataloader_workers_alike(tmp_path):
    runs_alike(IPC, tmp_path)


def test_ddp_and_fsdp2_on_two_fake_gpus_with_torchs_default_nccl_backend_train_alike(tmp_path):
    runs_alike(DISTRIBUTED, tmp_path)


def test_ddp_and_fsdp2_on_two_fake_gpus_with_the_stock_process_group_nccl_train_alike(tmp_path):
    runs_alike(DISTRIBUTED_STOCK_NCCL, tmp_path)
