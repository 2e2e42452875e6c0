"""Sleep and wake: give the GPU memory back and take it again, at the same addresses.

Use::

    with ferrocache.region("weights"):      # allocations of this thread go under the tag
        model = build_model().cuda()
    report = ferrocache.sleep("weights")     # copied to host memory, then given back
    ...                                      # another user of the GPU allocates it
    ferrocache.wake("weights")               # mapped again at the same addresses, restored

See docs/sleep.md. Touching memory while it sleeps is the program's error (an illegal address on
a GPU); so is reading memory that slept without a backup before writing it again (its bytes
after wake are undefined: zeros on the fake CUDA).
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

from . import _lib

__all__ = [
    "DeviceSleepReport",
    "SleepError",
    "SleepReport",
    "region",
    "release_host_memory",
    "sleep",
    "wake",
]

Tags = Union[None, str, Sequence[str]]

_thread = threading.local()


@dataclass(frozen=True)
class DeviceSleepReport:
    """What a :func:`sleep` or :func:`wake` moved on one device (the fields of
    :class:`SleepReport`)."""

    device: int
    segments: int
    bytes: int
    blocks: int
    copied_bytes: int
    skipped_bytes: int
    seconds: float


@dataclass(frozen=True)
class SleepReport:
    """What a :func:`sleep` or :func:`wake` moved, summed over devices."""

    #: Segments that slept (or woke).
    segments: int
    #: Their bytes: device memory given back (or taken again).
    bytes: int
    #: Live allocations in them.
    blocks: int
    #: Bytes copied to host memory (sleep with backup) or back (wake): the live allocations'
    #: bytes, not the segments' (nor an expandable segment's mapped pages').
    copied_bytes: int
    #: Bytes that matched but cannot sleep: segments made before sleep-ability was on
    #: (``FERROCACHE_SLEEP=1``, or the first :func:`region`). Expandable segments always can.
    skipped_bytes: int
    #: Whether the copies went to (or came from) page-locked host memory.
    host_memory_pinned: bool
    #: Pinned host buffers this call allocated (0 once a buffer kept from an earlier sleep fits).
    host_allocations: int
    #: Times this call made the host wait for the device, per device: sleep once (for its
    #: copies, which wait for the program's streams on the device; without backup, for the
    #: device), wake once with backups and not at all without.
    host_synchronizations: int
    #: Pinned host memory sleep holds after the call (kept for the next sleep unless
    #: :func:`release_host_memory` or ``keep_host_memory=False`` gives it back).
    host_memory_bytes: int
    #: Host time taken.
    seconds: float
    #: The same, per device, in device order (up to the device that failed, for a
    #: :class:`SleepError`'s report).
    devices: tuple[DeviceSleepReport, ...] = ()


class SleepError(RuntimeError):
    """A :func:`sleep` or :func:`wake` failed on one device. What the devices before it did
    stays done (memory that slept stays asleep, memory that woke stays awake), and
    :attr:`report` says what that was; calling again goes on where it stopped."""

    def __init__(self, message: str, report: Optional[SleepReport], device: Optional[int]):
        super().__init__(message)
        #: What was done before the failure, per device (the failing one included); None when
        #: the library could not say.
        self.report = report
        #: The device that failed.
        self.device = device


def _check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag or "\n" in tag:
        raise ValueError(f"a tag is a non-empty string without newlines, not {tag!r}")
    return tag


def _tags_argument(tags: Tags) -> Optional[bytes]:
    if tags is None:
        return None
    names = [tags] if isinstance(tags, str) else list(tags)
    return _lib.encode("\n".join(_check_tag(name) for name in names))


def _set_thread_tag(tag: Optional[str]) -> None:
    _lib.call_status("ferrocache_set_thread_tag", _lib.encode(tag))


@contextlib.contextmanager
def region(tag: str) -> Iterator[None]:
    """Allocations this thread makes inside the block go under ``tag`` (regions nest; the
    innermost tag counts), so that :func:`sleep` and :func:`wake` can name them. The first
    region makes new memory sleep-able (VMM-backed). A CUDA graph capture still takes the
    allocations on its streams into its own pool."""
    _check_tag(tag)
    stack: list[str] = _thread.__dict__.setdefault("tags", [])
    _set_thread_tag(tag)
    stack.append(tag)
    try:
        yield
    finally:
        stack.pop()
        _set_thread_tag(stack[-1] if stack else None)


def _moved(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "segments": int(fields["segments"]),
        "bytes": int(fields["bytes"]),
        "blocks": int(fields["blocks"]),
        "copied_bytes": int(fields["copied_bytes"]),
        "skipped_bytes": int(fields["skipped_bytes"]),
        "seconds": float(fields["seconds"]),
    }


def _host_memory(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "host_memory_pinned": bool(fields["host_memory_pinned"]),
        "host_allocations": int(fields["host_allocations"]),
        "host_synchronizations": int(fields["host_synchronizations"]),
        "host_memory_bytes": int(fields["host_memory_bytes"]),
    }


def _report(fields: dict[str, Any]) -> SleepReport:
    devices = tuple(
        DeviceSleepReport(device=int(d["device"]), **_moved(d)) for d in fields.get("devices", ())
    )
    return SleepReport(**_moved(fields), **_host_memory(fields), devices=devices)


def _sleep_or_wake(function: str, *args: Any) -> SleepReport:
    """Calls ``ferrocache_sleep`` or ``ferrocache_wake``; on failure raises :class:`SleepError`
    with the report of what was done, which the library keeps for this thread."""
    text = _lib.take_string(_lib.function(function)(*args))
    if text is not None:
        return _report(json.loads(text))
    message = _lib.last_error() or f"{function} failed without saying why"
    kept = _lib.take_string(_lib.function("ferrocache_last_sleep_report")())
    fields = json.loads(kept) if kept is not None else None
    failed = (fields or {}).get("failed") or {}
    device = failed.get("device")
    raise SleepError(
        message,
        _report(fields) if fields is not None else None,
        int(device) if device is not None else None,
    )


def sleep(tags: Tags = None, backup: bool = True) -> SleepReport:
    """Gives back the device memory of ``tags`` (one tag or several; ``None``: all memory that
    can sleep), live and cached alike, after waiting for the device. With ``backup`` the live
    allocations' bytes are copied to pinned host memory first (kept for the next sleep; see
    :func:`release_host_memory`); without, they are dropped. Addresses stay reserved. Memory
    already asleep is left as it is, so calling it twice is harmless. A device that fails raises
    :class:`SleepError`, whose ``report`` says what the devices before it did."""
    return _sleep_or_wake("ferrocache_sleep", _tags_argument(tags), int(bool(backup)))


def wake(tags: Tags = None, keep_host_memory: bool = True) -> SleepReport:
    """Maps the memory of ``tags`` (``None``: all) back at the same addresses and restores what
    was backed up. Memory awake is left as it is; after a failure, calling it again goes on.
    Under a memory fraction, memory whose wake would reserve past the limit stays asleep and a
    :class:`SleepError` (a RuntimeError) says so (docs/sleep.md). The pinned host memory the
    backups used is kept for the next sleep, unless ``keep_host_memory`` is false (then as
    :func:`release_host_memory`; the report's ``host_memory_bytes`` is what was held before)."""
    report = _sleep_or_wake("ferrocache_wake", _tags_argument(tags))
    if not keep_host_memory:
        release_host_memory()
    return report


def release_host_memory() -> int:
    """Gives back the pinned host memory that :func:`sleep` keeps for its backups, except what
    holds the backup of memory still asleep; returns its bytes. The next sleep with backup
    allocates it again."""
    return int(_lib.function("ferrocache_release_host_memory")())
