#!/usr/bin/env python3
"""Builds the fake CUDA: the driver (libcuda.so.1), the runtime (libcudart.so.N) and a stub
library for every other CUDA library an installed PyTorch links against.

    tests/fake-cuda/build.py --out DIR [--torch-lib TORCH/lib] [--cuda-major 12|13]

Writes the libraries to DIR/lib and, in DIR/preload, the list of paths to put in LD_PRELOAD
(one per line, in order). Without --torch-lib it builds the driver and the runtime alone.
The stubs are generated from the wheel itself with readelf: for each CUDA library that a torch
library needs (DT_NEEDED), one C function per symbol torch imports from it, under the symbol
version torch asks for, that logs its name once and returns that library's error code. So a
new torch version needs no edits here. The CUDA major version (which runtime to build) is read
from torch's libraries too. Nothing is rebuilt when nothing changed (DIR/stamp).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: CUDA libraries by name: what PyTorch may link against and the fake must stand in for.
CUDA_LIBRARY = re.compile(
    r"^lib(cuda|cudart|cublas|cublasLt|cudnn\w*|cufft|cufile|cupti|curand|cusolver|cusparse|"
    r"cusparseLt|nccl|nvrtc|nvshmem_host|nvToolsExt|nvJitLink|nvjitlink)\.so(\.\d+)*$"
)
#: Unversioned imports are matched to a library by prefix (the longest prefix first).
UNVERSIONED_PREFIXES = [
    ("cusparseLt", "libcusparseLt"),
    ("cuFile", "libcufile"),
    ("nccl", "libnccl"),
    ("nvshmem", "libnvshmem_host"),
    ("nvtx", "libnvToolsExt"),
    ("cu", "libcuda"),
]
#: What a stub returns, per library: a "not supported"/"not initialized" code of its API.
ERROR_CODES = {
    "libcudart": 801, "libcuda": 801, "libcublas": 15, "libcublasLt": 15, "libcudnn": 3000,
    "libcufft": 16, "libcufile": 5001, "libcupti": 999, "libcurand": 203, "libcusolver": 7,
    "libcusparse": 10, "libcusparseLt": 10, "libnccl": 5, "libnvrtc": 11, "libnvshmem_host": 1,
    "libnvToolsExt": 0, "libnvJitLink": 1, "libnvjitlink": 1,
}
#: The hand-written functions of each library (libs/, one static library linked into each):
#: a library gets those of the archive's exports that start with one of its prefixes and with
#: none of its exclusions.
HAND_WRITTEN = {
    "libcublas": (("cublas",), ("cublasLt",)), "libcublasLt": (("cublasLt",), ()),
    "libcudnn": (("cudnn",), ()), "libnccl": (("nccl", "fake_nccl"), ()), "libcufft": (("cufft",), ()),
    "libcusparse": (("cusparse",), ("cusparseLt",)), "libcusolver": (("cusolver",), ()),
}
#: Libraries whose other functions take their handle first: their stubs succeed as pending work
#: on the handle's stream (the named function in libs/), except those that must write an answer
#: the stub cannot know (a size, a handle, a value), which keep returning the error code.
GENERIC_CALL = {
    "libcublas": "fake_cublas_generic",
    "libcusparse": "fake_cusparse_generic",
    "libcusolver": "fake_cusolver_generic",
}
NEEDS_AN_ANSWER = re.compile(r"Create|Destroy|[Bb]ufferSize|Matrix|Vector|Get|Set|Init|Version")
#: Functions that return a string, not a status.
STRING_FUNCTION = re.compile(
    r"(GetErrorString|GetStatusString|GetErrorName|GetStatusName|GetResultString|"
    r"GetCallbackName|GetLastError)$"
)
#: Version queries that PyTorch checks at start-up: they must answer a plausible number.
VERSION_ANSWERS = {
    "cudnnGetVersion": 92600, "cudnnGetCudartVersion": 13020, "cudnnGetMaxDeviceVersion": 1000,
    "cublasLtGetVersion": 130401, "cublasLtGetCudartVersion": 13020,
}


def run(*command: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        sys.exit(f"fake-cuda: {' '.join(map(str, command))} failed:\n{result.stderr}{result.stdout}")
    return result.stdout


def stem(soname: str) -> str:
    return soname.split(".so")[0]


def torch_libraries(torch_lib: Path) -> list[Path]:
    return sorted(p for p in torch_lib.glob("*.so*") if p.is_file() and not p.is_symlink())


def needed(library: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run("readelf", "-d", library))


def version_files(library: Path) -> dict[str, str]:
    """Symbol version name -> the library file that must define it (from .gnu.version_r)."""
    mapping, current = {}, None
    for line in run("readelf", "-V", "-W", library).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            mapping[m.group(1)] = current
    return mapping


def imported_symbols(library: Path) -> list[tuple[str, str | None]]:
    """(name, version or None) of every undefined dynamic symbol."""
    out = []
    for line in run("readelf", "--dyn-syms", "-W", library).splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[6] == "UND" and fields[7]:
            name = re.sub(r" \(\d+\)$", "", " ".join(fields[7:]))
            base, _, version = name.partition("@")
            out.append((base, version.lstrip("@") or None))
    return out


def defined_symbols(library: Path) -> set[str]:
    out = run("nm", "-D", "--defined-only", library)
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if len(line.split()) >= 3}


def archive_exports(archive: Path, prefixes: tuple[str, ...]) -> set[str]:
    out = run("nm", "--defined-only", archive)
    return {
        line.split()[2]
        for line in out.splitlines()
        if len(line.split()) == 3 and line.split()[1] == "T" and line.split()[2].startswith(prefixes)
    }


def wanted_symbols(torch_lib: Path) -> tuple[dict[str, set[str]], dict[str, str | None], int]:
    """Per CUDA library soname: the symbols torch imports from it; its version node; and the
    CUDA major version of the runtime torch was built against."""
    libraries = torch_libraries(torch_lib)
    defined = set().union(*(defined_symbols(p) for p in libraries))
    sonames = {n for p in libraries for n in needed(p) if CUDA_LIBRARY.match(n)}
    wanted: dict[str, set[str]] = {soname: set() for soname in sonames}
    versions: dict[str, str | None] = {soname: None for soname in sonames}
    by_stem = {stem(s): s for s in sonames}
    for library in libraries:
        files = version_files(library)
        for name, version in imported_symbols(library):
            if version and files.get(version) in wanted:
                wanted[files[version]].add(name)
                versions[files[version]] = version
            elif not version and name not in defined:
                for prefix, library_stem in UNVERSIONED_PREFIXES:
                    if name.startswith(prefix) and library_stem in by_stem:
                        wanted[by_stem[library_stem]].add(name)
                        break
    cudart = [s for s in sonames if stem(s) == "libcudart"]
    if not cudart:
        sys.exit(f"fake-cuda: no torch library in {torch_lib} needs libcudart: is it a CUDA build?")
    return wanted, versions, int(cudart[0].split(".so.")[1])


def stub_source(soname: str, names: set[str], generic: str | None = None) -> str:
    code = ERROR_CODES.get(stem(soname), 999)
    lines = [
        "/* Generated by tests/fake-cuda/build.py from the installed torch wheel: do not edit. */",
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "#define STUB_CALLED(name) do { static int once; if (!once++ && !getenv(\"FAKE_CUDA_QUIET\")) "
        f"fprintf(stderr, \"[fake-cuda] %s is a stub of {soname}: it returns an error\\n\", name); }} while (0)",
    ]
    for name in sorted(names):
        if STRING_FUNCTION.search(name):
            lines.append(
                f'const char *{name}(void) {{ STUB_CALLED("{name}"); return "{name}: fake CUDA stub"; }}'
            )
        elif name in VERSION_ANSWERS:
            lines.append(f"unsigned long {name}(void) {{ return {VERSION_ANSWERS[name]}UL; }}")
        elif generic and not NEEDS_AN_ANSWER.search(name):
            lines.append(f'int {generic}(void *handle, const char *name);')
            lines.append(f'int {name}(void *handle) {{ return {generic}(handle, "{name}"); }}')
        else:
            lines.append(f'int {name}(void) {{ STUB_CALLED("{name}"); return {code}; }}')
    return "\n".join(lines) + "\n"


def version_script(version: str | None, names: set[str]) -> str:
    listed = "".join(f"    {n};\n" for n in sorted(names))
    exported = f"  global:\n{listed}" if names else ""
    return f"{version or ''} {{\n{exported}  local: *;\n}};\n"


def link(out: Path, soname: str, names: set[str], version: str | None, sources: list[Path],
         archive: Path | None = None, extra: list[str] | None = None) -> Path:
    target = out / "lib" / soname
    script = out / "build" / f"{soname}.map"
    script.write_text(version_script(version, names))
    command = ["gcc", "-shared", "-fPIC", "-O1", "-w", "-o", str(target), f"-Wl,-soname,{soname}",
               f"-Wl,--version-script={script}", *map(str, sources)]
    if archive is not None:
        # Pull in each export from the static library (nothing references them there).
        command += [f"-Wl,--undefined={n}" for n in sorted(names) if not n.startswith("#")]
        command += [str(archive)]
    command += (extra or []) + ["-lpthread", "-ldl", "-lm", "-lgcc_s", "-lc"]
    run(*command)
    return target


def cargo_build(target_dir: Path, *arguments: str, env: dict[str, str] | None = None) -> None:
    cargo = os.environ.get("CARGO", "cargo")
    result = subprocess.run(
        [cargo, "build", "--quiet", "--release", "--manifest-path", str(HERE / "Cargo.toml"),
         "--target-dir", str(target_dir), *arguments],
        env={**os.environ, **(env or {})}, check=False,
    )
    if result.returncode != 0:
        sys.exit(f"fake-cuda: cargo build {' '.join(arguments)} failed")


def looked_up_driver_functions(torch_lib: Path | None) -> set[str]:
    """The driver functions libc10_cuda finds with dlsym rather than imports: c10's DriverAPI
    (torch 2.5 to 2.7 look up every one of its list when the native allocator starts, and fail
    if one is missing). Read from the library's strings: names of the driver's form, `cuX...`."""
    library = torch_lib / "libc10_cuda.so" if torch_lib is not None else None
    if library is None or not library.exists():
        return set()
    data = library.read_bytes()
    return {m.decode() for m in re.findall(rb"(?<=\x00)(cu[A-Z][A-Za-z0-9_]{2,60})(?=\x00)", data)}


def rust_exports(source_dir: Path) -> set[str]:
    """The names of the `#[unsafe(no_mangle)]` functions in a crate's sources."""
    pattern = re.compile(r"#\[unsafe\(no_mangle\)\]\s*pub (?:unsafe )?extern \"C\" fn (\w+)")
    return {m.group(1) for p in source_dir.rglob("*.rs") for m in pattern.finditer(p.read_text())}


