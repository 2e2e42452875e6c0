"""Which CUDA driver library ferrocache calls under real PyTorch: the one PyTorch loaded (here
the preloaded fake), even with a CUDA toolkit's stub ``libcuda.so`` first on
``LD_LIBRARY_PATH`` (cudarc's loader, which ferrocache used before, opened ``libcuda.so``
first, and every driver call then answered ``CUDA_ERROR_STUB_LIBRARY``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from torch_env import FAKE_CUDA, MIB, require_real_torch, run_torch_process, torch_env

require_real_torch()


def build_stub(directory: Path) -> Path:
    """A stand-in for a toolkit's ``stubs/libcuda.so``: every ``cu*`` function the fake driver
    exports answers ``CUDA_ERROR_STUB_LIBRARY`` (34); the soname is ``libcuda.so.1``, as the
    real stub's. Returns its directory."""
    fake = Path(FAKE_CUDA or "") / "lib" / "libcuda.so.1"
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", "--format=posix", str(fake)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    names = sorted({line.split()[0] for line in symbols if line.startswith("cu")})
    assert "cuMemAlloc_v2" in names
    source = directory / "stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 34; }}\n" for name in names))
    stub_dir = directory / "stubs"
    stub_dir.mkdir()
    compiler = os.environ.get("CC", "cc")
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
         str(stub_dir / "libcuda.so"), str(source)],
        check=True,
    )
    return stub_dir


def test_a_stub_first_on_the_library_path_is_not_used(tmp_path: Path) -> None:
    stub_dir = build_stub(tmp_path)
    library_path = f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    process = run_torch_process(
        f"""
        ferrocache.install()
        x = torch.zeros({MIB}, dtype=torch.uint8, device="cuda")
        print("RESULT:", int(x.cpu().sum()), fake_stat("cuMemAlloc_v2"))
        """,
        env=torch_env(LD_LIBRARY_PATH=library_path, TORCH_CUDA_ALLOC_LOG_LEVEL="INFO"),
    )
    assert "RESULT: 0 1" in process.stdout, process.stderr
    lines = [line for line in process.stderr.splitlines() if "CUDA driver library" in line]
    assert len(lines) == 1, process.stderr
    assert str(stub_dir) not in lines[0]
    assert lines[0].endswith(("/libcuda.so.1", "/libcuda.so")), lines[0]
