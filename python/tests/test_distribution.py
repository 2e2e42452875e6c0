"""What the installed wheel is: tagged manylinux for any Python 3, every native file in it within
that tag's glibc, the library and the command inside, and (FERROCACHE_WHEEL) no Rust needed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import _skip_or_fail

WHEEL = os.environ.get("FERROCACHE_WHEEL", "")
#: ``py3-none-manylinux_2_34_x86_64``: any Python 3, no CPython ABI, glibc 2.34 or newer.
TAG = re.compile(r"^py3-none-manylinux_(\d+)_(\d+)_(x86_64|aarch64)$")
#: What a manylinux wheel may link to outside itself (PEP 600's libraries, the ones used here).
SYSTEM_LIBRARIES = {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libstdc++.so.6", "ld-linux-x86-64.so.2",
                    "ld-linux-aarch64.so.1", "libdl.so.2", "libpthread.so.0", "librt.so.1"}


@pytest.fixture(scope="module")
def distribution() -> importlib.metadata.Distribution:
    try:
        dist = importlib.metadata.distribution("ferrocache")
    except importlib.metadata.PackageNotFoundError:
        _skip_or_fail("ferrocache is not installed (scripts/python-tests installs it)")
    direct_url = dist.read_text("direct_url.json") or ""
    if '"editable": true' in direct_url:
        pytest.skip("an editable install carries no wheel contents")
    return dist


def installed(dist: importlib.metadata.Distribution, pattern: str) -> list[Path]:
    return [Path(str(dist.locate_file(f))) for f in dist.files or [] if re.fullmatch(pattern, str(f))]


def glibc_needed(path: Path) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version ``path`` needs, from binutils' objdump."""
    objdump = shutil.which("objdump")
    if objdump is None:
        _skip_or_fail("objdump (binutils) is not installed")
    listing = subprocess.run([str(objdump), "-T", str(path)], capture_output=True, text=True, check=True)
    versions = {(int(a), int(b)) for a, b in re.findall(r"\bGLIBC_(\d+)\.(\d+)", listing.stdout)}
    assert versions, f"{path} names no glibc version"
    return max(versions)


def needed_libraries(path: Path) -> set[str]:
    listing = subprocess.run(["objdump", "-p", str(path)], capture_output=True, text=True, check=True)
    return set(re.findall(r"^\s*NEEDED\s+(\S+)", listing.stdout, re.M))


def wheel_tag(dist: importlib.metadata.Distribution) -> str:
    tags = re.findall(r"^Tag: (\S+)$", dist.read_text("WHEEL") or "", re.M)
    assert len(tags) == 1, tags
    return tags[0]


def test_the_wheel_is_tagged_manylinux_for_any_python_3(distribution: importlib.metadata.Distribution) -> None:
    assert TAG.match(wheel_tag(distribution)), wheel_tag(distribution)
    if WHEEL:
        assert Path(WHEEL).name.endswith(f"-{wheel_tag(distribution)}.whl")


def test_it_carries_the_library_and_the_command(distribution: importlib.metadata.Distribution) -> None:
    libraries = installed(distribution, r"ferrocache\.libs/libferrocache-[0-9a-f]+\.so")
    binaries = installed(distribution, r"ferrocache\.scripts/ferrocache")
    assert len(libraries) == 1 and len(binaries) == 1, distribution.files
    # The binary is linked to the copied library, by the name it has in the wheel.
    assert libraries[0].name in needed_libraries(binaries[0])
    assert installed(distribution, r"ferrocache/__init__\.py")
    # ferrocache run's startup hook, which the launcher finds beside the library.
    assert installed(distribution, r"ferrocache/_startup/sitecustomize\.py")


def test_its_native_files_need_no_newer_glibc_than_the_tag_says(
    distribution: importlib.metadata.Distribution,
) -> None:
    match = TAG.match(wheel_tag(distribution))
    assert match
    baseline = (int(match.group(1)), int(match.group(2)))
    natives = installed(distribution, r"ferrocache\.libs/.*\.so|ferrocache\.scripts/ferrocache")
    assert natives
    own = {path.name for path in natives}
    for path in natives:
        assert glibc_needed(path) <= baseline, path
        outside = needed_libraries(path) - own - SYSTEM_LIBRARIES
        assert not outside, f"{path} links to libraries outside the wheel: {outside}"


def test_a_wheel_install_needs_no_rust() -> None:
    if not WHEEL:
        pytest.skip("the package was built here (pip install .); FERROCACHE_WHEEL is not set")
    assert shutil.which("cargo") is None and shutil.which("rustc") is None
    with zipfile.ZipFile(WHEEL) as archive:
        names = archive.namelist()
    assert not any(name.endswith((".rs", "Cargo.toml")) for name in names)
