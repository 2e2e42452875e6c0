"""The exceptions the package raises, and the one place that turns a library error into one."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Optional

#: How every out-of-memory message of PyTorch's caching allocator (and ferrocache's) starts.
OOM_PREFIX = "CUDA out of memory."


class OutOfMemoryError(RuntimeError):
    """An allocation failed for lack of device memory; the message is PyTorch's.

    Raised by :func:`ferrocache.caching_allocator_alloc`. Where PyTorch can be imported the
    exception raised is also a ``torch.cuda.OutOfMemoryError``, so either ``except`` clause
    catches it.
    """


class LibraryNotFoundError(ImportError):
    """``libferrocache.so`` is not where the package looks for it."""


class LibraryVersionError(ImportError):
    """The library found is not the version of the Python package (a stale build)."""


_torch_oom_class: Optional[type[RuntimeError]] = None


def _oom_class() -> type[RuntimeError]:
    """:class:`OutOfMemoryError`, joined with ``torch.cuda.OutOfMemoryError`` where PyTorch is
    importable (imported only now, when memory has already run out)."""
    global _torch_oom_class
    if _torch_oom_class is not None:
        return _torch_oom_class
    torch = sys.modules.get("torch")
    if torch is None and importlib.util.find_spec("torch") is not None:
        try:
            torch = importlib.import_module("torch")
        except Exception:  # a broken installation must not hide the out-of-memory error
            torch = None
    torch_oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if isinstance(torch_oom, type) and issubclass(torch_oom, BaseException):
        _torch_oom_class = type(
            "OutOfMemoryError",
            (torch_oom, OutOfMemoryError),
            {"__module__": __name__, "__doc__": OutOfMemoryError.__doc__},
        )
        return _torch_oom_class
    return OutOfMemoryError


def library_error(message: str, function: str) -> RuntimeError:
    """The exception for a failed library call: out of memory, or a RuntimeError."""
    if message.startswith(OOM_PREFIX):
        return _oom_class()(message)
    if not message:
        message = f"{function} failed without saying why"
    return RuntimeError(message)
