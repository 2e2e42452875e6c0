"""The build backend (python/build_backend/ferrocache_build.py): wheels, metadata, sdist,
editable installs, and its failure messages."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO, STRICT

BACKEND_FILE = REPO / "python" / "build_backend" / "ferrocache_build.py"


def _load_backend() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ferrocache_build", BACKEND_FILE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


backend = _load_backend()


@pytest.fixture(scope="module")
def cargo() -> str:
    try:
        return str(backend.find_cargo())
    except backend.BuildError as err:
        if STRICT:
            pytest.fail(str(err))
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def wheel(cargo: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("wheel")
    name = backend.build_wheel(str(directory))
    return directory / name


def test_the_wheel_is_named_and_tagged_for_the_platform(wheel: Path) -> None:
    version = backend.cargo_version()
    assert wheel.name == f"ferrocache-{version}-py3-none-{backend.platform_tag()}.whl"
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(f"ferrocache-{version}.dist-info/WHEEL").decode()
    assert f"Tag: py3-none-{backend.platform_tag()}" in text and "Root-Is-Purelib: false" in text


def test_the_wheel_holds_the_package_and_the_library(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        library = archive.getinfo("ferrocache/libferrocache.so")
    sources = {
        f"ferrocache/{p.relative_to(REPO / 'python' / 'ferrocache').as_posix()}"
        for p in (REPO / "python" / "ferrocache").rglob("*.py")
    }
    assert sources and sources <= names
    assert "ferrocache/py.typed" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert library.file_size > 100_000 and (library.external_attr >> 16) & 0o111


def test_the_record_lists_every_file_with_its_hash(wheel: Path) -> None:
    version = backend.cargo_version()
    with zipfile.ZipFile(wheel) as archive:
        record_name = f"ferrocache-{version}.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(archive.read(record_name).decode())))
        assert {row[0] for row in rows} == set(archive.namelist())
        for name, digest, size in rows:
            if name == record_name:
                assert digest == size == ""
                continue
            data = archive.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data), name


def test_the_metadata(wheel: Path, tmp_path: Path) -> None:
    version = backend.cargo_version()
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"ferrocache-{version}.dist-info/METADATA").decode()
    assert f"Name: ferrocache\nVersion: {version}\n" in metadata
    assert 'Requires-Dist: torch>=2.1; extra == "torch"' in metadata
    assert "Description-Content-Type: text/markdown" in metadata
    name = backend.prepare_metadata_for_build_wheel(str(tmp_path))
    assert (tmp_path / name / "METADATA").read_text() == metadata


def test_the_source_distribution(tmp_path: Path) -> None:
    name = backend.build_sdist(str(tmp_path))
    base = name[: -len(".tar.gz")]
    with tarfile.open(tmp_path / name) as archive:
        names = set(archive.getnames())
    required_files = (
        "Cargo.toml", "Cargo.lock", "build.rs", "src/ffi.rs", "include/ferrocache.h", "pyproject.toml",
        "python/build_backend/ferrocache_build.py", "python/ferrocache/__init__.py", "PKG-INFO",
    )
    for required in required_files:
        assert f"{base}/{required}" in names, required
    assert not any("/target/" in n or n.endswith(".so") for n in names)


def test_an_editable_install_imports_the_checkout(cargo: str, tmp_path: Path) -> None:
    name = backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as archive:
        assert archive.read("ferrocache_editable.pth") == b"import _ferrocache_editable\n"
        archive.extract("_ferrocache_editable.py", tmp_path)
    # -S: no site-packages, so the installed ferrocache cannot answer instead.
    code = (
        "import _ferrocache_editable, ferrocache, json; "
        "print(json.dumps([ferrocache.__file__, str(ferrocache.library_path())]))"
    )
    process = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    module_file, library = json.loads(process.stdout)
    assert module_file == str(REPO / "python" / "ferrocache" / "__init__.py")
    assert library.startswith(str(REPO)) and library.endswith("release/libferrocache.so")


def test_cargo_artifacts_are_read_from_its_json_messages() -> None:
    lines = [
        "Compiling something",
        json.dumps({"reason": "compiler-artifact", "target": {"name": "cc", "kind": ["lib"]},
                    "filenames": ["/t/libcc.rlib"]}),
        json.dumps({"reason": "compiler-artifact",
                    "target": {"name": "ferrocache", "kind": ["cdylib", "rlib"]},
                    "filenames": ["/t/release/libferrocache.so", "/t/release/libferrocache.rlib"]}),
        json.dumps({"reason": "build-finished", "success": True}),
    ]
    assert backend.cdylib_from_messages(lines) == Path("/t/release/libferrocache.so")
    assert backend.cdylib_from_messages(lines[:2]) is None


def test_a_version_mismatch_stops_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "cargo_version", lambda root=REPO: "9.9.9")
    with pytest.raises(backend.BuildError, match="Cargo.toml says 9.9.9"):
        backend.project_version()


def test_without_cargo_the_build_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("CARGO", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(backend.BuildError, match="rustup.rs"):
        backend.find_cargo()


def test_the_platform_tag() -> None:
    tag = backend.platform_tag()
    assert tag and all(c.isalnum() or c == "_" for c in tag)
    if sys.platform == "linux":
        assert tag.startswith("linux_")
