"""Host cost per allocation through real PyTorch: ferrocache (its own allocator object, and
behind CUDAPluggableAllocator) against PyTorch's native caching allocator, on the fake CUDA,
side by side in one run.

    scripts/with-fake-cuda python benches/torch_alloc.py [--rounds 7] [--chunks 41] [--json FILE]

Four kinds of process, identical but for the allocator PyTorch is given before CUDA starts:

- ``native``: PyTorch's own caching allocator;
- ``ferrocache``: ``ferrocache.install()``, ferrocache's own ``CUDAAllocator`` object
  (python/ferrocache/frontend.cpp, no map of pointers);
- ``pluggable``: ``ferrocache.install()`` with ``FERROCACHE_FRONTEND=0``
  (``CUDAPluggableAllocator`` over ``rust_malloc`` and ``rust_free``, the path before the front
  end);
- ``floor``: ``CUDAPluggableAllocator`` over a do-nothing allocator (``floor_malloc`` and
  ``floor_free`` in benches/torch_alloc.cpp: a stack per size class, no lock). What it costs
  through PyTorch is PyTorch's wrapper, the least any pluggable allocator can cost there.

In each, at 1,000, 10,000 and 100,000 live 4 KiB blocks (and one cached 4 KiB hole between two
of them, so that a 4 KiB request is a cache hit that neither splits nor merges; and one cached
64 MiB block):

- **C++**: pairs of ``c10::cuda::CUDACachingAllocator::raw_alloc_with_stream`` + ``raw_delete``
  (benches/torch_alloc.cpp, compiled here against the installed torch's headers and libc10,
  libc10_cuda, with the CUDA runtime's headers from the ``nvidia-cuda-runtime`` wheel), 4 KiB
  and 64 MiB. In the pluggable processes also the allocator's two functions called directly, as
  the wrapper calls them, which leaves the wrapper out: wrapper = through PyTorch - direct.
- **Python**: ``torch.empty(1024, dtype=torch.float32, device="cuda")`` + ``del``, with 10,000
  live tensors.

Each figure is the median chunk of pairs (a chunk the scheduler interrupted does not count),
per pair; each round runs the three processes in turn, so drift on a shared machine hits all
alike, and the table gives the median over the rounds. (Speed is never asserted in tests; this
is a benchmark. python/tests/real_torch/test_torch_alloc_bench.py checks that it runs.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).with_name("torch_alloc.cpp")
WORK = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")).resolve() / "torch-alloc-bench"
MODES = ("native", "ferrocache", "pluggable", "floor")
LIVE = (1_000, 10_000, 100_000)
SMALL = 4 << 10
LARGE = 64 << 20
#: The two ways a pluggable allocator is called: through PyTorch, and directly.
WAYS = ("torch", "direct")

# The CUDA runtime wheels ship the runtime's headers but not the two of crt/ that nvcc's
# toolkit has; a host-only compile needs only these: CUDA's attributes as nothing, or as GCC's.
HOST_DEFINES = """\
#pragma once
/* For host-only compiles of the CUDA runtime headers (benches/torch_alloc.py). */
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __align__(n)
#define __CUDA_ALIGN__(n) __align__(n)
#define __no_return__ __attribute__((noreturn))
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __thread__ __thread
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
#define __specialization_static
#define __launch_bounds__(...)
#define __grid_constant__
#define __dv(v)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define CUDART_CB
"""

# What the build needs to know of the installed torch, asked in a child: importing torch here
# would tie this process to one allocator before the measuring children choose theirs.
TORCH_INFO = """
import json, pathlib, torch
root = pathlib.Path(torch.__file__).parent
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda,
                  "include": str(root / "include"), "lib": str(root / "lib"),
                  "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI)}))