def sources_mtime() -> float:
    files = [p for p in HERE.rglob("*") if p.is_file() and "target" not in p.parts]
    return max(p.stat().st_mtime for p in files)


def build(out: Path, torch_lib: Path | None, cuda_major: int | None) -> None:
    lib = out / "lib"
    stamp = out / "stamp"
    key = json.dumps({"torch_lib": str(torch_lib), "cuda_major": cuda_major})
    if stamp.exists() and stamp.read_text() == key and stamp.stat().st_mtime > sources_mtime():
        return
    shutil.rmtree(lib, ignore_errors=True)
    (out / "build").mkdir(parents=True, exist_ok=True)
    lib.mkdir(parents=True)

    wanted, versions = {}, {}
    if torch_lib is not None:
        wanted, versions, major = wanted_symbols(torch_lib)
        cuda_major = cuda_major or major
    cuda_major = cuda_major or 13

    # What torch imports from libcuda.so.1 and the fake driver does not implement becomes a
    # generated "not supported" export of the driver itself (see driver/build.rs).
    driver_names = out / "build" / "driver-stubs.txt"
    implemented_driver = rust_exports(HERE / "driver" / "src")
    imported = wanted.pop("libcuda.so.1", set()) | looked_up_driver_functions(torch_lib)
    driver_names.write_text("".join(f"{n}\n" for n in sorted(imported - implemented_driver)))
    versions.pop("libcuda.so.1", None)
    cargo_target = out / "cargo"
    cargo_build(cargo_target, "-p", "fake-libcuda", env={"FAKE_CUDA_DRIVER_STUBS": str(driver_names)})
    features = ["--features", "cuda-13"] if cuda_major >= 13 else ["--no-default-features", "--features", "cuda-12"]
    cargo_target_rt = out / f"cargo-cuda{cuda_major}"
    cargo_build(cargo_target_rt, "-p", "fake-cudart", *features)
    cargo_target_libs = out / "cargo-libs"
    cargo_build(cargo_target_libs, "-p", "fake-cuda-libs")
    libs_archive = cargo_target_libs / "release" / "libfakecudalibs.a"
    libs_exports = archive_exports(libs_archive, tuple(p for ps, _ in HAND_WRITTEN.values() for p in ps))

    driver = lib / "libcuda.so.1"
    shutil.copy2(cargo_target / "release" / "libcuda.so", driver)
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    # PyTorch and ferrocache dlopen NVML; the driver exports what they call (driver/src/nvml.rs).
    (lib / "libnvidia-ml.so.1").symlink_to("libcuda.so.1")
    preload = [driver]

    cudart = f"libcudart.so.{cuda_major}"
    archive = cargo_target_rt / "release" / "libfakecudart.a"
    implemented = archive_exports(archive, ("cuda", "__cuda", "fake_cudart"))
    stubs = wanted.pop(cudart, set()) - implemented
    version = versions.pop(cudart, None) or cudart
    source = out / "build" / f"{cudart}_stubs.c"
    source.write_text(stub_source(cudart, stubs))
    preload.append(link(out, cudart, implemented | stubs, version, [source], archive,
                        [f"-L{lib}", "-l:libcuda.so.1"]))

    for soname, names in sorted(wanted.items()):
        source = out / "build" / f"{soname}_stubs.c"
        prefixes, exclusions = HAND_WRITTEN.get(stem(soname), ((), ()))
        own = {n for n in libs_exports if n.startswith(prefixes) and not n.startswith(exclusions)} if prefixes else set()
        generic = GENERIC_CALL.get(stem(soname))
        source.write_text(stub_source(soname, names - own, generic))
        if own or generic:
            pulled = own | ({generic} if generic else set())
            preload.append(link(out, soname, names | own, versions.get(soname), [source], libs_archive,
                                [f"-L{lib}", "-l:libcuda.so.1", "-Wl,-z,defs"]
                                + [f"-Wl,--undefined={n}" for n in sorted(pulled)]))
        else:
            preload.append(link(out, soname, names, versions.get(soname), [source]))

    (out / "preload").write_text("".join(f"{p}\n" for p in preload))
    summary = {p.name: len(defined_symbols(p)) for p in preload}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    stamp.write_text(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--torch-lib", type=Path)
    parser.add_argument("--cuda-major", type=int, choices=(12, 13))
    args = parser.parse_args()
    build(args.out.resolve(), args.torch_lib.resolve() if args.torch_lib else None, args.cuda_major)
    print(args.out.resolve() / "lib")


if __name__ == "__main__":
    main()
