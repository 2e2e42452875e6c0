"""Which ``PYTORCH_CUDA_ALLOC_CONF`` to set, from what this process did: :func:`advise`.

The library replays the allocation history this process recorded
(``torch.cuda.memory._record_memory_history()``, which ferrocache answers once installed, or
:func:`ferrocache.record_memory_history`) under every setting of ``ferrocache tune``'s search
space, each on a simulated GPU, in parallel, and ranks them: the lowest peak reserved with no
out-of-memory within the GPU's memory. It is the same search and the same table as
``ferrocache tune`` on a snapshot of this process (see docs/tune.md).
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from . import _lib, _torch
from ._torch import Device
from .snapshot import PICKLE_PROTOCOL

#: How much of a GiB a byte is.
_GIB = float(1 << 30)


class NoHistoryError(RuntimeError):
    """:func:`advise` found no recorded allocation history; the message says how to record it."""


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found. ``str(advice)`` is the table ``ferrocache tune`` prints."""

    #: The ``PYTORCH_CUDA_ALLOC_CONF`` value to set ("" is PyTorch's defaults), or None when
    #: no setting tried fits in the GPU's memory, or when the replay of the recorded work does
    #: not reproduce it (``data["not_claimed_because"]`` says why).
    recommended_conf: Optional[str]
    #: ferrocache's own variables to set with it (``{"FERROCACHE_CROSS_STREAM": "1"}``), or {}.
    recommended_env: dict[str, str]
    #: Peak reserved bytes of the recorded work under the process's current setting (replayed).
    current_peak_reserved_bytes: Optional[int]
    #: The same under the recommendation (None without one).
    recommended_peak_reserved_bytes: Optional[int]
    #: The same under PyTorch's defaults.
    defaults_peak_reserved_bytes: int
    #: The process's current setting as a conf (what the table calls the recording's).
    current_conf: Optional[str]
    #: The GPU memory the search fitted in, in bytes.
    capacity_bytes: int
    #: Every setting tried, best first: ``{"conf", "env", "peak_reserved_bytes",
    #: "device_allocs", "ooms", ...}``.
    candidates: list[dict[str, Any]]
    #: The table, the lines to paste and the savings, as ``ferrocache tune`` prints them.
    table: str
    #: The whole answer, as ``ferrocache tune --json`` writes it.
    data: dict[str, Any] = field(repr=False)

    def __str__(self) -> str:
        return self.table

    @property
    def exports(self) -> list[str]:
        """The lines to paste into a shell (empty without a recommendation)."""
        if self.recommended_conf is None:
            return []
        lines = [f"export PYTORCH_CUDA_ALLOC_CONF={_shell_quote(self.recommended_conf)}"]
        lines += [f"export {name}={_shell_quote(value)}" for name, value in self.recommended_env.items()]
        return lines

    @property
    def saving_bytes(self) -> Optional[int]:
        """Peak reserved bytes the recommendation saves against the current setting."""
        if self.recommended_peak_reserved_bytes is None or self.current_peak_reserved_bytes is None:
            return None
        return self.current_peak_reserved_bytes - self.recommended_peak_reserved_bytes


def _shell_quote(value: str) -> str:
    plain = value and all(c.isascii() and (c.isalnum() or c in "_:.,=-/+@%") for c in value)
    return value if plain else "'" + value.replace("'", "'\\''") + "'"


def _snapshot_bytes(snapshot: Union[str, "os.PathLike[str]", bytes, dict[str, Any]]) -> bytes:
    if isinstance(snapshot, (bytes, bytearray)):
        return bytes(snapshot)
    if isinstance(snapshot, dict):
        return pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL)
    with open(os.fspath(snapshot), "rb") as f:
        return f.read()


def advise(
    device: Device = None,
    *,
    capacity_gib: Optional[float] = None,
    max_candidates: Optional[int] = None,
    snapshot: Union[str, "os.PathLike[str]", bytes, dict[str, Any], None] = None,
) -> Advice:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` (and ``FERROCACHE_*`` variables) under which the work
    recorded so far would have reserved the least memory at its peak, without running out of
    memory on this GPU.

    ``device``: whose history (default: the current device). ``capacity_gib``: the memory to fit
    in (default: the device's, or the memory fraction's limit; given, the search also tries
    ``garbage_collection_threshold``). ``max_candidates``: try at most this many settings,
    the simplest first (default: all, a few hundred). ``snapshot``: advise on a snapshot
    instead (a file, its bytes, or the dict ``torch.cuda.memory._snapshot()`` returns), as
    ``ferrocache tune`` does.

    Raises :class:`NoHistoryError`, saying how to record, when no history was recorded. The
    search runs in the library, outside the GIL, on every core (``RAYON_NUM_THREADS`` bounds
    it); it takes about a second for a few hundred thousand recorded events.
    """
    if capacity_gib is not None and not (capacity_gib > 0 and capacity_gib < 1e6):
        raise ValueError(f"capacity_gib must be a number of GiB above 0, not {capacity_gib!r}")
    if max_candidates is not None and (isinstance(max_candidates, bool) or max_candidates < 1):
        raise ValueError(f"max_candidates must be a positive int, not {max_candidates!r}")
    capacity = 0 if capacity_gib is None else int(capacity_gib * _GIB)
    if snapshot is None:
        data: Optional[bytes] = None
        index = _torch.device_index(device)
    else:
        data = _snapshot_bytes(snapshot)
        index = -1 if device is None else _torch.device_index(device)
    # c_char_p passes the bytes' own buffer; the length says where it ends (NULs inside).
    length = 0 if data is None else len(data)
    try:
        text = _lib.call_string("ferrocache_advise", data, length, index, capacity, max_candidates or 0)
    except RuntimeError as err:
        message = str(err)
        if "history" in message and "_record_memory_history" in message:
            raise NoHistoryError(message) from None
        raise
    result: dict[str, Any] = json.loads(text)
    table = str(result.pop("table", ""))
    return Advice(
        recommended_conf=result.get("recommended_conf"),
        recommended_env=dict(result.get("recommended_env") or {}),
        current_peak_reserved_bytes=result.get("recorded_peak_reserved_bytes"),
        recommended_peak_reserved_bytes=result.get("peak_reserved_bytes"),
        defaults_peak_reserved_bytes=int(result["defaults_peak_reserved_bytes"]),
        current_conf=result.get("recorded_conf"),
        capacity_bytes=int(result["capacity_bytes"]),
        candidates=list(result.get("candidates") or []),
        table=table,
        data=result,
    )


__all__ = ["Advice", "NoHistoryError", "advise"]
