"""Finding and loading ``libferrocache.so`` with ctypes, and its C signatures.

Every function of ``include/ferrocache.h`` is declared in :data:`SIGNATURES`;
``python/tests/test_lib.py`` parses the header and checks each declaration against it. Strings
that the library hands over (``char *``) are declared ``c_void_p`` so that they can be given
back to ``ferrocache_string_free``; strings it keeps (``const char *``) are ``c_char_p``.

The library reads its settings (``PYTORCH_CUDA_ALLOC_CONF``, ``TORCH_CUDA_ALLOC_LOG_LEVEL``)
at the first call that needs them, not when it is loaded: :func:`settings_may_be_read` tells
whether this package has made such a call yet.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from ctypes import (
    POINTER,
    c_char_p,
    c_double,
    c_int,
    c_int64,
    c_size_t,
    c_uint64,
    c_ulonglong,
    c_void_p,
)
from pathlib import Path
from typing import Any, Callable, Optional

from . import _env
from ._version import __version__
from .errors import LibraryNotFoundError, LibraryVersionError, library_error

#: Set it to the path of a ``libferrocache.so`` to use that one (development builds).
LIBRARY_ENV = _env.LIBRARY.name
#: The library's file name as cargo builds it.
LIBRARY_NAME = "libferrocache.so"
#: Where a wheel puts the library, beside the package in site-packages: maturin copies the library
#: that the ``ferrocache`` binary links to into ``ferrocache.libs/``, its name suffixed with a
#: hash of its contents (``libferrocache-1a2b3c4d.so``), as auditwheel does.
WHEEL_LIBRARY_DIR = "ferrocache.libs"
WHEEL_LIBRARY_GLOB = "libferrocache-*.so"

_CType = Any  # a ctypes type, or None for void

#: name -> (restype, argtypes), as in include/ferrocache.h.
SIGNATURES: dict[str, tuple[_CType, tuple[_CType, ...]]] = {
    # PyTorch's CUDAPluggableAllocator functions. rust_malloc throws a C++ exception on
    # failure: it is only ever called by PyTorch, never through ctypes.
    "rust_malloc": (c_void_p, (c_size_t, c_int, c_void_p)),
    "rust_free": (None, (c_void_p, c_size_t, c_int, c_void_p)),
    "rust_init": (None, (c_int,)),
    "rust_reset": (None, ()),
    "rust_memory_fraction": (None, (c_double, c_int)),
    "rust_record_stream": (None, (c_void_p, c_void_p)),
    "rust_base_alloc": (c_void_p, (c_void_p, POINTER(c_size_t))),
    # For Python and C callers.
    "ferrocache_alloc": (c_void_p, (c_size_t, c_int, c_void_p)),
    "ferrocache_free": (c_int, (c_void_p,)),
    "ferrocache_last_error": (c_char_p, ()),
    "ferrocache_string_free": (None, (c_void_p,)),
    "ferrocache_memory_stats": (c_void_p, (c_int,)),
    "ferrocache_snapshot": (c_void_p, ()),
    "ferrocache_record_history": (c_int, (c_int, c_size_t)),
    # Snapshot bytes (or NULL: the recorded history), length, device, capacity, max candidates.
    "ferrocache_advise": (c_void_p, (c_char_p, c_size_t, c_int, c_ulonglong, c_size_t)),
    "ferrocache_reset_peak_stats": (c_int, (c_int,)),
    "ferrocache_reset_accumulated_stats": (c_int, (c_int,)),
    "ferrocache_empty_cache": (c_int, ()),
    # Each device's current stream (PyTorch's emptyCache, from the front end).
    "ferrocache_empty_cache_with_current_streams": (c_int, (c_void_p, c_int)),
    "ferrocache_set_memory_fraction": (c_int, (c_double, c_int)),
    "ferrocache_get_memory_fraction": (c_double, (c_int,)),
    # torch.cuda.memory._set_allocator_settings and the per-thread memory metadata.
    "ferrocache_set_allocator_settings": (c_int, (c_char_p,)),
    "ferrocache_set_memory_metadata": (c_int, (c_char_p,)),
    "ferrocache_get_memory_metadata": (c_void_p, ()),
    # torch.cuda.memory.caching_allocator_enable / caching_allocator_disabled.
    "ferrocache_set_caching_enabled": (c_int, (c_int,)),
    "ferrocache_caching_enabled": (c_int, ()),
    # Function pointers as addresses (snapshot.py's stack gatherer, torch_api.py's OOM shim).
    "ferrocache_set_stack_gatherer": (c_int, (c_void_p, c_int)),
    "ferrocache_set_oom_thrower": (c_int, (c_void_p,)),
    "ferrocache_set_reserve_class_lookup": (c_int, (c_void_p,)),
    "ferrocache_attach_oom_observer": (c_int, (c_void_p,)),
    "ferrocache_detach_oom_observer": (c_int, (c_void_p,)),
    "ferrocache_check_invariants": (c_int, ()),
    "ferrocache_check_config": (c_int, (c_char_p,)),
    "ferrocache_describe_config": (c_void_p, (c_char_p,)),
    "ferrocache_version": (c_char_p, ()),
    # The `ferrocache` command (the binary calls it; so may anyone who has argv at hand).
    "ferrocache_cli_main": (c_int, (c_int, POINTER(c_char_p))),
    # Private pools (CUDA graphs, ferrocache.mem_pool): device, then the pool id's two halves.
    "ferrocache_begin_allocate_current_thread_to_pool": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_end_allocate_to_pool": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_release_pool": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_create_or_incref_pool": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    # Device, pool id, the context of the pool's own allocator and its alloc, free and release
    # functions (frontend.cpp's; MemPool(allocator=...)).
    "ferrocache_create_pool_with_allocator": (
        c_int,
        (c_int, c_ulonglong, c_ulonglong, c_void_p, c_void_p, c_void_p, c_void_p),
    ),
    "ferrocache_pool_use_count": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_empty_pool_cache": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    # Device, pool id, use_on_oom, no_split.
    "ferrocache_set_pool_options": (c_int, (c_int, c_ulonglong, c_ulonglong, c_int, c_int)),
    # Sleep and wake: a tag (NULL: none), tags separated by newlines (NULL: all), backup.
    "ferrocache_set_thread_tag": (c_int, (c_char_p,)),
    "ferrocache_sleep": (c_void_p, (c_char_p, c_int)),
    "ferrocache_wake": (c_void_p, (c_char_p,)),
    # The report of this thread's latest sleep or wake, a failed one's included.
    "ferrocache_last_sleep_report": (c_void_p, ()),
    # Gives back sleep's idle pinned host memory: the bytes given back.
    "ferrocache_release_host_memory": (c_uint64, ()),
    # ferrocache's own CUDAAllocator object for PyTorch (frontend.cpp) and what it asks.
    "ferrocache_frontend_malloc": (
        c_void_p,
        (c_size_t, c_int, c_void_p, POINTER(c_char_p), POINTER(c_void_p)),
    ),
    "ferrocache_frontend_begin_allocate_to_pool": (
        c_char_p,
        (c_int, c_ulonglong, c_ulonglong, c_void_p, c_void_p, c_void_p),
    ),
    "ferrocache_cache_info": (c_int, (c_int, POINTER(c_size_t))),
    # Device, a struct ferrocache_device_stats to fill.
    "ferrocache_read_device_stats": (c_int, (c_int, c_void_p)),
    # Device, pool id, the expected live addresses and their count.
    "ferrocache_check_pool_live_allocations": (
        c_int,
        (c_int, c_ulonglong, c_ulonglong, POINTER(c_void_p), c_size_t),
    ),
    # CUDA graph trees' checkpoints: device and pool id (a checkpoint, NULL on failure); the
    # checkpoint given back; device, checkpoint and a struct ferrocache_checkpoint_delta to fill;
    # that delta's arrays given back.
    "ferrocache_checkpoint_pool": (c_void_p, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_checkpoint_free": (None, (c_void_p,)),
    "ferrocache_restore_pool_checkpoint": (c_int, (c_int, c_void_p, c_void_p)),
    "ferrocache_checkpoint_delta_free": (None, (c_void_p,)),
    "ferrocache_set_pool_use_on_oom": (c_int, (c_int, c_ulonglong, c_ulonglong, c_int)),
    "ferrocache_set_pool_no_split": (c_int, (c_int, c_ulonglong, c_ulonglong)),
    "ferrocache_history_enabled": (c_int, ()),
    # Pool id ((0, 0): all), context, segment and block visitors.
    "ferrocache_snapshot_segments": (c_int, (c_ulonglong, c_ulonglong, c_void_p, c_void_p, c_void_p)),
    # CUDA IPC (src/ffi/ipc.rs): a handle's bytes (length, offset), given back; a handle opened
    # (bytes, length, device, token), closed by its token.
    "ferrocache_ipc_share": (c_void_p, (c_void_p, c_int, POINTER(c_size_t), POINTER(c_int64))),
    "ferrocache_ipc_bytes_free": (None, (c_void_p, c_size_t)),
    "ferrocache_ipc_open": (c_void_p, (c_void_p, c_size_t, c_int, POINTER(c_uint64))),
    "ferrocache_ipc_close": (c_int, (c_uint64,)),
    # The one allocator trace tracker (a function's address; NULL: none).
    "ferrocache_attach_trace_tracker": (c_int, (c_void_p,)),
    # PyTorch's free-memory callbacks, run on a cache miss (the front end registers them).
    "ferrocache_set_free_memory_callbacks": (c_int, (c_void_p,)),
    # Device, an array of struct ferrocache_stream_segment_size and its length.
    "ferrocache_expandable_segment_sizes": (c_int64, (c_int, c_void_p, c_size_t)),
}

#: PyTorch's CUDA graph pool hooks. Their parameter types are C++ (``std::pair``,
#: ``std::function``), so they are only handed to PyTorch by address, never declared or called
#: through ctypes; the header declares them in its C++-only part.
CPP_HOOKS = frozenset(
    {"rust_begin_allocate_to_pool", "rust_end_allocate_to_pool", "rust_release_pool"}
)

#: Functions that must never be called through ctypes (they throw C++ exceptions, or take C++
#: types).
NOT_CALLABLE = frozenset({"rust_malloc", "ferrocache_frontend_begin_allocate_to_pool"}) | CPP_HOOKS
#: Functions that do not make the library read its settings.
_SETTINGS_FREE = frozenset(
    {
        "ferrocache_version",
        "ferrocache_last_error",
        "ferrocache_string_free",
        "ferrocache_cli_main",
        "ferrocache_set_stack_gatherer",
        "ferrocache_set_oom_thrower",
        "ferrocache_set_reserve_class_lookup",
        "ferrocache_attach_oom_observer",
        "ferrocache_detach_oom_observer",
        "ferrocache_set_memory_metadata",
        "ferrocache_get_memory_metadata",
        "ferrocache_set_caching_enabled",
        "ferrocache_caching_enabled",
    }
)

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_library_file: Optional[Path] = None
_settings_touched = False


def _checkout_candidates(package_dir: Path) -> list[Path]:
    """Where a build in a source checkout is (``pip install -e .``, or running from source)."""
    root = package_dir.parent.parent
    if not (root / "Cargo.toml").is_file():
        return []
    target = Path(os.environ.get("CARGO_TARGET_DIR") or root / "target")
    if not target.is_absolute():
        target = root / target
    return [target / "release" / LIBRARY_NAME, target / "debug" / LIBRARY_NAME]


def _wheel_candidates(package_dir: Path) -> list[Path]:
    """The library a wheel installed beside the package; an error if there are several."""
    libs = package_dir.parent / WHEEL_LIBRARY_DIR
    found = sorted(libs.glob(WHEEL_LIBRARY_GLOB)) if libs.is_dir() else []
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise LibraryNotFoundError(
            f"{libs} holds several ferrocache libraries ({names}), left by more than one "
            "installation: reinstall the package (pip install --force-reinstall ...)"
        )
    return found


def library_path() -> Path:
    """The ``libferrocache.so`` this package uses, as an absolute path.

    ``$FERROCACHE_LIBRARY`` when set; otherwise the library the wheel installed beside the
    package (``site-packages/ferrocache.libs/``); for a package imported from a source checkout
    (``pip install -e .``), the checkout's ``target/release`` (then ``target/debug``) build.
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override).expanduser().resolve()
        if not path.is_file():
            raise LibraryNotFoundError(f"{LIBRARY_ENV}={override!r} is not a file")
        return path
    package_dir = Path(__file__).resolve().parent
    candidates = [*_wheel_candidates(package_dir), *_checkout_candidates(package_dir)]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join([str(package_dir.parent / WHEEL_LIBRARY_DIR / WHEEL_LIBRARY_GLOB)]
                       + [str(c) for c in candidates])
    raise LibraryNotFoundError(
        f"ferrocache's library was not found (looked at {looked}): install the package with "
        f"`pip install .` from the repository root or from a wheel (scripts/build-wheel), or "
        f"set {LIBRARY_ENV} to a libferrocache.so"
    )


