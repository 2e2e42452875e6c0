"""ferrocache's PEP 517 build backend: cargo builds the library, this module writes the wheel.

`pip install .` (from the repository root) calls :func:`build_wheel`, which

1. runs ``cargo build --release --lib`` on the repository's ``Cargo.toml`` (the cargo target
   directory is the usual ``target/``, or ``CARGO_TARGET_DIR``, so a second build is a no-op),
   and finds the ``cdylib`` in cargo's JSON messages;
2. writes a wheel with ``python/ferrocache/*`` and that library as ``ferrocache/libferrocache.so``,
   tagged ``py3-none-<platform>`` (the library is not tied to a Python version).

Why not setuptools-rust or maturin: the library is a plain C ABI for PyTorch, not a Python
extension module, so neither's binding machinery is needed; this backend needs nothing from PyPI
(on Python >= 3.11), so ``pip install .`` works offline and with ``--no-build-isolation``, and
it puts the library exactly where ``ferrocache._lib`` looks for it.

Also provided: :func:`build_sdist` (the Rust sources and the package) and :func:`build_editable`
(``pip install -e .``: the package is imported from ``python/ferrocache`` and finds the library
in the checkout's ``target/``). ``config_settings`` may set ``profile`` (``release`` by default,
or ``debug``: faster to build, for tests of the packaging itself).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.9/3.10 only
    import tomli as tomllib

#: The repository root: this file is python/build_backend/ferrocache_build.py.
ROOT = Path(__file__).resolve().parents[2]
#: The library's file name inside the package, on every platform ferrocache supports.
LIBRARY_NAME = "libferrocache.so"
#: Files of the package directory that never go into a wheel.
_EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".so", ".dylib")


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""


# ------------------------------------------------------------------------------------------------
# Project description
# ------------------------------------------------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def cargo_version(root: Path = ROOT) -> str:
    """The ``version`` of the ``[package]`` table of ``Cargo.toml``."""
    with open(root / "Cargo.toml", "rb") as f:
        return str(tomllib.load(f)["package"]["version"])


def python_version(package_dir: Path) -> str:
    """``__version__`` as written in the package's ``_version.py``."""
    text = (package_dir / "_version.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.MULTILINE)
    if match is None:
        raise BuildError(f"{package_dir / '_version.py'} does not set __version__")
    return match.group(1)


def project_version() -> str:
    """Cargo.toml's version, after checking that the Python package says the same."""
    version = cargo_version()
    in_package = python_version(_package_dir())
    if in_package != version:
        raise BuildError(
            f"version mismatch: Cargo.toml says {version}, "
            f"python/ferrocache/_version.py says {in_package}; make them equal"
        )
    return version


def _package_dir() -> Path:
    settings = _pyproject().get("tool", {}).get("ferrocache", {})
    return ROOT / str(settings.get("package-dir", "python/ferrocache"))


def _metadata_text(version: str) -> str:
    """Core metadata (version 2.1) from the ``[project]`` table."""
    project = _pyproject()["project"]
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {version}",
    ]
    if "description" in project:
        lines.append(f"Summary: {project['description']}")
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    license_ = project.get("license", {})
    if "text" in license_:
        lines.append(f"License: {license_['text']}")
    lines.extend(f"Classifier: {c}" for c in project.get("classifiers", []))
    lines.extend(f"Requires-Dist: {d}" for d in project.get("dependencies", []))
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for requirement in requirements:
            lines.append(f"Requires-Dist: {requirement}; extra == {extra!r}".replace("'", '"'))
    body = ""
    readme = project.get("readme")
    if isinstance(readme, str):
        lines.append("Description-Content-Type: text/markdown")
        body = (ROOT / readme).read_text(encoding="utf-8")
    return "\n".join(lines) + "\n\n" + body


def _name() -> str:
    return str(_pyproject()["project"]["name"])


# ------------------------------------------------------------------------------------------------
# Cargo
# ------------------------------------------------------------------------------------------------


