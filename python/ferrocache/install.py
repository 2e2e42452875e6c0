"""``ferrocache.install()``: makes ferrocache PyTorch's CUDA allocator.

It swaps in ferrocache's own ``CUDAAllocator`` object (:mod:`ferrocache.frontend`, built
against the running PyTorch and cached), which answers every question PyTorch's C++ code asks
its allocator. Where that object cannot be built (no compiler, no CUDA headers) it writes one
WARN naming what is lost and builds ``torch.cuda.memory.CUDAPluggableAllocator(library_path(),
"rust_malloc", "rust_free")`` instead, hands PyTorch the addresses of the library's hooks
(PyTorch's ``set_*_fn`` methods take function addresses as integers), and calls
``torch.cuda.memory.change_current_allocator``. PyTorch only allows either before CUDA is
initialised, so ``install()`` must come before the first CUDA tensor.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Union

from . import _env, _lib, _ranks, config, frontend, oom, torch_api

#: PyTorch's hook setters, the library function each one gets, and what is lost without it.
HOOKS = (
    ("set_init_fn", "rust_init", "ferrocache is not told the device count"),
    ("set_reset_fn", "rust_reset", "torch.cuda.empty_cache() does nothing"),
    (
        "set_memory_fraction_fn",
        "rust_memory_fraction",
        "torch.cuda.set_per_process_memory_fraction() does nothing",
    ),
    ("set_record_stream_fn", "rust_record_stream", "Tensor.record_stream() is ignored"),
    ("set_base_alloc_fn", "rust_base_alloc", "CUDA IPC sees allocations, not their segments"),
)

#: PyTorch's CUDA graph pool hooks and the library function each one gets. They work only
#: together (a capture that begins must end), so they are set all three or not at all.
POOL_HOOKS = (
    ("set_begin_allocate_to_pool", "rust_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "rust_end_allocate_to_pool"),
    ("set_release_pool", "rust_release_pool"),
)
#: What is lost without the pool hooks.
POOL_HOOKS_LOST = (
    "CUDA graph captures are not served from private pools, so memory a graph replays into can "
    "be handed to other tensors: do not use torch.cuda.graph with ferrocache on this PyTorch"
)


@dataclass(frozen=True)
class _Installed:
    allocator: Any  # torch.cuda.memory.CUDAPluggableAllocator
    conf: Optional[str]
    log_level: Optional[str]
    snapshot_on_oom: Optional[str]


_lock = threading.Lock()
_installed: Optional[_Installed] = None


def _import_torch() -> ModuleType:
    try:
        return importlib.import_module("torch")
    except ImportError as err:
        raise ImportError(
            "ferrocache.install() needs PyTorch (`import torch` failed: "
            f"{err}); install PyTorch with CUDA support. Everything else in ferrocache "
            "(memory_stats, memory_summary, snapshot, ...) works without it."
        ) from err


def is_installed() -> bool:
    """Whether :func:`install` has made ferrocache PyTorch's allocator in this process."""
    return _installed is not None


CROSS_STREAM_VAR = _env.CROSS_STREAM.name
#: The PyTorch whose rules ferrocache follows where they changed between versions (which of two
#: equal cached blocks best fit takes); install() sets it from ``torch.__version__``.
PYTORCH_VERSION_VAR = _env.PYTORCH_VERSION.name


