"""install() with a stand-in PyTorch, for what real PyTorch cannot show here (a build without
CUDA, the hook addresses as numbers), and without PyTorch. Everything else of install() is
tested on real PyTorch: python/tests/real_torch/test_install_real.py."""

from __future__ import annotations

import pytest
from conftest import GIB, MIB, memory_env, run_json

pytestmark = pytest.mark.usefixtures("fake_libcuda")

HOOKS = {
    "set_init_fn": "rust_init",
    "set_reset_fn": "rust_reset",
    "set_memory_fraction_fn": "rust_memory_fraction",
    "set_record_stream_fn": "rust_record_stream",
    "set_base_alloc_fn": "rust_base_alloc",
    "set_begin_allocate_to_pool": "rust_begin_allocate_to_pool",
    "set_end_allocate_to_pool_fn": "rust_end_allocate_to_pool",
    "set_release_pool": "rust_release_pool",
}


def test_install_connects_every_hook_and_swaps_the_allocator() -> None:
    out = run_json(
        """
        import ctypes, ferrocache, torch
        allocator = ferrocache.install()
        library = ctypes.CDLL(str(ferrocache.library_path()))
        address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        again = ferrocache.install()
        result({
            "path": allocator.path == str(ferrocache.library_path()),
            "alloc": allocator.alloc_fn == address("rust_malloc"),
            "free": allocator.free_fn == address("rust_free"),
            "hooks": {k: v == address(n) for k, (v, n) in
                      {k: (v, %r[k]) for k, v in allocator.allocator().hooks.items()}.items()},
            "current": torch.cuda.memory.current is allocator,
            "changes": torch.cuda.memory.changes,
            "again": again is allocator,
            "installed": ferrocache.is_installed(),
        })
        """
        % HOOKS,
        fake_torch=True,
        env=memory_env(GIB),
    )
    assert out == {
        "path": True,
        "alloc": True,
        "free": True,
        "hooks": {name: True for name in HOOKS},
        "current": True,
        "changes": 1,
        "again": True,
        "installed": True,
    }


def test_the_hooks_work_when_called_as_pytorch_calls_them() -> None:
    """PyTorch calls the addresses it was given: empty_cache -> reset, and so on."""
    out = run_json(
        """
        import ctypes, ferrocache, torch
        from ctypes import CFUNCTYPE, POINTER, c_double, c_int, c_size_t, c_void_p
        hooks = ferrocache.install().allocator().hooks
        init = CFUNCTYPE(None, c_int)(hooks["set_init_fn"])
        reset = CFUNCTYPE(None)(hooks["set_reset_fn"])
        fraction = CFUNCTYPE(None, c_double, c_int)(hooks["set_memory_fraction_fn"])
        base = CFUNCTYPE(c_void_p, c_void_p, POINTER(c_size_t))(hooks["set_base_alloc_fn"])
        out = {}
        init(1)
        p = ferrocache.caching_allocator_alloc(1000)
        q = ferrocache.caching_allocator_alloc(1000)
        size = c_size_t(0)
        out["base"] = [base(q, ctypes.byref(size)) == p, size.value]
        ferrocache.caching_allocator_delete(p); ferrocache.caching_allocator_delete(q)
        out["reserved before reset"] = ferrocache.memory_reserved()
        reset()  # torch.cuda.empty_cache()
        out["reserved after reset"] = ferrocache.memory_reserved()
        fraction(0.25, 0)  # torch.cuda.set_per_process_memory_fraction(0.25)
        try:
            ferrocache.caching_allocator_alloc(40 * 2**20)
            out["over the fraction"] = "allocated"
        except ferrocache.OutOfMemoryError:
            out["over the fraction"] = "out of memory"
        result(out)
        """,
        fake_torch=True,
        env=memory_env(128 * MIB),
    )
    assert out == {
        "base": [True, 2 * MIB],
        "reserved before reset": 2 * MIB,
        "reserved after reset": 0,
        "over the fraction": "out of memory",
    }


def test_a_pytorch_without_cuda_is_refused() -> None:
    out = run_json(
        """
        import ferrocache, torch
        try:
            ferrocache.install()
        except RuntimeError as err:
            result([str(err), torch.cuda.memory.changes])
        """,
        fake_torch=True,
        env={"FAKE_TORCH_CUDA_VERSION": ""},
    )
    assert out[0].startswith("ferrocache.install(): this PyTorch is built without CUDA") and out[1] == 0


def test_without_torch_only_install_complains() -> None:
    out = run_json(
        """
        import ferrocache
        try:
            ferrocache.install()
        except ImportError as err:
            message = str(err)
        p = ferrocache.caching_allocator_alloc(1000)
        result([message, ferrocache.memory_allocated(), "Allocated memory" in ferrocache.memory_summary()])
        """,
        block_torch=True,
        env=memory_env(GIB),
    )
    message, allocated, summary = out
    assert message.startswith("ferrocache.install() needs PyTorch")
    assert "works without it" in message
    assert allocated == 1024 and summary


def test_check_and_describe_config() -> None:
    out = run_json(
        """
        import ferrocache
        ferrocache.check_config("expandable_segments:True")
        try:
            ferrocache.check_config("backend:malloc")
        except ValueError as err:
            bad = str(err)
        result([bad, ferrocache.describe_config("max_split_size_mb:128")])
        """
    )
    assert out[0] == "Unknown allocator backend, options are native and cudaMallocAsync"
    assert "max_split_size: 128 MiB" in out[1]