def find_cargo() -> str:
    """``$CARGO``, then ``cargo`` on the PATH, then rustup's default place."""
    candidates = [os.environ.get("CARGO"), shutil.which("cargo")]
    candidates.append(str(Path.home() / ".cargo" / "bin" / "cargo"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise BuildError(
        "cargo was not found (looked at $CARGO, the PATH and ~/.cargo/bin): building ferrocache "
        "needs a Rust toolchain; install one with https://rustup.rs and run pip again"
    )


def cdylib_from_messages(lines: Iterable[str], crate: str = "ferrocache") -> Optional[Path]:
    """The path of ``crate``'s cdylib in cargo's ``--message-format=json`` output, if any."""
    found: Optional[Path] = None
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if message.get("reason") != "compiler-artifact":
            continue
        target = message.get("target", {})
        if target.get("name") != crate or "cdylib" not in target.get("kind", []):
            continue
        for filename in message.get("filenames", []):
            if filename.endswith((".so", ".dylib")):
                found = Path(filename)
    return found


def build_library(profile: str = "release") -> Path:
    """Runs cargo on the repository and returns the built shared library."""
    if profile not in ("release", "debug"):
        raise BuildError(f"profile must be 'release' or 'debug', not {profile!r}")
    command = [
        find_cargo(),
        "build",
        "--lib",
        "--message-format=json-render-diagnostics",
        "--manifest-path",
        str(ROOT / "Cargo.toml"),
    ]
    if profile == "release":
        command.append("--release")
    print(f"ferrocache_build: {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    # Cargo's progress and diagnostics go to stderr (shown by `pip install -v`); its JSON
    # messages come on stdout.
    process = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if process.returncode != 0:
        raise BuildError(
            f"cargo build failed (exit status {process.returncode}); its messages are above "
            "(run `pip install -v .` to see them)"
        )
    library = cdylib_from_messages(process.stdout.splitlines())
    if library is None or not library.is_file():
        raise BuildError("cargo finished but reported no cdylib for the ferrocache crate")
    elapsed = time.monotonic() - started
    print(f"ferrocache_build: built {library} in {elapsed:.1f} s", file=sys.stderr, flush=True)
    return library


# ------------------------------------------------------------------------------------------------
# Wheels
# ------------------------------------------------------------------------------------------------


def platform_tag() -> str:
    """The wheel platform tag of this interpreter's platform, e.g. ``linux_x86_64``."""
    return re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


class _WheelWriter:
    """Writes files into a wheel and its RECORD, with fixed timestamps."""

    def __init__(self, path: Path, dist_info: str) -> None:
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self._dist_info = dist_info
        self._records: list[str] = []

    def add(self, name: str, data: bytes, executable: bool = False) -> None:
        info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o755 if executable else 0o644) << 16
        self._zip.writestr(info, data)
        self._records.append(f"{name},{_record_hash(data)},{len(data)}")

    def close(self) -> None:
        record = f"{self._dist_info}/RECORD"
        text = "\n".join(self._records + [f"{record},,"]) + "\n"
        info = zipfile.ZipInfo(record, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        self._zip.writestr(info, text.encode("utf-8"))
        self._zip.close()


def package_files(package_dir: Path) -> list[tuple[str, Path]]:
    """``(path in the wheel, source file)`` for the package's own files, sorted."""
    files = []
    for source in sorted(package_dir.rglob("*")):
        if not source.is_file() or "__pycache__" in source.parts:
            continue
        if source.name.endswith(_EXCLUDED_SUFFIXES):
            continue
        relative = source.relative_to(package_dir).as_posix()
        files.append((f"ferrocache/{relative}", source))
    return files


def _write_wheel(
    wheel_directory: str, version: str, contents: list[tuple[str, bytes, bool]], tag: str
) -> str:
    name = _name()
    dist_info = f"{name}-{version}.dist-info"
    filename = f"{name}-{version}-{tag}.whl"
    path = Path(wheel_directory) / filename
    writer = _WheelWriter(path, dist_info)
    for arcname, data, executable in contents:
        writer.add(arcname, data, executable)
    writer.add(f"{dist_info}/METADATA", _metadata_text(version).encode("utf-8"))
    writer.add(f"{dist_info}/WHEEL", _wheel_file(tag).encode("utf-8"))
    writer.add(f"{dist_info}/top_level.txt", b"ferrocache\n")
    writer.close()
    return filename


def _profile(config_settings: Optional[Mapping[str, Any]]) -> str:
    profile = (config_settings or {}).get("profile", "release")
    return str(profile)


# ------------------------------------------------------------------------------------------------
# PEP 517 / PEP 660 hooks
# ------------------------------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings: Optional[Mapping[str, Any]] = None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings: Optional[Mapping[str, Any]] = None) -> list[str]:
    return []


def get_requires_for_build_editable(
    config_settings: Optional[Mapping[str, Any]] = None,
) -> list[str]:
    return []


def _wheel_file(tag: str) -> str:
    return (
        "Wheel-Version: 1.0\n"
        "Generator: ferrocache_build\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {tag}\n"
    )


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: Optional[Mapping[str, Any]] = None
) -> str:
    """Writes the ``.dist-info`` directory without building anything (pip asks for it first)."""
    version = project_version()
    dist_info = Path(metadata_directory) / f"{_name()}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(_metadata_text(version), encoding="utf-8")
    (dist_info / "WHEEL").write_text(_wheel_file(f"py3-none-{platform_tag()}"), encoding="utf-8")
    return dist_info.name


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    """Builds the library with cargo and writes ``ferrocache-<version>-py3-none-<plat>.whl``."""
    version = project_version()
    library = build_library(_profile(config_settings))
    contents = [
        (arcname, source.read_bytes(), False) for arcname, source in package_files(_package_dir())
    ]
    contents.append((f"ferrocache/{LIBRARY_NAME}", library.read_bytes(), True))
    return _write_wheel(wheel_directory, version, contents, f"py3-none-{platform_tag()}")


_EDITABLE_FINDER = '''\
"""Makes `import ferrocache` load the package from the source checkout (pip install -e)."""
import importlib.util
import sys

PACKAGE_DIR = {package_dir!r}


class _FerrocacheFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "ferrocache":
            return None
        return importlib.util.spec_from_file_location(
            name, PACKAGE_DIR + "/__init__.py", submodule_search_locations=[PACKAGE_DIR]
        )


if not any(finder is _FerrocacheFinder for finder in sys.meta_path):
    sys.meta_path.append(_FerrocacheFinder)
'''


def build_editable(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    """``pip install -e .``: builds the library in ``target/`` and installs an import hook."""
    version = project_version()
    build_library(_profile(config_settings))
    finder = _EDITABLE_FINDER.format(package_dir=str(_package_dir()))
    contents = [
        ("_ferrocache_editable.py", finder.encode("utf-8"), False),
        ("ferrocache_editable.pth", b"import _ferrocache_editable\n", False),
    ]
    return _write_wheel(wheel_directory, version, contents, f"py3-none-{platform_tag()}")


def sdist_files(root: Path = ROOT) -> list[Path]:
    """The files a source distribution carries, relative to ``root``."""
    settings = _pyproject().get("tool", {}).get("ferrocache", {})
    files: list[Path] = []
    for entry in settings.get("sdist-include", []):
        path = root / entry
        candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
        for candidate in candidates:
            if not candidate.is_file() or "__pycache__" in candidate.parts:
                continue
            if candidate.name.endswith(_EXCLUDED_SUFFIXES):
                continue
            files.append(candidate.relative_to(root))
    return files


def build_sdist(sdist_directory: str, config_settings: Optional[Mapping[str, Any]] = None) -> str:
    """Writes ``ferrocache-<version>.tar.gz`` with the Rust sources and the package."""
    version = project_version()
    base = f"{_name()}-{version}"
    path = Path(sdist_directory) / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for relative in sdist_files():
            tar.add(ROOT / relative, arcname=f"{base}/{relative.as_posix()}", recursive=False)
        pkg_info = _metadata_text(version).encode("utf-8")
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(pkg_info))
    return path.name
