"""The fake NCCL's registrations (tests/fake-cuda/libs/src/nccl.rs), for the torchrun workers
that check what a process group registered."""

import ctypes

nccl = ctypes.CDLL("libnccl.so.2")
nccl.fake_nccl_registrations.restype = ctypes.c_int64
nccl.fake_nccl_registrations.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
nccl.fake_nccl_registration_count.restype = ctypes.c_int64
nccl.fake_nccl_registration_count.argtypes = [ctypes.c_int]


def registered() -> list[list[int]]:
    """The live registrations: [buffer, size], by buffer."""
    room = (ctypes.c_uint64 * (3 * 256))()
    count = nccl.fake_nccl_registrations(room, 256)
    assert 0 <= count <= 256, count
    return [[room[3 * k + 1], room[3 * k + 2]] for k in range(count)]
