"""install() and the settings: with a stand-in PyTorch that records what install() does, and
without PyTorch."""

from __future__ import annotations

import pytest
from conftest import GIB, MIB, memory_env, run_json, run_python

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


def test_install_after_cuda_initialisation_says_to_call_it_earlier() -> None:
    out = run_json(
        """
        import ferrocache, torch
        try:
            ferrocache.install()
        except RuntimeError as err:
            result([str(err), torch.cuda.memory.changes, ferrocache.is_installed()])
        """,
        fake_torch=True,
        env={"FAKE_TORCH_CUDA_INITIALIZED": "1"},
    )
    message, changes, installed = out
    assert "call ferrocache.install() earlier" in message and "before the first CUDA tensor" in message
    assert changes == 0 and installed is False


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


@pytest.mark.parametrize(
    "conf, message",
    [
        ("backend:malloc", "Unknown allocator backend, options are native and cudaMallocAsync"),
        ("roundup_power2_divisions:3", "For roundups, the divisions has to be power of 2 "),
        ("garbage_collection_threshold:1.5", "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),
    ],
)
def test_a_bad_configuration_is_refused_with_pytorchs_wording(conf: str, message: str) -> None:
    out = run_json(
        """
        import os, ferrocache, torch
        try:
            ferrocache.install(conf=%r)
        except ValueError as err:
            result([str(err), torch.cuda.memory.changes, os.environ.get("PYTORCH_CUDA_ALLOC_CONF")])
        """
        % conf,
        fake_torch=True,
    )
    assert out == [message, 0, None], "the environment is left as it was"


def test_a_bad_configuration_in_the_environment_is_refused_too() -> None:
    out = run_json(
        """
        import ferrocache
        try:
            ferrocache.install()
        except ValueError as err:
            result(str(err))
        """,
        fake_torch=True,
        env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:10"},
    )
    assert out == "CachingAllocator option max_split_size_mb too small, must be >= 20"


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


def test_the_configuration_given_reaches_the_library() -> None:
    out = run_json(
        """
        import os, ferrocache
        ferrocache.install(conf="max_split_size_mb:40,expandable_segments:True", log_level="info")
        settings = ferrocache.snapshot()["allocator_settings"]
        result([settings["PYTORCH_CUDA_ALLOC_CONF"], settings["max_split_size"],
                settings["expandable_segments"], os.environ["TORCH_CUDA_ALLOC_LOG_LEVEL"],
                ferrocache.memory_stats()["max_split_size"]])
        """,
        fake_torch=True,
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", **memory_env(GIB)},
    )
    assert out == ["max_split_size_mb:40,expandable_segments:True", 40 * MIB, True, "info", 40 * MIB]


def test_the_log_level_given_is_used() -> None:
    process = run_python(
        """
        import ferrocache
        ferrocache.install(log_level="INFO")
        ferrocache.caching_allocator_delete(ferrocache.caching_allocator_alloc(4096))
        """,
        fake_torch=True,
        env=memory_env(GIB),
    )
    assert "[INFO] Allocator: block 0x" in process.stderr
    quiet = run_python(
        """
        import ferrocache
        ferrocache.install()
        ferrocache.caching_allocator_delete(ferrocache.caching_allocator_alloc(4096))
        """,
        fake_torch=True,
        env=memory_env(GIB, TORCH_CUDA_ALLOC_LOG_LEVEL="OFF"),
    )
    assert "[INFO]" not in quiet.stderr


def test_a_bad_log_level_is_refused() -> None:
    out = run_json(
        """
        import ferrocache
        try:
            ferrocache.install(log_level="loud")
        except ValueError as err:
            result(str(err))
        """,
        fake_torch=True,
    )
    assert out.startswith("Unknown TORCH_CUDA_ALLOC_LOG_LEVEL value 'loud'")


def test_a_configuration_after_the_library_read_its_settings_is_refused() -> None:
    out = run_json(
        """
        import ferrocache
        ferrocache.memory_stats()  # the library reads its settings now
        out = []
        try:
            ferrocache.install(conf="expandable_segments:True")
        except RuntimeError as err:
            out.append(str(err))
        ferrocache.install()  # without a configuration it is fine
        try:
            ferrocache.install(conf="max_split_size_mb:64")  # and a second one may not change it
        except RuntimeError as err:
            out.append(str(err))
        result(out)
        """,
        fake_torch=True,
        env=memory_env(GIB),
    )
    assert len(out) == 2
    assert "must come before any other ferrocache call" in out[0]
    assert "already installed" in out[1] and "cannot change" in out[1]
