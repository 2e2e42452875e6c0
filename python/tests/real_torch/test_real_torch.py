"""ferrocache under real PyTorch (torch's CUDA wheel from PyPI on the fake CUDA), through
PyTorch's public API: ``ferrocache.install()``, then ``torch.empty``, streams,
``record_stream``, ``torch.cuda.empty_cache`` and so on, as a training script uses them.
Run with ``scripts/with-fake-cuda python -m pytest python/tests/real_torch`` (scripts/test-all
does)."""

from __future__ import annotations

import re

from torch_env import (
    GIB,
    MIB,
    TORCH_ABORTS_AT_EXIT_ON_A_BAD_SETTING,
    TORCH_VERSION,
    WORDING_FROM,
    require_real_torch,
    run_torch,
    run_torch_process,
    torch_env,
)

require_real_torch()


def test_real_torch_runs_on_the_fake_cuda() -> None:
    out = run_torch(
        """
        props = torch.cuda.get_device_properties(0)
        result({"version": torch.__version__, "cuda": torch.version.cuda,
                "available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
                "name": props.name, "total": props.total_memory, "file": torch.__file__,
                "capability": list(torch.cuda.get_device_capability(0))})
        """,
        env=torch_env(2 * GIB),
    )
    assert out["available"] and out["count"] == 1
    assert "fake_torch" not in out["file"] and out["cuda"]
    assert out["name"].startswith("Fake CUDA Device")
    # cudaGetDeviceProperties (runtime) and cuDeviceTotalMem (driver) agree.
    assert out["total"] == 2 * GIB
    assert out["capability"] == [9, 0]


def test_tensors_reach_ferrocache_with_the_current_stream() -> None:
    out = run_torch(
        """
        ferrocache.install()
        device_allocs = fake_stat("cuMemAlloc_v2")
        x = torch.empty(MIB, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = torch.empty(1000, dtype=torch.uint8, device="cuda")
        y_ptr = y.data_ptr()
        allocated = ferrocache.memory_allocated()
        streams = sorted({seg["stream"] for seg in ferrocache.snapshot()["segments"]})
        del y
        after_free = ferrocache.memory_allocated()
        # The freed block is cached in s's pool: the default stream does not get it, s does.
        z = torch.empty(1000, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(s):
            w = torch.empty(1000, dtype=torch.uint8, device="cuda")
        result({"allocated": allocated, "after_free": after_free,
                "device_allocs": fake_stat("cuMemAlloc_v2") - device_allocs,
                "streams": streams, "s": s.cuda_stream, "x": x.data_ptr(),
                "y": y_ptr, "z": z.data_ptr(), "w": w.data_ptr()})
        """.replace("MIB", str(MIB)),
    )
    # 1 MiB and 1000 bytes rounded up to 1024, both served by ferrocache.
    assert out["allocated"] == MIB + 1024
    assert out["after_free"] == MIB
    assert out["streams"] == sorted([0, out["s"]])
    # One 2 MiB segment per stream, from the fake driver (cudaMalloc is never called).
    assert out["device_allocs"] == 2
    assert out["z"] != out["y"] and out["w"] == out["y"]


RECORD_STREAM = """
    ferrocache.install()
    s = torch.cuda.Stream()
    x = torch.empty(4096, dtype=torch.uint8, device="cuda")
    freed = x.data_ptr()
    x.record_stream(s)
    del x
    pending = ferrocache.memory_stats()["active_bytes.all.current"]
    pointers = []
    for _ in range(8):
        t = torch.empty(4096, dtype=torch.uint8, device="cuda")
        pointers.append(t.data_ptr())
        del t
    result({"freed": freed, "pointers": pointers, "pending": pending})
"""


def test_record_stream_delays_reuse_until_the_event_completes() -> None:
    late = run_torch(RECORD_STREAM, env=torch_env(FAKE_LIBCUDA_EVENT_DELAY="3"))
    # Until the event on s completes, the block stays active and another one serves.
    assert late["pending"] == 4096
    assert late["pointers"][0] != late["freed"]
    assert late["freed"] in late["pointers"], "the block is reused once the event completed"
    assert late["pointers"].index(late["freed"]) >= 1
    # The control: with events that complete at once, the block is reused at the next request.
    prompt = run_torch(RECORD_STREAM, env=torch_env(FAKE_LIBCUDA_EVENT_DELAY="0"))
    assert prompt["pointers"][0] == prompt["freed"]