def install(
    conf: Optional[str] = None,
    log_level: Optional[str] = None,
    cross_stream: Optional[bool] = None,
    snapshot_on_oom: Optional[Union[str, "os.PathLike[str]"]] = None,
) -> Any:
    """Makes ferrocache PyTorch's CUDA caching allocator; call it before the first CUDA tensor.

    ``conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` value (``"expandable_segments:True"``,
    ``"max_split_size_mb:128,garbage_collection_threshold:0.8"``, ...); None uses the
    environment's setting as PyTorch would. A given ``conf`` is written into
    ``PYTORCH_CUDA_ALLOC_CONF`` before ferrocache reads its settings, which it does once, at
    its first use: so install() must also come before any other ferrocache call. ``log_level``
    sets ``TORCH_CUDA_ALLOC_LOG_LEVEL`` (OFF, ERROR, WARN, INFO, DEBUG, TRACE) the same way.
    ``cross_stream=True`` sets ``FERROCACHE_CROSS_STREAM=1`` (False sets 0; None leaves the
    environment's): a stream whose cache misses may take a block cached on another stream,
    after one device-side event wait (docs/cross-stream.md). It is ferrocache's own variable,
    never a ``PYTORCH_CUDA_ALLOC_CONF`` key, which PyTorch would reject.

    ``snapshot_on_oom=path`` (or ``FERROCACHE_SNAPSHOT_ON_OOM=path``; the argument wins)
    records the allocation history from now on, with Python stacks, and writes the snapshot to
    ``path`` at the first out of memory, before the exception reaches Python
    (:func:`ferrocache.oom.snapshot_on_oom`). ``{rank}``, ``{local_rank}`` and ``{pid}`` in it
    are replaced; without them, one rank of a job of several writes ``<stem>_rank<N><ext>``.

    Returns PyTorch's allocator object: ``torch.cuda.memory._get_current_allocator()`` for
    ferrocache's own (:mod:`ferrocache.frontend`), else the ``CUDAPluggableAllocator``. Raises ``ValueError`` with
    PyTorch's wording for an invalid setting, ``RuntimeError`` when CUDA is already initialised
    (too late to change PyTorch's allocator) and ``ImportError`` without PyTorch. A second call
    returns the same allocator and changes nothing.

    Once installed, PyTorch's ``torch.cuda.empty_cache()``,
    ``torch.cuda.set_per_process_memory_fraction()`` and ``Tensor.record_stream()`` act on
    ferrocache, ``torch.cuda.graph`` captures allocate from private pools (docs/cuda-graphs.md),
    and ``torch.cuda``'s statistics, summary, history and snapshot functions are
    ferrocache's (the table in :mod:`ferrocache.torch_api`); an out of memory raises
    ``torch.OutOfMemoryError`` where a C++ compiler can build the shim (see torch_api), after
    the observers attached with ``torch._C._cuda_attach_out_of_memory_observer`` ran.
    """
    global _installed
    torch = _import_torch()
    snapshot_on_oom = _snapshot_on_oom_path(snapshot_on_oom)  # refused before anything changes
    with _lock:
        if _installed is not None:
            _check_same_settings(_installed, conf, log_level)
            if snapshot_on_oom is not None and snapshot_on_oom != _installed.snapshot_on_oom:
                warnings.warn(
                    f"ferrocache is already installed; snapshot_on_oom={snapshot_on_oom!r} is ignored",
                    stacklevel=2,
                )
            if cross_stream is not None and os.environ.get(CROSS_STREAM_VAR) != _flag(cross_stream):
                warnings.warn(
                    f"ferrocache is already installed; cross_stream={cross_stream!r} is ignored",
                    stacklevel=2,
                )
            return _installed.allocator
        version = getattr(torch, "version", None)
        if getattr(version, "cuda", None) is None:
            raise RuntimeError(
                "ferrocache.install(): this PyTorch is built without CUDA (torch.version.cuda is "
                f"None; torch {getattr(torch, '__version__', '?')}); install a CUDA build of PyTorch"
            )
        memory = getattr(getattr(torch, "cuda", None), "memory", None)
        if memory is None or not hasattr(memory, "CUDAPluggableAllocator"):
            raise RuntimeError(
                "ferrocache.install(): this PyTorch has no CUDAPluggableAllocator "
                f"(torch {getattr(torch, '__version__', '?')}; a CUDA build of PyTorch >= 2.1 "
                "is needed)"
            )
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "ferrocache.install() came after CUDA was initialised, when PyTorch can no "
                "longer change its allocator: call ferrocache.install() earlier, right after "
                "`import torch` and before the first CUDA tensor or torch.cuda call that "
                "initialises CUDA"
            )
        # Before anything reads ferrocache's settings (config.apply may ask the library).
        if cross_stream is not None:
            os.environ[CROSS_STREAM_VAR] = _flag(cross_stream)
        torch_version = getattr(torch, "__version__", None)
        if torch_version:
            os.environ.setdefault(PYTORCH_VERSION_VAR, str(torch_version))
        config.apply(conf, log_level)
        _lib.load()
        allocator = _install_frontend(torch, memory)
        if allocator is None:
            allocator = _install_pluggable(memory)
        torch_api.patch_torch_cuda(torch, own_pools=frontend.is_installed())
        torch_api.connect_oom_error(torch)
        _replace_oom_observer_attachment(torch)
        if not frontend.is_installed():
            _warn_of_nccl_register_hook()
        if snapshot_on_oom is not None:
            oom.snapshot_on_oom(snapshot_on_oom)
        _installed = _Installed(allocator, conf, log_level, snapshot_on_oom)
        return allocator


#: What PyTorch's CUDAPluggableAllocator, the fallback, cannot do that the front end does.
FRONTEND_LOST = (
    "PyTorch's C++ callers get refusals: cacheInfo (convolutions with "
    "torch.backends.cudnn.benchmark=True raise), checkPoolLiveAllocations and pool "
    "checkpoints (CUDA graph trees: torch.compile with CUDA graphs raises), "
    "getDeviceStats from C++, PyTorch's own torch.cuda.MemPool (ferrocache's stands in), and "
    "every allocation pays PyTorch's map of pointers"
)


def _install_frontend(torch: ModuleType, memory: Any) -> Any:
    """ferrocache's own allocator object swapped in, as PyTorch's ``_CUDAAllocator``; None,
    after one WARN naming what is lost, where it cannot be built or loaded."""
    if not frontend.wanted():
        return None
    try:
        frontend.install(torch)
    except (RuntimeError, OSError) as err:  # OSError: an unwritable cache, a compiler that fails to start
        if "initialized allocator" in str(err):
            raise RuntimeError(
                f"ferrocache.install(): PyTorch refused to change its allocator ({err}); "
                "call ferrocache.install() before anything uses CUDA"
            ) from err
        _ranks.log(
            "WARN",
            f"ferrocache's own allocator object is unavailable ({err}); PyTorch's "
            f"CUDAPluggableAllocator is used instead: {FRONTEND_LOST}",
        )
        return None
    return memory._get_current_allocator()


