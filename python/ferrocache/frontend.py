"""ferrocache's own ``CUDAAllocator`` object for PyTorch (``frontend.cpp``), built at install time.

PyTorch's C++ code asks its allocator object directly (cuDNN's ``cacheInfo`` in benchmark mode,
CUDA graph trees' ``checkPoolLiveAllocations``, ``torch.cuda.MemPool``'s pool calls, the
statistics of ``torch._C._cuda_memoryStats``, ...), and the ``CUDAPluggableAllocator`` that
PyTorch builds around two C functions refuses most of them. :func:`install` builds (once per
PyTorch version and library, cached beside the out-of-memory shim) a subclass of
``c10::cuda::CUDACachingAllocator::CUDAAllocator`` whose every method calls ferrocache's C ABI,
and swaps it in with PyTorch's own ``changeCurrentAllocator``. It keeps no map of pointers of
its own, unlike ``CUDAPluggableAllocator``.

The build needs a C++20 compiler, the PyTorch's C++ headers and libraries, and CUDA's runtime
headers (``cuda_runtime.h`` with its ``crt/`` folder): ``FERROCACHE_CUDA_INCLUDE``, else
``$CUDA_HOME/include``, the ``nvidia/cu13/include`` (or ``nvidia/cuda_runtime/include``) that
the nvidia-cuda-runtime and nvidia-cuda-crt wheels install beside PyTorch, else
``/usr/local/cuda/include``. Without them :func:`install` raises ``RuntimeError`` saying what is
missing, and ``ferrocache.install()`` falls back to ``CUDAPluggableAllocator``.
``FERROCACHE_FRONTEND=0`` asks for that fallback on purpose (benchmarks, bisecting).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from . import _env, _lib, torch_api

#: ``0`` (or false, no, off): use PyTorch's CUDAPluggableAllocator, not the front end.
FRONTEND_ENV = _env.FRONTEND.name
#: A folder with ``cuda_runtime.h`` (and ``crt/``), searched first.
CUDA_INCLUDE_ENV = _env.CUDA_INCLUDE.name
_SOURCE = Path(__file__).with_name("frontend.cpp")
_frontend: Any = None  # the loaded front end, kept for the life of the process


def wanted() -> bool:
    """Whether ``FERROCACHE_FRONTEND`` leaves the front end on (the default)."""
    return _env.flag_is_on(_env.FRONTEND, default=True)


def _site_packages_of(torch: ModuleType) -> Path:
    return Path(torch.__file__).resolve().parent.parent


def cuda_include_dirs(torch: ModuleType) -> list[Path]:
    """The folders that give ``cuda_runtime.h`` and its ``crt/host_config.h``, in search order;
    raises ``RuntimeError`` naming where it looked when they are missing."""
    candidates: list[Path] = []
    explicit = os.environ.get(CUDA_INCLUDE_ENV)
    if explicit:
        candidates.append(Path(explicit).expanduser())
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            candidates.append(Path(home) / "include")
    nvidia = _site_packages_of(torch) / "nvidia"
    candidates += [
        nvidia / "cu13" / "include",
        nvidia / "cu12" / "include",
        nvidia / "cuda_runtime" / "include",
        nvidia / "cuda_crt" / "include",
        nvidia / "cuda_nvcc" / "include",
        Path("/usr/local/cuda/include"),
    ]
    runtime = next((c for c in candidates if (c / "cuda_runtime.h").is_file()), None)
    crt = next((c for c in candidates if (c / "crt" / "host_config.h").is_file()), None)
    if runtime is None or crt is None:
        missing = "cuda_runtime.h" if runtime is None else "crt/host_config.h"
        looked = ", ".join(str(c) for c in candidates)
        raise RuntimeError(
            f"CUDA's runtime headers are missing ({missing}; looked in {looked}): install the "
            f"nvidia-cuda-runtime and nvidia-cuda-crt wheels of this PyTorch's CUDA, or set "
            f"{CUDA_INCLUDE_ENV}"
        )
    return list(dict.fromkeys([runtime, crt]))


def _torch_version_numbers(torch: ModuleType) -> tuple[int, int]:
    release = str(torch.__version__).split("+")[0].split(".")
    try:
        return int(release[0]), int(release[1])
    except (IndexError, ValueError):
        raise RuntimeError(f"PyTorch's version {torch.__version__!r} is not MAJOR.MINOR...") from None


def build(torch: ModuleType) -> Path:
    """The front end for this PyTorch and this ``libferrocache.so``, built on first use and
    cached; raises ``RuntimeError`` saying why it cannot be built."""
    include, lib = torch_api._torch_paths(torch)
    if not (include / "c10" / "cuda" / "CUDACachingAllocator.h").is_file():
        raise RuntimeError(f"this PyTorch ships no C++ headers ({include}/c10/cuda/CUDACachingAllocator.h)")
    needed = ("libc10.so", "libc10_cuda.so", "libtorch_cuda.so")
    absent = [name for name in needed if not (lib / name).is_file()]
    if absent:
        raise RuntimeError(f"this PyTorch lacks {', '.join(absent)} in {lib}")
    library = _lib.loaded_path() or _lib.library_path()
    major, minor = _torch_version_numbers(torch)
    abi = torch_api._cxx11_abi(torch)
    stat = library.stat()
    identity = f"{torch.__version__}|{lib}|{abi}|{library}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(_SOURCE.read_bytes() + identity.encode()).hexdigest()[:16]
    target = torch_api._cache_dir() / f"frontend-torch-{torch.__version__}-{key}.so"
    if target.is_file():
        return target
    compiler = torch_api._compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, c++, g++, clang++)")
    cuda_include = cuda_include_dirs(torch)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [
            compiler, "-std=c++20", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DFERROCACHE_TORCH_MAJOR={major}",
            f"-DFERROCACHE_TORCH_MINOR={minor}", f"-I{include}",
            *(f"-I{folder}" for folder in cuda_include), str(_SOURCE), "-o", str(built),
            f"-L{lib}", "-lc10", "-lc10_cuda", "-ltorch_cuda", str(library),
            f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            last = (errors or done.stderr.strip().splitlines() or ["no message"])[0]
            raise RuntimeError(f"{compiler} could not build {_SOURCE.name}: {last}")
        os.replace(built, target)  # atomic: another process may be building it too
    return target


def install(torch: ModuleType) -> None:
    """Builds (or finds) the front end and makes it PyTorch's CUDA allocator. Raises
    ``RuntimeError`` saying why not (it cannot be built, or PyTorch refused the swap)."""
    global _frontend
    if _frontend is not None:
        return
    _lib.load()  # the front end links to the library this package loaded
    path = build(torch)
    try:
        frontend = ctypes.CDLL(str(path))
    except OSError as err:
        raise RuntimeError(f"the front end {path} could not be loaded: {err}") from err
    frontend.ferrocache_frontend_install.restype = ctypes.c_char_p
    frontend.ferrocache_frontend_install.argtypes = []
    frontend.ferrocache_frontend_installed.restype = ctypes.c_int
    frontend.ferrocache_frontend_installed.argtypes = []
    refused = frontend.ferrocache_frontend_install()
    if refused is not None:
        raise RuntimeError(f"PyTorch refused ferrocache's allocator: {refused.decode('utf-8', 'replace')}")
    _frontend = frontend


def is_installed() -> bool:
    """Whether PyTorch's current CUDA allocator is ferrocache's front end."""
    return _frontend is not None and bool(_frontend.ferrocache_frontend_installed())


__all__ = ["CUDA_INCLUDE_ENV", "FRONTEND_ENV", "build", "cuda_include_dirs", "install", "is_installed", "wanted"]
