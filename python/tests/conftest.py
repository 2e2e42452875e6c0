"""Shared helpers: paths, the fake libcuda, and running ferrocache in a process of its own.

The library reads its settings (and loads libcuda) once per process, so every test that needs
a given environment, or a library in a known state, runs its code in a fresh Python process
with :func:`run_python`. ``scripts/python-tests`` runs this suite in a fresh virtual environment
with the package installed by ``pip install .`` and the fake libcuda first on
``LD_LIBRARY_PATH``; it sets ``FERROCACHE_TESTS_STRICT=1`` so that a missing fake fails the run
instead of skipping tests.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Mapping, Optional

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[1]
HEADER = REPO / "include" / "ferrocache.h"
#: A stand-in for PyTorch that records what ferrocache.install() does with it.
FAKE_TORCH = TESTS / "fake_torch"
#: The real snapshots of shared/traces (see its README); the tests skip where it is absent.
TRACES = Path(os.environ.get("FERROCACHE_TRACES_DIR", REPO.parent / "shared" / "traces"))
STRICT = os.environ.get("FERROCACHE_TESTS_STRICT") == "1"

MIB = 1 << 20
GIB = 1 << 30


def fake_libcuda_loaded() -> bool:
    """Whether ``libcuda.so`` on this process's library path is the fake one."""
    try:
        library = ctypes.CDLL("libcuda.so")
    except OSError:
        return False
    return hasattr(library, "fake_cuda_stat")


def _skip_or_fail(reason: str) -> None:
    if STRICT:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def fake_libcuda() -> None:
    """Requires the fake libcuda first on LD_LIBRARY_PATH (scripts/python-tests puts it there)."""
    if not fake_libcuda_loaded():
        _skip_or_fail(
            "the fake libcuda is not first on LD_LIBRARY_PATH; run the suite with "
            "scripts/python-tests"
        )


class ChildFailed(AssertionError):
    pass


def run_python(
    code: str,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 120,
    fake_torch: bool = False,
    block_torch: bool = False,
    check: bool = True,
    cwd: Optional[Path] = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a new Python process with ``env`` added to this one's environment.

    ``fake_torch`` puts the stand-in PyTorch first on the import path; ``block_torch`` makes
    ``import torch`` fail even where PyTorch is installed. With ``check``, a non-zero exit
    fails the test and shows the child's output.
    """
    full_env = dict(os.environ)
    full_env.pop("FERROCACHE_LIBRARY", None)
    full_env.update(env or {})
    prelude = ""
    if fake_torch:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(FAKE_TORCH), full_env.get("PYTHONPATH", "")) if p
        )
    if block_torch:
        prelude = textwrap.dedent(
            """
            import sys
            class _NoTorch:
                @staticmethod
                def find_spec(name, path=None, target=None):
                    if name == "torch" or name.startswith("torch."):
                        raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
                    return None
            sys.meta_path.insert(0, _NoTorch)
            """
        )
    source = prelude + textwrap.dedent(code)
    process = subprocess.run(
        [sys.executable, "-c", source],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check and process.returncode != 0:
        raise ChildFailed(
            f"child exited with {process.returncode}\n--- stdout\n{process.stdout}\n"
            f"--- stderr\n{process.stderr}"
        )
    return process


RESULT_MARK = "RESULT:"


def run_json(code: str, **kwargs: Any) -> Any:
    """Runs ``code`` (see :func:`run_python`), which calls ``result(value)`` once; returns the
    value (JSON-encoded across the process boundary)."""
    helper = textwrap.dedent(
        f"""
        def result(value):
            import json
            print({RESULT_MARK!r} + json.dumps(value), flush=True)
        """
    )
    process = run_python(helper + textwrap.dedent(code), **kwargs)
    for line in process.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    raise ChildFailed(f"the child printed no result\n{process.stdout}\n{process.stderr}")


def memory_env(total_bytes: int, **extra: str) -> dict[str, str]:
    """The environment for a child whose fake GPU has ``total_bytes`` of memory."""
    return {"FAKE_LIBCUDA_TOTAL_MEM": str(total_bytes), **extra}
