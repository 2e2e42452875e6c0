"""With PyTorch and a real CUDA GPU: ferrocache installed as PyTorch's allocator. Skipped
elsewhere (scripts/gpu-check covers the same ground and more, side by side with PyTorch)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fake_libcuda_loaded, run_json

REASON = "needs PyTorch with a CUDA GPU"


def _torch_cuda_available() -> bool:
    """Asked in a child process, so that this one stays free of CUDA (and of PyTorch)."""
    if fake_libcuda_loaded() or importlib.util.find_spec("torch") is None:
        return False
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return child.stdout.strip() == "True"


pytestmark = pytest.mark.skipif(not _torch_cuda_available(), reason=REASON)

MIB = 1 << 20


def test_tensors_come_from_ferrocache() -> None:
    out = run_json(
        """
        import torch, ferrocache
        ferrocache.install()
        x = torch.empty(1000, dtype=torch.uint8, device="cuda")
        y = torch.empty(5 * 2**20, dtype=torch.uint8, device="cuda")
        stats = ferrocache.memory_stats()
        out = {"allocated": stats["allocated_bytes.all.current"], "reserved": stats["reserved_bytes.all.current"]}
        del x, y
        torch.cuda.empty_cache()
        out["reserved after empty_cache"] = ferrocache.memory_reserved()
        result(out)
        """,
        timeout=300,
    )
    assert out == {"allocated": 1024 + 5 * MIB, "reserved": 22 * MIB, "reserved after empty_cache": 0}


def test_out_of_memory_is_an_exception_and_the_run_goes_on() -> None:
    out = run_json(
        """
        import torch, ferrocache
        ferrocache.install()
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            message = None
        except RuntimeError as err:
            message = str(err)
        a = torch.ones(1024, device="cuda")
        result([message, float(a.sum().item()), ferrocache.memory_stats()["num_ooms"]])
        """,
        timeout=300,
    )
    message, total, ooms = out
    assert message is not None and message.startswith("CUDA out of memory. Tried to allocate")
    assert total == 1024.0 and ooms == 1


def test_record_stream_keeps_memory_until_the_other_stream_is_done() -> None:
    out = run_json(
        """
        import torch, ferrocache
        ferrocache.install()
        n = 1 << 24
        side = torch.cuda.Stream()
        x = torch.ones(n, device="cuda")
        address = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            y = x * 2
        x.record_stream(side)
        del x
        z = torch.full((n,), 7.0, device="cuda")
        torch.cuda.synchronize()
        result([bool((y == 2).all().item()), z.data_ptr() == address])
        """,
        timeout=300,
    )
    assert out == [True, False]


def test_a_snapshot_of_a_torch_run(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    out = run_json(
        f"""
        import pickle, torch, ferrocache
        ferrocache.install()
        ferrocache.record_memory_history()
        x = torch.randn(1024, 1024, device="cuda")
        y = x @ x
        ferrocache.dump_snapshot({str(path)!r})
        with open({str(path)!r}, "rb") as f:
            snapshot = pickle.load(f)
        result(sorted({{e["action"] for e in snapshot["device_traces"][0]}}))
        """,
        timeout=300,
    )
    assert {"alloc", "segment_alloc"} <= set(out)