def test_empty_cache_and_memory_fraction_act_on_ferrocache() -> None:
    out = run_torch(
        """
        ferrocache.install()
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x
        before = (ferrocache.memory_reserved(), fake_stat("bytes_in_use"))
        torch.cuda.empty_cache()
        after = (ferrocache.memory_reserved(), fake_stat("bytes_in_use"))
        torch.cuda.set_per_process_memory_fraction(0.25)
        try:
            torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
            refused = None
        except RuntimeError as err:
            refused = str(err)
        fits = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        result({"before": before, "after": after, "refused": refused,
                "fits": ferrocache.memory_allocated()})
        """,
        env=torch_env(GIB),
    )
    assert out["before"] == [64 * MIB, 64 * MIB]
    assert out["after"] == [0, 0]
    assert out["refused"] and out["refused"].startswith("CUDA out of memory.")
    assert "256.00 MiB is allowed" in out["refused"] or "allowed" in out["refused"]
    assert out["fits"] == 128 * MIB


def test_out_of_memory_raises_with_pytorchs_message_and_the_next_allocation_works() -> None:
    out = run_torch(
        """
        ferrocache.install()
        try:
            torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            raised = None
        except Exception as err:
            raised = {"message": str(err), "runtime_error": isinstance(err, RuntimeError),
                      "mro": [c.__name__ for c in type(err).__mro__]}
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        result({"raised": raised, "next": y.data_ptr() != 0, "ooms": ferrocache.memory_stats()["num_ooms"]})
        """,
        env=torch_env(256 * MIB),
    )
    raised = out["raised"]
    assert raised is not None and raised["runtime_error"]
    assert raised["message"].startswith(
        "CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 256.00 MiB"
    ), raised["message"]
    assert out["next"] and out["ooms"] == 1


def test_a_setting_pytorch_cannot_parse_is_a_value_error_that_says_why() -> None:
    conf = "max_split_size_mb:banana"
    native = run_torch(
        """
        try:
            torch.empty(1, device="cuda")
            message = None
        except Exception as err:
            message = str(err)
        result(message)
        """,
        env=torch_env(PYTORCH_CUDA_ALLOC_CONF=conf),
        # torch 2.9 also aborts at exit on a setting it refused; the answer came before.
        check=False,
    )
    ours = run_torch(
        """
        try:
            ferrocache.install()
            raised = None
        except ValueError as err:
            raised = str(err)
        result({"raised": raised, "initialized": torch.cuda.is_initialized()})
        """,
        env=torch_env(PYTORCH_CUDA_ALLOC_CONF=conf),
        check=not TORCH_ABORTS_AT_EXIT_ON_A_BAD_SETTING,
    )
    assert ours["raised"] is not None and not ours["initialized"]
    # PyTorch's own allocator, given the same setting, refuses it with the same words.
    assert native is not None
    # PyTorch's own allocator fails on it with a bare std::invalid_argument ("stoull");
    # ferrocache says what is wrong and names PyTorch's failure.
    assert native in ("stoull", "stoi")
    if TORCH_VERSION < WORDING_FROM:
        return
    assert ours["raised"] == (
        "Invalid value 'banana' for max_split_size_mb: expected an unsigned integer "
        "(PyTorch fails with std::invalid_argument: stoull)"
    )


def test_install_after_cuda_is_initialised_is_a_clear_error() -> None:
    out = run_torch(
        """
        torch.empty(1, device="cuda")
        try:
            ferrocache.install()
            raised = None
        except RuntimeError as err:
            raised = str(err)
        result({"raised": raised, "installed": ferrocache.is_installed()})
        """
    )
    assert out["raised"] and "came after CUDA was initialised" in out["raised"]
    assert not out["installed"]


def test_info_log_lines_from_a_real_pytorch_process() -> None:
    process = run_torch_process(
        """
        ferrocache.install()
        x = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.empty_cache()
        """,
        env=torch_env(TORCH_CUDA_ALLOC_LOG_LEVEL="INFO"),
    )
    lines = [line for line in process.stderr.splitlines() if line.startswith("[INFO] Allocator:")]
    expected = [
        r"\[INFO\] Allocator: ferrocache \S+ initialised for 1 device\(s\); TORCH_CUDA_ALLOC_LOG_LEVEL=INFO",
        # The driver PyTorch loaded (the preloaded fake), not another from the library path.
        r"\[INFO\] Allocator: CUDA driver library \S+/libcuda\.so\S*",
        r"\[INFO\] Allocator: new segment 0x[0-9a-f]+ \(size 20 MB\) from the device for stream 0",
        r"\[INFO\] Allocator: splitting block 0x[0-9a-f]+: 4 MB allocated, 16 MB remains free",
        r"\[INFO\] Allocator: block 0x[0-9a-f]+ \(size 4 MB\) allocated to stream 0",
        r"\[INFO\] Allocator: block 0x[0-9a-f]+ freed, returning to pool",
        r"\[INFO\] Allocator: merging block 0x[0-9a-f]+ with adjacent free block",
        r"\[INFO\] Allocator: new free block size 20 MB",
        r"\[INFO\] Allocator: segment 0x[0-9a-f]+ \(size 20 MB\) released to the device",
    ]
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in lines), (pattern, process.stderr)


