"""install() and the settings under real PyTorch. (What real PyTorch cannot show, a PyTorch
built without CUDA, stays with the stand-in in python/tests/test_install.py.)"""

from __future__ import annotations

import pytest

from torch_env import (
    GIB,
    MIB,
    TORCH_ABORTS_AT_EXIT_ON_A_BAD_SETTING,
    TORCH_VERSION,
    WORDING_FROM,
    require_real_torch,
    run_torch,
    run_torch_process,
    torch_env,
)

require_real_torch()


def test_install_makes_ferrocache_pytorchs_allocator_once() -> None:
    out = run_torch(
        """
        allocator = ferrocache.install()
        again = ferrocache.install()
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        result({"type": type(allocator).__name__, "again": again is allocator,
                "installed": ferrocache.is_installed(),
                "served": ferrocache.memory_allocated() == x.nbytes})
        """
    )
    # PyTorch's wrapper of its current allocator, ferrocache's own object (test_frontend_real.py).
    assert out == {"type": "_CUDAAllocator", "again": True, "installed": True, "served": True}


# Each setting PyTorch refuses, and the start of PyTorch's own message for it.
BAD_SETTINGS = [
    "backend:malloc",
    "roundup_power2_divisions:3",
    "garbage_collection_threshold:1.5",
    "max_split_size_mb:10",
    "expandable_segments:maybe",
]


@pytest.mark.parametrize("conf", BAD_SETTINGS)
def test_a_bad_setting_is_refused_in_pytorchs_own_words(conf: str) -> None:
    """ferrocache's ValueError carries the message PyTorch's own allocator gives for the same
    PYTORCH_CUDA_ALLOC_CONF: the real PyTorch is the judge of the wording."""
    native = run_torch(
        """
        try:
            torch.empty(1, device="cuda")
            result(None)
        except Exception as err:  # ValueError in torch 2.15, RuntimeError in older ones
            result(str(err))
        """,
        env=torch_env(PYTORCH_CUDA_ALLOC_CONF=conf),
        # torch 2.9 also aborts at exit on a setting it refused; the answer came before.
        check=False,
    )
    ours = run_torch(
        f"""
        import os
        out = {{}}
        try:
            ferrocache.install(conf={conf!r})
        except ValueError as err:
            out["given"] = str(err)
        out["environment_unchanged"] = "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        out["initialized"] = torch.cuda.is_initialized()
        result(out)
        """
    )
    from_environment = run_torch(
        """
        try:
            ferrocache.install()
        except ValueError as err:
            result(str(err))
        """,
        env=torch_env(PYTORCH_CUDA_ALLOC_CONF=conf),
        check=not TORCH_ABORTS_AT_EXIT_ON_A_BAD_SETTING,
    )
    assert native is not None, f"PyTorch accepts {conf!r}"
    assert ours["given"]
    if TORCH_VERSION >= WORDING_FROM:
        assert ours["given"] in native.split("\n")[0], (ours["given"], native)
    assert from_environment == ours["given"]
    assert ours["environment_unchanged"] and not ours["initialized"]


def test_the_settings_given_reach_the_library() -> None:
    out = run_torch(
        """
        import os
        ferrocache.install(conf="max_split_size_mb:40,expandable_segments:True", log_level="info")
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        settings = ferrocache.snapshot()["allocator_settings"]
        result([settings["PYTORCH_CUDA_ALLOC_CONF"], settings["max_split_size"],
                settings["expandable_segments"], os.environ["TORCH_CUDA_ALLOC_LOG_LEVEL"],
                ferrocache.memory_stats()["max_split_size"]])
        """,
        env=torch_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False"),
    )
    assert out == ["max_split_size_mb:40,expandable_segments:True", 40 * MIB, True, "info", 40 * MIB]


def test_the_log_level_given_is_used_and_a_bad_one_refused() -> None:
    loud = run_torch_process(
        """
        ferrocache.install(log_level="INFO")
        _ = torch.empty(4096, dtype=torch.uint8, device="cuda"); del _
        """,
    )
    assert "[INFO] Allocator: block 0x" in loud.stderr
    quiet = run_torch_process(
        """
        ferrocache.install()
        _ = torch.empty(4096, dtype=torch.uint8, device="cuda"); del _
        """,
        env=torch_env(GIB, TORCH_CUDA_ALLOC_LOG_LEVEL="OFF"),
    )
    assert "[INFO]" not in quiet.stderr and "Allocator" not in quiet.stderr
    bad = run_torch(
        """
        try:
            ferrocache.install(log_level="loud")
        except ValueError as err:
            result(str(err))
        """
    )
    assert bad.startswith("Unknown TORCH_CUDA_ALLOC_LOG_LEVEL value 'loud'")


def test_a_setting_after_the_library_read_its_settings_is_refused() -> None:
    out = run_torch(
        """
        ferrocache.memory_stats()  # the library reads its settings now
        out = []
        try:
            ferrocache.install(conf="expandable_segments:True")
        except RuntimeError as err:
            out.append(str(err))
        ferrocache.install()  # without a setting it is fine
        try:
            ferrocache.install(conf="max_split_size_mb:64")  # and a second call may not change it
        except RuntimeError as err:
            out.append(str(err))
        x = torch.empty(10, device="cuda")
        result(out + [ferrocache.memory_allocated()])
        """
    )
    assert len(out) == 3
    assert "must come before any other ferrocache call" in out[0]
    assert "already installed" in out[1] and "cannot change" in out[1]
    assert out[2] == 512
