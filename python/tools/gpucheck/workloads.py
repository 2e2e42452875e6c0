"""The GPU programs of the check, each run in a process of its own (an allocator cannot be
swapped once CUDA is initialised):

    python -m gpucheck.workloads steptime --allocator A --example examples/train.py --out r.json
    python -m gpucheck.workloads train    --allocator A --example examples/train.py --out r.json
    python -m gpucheck.workloads features --allocator A --out r.json
    python -m gpucheck.workloads peer     --allocator A --out r.json
    python -m gpucheck.workloads sleep    --allocator ferrocache[-expandable] --out r.json
    python -m gpucheck.workloads bench    --allocator A          (the line protocol of bench.py)

``--allocator`` names a row of :data:`ALLOCATORS`: PyTorch's own (``native``, and
``native-expandable``) or ferrocache (``ferrocache``, ``ferrocache-expandable`` with
``expandable_segments:True``, ``ferrocache-cross-stream`` with cross-stream reuse). Each program
writes its raw results as JSON; gpucheck.checks judges them.

On the fake CUDA (the rehearsal, ``python/tests/real_torch/test_gpu_check_rehearsal.py``) no
kernel runs: where a program or a part of it stops at the first kernel, its result says
``{"skipped_on_fake": why}`` instead of an error. Anything else that fails is an error there too.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional, Sequence

EXPANDABLE = "expandable_segments:True"


class Allocator(NamedTuple):
    """How a workload process sets up its allocator."""

    ferrocache: bool
    conf: Optional[str] = None
    cross_stream: bool = False


ALLOCATORS = {
    "native": Allocator(False),
    "native-expandable": Allocator(False, EXPANDABLE),
    "ferrocache": Allocator(True),
    "ferrocache-expandable": Allocator(True, EXPANDABLE),
    "ferrocache-cross-stream": Allocator(True, cross_stream=True),
}
#: What PyTorch says when the fake CUDA is asked to run a kernel (``no kernel image``, see
#: tests/fake-cuda/README.md) or to use a library it only stubs (cuBLAS, cuDNN).
FAKE_CANNOT_RUN = ("no kernel image", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error")


def on_fake_cuda() -> bool:
    """Whether the driver this process loaded is the project's fake (tests/fake-cuda)."""
    try:
        return hasattr(ctypes.CDLL("libcuda.so.1"), "fake_cuda_stat")
    except OSError:
        return False


def fake_cannot_run(err: BaseException) -> Optional[str]:
    """Why ``err`` only means that this runs on the fake CUDA, which runs no kernel; None where
    it is a failure."""
    if not any(sign in str(err) for sign in FAKE_CANNOT_RUN) or not on_fake_cuda():
        return None
    traceback.print_exception(err, file=sys.stderr)  # the details, in the workload's log
    return "needs kernels, which the fake CUDA cannot run"


def setup(allocator: str) -> ModuleType:
    """Imports PyTorch and sets up ``allocator`` before CUDA starts."""
    chosen = ALLOCATORS[allocator]
    if chosen.conf and not chosen.ferrocache:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = chosen.conf  # read when CUDA starts
    torch = importlib.import_module("torch")
    if chosen.ferrocache:
        import ferrocache

        ferrocache.install(conf=chosen.conf, cross_stream=chosen.cross_stream or None)
    return torch


def memory_api(allocator: str) -> Any:
    """Where the statistics come from: torch.cuda, or ferrocache for a pluggable allocator."""
    if not ALLOCATORS[allocator].ferrocache:
        import torch

        return torch.cuda
    import ferrocache

    return ferrocache


