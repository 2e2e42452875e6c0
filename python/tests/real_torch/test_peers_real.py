"""Tensors copied between two GPUs under ``expandable_segments:True``, with real PyTorch on the
fake CUDA (2 devices). Pages mapped with ``cuMemMap`` are reachable only by the devices
``cuMemSetAccess`` names; ``torch.cuda`` enables peer access (``cudaDeviceEnablePeerAccess``)
for a copy between devices, which does not apply to those pages, and a plugged-in allocator is
not told about it. The fake faults as a GPU would (an illegal address) when a copy touches pages
its device may not access."""

from __future__ import annotations

import pytest
from torch_env import MIB, require_real_torch, run_torch, torch_env

require_real_torch()

PROGRAM = """
    import numpy as np
    if USE_FERROCACHE:
        ferrocache.install()
    rng = np.random.default_rng(27)

    def filled(size, device):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        return torch.from_numpy(data).to(device), data

    def same(tensor, data):
        return bool(np.array_equal(tensor.cpu().numpy(), data))

    checks = []
    # Pages mapped before torch.cuda enabled peer access: the first copy each way enables it.
    a, a_data = filled(5 * MIB, "cuda:0")
    b = a.to("cuda:1")          # runs on device 0, writes device 1's pages
    checks.append(same(b, a_data))
    c = b.to("cuda:0")          # runs on device 1, writes device 0's pages
    checks.append(same(c, a_data))
    # Pages mapped after: more memory on both devices, copied both ways.
    d, d_data = filled(45 * MIB, "cuda:0")
    e = torch.empty(45 * MIB, dtype=torch.uint8, device="cuda:1")
    e.copy_(d)                  # device 0 writes new pages of device 1
    checks.append(same(e, d_data))
    f = torch.empty(45 * MIB, dtype=torch.uint8, device="cuda:0")
    f.copy_(e)                  # device 1 writes new pages of device 0
    checks.append(same(f, d_data))
    a.copy_(e[: 5 * MIB])       # device 1 writes the first pages of device 0 again
    checks.append(same(a, d_data[: 5 * MIB]))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    result({"checks": checks, "peer_links": fake_stat("peer_links"),
            "creates": fake_stat("cuMemCreate"), "mallocs": fake_stat("cuMemAlloc_v2")})
"""


@pytest.mark.parametrize("allocator", ["ferrocache", "pytorch"])
def test_expandable_tensors_copy_between_devices_both_ways(allocator: str) -> None:
    use_ferrocache = allocator == "ferrocache"
    out = run_torch(
        f"    USE_FERROCACHE = {use_ferrocache}\n    MIB = {MIB}\n" + PROGRAM,
        env=torch_env(
            FAKE_LIBCUDA_DEVICE_COUNT="2",
            PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        ),
    )
    assert out["checks"] == [True] * 5
    assert out["peer_links"] == 2, "torch.cuda enabled peer access both ways"
    assert out["creates"] > 0, "expandable segments on both devices"
    if use_ferrocache:
        assert out["mallocs"] == 0