"""

CHILD = textwrap.dedent(
    """
    import ctypes, json, statistics, sys, time
    import torch

    mode, harness_path, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    harness = ctypes.CDLL(harness_path)
    harness.torch_hold.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    harness.torch_release.argtypes = [ctypes.c_size_t]
    harness.torch_pairs_ns.restype = ctypes.c_double
    harness.torch_pairs_ns.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_size_t]
    harness.direct_pairs_ns.restype = ctypes.c_double
    harness.direct_pairs_ns.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_size_t]
    harness.get_device_ns.restype = ctypes.c_double
    harness.get_device_ns.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    RELEASE_ALL = ctypes.c_size_t(-1).value
    fake_driver = ctypes.CDLL("libcuda.so.1")  # the fake's call counters
    fake_driver.fake_cuda_stat.restype = ctypes.c_int64
    fake_driver.fake_cuda_stat.argtypes = [ctypes.c_char_p]

    def fake_stat(name):
        return fake_driver.fake_cuda_stat(name.encode())

    def address(library, name):
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value

    direct = None  # the pluggable allocator's malloc and free, for calls without the wrapper
    if mode in ("ferrocache", "pluggable"):
        import os
        import ferrocache
        if mode == "pluggable":
            os.environ["FERROCACHE_FRONTEND"] = "0"
        ferrocache.install()
        library = ctypes.CDLL(str(ferrocache._lib.library_path()))
        direct = (address(library, "rust_malloc"), address(library, "rust_free"))
    elif mode == "floor":
        floor = torch.cuda.memory.CUDAPluggableAllocator(harness_path, "floor_malloc",
                                                         "floor_free")
        torch.cuda.memory.change_current_allocator(floor)
        direct = (address(harness, "floor_malloc"), address(harness, "floor_free"))
    torch.empty(1, device="cuda")  # CUDA initialised
    chunks, chunk_pairs = options["chunks"], options["chunk_pairs"]
    stream = None  # the default stream, where torch.empty allocates too

    def check(value, what):
        if value < 0:
            sys.exit(f"{what} failed in the {mode} process (PyTorch's message above)")
        return value

    figures = {}
    for live in options["live"]:
        check(harness.torch_release(RELEASE_ALL), "release")
        # live + 1 blocks, then the middle one freed: a cached hole between two live blocks.
        check(harness.torch_hold(live + 1, options["small"], stream), "hold")
        check(harness.torch_release(live // 2), "release")
        # One 64 MiB block allocated and freed: cached, for the large pairs.
        check(harness.torch_pairs_ns(options["large"], stream, 1, 1), "warm-up")
        row = {}
        device_allocs = fake_stat("cuMemAlloc_v2")
        for name, size in (("small", options["small"]), ("large", options["large"])):
            row[f"torch_{name}"] = check(
                harness.torch_pairs_ns(size, stream, chunks, chunk_pairs), "pairs")
            if direct:
                row[f"direct_{name}"] = harness.direct_pairs_ns(
                    direct[0], direct[1], size, 0, stream, chunks, chunk_pairs)
        # Every timed pair is a cache hit: no device allocation in any of them.
        row["device_allocs"] = fake_stat("cuMemAlloc_v2") - device_allocs
        row["get_device"] = harness.get_device_ns(chunks, chunk_pairs)
        figures[str(live)] = row
    check(harness.torch_release(RELEASE_ALL), "release")
    if mode in ("ferrocache", "pluggable"):  # ferrocache's own count: PyTorch did hand it the pairs
        figures["ferrocache_allocations"] = ferrocache.memory_stats()["allocation.all.allocated"]

    # The Python level: torch.empty + del with live tensors and a cached hole, as above.
    torch.cuda.empty_cache()
    live_tensors = [torch.empty(1024, dtype=torch.float32, device="cuda")
                    for _ in range(options["python_live"] + 1)]
    del live_tensors[options["python_live"] // 2]
    per_pair = []
    for _ in range(options["python_chunks"]):
        began = time.perf_counter()
        for _ in range(chunk_pairs):
            x = torch.empty(1024, dtype=torch.float32, device="cuda")
            del x
        per_pair.append((time.perf_counter() - began) / chunk_pairs * 1e9)
    figures["python"] = statistics.median(per_pair)
    print(json.dumps(figures))
    """
)


def torch_info() -> dict[str, Any]:
    """The installed torch's version, CUDA version, header and library folders, C++ ABI."""
    out = subprocess.run(
        [sys.executable, "-c", TORCH_INFO], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cuda_headers(cuda: str) -> list[Path]:
    """Include folders with the CUDA runtime's headers for CUDA ``cuda`` ("13.2"), from NVIDIA's
    runtime wheel (downloaded once, ~2 MB, into target/), and the crt/ headers the wheel lacks."""
    major = cuda.split(".")[0]
    folder = WORK / f"cuda-{cuda}"
    found = sorted(folder.glob("**/include/cuda_runtime_api.h"))
    if not found:
        package = "nvidia-cuda-runtime" if int(major) >= 13 else f"nvidia-cuda-runtime-cu{major}"
        download = folder / "wheel"
        shutil.rmtree(download, ignore_errors=True)
        download.mkdir(parents=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--quiet",
             "--no-deps", "--only-binary=:all:", f"{package}=={cuda}.*", "-d", str(download)],
            check=True,
        )  # fmt: skip
        for wheel in download.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(folder / "unpacked")
        found = sorted(folder.glob("**/include/cuda_runtime_api.h"))
        if not found:
            raise RuntimeError(f"{package}=={cuda}.* has no include/cuda_runtime_api.h")
    include = found[0].parent
    shim = folder / "host-only"
    (shim / "crt").mkdir(parents=True, exist_ok=True)
    for name, text in (("host_defines.h", HOST_DEFINES), ("host_config.h", "#pragma once\n")):
        (shim / "crt" / name).write_text(text)
    # The wheel's own crt/ first, where a later wheel has one.
    return [include, shim]


def build_harness(info: dict[str, Any]) -> Path:
    """benches/torch_alloc.cpp compiled against this torch (cached per source and torch)."""
    key = hashlib.sha256(SOURCE.read_bytes() + json.dumps(info, sort_keys=True).encode())
    built = WORK / f"torch_alloc-{key.hexdigest()[:16]}.so"
    if built.is_file():
        return built
    includes = [f"-I{folder}" for folder in cuda_headers(info["cuda"])]
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (looked for $CXX, g++, c++)")
    partial = built.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run(
        [compiler, "-std=c++20", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
         f"-D_GLIBCXX_USE_CXX11_ABI={info['abi']}", f"-I{info['include']}", *includes,
         str(SOURCE), "-o", str(partial), f"-L{info['lib']}", "-lc10", "-lc10_cuda",
         f"-Wl,-rpath,{info['lib']}"],
        check=True,
    )  # fmt: skip
    partial.replace(built)
    return built


def measure(mode: str, harness: Path, options: dict[str, Any]) -> dict[str, Any]:
    """One process of kind ``mode``: its figures, in ns per pair."""
    env = dict(os.environ, FAKE_CUDA_QUIET="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(harness), json.dumps(options)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the rounds of every figure, per mode."""

    def median(mode: str, *keys: str) -> float:
        values = []
        for run in runs[mode]:
            value: Any = run
            for key in keys:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    summary: dict[str, Any] = {}
    for mode in runs:
        per_live = {}
        for live in runs[mode][0]:
            if not live.isdigit():
                continue
            per_live[live] = {key: median(mode, live, key) for key in runs[mode][0][live]}
        summary[mode] = {"cpp": per_live, "python": median(mode, "python")}
    return summary


def _cpp_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for live, row in run.items() if live.isdigit()]


def _ratio_range(runs: dict[str, list[dict[str, Any]]], *keys: str, mode: str = "ferrocache") -> str:
    """The lowest and highest ``mode``/native ratio of one round (processes run in turn)."""

    def pick(run: dict[str, Any]) -> float:
        for key in keys:
            run = run[key]
        return float(run)  # type: ignore[arg-type]

    ratios = [pick(f) / pick(n) for n, f in zip(runs["native"], runs[mode])]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def report(summary: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    native, ours, pluggable, floor = (summary[mode] for mode in MODES)
    sizes = (("small", "4 KiB"), ("large", "64 MiB"))
    print(f"medians over {len(runs['native'])} rounds, ns per alloc+free pair")
    print()
    print("C++: raw_alloc_with_stream + raw_delete, through PyTorch")
    print(f"{'pair':<7} {'live':>7} {'native':>8} {'ferrocache':>10} {'pluggable':>9} "
          f"{'floor':>7} {'ferrocache/native':>17} {'(rounds)':>9} {'pluggable/native':>16} "
          f"{'floor/native':>12}")  # fmt: skip
    for live in native["cpp"]:
        for name, label in sizes:
            key = f"torch_{name}"
            n, f, p, w = (m["cpp"][live][key] for m in (native, ours, pluggable, floor))
            spread = _ratio_range(runs, live, key)
            print(f"{label:<7} {int(live):>7,} {n:8.1f} {f:10.1f} {p:9.1f} {w:7.1f} "
                  f"{f / n:17.2f} {spread:>9} {p / n:16.2f} {w / n:12.2f}")  # fmt: skip
    print()
    print("the pluggable allocators called directly, and PyTorch's wrapper (= through - direct)")
    print(f"{'pair':<7} {'live':>7} {'ferrocache direct':>17} {'wrapper':>7} "
          f"{'floor direct':>12} {'wrapper':>7} {'GetDevice':>9}")  # fmt: skip
    for live in native["cpp"]:
        for name, label in sizes:
            through_ours, direct_ours = (ours["cpp"][live][f"{k}_{name}"] for k in WAYS)
            through_floor, direct_floor = (floor["cpp"][live][f"{k}_{name}"] for k in WAYS)
            get_device = native["cpp"][live]["get_device"]
            print(f"{label:<7} {int(live):>7,} {direct_ours:17.1f} "
                  f"{through_ours - direct_ours:7.1f} {direct_floor:12.1f} "
                  f"{through_floor - direct_floor:7.1f} {get_device:9.1f}")  # fmt: skip
    device_allocs = {
        mode: max(row["device_allocs"] for run in runs[mode] for row in _cpp_rows(run))
        for mode in MODES
    }
    print(f"device allocations in the timed pairs (most in one process): {device_allocs}")
    print()
    print("Python: torch.empty(1024, dtype=torch.float32, device='cuda') + del, 10,000 live")
    n, f, p, w = native["python"], ours["python"], pluggable["python"], floor["python"]
    print(f"native {n:.0f} ns, ferrocache {f:.0f} ns, pluggable {p:.0f} ns, floor {w:.0f} ns; "
          f"ferrocache/native {f / n:.2f} (rounds {_ratio_range(runs, 'python')}), "
          f"pluggable/native {p / n:.2f} (rounds {_ratio_range(runs, 'python', mode='pluggable')}), "
          f"floor/native {w / n:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="processes of each kind")
    parser.add_argument("--chunks", type=int, default=41, help="timed chunks per C++ figure")
    parser.add_argument("--chunk-pairs", type=int, default=1000, help="pairs per chunk")
    parser.add_argument("--python-chunks", type=int, default=21, help="chunks, Python level")
    parser.add_argument("--live", type=int, nargs="+", default=list(LIVE))
    parser.add_argument("--json", type=Path, help="write every process's figures here")
    args = parser.parse_args()
    info = torch_info()
    harness = build_harness(info)
    options = {
        "live": args.live, "small": SMALL, "large": LARGE, "chunks": args.chunks,
        "chunk_pairs": args.chunk_pairs, "python_chunks": args.python_chunks,
        "python_live": 10_000,
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(measure(mode, harness, options))
    print(f"torch {info['version']} (CUDA {info['cuda']}) on the fake CUDA; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    summary = summarise(runs)
    report(summary, runs)
    if args.json:
        args.json.write_text(json.dumps({"torch": info["version"], "options": options,
                                         "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
