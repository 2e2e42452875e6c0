"""Cross-stream reuse (FERROCACHE_CROSS_STREAM=1) with real PyTorch on the fake CUDA: a block
freed on one stream serves another only after that stream waited on the device
(cuStreamWaitEvent), and the waits land on the right streams in the right order."""

from __future__ import annotations

from torch_env import MIB, require_real_torch, run_torch, torch_env

require_real_torch()

PROGRAM = """
    import ctypes
    _fake.fake_cuda_stream_waits.restype = ctypes.c_int64
    _fake.fake_cuda_stream_waits.argtypes = [ctypes.c_void_p]
    ferrocache.install()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def waits():
        return [_fake.fake_cuda_stream_waits(s.cuda_stream) for s in (s1, s2)]

    steps = []
    with torch.cuda.stream(s1):
        a = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    first = a.data_ptr()
    del a
    steps.append(waits())
    with torch.cuda.stream(s2):
        b = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    steps.append(waits())
    second = b.data_ptr()
    del b
    with torch.cuda.stream(s1):
        c = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
    steps.append(waits())
    result({"first": first, "second": second, "third": c.data_ptr(), "steps": steps,
            "reserved": ferrocache.memory_reserved()})
""".replace("SIZE", str(8 * MIB))


def test_a_block_moves_between_streams_after_one_wait_each_time() -> None:
    out = run_torch(PROGRAM, env=torch_env(FERROCACHE_CROSS_STREAM="1"))
    # s1's block serves s2, then s1 again: one segment (20 MiB for an 8 MiB request) in all.
    assert out["second"] == out["first"] and out["third"] == out["first"]
    assert out["reserved"] == 20 * MIB
    # Waits per stream [s1, s2] after each step: none; then s2 waited once (for s1's event);
    # then s1 waited once (for s2's).
    assert out["steps"] == [[0, 0], [0, 1], [1, 1]]


def test_without_the_mode_each_stream_has_its_own_cache_and_no_waits() -> None:
    out = run_torch(PROGRAM, env=torch_env())
    assert out["second"] != out["first"]
    assert out["third"] == out["first"]
    assert out["reserved"] == 2 * 20 * MIB
    assert out["steps"] == [[0, 0], [0, 0], [0, 0]]


def test_install_cross_stream_true_turns_the_mode_on() -> None:
    out = run_torch(PROGRAM.replace("ferrocache.install()", "ferrocache.install(cross_stream=True)"))
    assert out["second"] == out["first"]
    assert out["steps"] == [[0, 0], [0, 1], [1, 1]]
