"""PyTorch where the program uses it: device indices and streams as ``torch.cuda`` has them.

Nothing here imports PyTorch. Only a PyTorch that the program has already imported is asked
(for the current device and stream, once CUDA is initialised), so that the statistics,
summaries and snapshots work, and cost nothing extra, without PyTorch.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Optional, Union

#: What the ``device`` argument of the ``torch.cuda`` memory functions accepts: an index, a
#: string such as ``"cuda:1"``, a ``torch.device``, or None for the current device.
Device = Union[int, str, Any, None]


def imported_torch() -> Optional[ModuleType]:
    """``torch`` if the program has imported it, else None."""
    return sys.modules.get("torch")


def version() -> Optional[tuple[int, int]]:
    """(major, minor) of the PyTorch imported in this process, or None."""
    torch = imported_torch()
    text = str(getattr(torch, "__version__", "")) if torch is not None else ""
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()``, or False where PyTorch is not imported."""
    torch = imported_torch()
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    return bool(is_initialized is not None and is_initialized())


def current_device() -> int:
    """``torch.cuda.current_device()`` once CUDA is initialised; device 0 before."""
    if cuda_initialized():
        torch = imported_torch()
        assert torch is not None
        return int(torch.cuda.current_device())
    return 0


def device_index(device: Device) -> int:
    """The CUDA device index ``device`` names, as PyTorch's ``_get_device_index(device,
    optional=True)`` reads it: None, ``"cuda"`` and ``torch.device("cuda")`` are the current
    device."""
    if device is None:
        return current_device()
    if isinstance(device, bool):
        raise TypeError(f"Invalid device, must be cuda device, int or str, not {device!r}")
    if isinstance(device, int):
        index: Optional[int] = device
    elif isinstance(device, str):
        kind, _, number = device.partition(":")
        if kind.isdigit() and not number:
            kind, number = "cuda", kind
        if kind != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        try:
            index = int(number) if number else None
        except ValueError:
            raise ValueError(f"Invalid device string: '{device}'") from None
    elif hasattr(device, "type") and hasattr(device, "index"):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = device.index
    else:
        raise TypeError(f"Invalid device, must be cuda device, int or str, not {device!r}")
    if index is None:
        return current_device()
    if index < 0:
        raise ValueError(f"Invalid device index {index}: must be >= 0")
    return int(index)


def stream_handle(stream: Any, device: int) -> int:
    """The ``cudaStream_t`` value of ``stream``: a ``torch.cuda.Stream``, an int, or None for
    ``torch.cuda.current_stream(device)`` (the default stream, 0, before CUDA is initialised
    or without PyTorch)."""
    if stream is None:
        if not cuda_initialized():
            return 0
        torch = imported_torch()
        assert torch is not None
        return int(torch.cuda.current_stream(device).cuda_stream)
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            "Invalid type for stream argument, must be `torch.cuda.Stream` or `int` "
            "representing a pointer to a existing stream"
        )
    return handle
