"""maturin's PEP 517 hooks, building the wheel that ``maturin build`` builds.

``pip install .`` and ``pip install -e .`` call maturin's hooks, which build with
``--compatibility off`` unless they are given a ``--compatibility``. That setting skips
maturin's audit of the binary, and with it the copy of the shared libraries the binary needs into
the wheel. The ``ferrocache`` binary needs ``libferrocache.so`` (src/bin/ferrocache.rs), so
without the audit the installed package would have no library. ``build_wheel`` adds
``--compatibility pypi`` (the lowest manylinux tag the build allows; an error where there is
none) to maturin's build arguments, unless the caller chose a compatibility already, through
``--config-settings maturin.build-args=...`` or ``MATURIN_PEP517_ARGS``. Everything else is
maturin's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import maturin  # type: ignore[import-untyped]
from maturin import (  # noqa: F401  (PEP 517 hooks, re-exported as they are)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

#: What the wheel is audited against when the caller says nothing.
DEFAULT_COMPATIBILITY = "pypi"


def with_audit(config_settings: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """``config_settings`` with ``--compatibility`` added to maturin's build arguments."""
    arguments = maturin.get_maturin_pep517_args(config_settings)
    chosen = any(
        arg in ("--compatibility", "--manylinux") or arg.startswith(("--compatibility=", "--manylinux="))
        for arg in arguments
    )
    if not chosen:
        arguments = [*arguments, "--compatibility", DEFAULT_COMPATIBILITY]
    return {**(config_settings or {}), "maturin.build-args": arguments}


def forget_patched_binaries(root: Path = Path.cwd()) -> None:
    """Removes maturin's staged copies and cargo's release binary, so that cargo links it anew.

    maturin 1.16 patches the binary it packages in place (run path, the copied library's name)
    and keeps copies in ``target/maturin/``; cargo's ``deps/`` copy can be the same file. One
    build's patches would then reach the next build, or ``cargo run``: a binary that looks for
    ``libferrocache-<hash>.so``. Linking the small binary again costs seconds; the library is
    not rebuilt. scripts/build-wheel does the same.
    """
    target = Path(os.environ.get("CARGO_TARGET_DIR") or root / "target")
    if not target.is_absolute():
        target = root / target
    staged = target / "maturin"
    for path in [staged / "ferrocache", target / "release" / "ferrocache",
                 *(target / "release" / "deps").glob("ferrocache-*")]:
        if path.suffix != ".d" and (path.is_file() or path.is_symlink()):
            path.unlink()


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    forget_patched_binaries()
    try:
        return str(maturin.build_wheel(wheel_directory, with_audit(config_settings), metadata_directory))
    finally:
        forget_patched_binaries()


def build_editable(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    """maturin's editable build, with its default compatibility: the editable package loads the
    library from the checkout's target/, and maturin adds that directory to the binary's run
    path, so nothing is copied. (maturin 1.16 also drops the command from an audited editable
    wheel.)"""
    forget_patched_binaries()
    try:
        return str(maturin.build_editable(wheel_directory, config_settings, metadata_directory))
    finally:
        forget_patched_binaries()
