"""What :func:`ferrocache.install` changes in ``torch.cuda``, and nothing else does.

PyTorch's own memory functions (``torch.cuda.memory_stats``, ``max_memory_allocated``,
``memory_summary``, ``_record_memory_history``, ``_snapshot``, ...) ask PyTorch's allocator,
which for a plugged-in allocator raises "CUDAPluggableAllocator does not yet support ...".
:data:`TORCH_CUDA_FUNCTIONS` is the one table of what install() puts in their place, under the
same names, in ``torch.cuda.memory`` and in ``torch.cuda`` (where each exists), and
:data:`TORCH_ACCELERATOR_FUNCTIONS` those of ``torch.accelerator`` (PyTorch >= 2.9), which
answer for the CUDA device only and otherwise call PyTorch's own.

:data:`TORCH_POOL_NAMES` puts ferrocache's private pools under PyTorch's ``MemPool`` and
``use_mem_pool``, and :data:`TORCH_C_FUNCTIONS` / :data:`TORCH_C_WRAPPED` replace the ``torch._C``
functions that PyTorch's own Python functions call (settings changed at run time, the memory
fraction asked back, memory metadata, caching turned off), so that every caller reaches
ferrocache, however it got to the function.

A name this PyTorch lacks is skipped. Functions left as they are, because they already reach
ferrocache through the plugged-in allocator: ``empty_cache``, ``set_per_process_memory_fraction``,
``caching_allocator_alloc`` / ``caching_allocator_delete``, ``mem_get_info``, and
``_save_segment_usage`` / ``_save_memory_usage`` (which call the replaced ``_snapshot``).

Out of memory: PyTorch raises ``torch.OutOfMemoryError`` only for a C++ ``c10::OutOfMemoryError``.
install() builds (once per PyTorch version, cached) a few lines of C++ (``oom_shim.cpp``) against
the installed PyTorch's headers and ``libc10.so`` and registers its thrower with the library.
Without a C++ compiler, or when the build fails, an out of memory is a ``RuntimeError`` with the
same message, and one WARN line says why. ``FERROCACHE_OOM_SHIM`` names a prebuilt shim to use
instead; ``FERROCACHE_CACHE_DIR`` where built shims are kept.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from . import _env, _lib, _ranks, _torch, memory, pools, snapshot
from ._torch import Device
from .errors import library_error

# ------------------------------------------------------------------------------------------------
# The functions
# ------------------------------------------------------------------------------------------------


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"`torch.cuda.{old}` is deprecated. Use `torch.cuda.{new}` instead.", FutureWarning, stacklevel=3)


def _memory_stats(device: Device = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats``: empty before CUDA is initialised, as PyTorch's."""
    if not _torch.cuda_initialized():
        return {}
    return memory.memory_stats(device)


def _memory_stats_as_nested_dict(device: Device = None) -> dict[str, Any]:
    if not _torch.cuda_initialized():
        return {}
    return memory.memory_stats_as_nested_dict(device)


def _memory_cached(device: Device = None) -> int:
    _deprecated("memory_cached", "memory_reserved")
    return memory.memory_reserved(device)


def _max_memory_cached(device: Device = None) -> int:
    _deprecated("max_memory_cached", "max_memory_reserved")
    return memory.max_memory_reserved(device)


