"""``PYTORCH_CUDA_ALLOC_CONF`` and ``TORCH_CUDA_ALLOC_LOG_LEVEL``: checking them with the
library's parser (PyTorch's rules and wording), and setting them before the library reads them.

The library reads both variables once, at its first use in the process. So a setting given to
:func:`ferrocache.install` is written into the environment before any other call into the
library, and :func:`apply` verifies afterwards that the library took it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from . import _env, _lib

#: The variables PyTorch reads its allocator settings from, the first one set winning.
ALLOC_CONF_VARS = _env.ALLOC_CONF_VARS
#: The variable ferrocache's log level comes from.
LOG_LEVEL_VAR = _env.LOG_LEVEL.name
#: The log levels the library accepts (in any case).
LOG_LEVELS = ("OFF", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "TRACE")


def check_config(conf: Optional[str] = None) -> None:
    """Raises ``ValueError`` with PyTorch's wording when PyTorch would reject ``conf`` (None:
    the setting in the environment, read as PyTorch reads it)."""
    if not _lib.function("ferrocache_check_config")(_lib.encode(conf)):
        raise ValueError(_lib.last_error())


def describe_config(conf: Optional[str] = None) -> str:
    """What ``conf`` (None: the environment's setting) changes from PyTorch's defaults, the keys
    ferrocache accepts but does not use, and warnings; ``ValueError`` when it is invalid."""
    text = _lib.take_string(_lib.function("ferrocache_describe_config")(_lib.encode(conf)))
    if text is None:
        raise ValueError(_lib.last_error())
    return text


def check_log_level(level: str) -> None:
    """Raises ``ValueError`` for a ``TORCH_CUDA_ALLOC_LOG_LEVEL`` value the library rejects."""
    if level.strip().upper() not in LOG_LEVELS:
        raise ValueError(
            f"Unknown {LOG_LEVEL_VAR} value '{level}', expected one of OFF, ERROR, WARN, "
            "INFO, DEBUG, TRACE"
        )


def settings_in_effect() -> dict[str, Any]:
    """The settings the library runs with, as a snapshot's ``allocator_settings`` shows them
    (``PYTORCH_CUDA_ALLOC_CONF`` there is the raw setting). Makes the library read them."""
    snapshot = _lib.call_json("ferrocache_snapshot")
    return dict(snapshot.get("allocator_settings", {}))


def apply(conf: Optional[str], log_level: Optional[str]) -> None:
    """Puts ``conf`` and ``log_level`` (where given) into the environment, makes the library
    read its settings, and checks them.

    Raises ``ValueError`` (PyTorch's wording) for an invalid setting, leaving the environment as
    it was; ``RuntimeError`` when the library had read different settings earlier in this
    process (they cannot change after that).
    """
    if log_level is not None:
        check_log_level(log_level)
        if _lib.settings_may_be_read() and os.environ.get(LOG_LEVEL_VAR) != log_level:
            warnings.warn(
                f"ferrocache read {LOG_LEVEL_VAR} at its first use, before install(); "
                f"log_level={log_level!r} takes effect in the next process",
                stacklevel=3,
            )
        os.environ[LOG_LEVEL_VAR] = log_level
    previous = os.environ.get(ALLOC_CONF_VARS[0])
    if conf is not None:
        os.environ[ALLOC_CONF_VARS[0]] = conf
    try:
        # Checks the environment as the library reads it; if this is the library's first use,
        # the library takes its settings from this environment now.
        check_config(None)
        try:
            in_effect = settings_in_effect()
        except RuntimeError as err:  # the library read an invalid setting earlier
            raise ValueError(str(err)) from None
    except ValueError:
        _restore(previous)
        raise
    if conf is not None and in_effect.get(ALLOC_CONF_VARS[0]) != conf:
        _restore(previous)
        raise RuntimeError(
            f"ferrocache already runs with {ALLOC_CONF_VARS[0]}="
            f"{in_effect.get(ALLOC_CONF_VARS[0])!r}: it reads its settings once, at its first "
            f"use, so install(conf={conf!r}) must come before any other ferrocache call (or set "
            f"{ALLOC_CONF_VARS[0]} before Python starts)"
        )


def _restore(previous: Optional[str]) -> None:
    if previous is None:
        os.environ.pop(ALLOC_CONF_VARS[0], None)
    else:
        os.environ[ALLOC_CONF_VARS[0]] = previous


__all__ = [
    "ALLOC_CONF_VARS",
    "LOG_LEVEL_VAR",
    "apply",
    "check_config",
    "check_log_level",
    "describe_config",
    "settings_in_effect",
]
