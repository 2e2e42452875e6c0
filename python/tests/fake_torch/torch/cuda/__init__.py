"""The stand-in's torch.cuda."""

import os

from . import memory  # noqa: F401


class OutOfMemoryError(RuntimeError):
    """Stands for torch.cuda.OutOfMemoryError."""


_initialized = os.environ.get("FAKE_TORCH_CUDA_INITIALIZED") == "1"


def is_initialized() -> bool:
    return _initialized


def current_device() -> int:
    return int(os.environ.get("FAKE_TORCH_CURRENT_DEVICE", "0"))