def _reset_max_memory_allocated(device: Device = None) -> None:
    warnings.warn(
        "torch.cuda.reset_max_memory_allocated now calls torch.cuda.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    memory.reset_peak_memory_stats(device)


def _reset_max_memory_cached(device: Device = None) -> None:
    warnings.warn(
        "torch.cuda.reset_max_memory_cached now calls torch.cuda.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    memory.reset_peak_memory_stats(device)


def _memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary``: PyTorch's table, line for line (ferrocache's own
    :func:`ferrocache.memory_summary` adds its split and merge counts)."""
    index = _torch.device_index(device)
    return memory.format_summary(memory.memory_stats(index), index, abbreviated, layout="pytorch")


#: ``torch.cuda.memory`` name -> ferrocache's function; also set in ``torch.cuda`` where
#: ``torch.cuda`` has the name.
TORCH_CUDA_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "memory_stats": _memory_stats,
    "memory_stats_as_nested_dict": _memory_stats_as_nested_dict,
    "memory_allocated": memory.memory_allocated,
    "max_memory_allocated": memory.max_memory_allocated,
    "memory_reserved": memory.memory_reserved,
    "max_memory_reserved": memory.max_memory_reserved,
    "memory_cached": _memory_cached,
    "max_memory_cached": _max_memory_cached,
    "reset_peak_memory_stats": memory.reset_peak_memory_stats,
    "reset_max_memory_allocated": _reset_max_memory_allocated,
    "reset_max_memory_cached": _reset_max_memory_cached,
    "reset_accumulated_memory_stats": memory.reset_accumulated_memory_stats,
    "memory_summary": _memory_summary,
    "memory_snapshot": snapshot.memory_snapshot,
    "_record_memory_history": snapshot.record_memory_history,
    "_record_memory_history_impl": snapshot._record_memory_history_impl,
    "_record_memory_history_legacy": snapshot._record_memory_history_legacy,
    "_snapshot": snapshot.snapshot,
    "_dump_snapshot": snapshot.torch_dump_snapshot,
    "_allocation_traceback": snapshot.allocation_traceback,
}


# ------------------------------------------------------------------------------------------------
# torch._C: what PyTorch's own Python functions call
# ------------------------------------------------------------------------------------------------


def _get_memory_fraction(device: int) -> float:
    """``torch._C._cuda_getMemoryFraction`` (``torch.cuda.get_per_process_memory_fraction``):
    the device's limit over its memory, 1 when none was set."""
    fraction = _lib.function("ferrocache_get_memory_fraction")(int(device))
    if fraction < 0:
        raise library_error(_lib.last_error(), "get_per_process_memory_fraction")
    return float(fraction)


def _set_memory_metadata(metadata: str) -> None:
    """``torch._C._cuda_setMemoryMetadata`` (``torch.cuda.memory._set_memory_metadata``, which
    turns a dict into JSON first): this thread's trace entries carry it as ``user_metadata``."""
    if not isinstance(metadata, str):
        raise TypeError(f"_cuda_setMemoryMetadata(): expected a str, not {type(metadata).__name__}")
    _lib.call_status("ferrocache_set_memory_metadata", metadata.encode("utf-8"))


def _get_memory_metadata() -> str:
    """``torch._C._cuda_getMemoryMetadata``: this thread's metadata, "" when none."""
    return _lib.call_string("ferrocache_get_memory_metadata")


def _memory_metadata_supported() -> bool:
    """``torch._C._cuda_memoryMetadataSupported``: ferrocache records the metadata."""
    return True


def _enable_caching(enabled: bool) -> None:
    """``torch._C._cuda_cudaCachingAllocator_enable`` (``caching_allocator_enable`` and
    ``caching_allocator_disabled``): off, allocations go to the driver and back at their exact
    size, outside the cache and its statistics, as PyTorch's do."""
    _lib.function("ferrocache_set_caching_enabled")(1 if enabled else 0)


def _caching_enabled() -> bool:
    """``torch._C._cuda_cudaCachingAllocator_is_enabled``."""
    return bool(_lib.function("ferrocache_caching_enabled")())


def _allocator_settings_for_both(theirs: Callable[[str], Any]) -> Callable[[str], None]:
    """``torch._C._accelerator_setAllocatorSettings`` (what
    ``torch.cuda.memory._set_allocator_settings`` calls): PyTorch's parser first, so that the
    PyTorch in use accepts or refuses the setting in its own words and keeps its own record of
    it (its host allocator reads it too); then ferrocache applies it, from each device's next
    decision on."""

    @functools.wraps(theirs)
    def set_allocator_settings(env: str) -> None:
        theirs(env)
        if _lib.function("ferrocache_set_allocator_settings")(env.encode("utf-8")) != 0:
            raise ValueError(_lib.last_error())

    return set_allocator_settings


#: ``torch._C`` name -> ferrocache's function, or a function of PyTorch's that gives it.
TORCH_C_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "_cuda_getMemoryFraction": _get_memory_fraction,
    "_cuda_setMemoryMetadata": _set_memory_metadata,
    "_cuda_getMemoryMetadata": _get_memory_metadata,
    "_cuda_memoryMetadataSupported": _memory_metadata_supported,
    "_cuda_cudaCachingAllocator_enable": _enable_caching,
    "_cuda_cudaCachingAllocator_is_enabled": _caching_enabled,
}
#: ``torch._C`` functions that keep working and are followed by ferrocache's. PyTorch before
#: 2.9 sets the allocator settings through ``_cuda_cudaCachingAllocator_set_allocator_settings``.
TORCH_C_WRAPPED: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "_accelerator_setAllocatorSettings": _allocator_settings_for_both,
    "_cuda_cudaCachingAllocator_set_allocator_settings": _allocator_settings_for_both,
}
#: ``torch.cuda.memory`` (and ``torch.cuda``) names that PyTorch's classes and context managers
#: of private pools take under ferrocache.
TORCH_POOL_NAMES: dict[str, Any] = {
    "MemPool": pools.TorchMemPool,
    "use_mem_pool": pools.use_mem_pool,
}