def _declare(library: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = list(argtypes)


def load() -> ctypes.CDLL:
    """The loaded library (loaded once), its signatures declared and its version checked."""
    global _library, _library_file
    if _library is not None:
        return _library
    with _lock:
        if _library is not None:
            return _library
        path = library_path()
        try:
            library = ctypes.CDLL(str(path))
        except OSError as err:
            raise LibraryNotFoundError(f"{path} could not be loaded: {err}") from err
        try:
            _declare(library)
        except AttributeError as err:
            raise LibraryVersionError(
                f"{path} lacks a function of ferrocache {__version__}'s C ABI ({err}); "
                "rebuild it (pip install .)"
            ) from err
        version = (library.ferrocache_version() or b"").decode("utf-8", "replace")
        if version != __version__:
            raise LibraryVersionError(
                f"{path} is ferrocache {version or '(unknown)'}, but the Python package is "
                f"{__version__}: reinstall with `pip install .`, or point {LIBRARY_ENV} at a "
                "matching build"
            )
        _library, _library_file = library, path
        return library


def loaded_path() -> Optional[Path]:
    """The file of the loaded library, or None before :func:`load`."""
    return _library_file


def settings_may_be_read() -> bool:
    """Whether this package has called a library function that reads the settings."""
    return _settings_touched


def function(name: str) -> Callable[..., Any]:
    """A library function, for a call through ctypes."""
    global _settings_touched
    if name in NOT_CALLABLE:
        raise ValueError(
            f"{name} throws C++ exceptions or takes C++ types: it must not be called through ctypes"
        )
    if name not in _SETTINGS_FREE:
        _settings_touched = True
    return getattr(load(), name)  # type: ignore[no-any-return]


def address(name: str) -> int:
    """The address of a library function, as PyTorch's ``set_*_fn`` hooks take it."""
    pointer = ctypes.cast(getattr(load(), name), c_void_p).value
    if not pointer:
        raise LibraryVersionError(f"the library has no function {name}")
    return pointer


def last_error() -> str:
    """This thread's last error message from the library ('' after a success)."""
    raw = load().ferrocache_last_error()
    return (raw or b"").decode("utf-8", "replace")


def take_string(pointer: Optional[int]) -> Optional[str]:
    """Copies a string the library handed over and gives it back to the library."""
    if not pointer:
        return None
    try:
        return ctypes.string_at(pointer).decode("utf-8", "replace")
    finally:
        load().ferrocache_string_free(pointer)


def call_string(name: str, *args: Any) -> str:
    """Calls a function that returns an owned string; raises on NULL."""
    text = take_string(function(name)(*args))
    if text is None:
        raise library_error(last_error(), name)
    return text


def call_json(name: str, *args: Any) -> Any:
    """Calls a function that returns an owned JSON string, and parses it."""
    return json.loads(call_string(name, *args))


def call_status(name: str, *args: Any) -> None:
    """Calls a function that returns 0 on success and -1 (last error set) on failure."""
    if function(name)(*args) != 0:
        raise library_error(last_error(), name)


def encode(text: Optional[str]) -> Optional[bytes]:
    """A Python string as a C string argument (None stays NULL)."""
    return None if text is None else text.encode("utf-8")

