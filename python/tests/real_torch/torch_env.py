"""What the real-PyTorch tests share: they run only under ``scripts/with-fake-cuda`` (real
torch from PyPI, the fake CUDA preloaded), each scenario in a fresh Python process, since both
PyTorch and ferrocache read their settings and choose their allocator once per process.

The child's code gets a prelude: ``torch`` and ``ferrocache`` imported (not installed: each
test says when), ``result(value)`` to send a JSON value back, and ``fake_stat(name)``, which
reads a counter of the fake driver (``bytes_in_use``, ``live_allocations``, the number of calls
of a driver function such as ``cuMemAlloc_v2``; see tests/fake-cuda/README.md).

``scripts/gpu-check`` runs a chosen few of these tests on a real GPU (``FERROCACHE_REAL_GPU=1``,
see ``python/tools/gpucheck/real_torch.py``): there the prelude's ``_fake`` is None, and only
tests that ask nothing of the fake are chosen.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import textwrap
from typing import Any, Mapping, Optional

import pytest
from conftest import STRICT, run_json, run_python

FAKE_CUDA = os.environ.get("FERROCACHE_FAKE_CUDA")
#: Set by scripts/gpu-check, which runs the tests it chose on a real GPU.
REAL_GPU = os.environ.get("FERROCACHE_REAL_GPU") == "1"


def _torch_version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:2])


#: The installed PyTorch's (major, minor), without importing it.
TORCH_VERSION = _torch_version()
#: torch 2.9 parses PYTORCH_CUDA_ALLOC_CONF once more at exit and aborts there on a setting it
#: refused, whichever allocator is in use: a child that answered may still exit with SIGABRT.
TORCH_ABORTS_AT_EXIT_ON_A_BAD_SETTING = TORCH_VERSION == (2, 9)
#: ferrocache's messages for refused settings are those of this PyTorch and newer (older ones
#: word some of them differently).
WORDING_FROM = (2, 15)
MIB = 1 << 20
GIB = 1 << 30

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import torch
    import ferrocache

    _fake = ctypes.CDLL("libcuda.so.1")
    if hasattr(_fake, "fake_cuda_stat"):
        _fake.fake_cuda_stat.restype = ctypes.c_int64
        _fake.fake_cuda_stat.argtypes = [ctypes.c_char_p]
    else:  # a real GPU (scripts/gpu-check)
        _fake = None

    def fake_stat(name):
        assert _fake is not None, "fake_stat() needs the fake CUDA"
        value = _fake.fake_cuda_stat(name.encode())
        assert value >= 0, f"the fake driver has no counter {name!r}"
        return value
    """
)


def require_real_torch() -> None:
    """Skips the module unless it runs under scripts/with-fake-cuda (fails under STRICT), or
    on a real GPU under scripts/gpu-check."""
    if FAKE_CUDA or REAL_GPU:
        return
    reason = "needs real PyTorch on the fake CUDA: run it with scripts/with-fake-cuda"
    if STRICT and os.environ.get("FERROCACHE_REAL_TORCH_TESTS") == "1":
        pytest.fail(reason)
    pytest.skip(reason, allow_module_level=True)


def torch_env(total_bytes: int = 4 * GIB, **extra: str) -> dict[str, str]:
    """The environment of a child: the fake GPU's memory, and any settings given."""
    env = {"FAKE_LIBCUDA_TOTAL_MEM": str(total_bytes), "FAKE_CUDA_QUIET": "1"}
    env.update(extra)
    return env


def run_torch(code: str, env: Optional[Mapping[str, str]] = None, **kwargs: Any) -> Any:
    """Runs ``code`` after the prelude in a fresh process; returns what it passed to result()."""
    return run_json(PRELUDE + textwrap.dedent(code), env=env or torch_env(), **kwargs)


def run_torch_process(code: str, env: Optional[Mapping[str, str]] = None, **kwargs: Any):
    """Like :func:`run_torch`, returning the finished process (for its stderr)."""
    return run_python(PRELUDE + textwrap.dedent(code), env=env or torch_env(), **kwargs)