def _for_cuda_only(ours: Callable[..., Any], theirs: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.accelerator`` function answered by ferrocache when the accelerator (or the
    device given) is CUDA, by PyTorch's own otherwise."""

    @functools.wraps(theirs)
    def answer(device_index: Device = None, /) -> Any:
        if _is_cuda(device_index):
            return ours(device_index)
        return theirs(device_index)

    return answer


def _is_cuda(device: Device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda" or device.isdigit()
    if device is None or isinstance(device, int):
        torch = _torch.imported_torch()
        current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
        return current is None or getattr(current(), "type", "cuda") == "cuda"
    return getattr(device, "type", None) == "cuda"


#: ``torch.accelerator`` name -> ferrocache's function, for the CUDA device.
TORCH_ACCELERATOR_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "memory_stats": memory.memory_stats,
    "memory_allocated": memory.memory_allocated,
    "max_memory_allocated": memory.max_memory_allocated,
    "memory_reserved": memory.memory_reserved,
    "max_memory_reserved": memory.max_memory_reserved,
    "reset_peak_memory_stats": memory.reset_peak_memory_stats,
    "reset_accumulated_memory_stats": memory.reset_accumulated_memory_stats,
}

#: What install() replaced: (module, name, PyTorch's function), to tell and to undo in tests.
_replaced: list[tuple[ModuleType, str, Any]] = []


def _replace(module: ModuleType, name: str, function: Callable[..., Any]) -> None:
    original = getattr(module, name)
    if original is function:
        return
    setattr(module, name, function)
    _replaced.append((module, name, original))


def patch_torch_cuda(torch: ModuleType, own_pools: bool = False) -> list[str]:
    """Puts :data:`TORCH_CUDA_FUNCTIONS` and :data:`TORCH_ACCELERATOR_FUNCTIONS` in place;
    returns the qualified names replaced. ``own_pools``: PyTorch's ``MemPool`` and
    ``use_mem_pool`` stay PyTorch's (ferrocache's allocator object answers their calls), else
    :data:`TORCH_POOL_NAMES` replace them."""
    cuda_memory = torch.cuda.memory
    for name, function in TORCH_CUDA_FUNCTIONS.items():
        if not hasattr(cuda_memory, name):
            continue
        _replace(cuda_memory, name, function)
        if hasattr(torch.cuda, name):
            _replace(torch.cuda, name, function)
    for name, replacement in TORCH_POOL_NAMES.items() if not own_pools else ():
        for module in (cuda_memory, torch.cuda):
            if hasattr(module, name):
                _replace(module, name, replacement)
    native = getattr(torch, "_C", None)
    for name, function in TORCH_C_FUNCTIONS.items():
        if hasattr(native, name):
            _replace(native, name, function)
    for name, wrap in TORCH_C_WRAPPED.items():
        theirs = getattr(native, name, None)
        if theirs is not None:
            _replace(native, name, wrap(theirs))
    accelerator = getattr(torch, "accelerator", None)
    for name, function in TORCH_ACCELERATOR_FUNCTIONS.items():
        for module in (accelerator, getattr(accelerator, "memory", None)):
            theirs = getattr(module, name, None) if module is not None else None
            if theirs is not None and module is not None:
                _replace(module, name, _for_cuda_only(function, theirs))
    return [f"{module.__name__}.{name}" for module, name, _ in _replaced]


def replaced_names() -> list[str]:
    """The ``torch`` functions that install() replaced, qualified (``torch.cuda.memory_stats``)."""
    return [f"{module.__name__}.{name}" for module, name, _ in _replaced]


# ------------------------------------------------------------------------------------------------
# Out of memory as torch.OutOfMemoryError
# ------------------------------------------------------------------------------------------------

#: A prebuilt shim to load instead of building one.
OOM_SHIM_ENV = _env.OOM_SHIM.name
#: Where built shims are cached (default ``$XDG_CACHE_HOME/ferrocache`` or ``~/.cache/ferrocache``).
CACHE_DIR_ENV = _env.CACHE_DIR.name
_SHIM_SOURCE = Path(__file__).with_name("oom_shim.cpp")
_SHIM_SYMBOL = "ferrocache_throw_oom"
_RESERVE_CLASS_SYMBOL = "ferrocache_stream_reserve_class"
_oom_shim: Any = None  # the loaded shim, kept for the life of the process


def _warn(message: str) -> None:
    """One WARN line on stderr in the library's format, unless the log level hides warnings."""
    _ranks.log("WARN", message)


def _cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ferrocache"


def _compiler() -> Optional[str]:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _torch_paths(torch: ModuleType) -> tuple[Path, Path]:
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _cxx11_abi(torch: ModuleType) -> int:
    flag = getattr(getattr(torch, "_C", None), "_GLIBCXX_USE_CXX11_ABI", None)
    if flag is None:
        compiled = getattr(torch, "compiled_with_cxx11_abi", None)
        flag = compiled() if compiled is not None else True
    return 1 if flag else 0


def build_oom_shim(torch: ModuleType) -> Path:
    """The shim for this PyTorch, built on first use and cached; raises ``RuntimeError`` saying
    why it cannot be built."""
    include, lib = _torch_paths(torch)
    if not (include / "c10" / "util" / "Exception.h").is_file():
        raise RuntimeError(f"this PyTorch ships no C++ headers ({include}/c10/util/Exception.h)")
    if not (lib / "libc10.so").is_file():
        raise RuntimeError(f"this PyTorch has no {lib}/libc10.so")
    abi = _cxx11_abi(torch)
    source = _SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + f"{torch.__version__}|{lib}|{abi}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"oom-shim-torch-{torch.__version__}-{key}.so"
    if target.is_file():
        return target
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, c++, g++, clang++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        # libc10_cuda for the reserve classes (a weak reference: absent in older PyTorch).
        cuda = ["-Wl,--no-as-needed", "-lc10_cuda"] if (lib / "libc10_cuda.so").is_file() else []
        command = [
            compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}", str(_SHIM_SOURCE),
            "-o", str(built), f"-L{lib}", "-lc10", *cuda, f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"{compiler} could not build {_SHIM_SOURCE.name}: {last}")
        os.replace(built, target)  # atomic: another process may be building it too
    return target