def test_tensors_on_the_second_device_use_its_allocator() -> None:
    out = run_torch(
        """
        ferrocache.install()
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda:1")
        with torch.cuda.device(1):
            y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        z = torch.empty(1 << 10, dtype=torch.uint8, device=torch.device("cuda", 0))
        during = [ferrocache.memory_allocated(0), ferrocache.memory_allocated(1)]
        devices = sorted({seg["device"] for seg in ferrocache.snapshot()["segments"]})
        del x, y
        after = [ferrocache.memory_allocated(0), ferrocache.memory_allocated(1)]
        torch.cuda.empty_cache()
        result({"during": during, "after": after, "devices": devices, "count": torch.cuda.device_count(),
                "reserved": [ferrocache.memory_reserved(0), ferrocache.memory_reserved(1)]})
        """,
        env=torch_env(FAKE_LIBCUDA_DEVICE_COUNT="2"),
    )
    assert out["count"] == 2
    assert out["during"] == [1024, 4 * MIB]
    assert out["devices"] == [0, 1]
    assert out["after"] == [1024, 0]
    assert out["reserved"][1] == 0


def test_bytes_come_back_unchanged_after_thousands_of_allocations() -> None:
    out = run_torch(
        """
        import numpy as np
        ferrocache.install()
        rng = np.random.default_rng(7)
        side = torch.cuda.Stream()
        kept = []
        checked = 0
        for i in range(3000):
            data = rng.integers(0, 256, int(rng.integers(1, 1 << 17)), dtype=np.uint8)
            if i % 3 == 0:
                with torch.cuda.stream(side):
                    tensor = torch.from_numpy(data).to("cuda")
                    side.synchronize()
            else:
                tensor = torch.from_numpy(data).pin_memory().to("cuda", non_blocking=True)
            if i % 5 == 0:
                tensor = tensor.clone()  # a device-to-device copy into a fresh block
            kept.append((tensor, data))
            # Garbage of other sizes between the kept tensors, freed at once.
            junk = torch.empty(int(rng.integers(1, 1 << 22)), dtype=torch.uint8, device="cuda")
            del junk
            if len(kept) > 64:
                victim = int(rng.integers(0, len(kept)))
                t, d = kept.pop(victim)
                assert np.array_equal(t.cpu().numpy(), d), f"tensor {victim} changed"
                checked += 1
        torch.cuda.synchronize()
        for t, d in kept:
            assert np.array_equal(t.cpu().numpy(), d)
            checked += 1
        result({"checked": checked, "allocs": ferrocache.memory_stats()["allocation.all.allocated"]})
        """,
        timeout=300,
    )
    assert out["checked"] == 3000
    assert out["allocs"] >= 6000


def test_a_training_shaped_loop_keeps_reserved_memory_stable() -> None:
    out = run_torch(
        """
        import numpy as np
        ferrocache.install()
        compute = torch.cuda.current_stream()
        gradients = torch.cuda.Stream()
        hidden, layers, batch = 1024, 8, 4
        params = [torch.empty(hidden, hidden, device="cuda") for _ in range(layers)]
        host_batches = [np.ones((batch, seq, hidden), dtype=np.float32) for seq in (384, 512)]
        reserved, allocated = [], []
        for step in range(150):
            host = host_batches[step % 2]
            inputs = torch.from_numpy(host).pin_memory().to("cuda", non_blocking=True)
            seq = host.shape[1]
            activations = [torch.empty(batch, seq, hidden, device="cuda") for _ in range(layers)]
            attention = [torch.empty(batch, 16, seq, seq // 4, device="cuda") for _ in range(layers)]
            with torch.cuda.stream(gradients):
                gradients.wait_stream(compute)
                grads = [torch.empty_like(p) for p in params]
                buckets = torch.empty(layers * hidden * hidden // 2, device="cuda")
            for g in grads:
                g.record_stream(compute)
            buckets.record_stream(compute)
            while activations:
                activations.pop()
                attention.pop()
            del grads, buckets, inputs
            compute.wait_stream(gradients)
            reserved.append(ferrocache.memory_reserved())
            allocated.append(ferrocache.memory_allocated())
        result({"reserved": reserved, "allocated": allocated,
                "device_allocs": ferrocache.memory_stats()["num_device_alloc"]})
        """,
        timeout=300,
    )
    reserved = out["reserved"]
    assert max(reserved) > 300 * MIB, "the loop holds realistic amounts of memory"
    # After a few warm-up steps, reserved memory stays where it is: every request is served
    # from the cache, whatever stream it is on.
    assert reserved[10:] == [reserved[10]] * len(reserved[10:]), reserved
    assert out["allocated"][10:] == [out["allocated"][10]] * len(out["allocated"][10:])