def _install_pluggable(memory: Any) -> Any:
    """PyTorch's CUDAPluggableAllocator around the library's functions, swapped in."""
    allocator = memory.CUDAPluggableAllocator(str(_lib.library_path()), "rust_malloc", "rust_free")
    _connect_hooks(allocator)
    try:
        memory.change_current_allocator(allocator)
    except RuntimeError as err:
        raise RuntimeError(
            f"ferrocache.install(): PyTorch refused to change its allocator ({err}); "
            "call ferrocache.install() before anything uses CUDA"
        ) from err
    return allocator


def _snapshot_on_oom_path(given: Optional[Union[str, "os.PathLike[str]"]]) -> Optional[str]:
    """The snapshot path ``install()`` was given, else ``FERROCACHE_SNAPSHOT_ON_OOM``'s, checked
    (``ValueError`` for a placeholder other than ``{rank}``, ``{local_rank}``, ``{pid}``)."""
    if given is not None:
        return _ranks.check_path(given)
    from_environment = oom.snapshot_on_oom_from_environment()
    if from_environment is None:
        return None
    try:
        return _ranks.check_path(from_environment)
    except ValueError as err:
        raise ValueError(f"{oom.SNAPSHOT_ON_OOM_VAR}: {err}") from None


#: PyTorch's way to attach an out-of-memory observer, which it refuses for a plugged-in
#: allocator; install() puts ferrocache's in its place.
TORCH_OOM_OBSERVER_ATTACHMENT = "_cuda_attach_out_of_memory_observer"


def _replace_oom_observer_attachment(torch: ModuleType) -> None:
    native = getattr(torch, "_C", None)
    if native is not None and hasattr(native, TORCH_OOM_OBSERVER_ATTACHMENT):
        # Listed by torch_api.replaced_names() with the rest.
        torch_api._replace(native, TORCH_OOM_OBSERVER_ATTACHMENT, oom.attach_out_of_memory_observer)


#: PyTorch's switch that registers the caching allocator's segments with NCCL through an
#: allocator trace tracker, which PyTorch's CUDAPluggableAllocator (the fallback) refuses; the
#: front end answers it.
NCCL_REGISTER_HOOK_VAR = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


def _warn_of_nccl_register_hook() -> None:
    """On the fallback path, with the hook on, PyTorch's NCCL process group aborts the process
    at its creation (docs/distributed.md): said once, at install(), while it can still be
    changed."""
    if os.environ.get(NCCL_REGISTER_HOOK_VAR, "").strip().lower() in ("1", "true", "yes", "on", "y"):
        _ranks.log(
            "WARN",
            f"{NCCL_REGISTER_HOOK_VAR}=1 needs ferrocache's front end or PyTorch's own allocator: "
            "with CUDAPluggableAllocator PyTorch's NCCL process group aborts the process when it is "
            "created; unset it (see docs/distributed.md)",
        )


def _flag(on: bool) -> str:
    return "1" if on else "0"


def _connect_hooks(allocator: Any) -> None:
    """Gives PyTorch the address of each hook this PyTorch can take."""
    native = allocator.allocator()
    for setter_name, symbol, lost in HOOKS:
        setter = getattr(native, setter_name, None)
        if setter is None:
            warnings.warn(
                f"this PyTorch has no CUDAPluggableAllocator.{setter_name}: {lost}",
                stacklevel=3,
            )
            continue
        setter(_lib.address(symbol))
    missing = [name for name, _ in POOL_HOOKS if getattr(native, name, None) is None]
    if missing:
        warnings.warn(
            f"this PyTorch has no CUDAPluggableAllocator.{', '.join(missing)}: {POOL_HOOKS_LOST}",
            stacklevel=3,
        )
        return
    for setter_name, symbol in POOL_HOOKS:
        getattr(native, setter_name)(_lib.address(symbol))


def _check_same_settings(installed: _Installed, conf: Optional[str], log_level: Optional[str]) -> None:
    if conf is not None and conf != installed.conf:
        in_effect = config.settings_in_effect().get(config.ALLOC_CONF_VARS[0])
        if conf != in_effect:
            raise RuntimeError(
                f"ferrocache is already installed with {config.ALLOC_CONF_VARS[0]}="
                f"{in_effect!r}; its settings cannot change within a process"
            )
    if log_level is not None and log_level != installed.log_level:
        warnings.warn(
            f"ferrocache is already installed; log_level={log_level!r} is ignored",
            stacklevel=3,
        )


__all__ = ["HOOKS", "POOL_HOOKS", "install", "is_installed"]