def connect_oom_error(torch: ModuleType) -> bool:
    """Makes out of memory arrive as ``torch.OutOfMemoryError``; where that cannot be, writes
    one WARN line saying why and returns False (out of memory is then a ``RuntimeError`` with
    the same message)."""
    global _oom_shim
    if _oom_shim is not None:
        return True
    import ctypes

    try:
        prebuilt = os.environ.get(OOM_SHIM_ENV)
        path = Path(prebuilt) if prebuilt else build_oom_shim(torch)
        shim = ctypes.CDLL(str(path))
        thrower = ctypes.cast(getattr(shim, _SHIM_SYMBOL), ctypes.c_void_p).value
    except (RuntimeError, OSError, AttributeError) as err:
        _warn(
            f"out of memory will raise RuntimeError, not torch.OutOfMemoryError (same message): "
            f"the shim that throws c10::OutOfMemoryError is unavailable: {err}"
        )
        return False
    if _lib.function("ferrocache_set_oom_thrower")(thrower) != 0:
        _warn("out of memory will raise RuntimeError: the library refused the shim's thrower")
        return False
    _oom_shim = shim
    # The shim also tells the allocator the reserve class of a stream (PyTorch 2.15's
    # expandable_segments_reserve_by_class); a shim built elsewhere may lack it.
    lookup = getattr(shim, _RESERVE_CLASS_SYMBOL, None)
    if lookup is not None:
        _lib.function("ferrocache_set_reserve_class_lookup")(ctypes.cast(lookup, ctypes.c_void_p).value)
    return True


__all__ = [
    "CACHE_DIR_ENV",
    "OOM_SHIM_ENV",
    "TORCH_ACCELERATOR_FUNCTIONS",
    "TORCH_CUDA_FUNCTIONS",
    "TORCH_C_FUNCTIONS",
    "TORCH_C_WRAPPED",
    "TORCH_POOL_NAMES",
    "build_oom_shim",
    "connect_oom_error",
    "patch_torch_cuda",
    "replaced_names",
]