def load_example(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("ferrocache_example_train", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# train: the same deterministic run under each allocator
# ------------------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch = setup(args.allocator)
    example = load_example(args.example)
    # Deterministic kernels, so that the losses can be compared bit for bit across processes;
    # CUBLAS_WORKSPACE_CONFIG is set by the parent before this process started. warn_only: an
    # op without a deterministic kernel warns (a second native run, the control, then shows
    # whether the run is deterministic at all) instead of stopping the check.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    memory = memory_api(args.allocator)
    if args.record_history:
        if not ALLOCATORS[args.allocator].ferrocache:
            # Python stacks only: C++ frames are symbolised through addr2line at the dump,
            # which has taken minutes of the GPU's time (ferrocache records Python stacks).
            torch.cuda.memory._record_memory_history(max_entries=args.history_entries, stacks="python")
        else:
            memory.record_memory_history(max_entries=args.history_entries)
    losses, seconds = example.train(torch, args.steps, seed=0)
    result: dict[str, Any] = {
        "allocator": args.allocator,
        "losses": losses,
        "step_seconds": seconds,
        "peak_reserved": memory.max_memory_reserved(),
        "peak_allocated": memory.max_memory_allocated(),
        "reserved": memory.memory_reserved(),
        "num_device_alloc": memory.memory_stats().get("num_device_alloc"),
    }
    if args.snapshot:
        if not ALLOCATORS[args.allocator].ferrocache:
            torch.cuda.memory._dump_snapshot(args.snapshot)
        else:
            memory.dump_snapshot(args.snapshot)
        result["snapshot"] = args.snapshot
    return result


# ------------------------------------------------------------------------------------------------
# steptime: the time of a training step, on the host and on the GPU, for two models
# ------------------------------------------------------------------------------------------------


class StepModel(NamedTuple):
    """examples/train.py's transformer at a size, and its batch."""

    d_model: int
    heads: int
    layers: int
    batch: int


#: launch-bound: examples/train.py's small model, whose kernels are short, so that the host's
#: launches (and allocations) set the pace; GPU-bound: a wider and deeper one, with TF32, that
#: keeps the GPU busy.
STEP_MODELS = {
    "launch-bound": StepModel(d_model=256, heads=4, layers=4, batch=16),
    "gpu-bound": StepModel(d_model=1024, heads=16, layers=6, batch=64),
}
#: Distinct batches made on the device before the timing, used in turn.
STEP_BATCHES = 8


def timed_steps(torch: Any, example: ModuleType, shape: StepModel, steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` training steps of a fresh model on batches already on the device; each step
    timed on the host (perf_counter around the step and a synchronize) and with CUDA events
    around the same work."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = example.build_model(torch, d_model=shape.d_model, heads=shape.heads, layers=shape.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEP_BATCHES):
        starts = torch.randint(0, example.VOCAB, (shape.batch, 1), generator=generator)
        tokens = ((starts + torch.arange(example.SEQUENCE + 1)) % example.VOCAB).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize()
    host: list[float] = []
    for step in range(steps):
        inputs, targets = batches[step % STEP_BATCHES]
        started = time.perf_counter()
        events[step][0].record()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, example.VOCAB), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        events[step][1].record()
        torch.cuda.synchronize()
        host.append(time.perf_counter() - started)
    device_seconds = [start.elapsed_time(end) / 1e3 for start, end in events]
    return {
        "shape": shape._asdict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "warmup": warmup,
        "host_seconds": host,
        "event_seconds": device_seconds,
        "last_loss": float(loss.item()),
    }


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    """Both models, one after the other, in this process (one allocator)."""
    torch = setup(args.allocator)
    example = load_example(args.example)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    memory = memory_api(args.allocator)
    models = {}
    for name, shape in STEP_MODELS.items():
        models[name] = timed_steps(torch, example, shape, args.steps, args.warmup)
    return {
        "allocator": args.allocator,
        "models": models,
        "peak_reserved": memory.max_memory_reserved(),
        "num_device_alloc": memory.memory_stats().get("num_device_alloc"),
    }


# ------------------------------------------------------------------------------------------------
# features: record_stream across two streams, empty_cache, out of memory
# ------------------------------------------------------------------------------------------------


def two_streams(torch: Any) -> dict[str, Any]:
    """A tensor read on a side stream is freed on the default stream after record_stream; a new
    tensor of the same size is then written on the default stream while the side stream still
    sleeps. Were record_stream ignored, the new tensor could take the old one's memory and the
    side stream would read 7s instead of 1s."""
    n = 1 << 24  # 64 MiB of float32
    side = torch.cuda.Stream()
    x = torch.ones(n, device="cuda")
    x_address = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # keep the side stream busy for a while
        y = x * 2
    x.record_stream(side)
    del x
    z = torch.full((n,), 7.0, device="cuda")
    reused_while_pending = z.data_ptr() == x_address
    torch.cuda.synchronize()
    correct = bool((y == 2).all().item())
    del z
    w = torch.empty(n, device="cuda")  # the side stream is done: the block may be reused now
    reused_after = w.data_ptr() == x_address
    return {
        "correct": correct,
        "reused_while_pending": reused_while_pending,
        "reused_after_sync": reused_after,
    }


def empty_cache(torch: Any, memory: Any) -> dict[str, Any]:
    """A 1 GiB tensor freed stays cached; torch.cuda.empty_cache() must give it back."""
    size = 1 << 30
    free_start = torch.cuda.mem_get_info()[0]
    x = torch.empty(size, dtype=torch.uint8, device="cuda")
    free_holding = torch.cuda.mem_get_info()[0]
    del x
    free_cached = torch.cuda.mem_get_info()[0]
    reserved_cached = memory.memory_reserved()
    torch.cuda.empty_cache()
    free_emptied = torch.cuda.mem_get_info()[0]
    return {
        "size": size,
        "free_start": free_start,
        "free_holding": free_holding,
        "free_cached": free_cached,
        "free_emptied": free_emptied,
        "reserved_cached": reserved_cached,
        "reserved_emptied": memory.memory_reserved(),
    }


def out_of_memory(torch: Any, memory: Any) -> dict[str, Any]:
    """Twice the device's memory must fail as PyTorch fails, and the program must go on."""
    total = torch.cuda.get_device_properties(0).total_memory
    result: dict[str, Any] = {"requested": 2 * total}
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        result["raised"] = None
    except Exception as err:  # the check reports whatever comes
        result["raised"] = type(err).__name__
        result["is_torch_oom"] = isinstance(err, torch.cuda.OutOfMemoryError)
        result["is_runtime_error"] = isinstance(err, RuntimeError)
        result["message"] = str(err)
    a = torch.randn(1024, 1024, device="cuda")
    result["continued"] = bool(torch.isfinite((a @ a).sum()).item())
    result["num_ooms"] = memory.memory_stats().get("num_ooms")
    return result


def cross_stream(torch: Any) -> dict[str, Any]:
    """A block freed on stream s1 while s1 still writes it is asked for on stream s2. With
    cross-stream reuse, s2 gets it after waiting on the device for s1's work, so s2's later
    write wins; without, s2 gets another block. Were the wait missing, s1's late write of 1s
    would land over s2's 7s."""
    n = 1 << 24  # 64 MiB of float32
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # s1's write below lands late
        a = torch.full((n,), 1.0, device="cuda")
    first = a.data_ptr()
    del a  # freed on s1 while its write is pending
    with torch.cuda.stream(s2):
        b = torch.empty(n, device="cuda")
        b.fill_(7.0)
    reused = b.data_ptr() == first
    torch.cuda.synchronize()
    return {"reused": reused, "correct": bool((b == 7).all().item())}


def graphs(torch: Any) -> dict[str, Any]:
    """A model's forward captured in a CUDA graph and replayed on new inputs, with other
    allocations between the replays: the graph's outputs equal the eager ones each time, and
    the replays leave the other tensors alone (were the graph's private memory handed to them,
    a replay would write over them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    model = model.cuda()
    static_input = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up off the default stream, as PyTorch advises
        for _ in range(3):
            model(static_input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(graph):
            static_output = model(static_input) * 2 + 1
        agree, intact = [], []
        for _ in range(5):
            static_input.copy_(torch.randn(64, 1024, device="cuda"))
            others = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
            copies = [other.clone() for other in others]
            graph.replay()
            expected = model(static_input) * 2 + 1
            agree.append(bool(torch.allclose(static_output, expected, rtol=1e-3, atol=1e-3)))
            intact.append(all(bool(torch.equal(a, b)) for a, b in zip(others, copies)))
            del others, copies
    pool = list(graph.pool())
    del static_output
    graph.reset()
    return {"replays": len(agree), "correct": all(agree), "others_intact": all(intact), "pool": pool}


def features(args: argparse.Namespace) -> dict[str, Any]:
    torch = setup(args.allocator)
    memory = memory_api(args.allocator)
    result: dict[str, Any] = {"allocator": args.allocator}
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("streams", lambda: two_streams(torch)),
        ("cross_stream", lambda: cross_stream(torch)),
        ("graphs", lambda: graphs(torch)),
        ("empty_cache", lambda: empty_cache(torch, memory)),
        ("oom", lambda: out_of_memory(torch, memory)),  # last: it may leave the cache emptied
    ]
    for name, part in parts:
        try:
            result[name] = part()
        except Exception as err:
            why = fake_cannot_run(err)
            result[name] = {"skipped_on_fake": why} if why else {"error": traceback.format_exc(limit=5)}
    return result


# ------------------------------------------------------------------------------------------------
# peer: device 0 -> 1 and back
# ------------------------------------------------------------------------------------------------


def peer(args: argparse.Namespace) -> dict[str, Any]:
    """Copies device 0 -> 1 -> 0: memory allocated before PyTorch enables peer access (at the
    first copy) and after (new pages of an expandable segment), then a copy that converts its
    type, which runs as a kernel on one device reading the other's memory. Each must come back
    bit for bit."""
    torch = setup(args.allocator)
    if torch.cuda.device_count() < 2:
        return {"error": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    result: dict[str, Any] = {"allocator": args.allocator}

    def round_trip(host: Any) -> bool:
        on_zero = host.to("cuda:0")
        on_one = on_zero.to("cuda:1")
        back = on_one.to("cuda:0")
        for device in (0, 1):
            torch.cuda.synchronize(device)
        return bool(torch.equal(back.cpu(), host))

    def copies() -> dict[str, Any]:
        generator = torch.Generator().manual_seed(0)
        before = torch.randint(0, 1 << 30, (1 << 20,), dtype=torch.int32, generator=generator)
        # 64 MiB: pages mapped after peer access was enabled by the first copy.
        after = torch.randint(0, 1 << 30, (16 << 20,), dtype=torch.int32, generator=generator)
        return {"before_peer_access": round_trip(before), "after_peer_access": round_trip(after)}

    def converting() -> dict[str, Any]:
        host = torch.arange(1 << 20, dtype=torch.int32)
        on_zero = host.to("cuda:0")
        on_one = on_zero.to("cuda:1", dtype=torch.float64)  # a kernel across devices
        back = on_one.to("cuda:0", dtype=torch.int32)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        return {"correct": bool(torch.equal(back.cpu(), host))}

    for name, part in (("copies", copies), ("converting", converting)):
        try:
            result[name] = part()
        except Exception as err:
            why = fake_cannot_run(err)
            result[name] = {"skipped_on_fake": why} if why else {"error": traceback.format_exc(limit=5)}
    return result


# ------------------------------------------------------------------------------------------------
# sleep: the bandwidth of sleep and wake with backup, against plain copies of the same bytes
# ------------------------------------------------------------------------------------------------

#: The blocks that sleep: many, as a model's parameters and optimizer state are.
SLEEP_BLOCK_BYTES = 64 << 20
#: At most this much sleeps (a quarter of the free memory where that is less).
SLEEP_BYTES_AT_MOST = 8 << 30
#: On the fake CUDA, whose device memory is host memory, a small rehearsal.
SLEEP_BYTES_ON_FAKE = 256 << 20
#: Sleep-and-wake cycles timed: the first allocates the pinned host memory sleep keeps, the
#: later ones reuse it (the steady state of an RL loop).
SLEEP_CYCLES = 3
#: What each timing is called in the result, in the order the check shows them.
SLEEP_PARTS = ("d2h_pinned", "sleep", "sleep_first", "d2h_pageable", "h2d_pinned", "wake", "wake_first",
               "h2d_pageable")  # fmt: skip


def sleep_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """Fills blocks of device memory by host-to-device copies, then times, in one process: a
    plain copy of every block into page-locked host memory and back (``non_blocking`` copies,
    one wait: the bus's speed), the same into pageable memory, and ``SLEEP_CYCLES`` cycles of
    ``ferrocache.sleep(backup=True)`` and ``ferrocache.wake()`` (the first one apart: it
    allocates the pinned memory that the later ones reuse); every block must hold its bytes, at
    its address, after the last wake. Rates are GiB/s of the blocks' bytes."""
    if not ALLOCATORS[args.allocator].ferrocache:
        return {"error": "sleep needs ferrocache"}
    os.environ["FERROCACHE_SLEEP"] = "1"  # every segment VMM-backed, so that all of it sleeps
    torch = setup(args.allocator)
    import ferrocache

    free, _ = torch.cuda.mem_get_info()
    total = SLEEP_BYTES_ON_FAKE if on_fake_cuda() else min(SLEEP_BYTES_AT_MOST, free // 4)
    count = max(1, total // SLEEP_BLOCK_BYTES)
    moved = count * SLEEP_BLOCK_BYTES
    generator = torch.Generator().manual_seed(0)
    patterns = [torch.randint(0, 256, (SLEEP_BLOCK_BYTES,), dtype=torch.uint8, generator=generator) for _ in range(4)]
    blocks = [torch.empty(SLEEP_BLOCK_BYTES, dtype=torch.uint8, device="cuda") for _ in range(count)]

    def fill() -> None:
        for i, block in enumerate(blocks):
            block.copy_(patterns[i % len(patterns)])
        torch.cuda.synchronize()

    fill()
    pointers = [block.data_ptr() for block in blocks]
    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=True)  # outside the timings
    pageable = torch.empty(SLEEP_BLOCK_BYTES, dtype=torch.uint8)
    parts = [pinned[i * SLEEP_BLOCK_BYTES:(i + 1) * SLEEP_BLOCK_BYTES] for i in range(count)]

    def timed(work: Callable[[], Any]) -> tuple[float, Any]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        answer = work()
        torch.cuda.synchronize()
        return time.perf_counter() - started, answer

    def copy_out_pinned() -> None:
        for part, block in zip(parts, blocks):
            part.copy_(block, non_blocking=True)

    def copy_in_pinned() -> None:
        for part, block in zip(parts, blocks):
            block.copy_(part, non_blocking=True)

    def copy_out_pageable() -> None:
        for block in blocks:
            pageable.copy_(block)

    def copy_in_pageable() -> None:
        for block in blocks:
            block.copy_(pageable)

    def intact() -> bool:
        return all(
            block.data_ptr() == pointer and torch.equal(block.cpu(), patterns[i % len(patterns)])
            for i, (block, pointer) in enumerate(zip(blocks, pointers))
        )

    seconds: dict[str, float] = {}
    seconds["d2h_pinned"], _ = timed(copy_out_pinned)
    seconds["h2d_pinned"], _ = timed(copy_in_pinned)  # the bytes copied out come back: the same
    seconds["d2h_pageable"], _ = timed(copy_out_pageable)
    seconds["h2d_pageable"], _ = timed(copy_in_pageable)
    fill()  # the pageable copy in wrote one block's bytes everywhere
    sleeps, wakes = [], []
    free_before, free_asleep = 0, 0
    reports: list[tuple[Any, Any]] = []
    for _ in range(SLEEP_CYCLES):
        free_before, _ = torch.cuda.mem_get_info()
        sleep_seconds, slept = timed(lambda: ferrocache.sleep(backup=True))
        free_asleep, _ = torch.cuda.mem_get_info()
        wake_seconds, woke = timed(ferrocache.wake)
        sleeps.append(sleep_seconds)
        wakes.append(wake_seconds)
        reports.append((slept, woke))
    seconds["sleep_first"], seconds["wake_first"] = sleeps[0], wakes[0]
    later = slice(1, None) if SLEEP_CYCLES > 1 else slice(0, None)
    seconds["sleep"], seconds["wake"] = min(sleeps[later]), min(wakes[later])  # the best later cycle
    slept, woke = reports[-1]

    def rate(seconds: float) -> float:
        return moved / seconds / (1 << 30) if seconds > 0 else 0.0

    return {
        "allocator": args.allocator,
        "bytes": moved,
        "blocks": count,
        "cycles": SLEEP_CYCLES,
        "slept_bytes": slept.bytes,
        "slept_copied_bytes": slept.copied_bytes,
        "skipped_bytes": slept.skipped_bytes,
        "woke_copied_bytes": woke.copied_bytes,
        "host_memory_pinned": slept.host_memory_pinned,
        "host_allocations": [s.host_allocations for s, _ in reports],
        "host_synchronizations": {"sleep": slept.host_synchronizations, "wake": woke.host_synchronizations},
        "freed_while_asleep": free_asleep - free_before,
        "intact": intact(),  # once, after the last wake: a check of 8 GiB costs seconds
        "seconds": seconds,
        "gib_per_s": {part: rate(seconds[part]) for part in SLEEP_PARTS},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# bench: the worker of bench.interleaved
# ------------------------------------------------------------------------------------------------


def bench_worker(args: argparse.Namespace) -> None:
    """Answers ``run <size> <iterations>`` with the host time of one ``torch.empty`` + free."""
    torch = setup(args.allocator)
    empty, uint8, device = torch.empty, torch.uint8, torch.device("cuda")
    empty(1, dtype=uint8, device=device)  # initialises CUDA
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        size, iterations = int(words[1]), int(words[2])
        for _ in range(10):  # the cache now holds a block of this size
            x = empty(size, dtype=uint8, device=device)
            del x
        started = time.perf_counter_ns()
        for _ in range(iterations):
            x = empty(size, dtype=uint8, device=device)
            del x
        elapsed = time.perf_counter_ns() - started
        print(json.dumps({"size": size, "ns_per_op": elapsed / iterations}), flush=True)


# ------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpucheck.workloads")
    parser.add_argument("workload", choices=("steptime", "train", "features", "peer", "sleep", "bench"))
    parser.add_argument("--allocator", choices=ALLOCATORS, required=True)
    parser.add_argument("--out", type=Path, help="where the JSON result goes")
    parser.add_argument("--example", help="examples/train.py (for train)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the step time (steptime)")
    parser.add_argument("--snapshot", help="dump a memory snapshot here at the end")
    parser.add_argument("--record-history", action="store_true", help="record allocator events")
    parser.add_argument("--history-entries", type=int, default=100_000)
    return parser.parse_args(argv)


#: Test-only: the workload this names hangs (sleeps) before it starts, to show that the
#: check caps it; GPU_CHECK_TEST_HANG_PIDS names a file that gets its process id.
HANG_ENV = "GPU_CHECK_TEST_HANG"
HANG_PIDS_ENV = "GPU_CHECK_TEST_HANG_PIDS"


def hang_if_asked(workload: str) -> None:
    if os.environ.get(HANG_ENV) != workload:
        return
    pids = os.environ.get(HANG_PIDS_ENV)
    if pids:
        with open(pids, "a") as handle:
            handle.write(f"{os.getpid()}\n")
    print(f"{HANG_ENV}={workload}: hanging", file=sys.stderr, flush=True)
    time.sleep(3600)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    hang_if_asked(args.workload)
    if args.workload == "bench":
        bench_worker(args)
        return 0
    if args.out is None:
        raise SystemExit("--out is required")
    programs = {"steptime": step_time, "train": train, "features": features, "peer": peer, "sleep": sleep_bandwidth}
    try:
        result = programs[args.workload](args)
    except Exception as err:
        why = fake_cannot_run(err)
        if why is None:
            raise
        result = {"allocator": args.allocator, "skipped_on_fake": why}
    result["pid"] = os.getpid()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
