"""The fault sweep under real PyTorch, behind ``scripts/torch-fault-sweep`` (issue 16, item 2).

A short training-shaped loop (CUDA start-up, two streams, ``record_stream``, pinned host copies
checked byte for byte, ``empty_cache``, and on torch >= 2.12 a CUDA graph captured into a private
pool and reset) runs once to count the calls it makes into the fake CUDA: the runtime's calls and
the driver's, numbered together from the first CUDA call of the process (the fake runtime reports
each of its calls to the driver's sweep, ``fake_cuda_sweep_arm``). Then it runs once per call
and error kind, with that call failing. A runtime call that fails does nothing and returns the
error; a driver call that fails fails the runtime call above it too, or ferrocache's call.

Each run must end with the process exiting normally (it runs Python's and the C libraries' exit
handlers) within the timeout, the host bytes copied to the device and back must be intact when
the copy reports success, and the failure must have reached Python as an exception or
ferrocache's log as an ERROR line, unless it had no effect at all (the loop then completed
intact). Sticky errors are expected to end every later step with an exception.

Speed: the parent imports torch and installs ferrocache once, before CUDA starts, then forks one
child per run (CUDA starts in the child, so the fork is safe); ``--workers`` parents share the
runs. A run takes about 0.1 s instead of the 3 s of a fresh interpreter."""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter

KINDS = {
    "out_of_memory": (2, 0),
    "invalid_value": (1, 0),
    "invalid_handle": (400, 0),
    "capture_unsupported": (900, 0),
    "illegal_address_sticky": (700, 1),
}
STEPS = 3
#: The loop's host batch: copied to the device and back each step and compared.
BATCH_SHAPE = (4, 64, 256)
VERDICTS_BAD = ("HUNG", "DIED", "CORRUPT", "SILENT")
#: The fake's settings: a 4 GiB device, and no line of its own per refused kernel launch.
FAKE_ENVIRONMENT = {"FAKE_CUDA_QUIET": "1", "FAKE_LIBCUDA_TOTAL_MEM": str(4 << 30)}


def program(fake, fail_at: int, code: int, sticky: int) -> dict:
    """The loop, in a forked child: arms the sweep, runs, and says what it saw."""
    import ctypes

    import numpy as np
    import torch

    fake.fake_cuda_sweep_arm(ctypes.c_uint64(fail_at), ctypes.c_uint32(code),
                             ctypes.c_int(sticky))
    errors: list[str] = []
    checked = 0
    corrupt = 0
    graphs = 0
    side = None
    host = np.arange(int(np.prod(BATCH_SHAPE)), dtype=np.float32).reshape(BATCH_SHAPE)
    capture = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)
    for step in range(STEPS):
        try:
            side = side or torch.cuda.Stream()
            x = torch.from_numpy(host).pin_memory().to("cuda", non_blocking=True)
            acts = [torch.empty(BATCH_SHAPE, device="cuda") for _ in range(4)]
            with torch.cuda.stream(side):
                side.wait_stream(torch.cuda.current_stream())
                grads = [torch.empty(256, 256, device="cuda") for _ in range(4)]
            for g in grads:
                g.record_stream(torch.cuda.current_stream())
            back = x.cpu().numpy()
            if (back == host).all():
                checked += 1
            else:
                corrupt += 1
            del acts, grads, x
            if step == 1:
                torch.cuda.empty_cache()
            if step == 2 and capture:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static = [torch.empty(256, 256, device="cuda") for _ in range(2)]
                del static
                graph.reset()
                graphs += 1
        except Exception as err:  # noqa: BLE001 - every failure is what the sweep looks for
            errors.append(f"step {step}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
    return {"calls": fake.fake_cuda_sweep_calls(), "fired": fake.fake_cuda_sweep_fired(),
            "errors": errors, "checked": checked, "corrupt": corrupt, "graphs": graphs,
            "graphs_expected": 1 if capture else 0}


def call_names(fake, total: int) -> list[str]:
    import ctypes

    buffer = ctypes.create_string_buffer(64)
    names = []
    for index in range(1, total + 1):
        fake.fake_cuda_sweep_call_name(ctypes.c_uint64(index), buffer, ctypes.c_size_t(64))
        names.append(buffer.value.decode())
    return names


def run_child(fake, fail_at: int, code: int, sticky: int, want_names: bool,
              result_read: int, result_write: int, err_write: int) -> None:
    """The forked child: runs the program, writes its outcome, exits; never returns (an error
    of the harness itself ends the child with status 70, never in the parent's code)."""
    import atexit
    import ctypes
    import traceback

    try:
        os.close(result_read)
        os.dup2(err_write, 2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        outcome = program(fake, fail_at, code, sticky)
        if want_names:
            outcome["names"] = call_names(fake, outcome["calls"])
        with os.fdopen(result_write, "w") as out:
            out.write(json.dumps(outcome))
    except BaseException:  # noqa: BLE001 - whatever it is, the child must not return
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    # The exit of a process: Python's atexit handlers (torch's among them), then libc's exit,
    # which runs the C and C++ libraries' handlers and destructors (torch's, ferrocache's).
    # Only the interpreter's own teardown of its modules is skipped (0.3 s a run).
    atexit._run_exitfuncs()
    sys.stderr.flush()
    ctypes.CDLL(None).exit(0)


def run_forked(fake, fail_at: int, code: int, sticky: int, timeout: float,
               want_names: bool = False) -> dict:
    """Runs the program in a forked child with call `fail_at` failing; its verdict."""
    result_read, result_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        run_child(fake, fail_at, code, sticky, want_names, result_read, result_write, err_write)
    os.close(result_write)
    os.close(err_write)
    chunks = {result_read: [], err_read: []}
    selector = selectors.DefaultSelector()
    for fd in chunks:
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    hung = False
    while selector.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            hung = True
            os.kill(pid, signal.SIGKILL)
            break
        for key, _ in selector.select(left):
            data = os.read(key.fd, 65536)
            if data:
                chunks[key.fd].append(data)
            else:
                selector.unregister(key.fd)
    for fd in chunks:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    stderr = b"".join(chunks[err_read]).decode(errors="replace")
    if hung:
        return {"verdict": "HUNG", "stderr": stderr[-600:]}
    text = b"".join(chunks[result_read]).decode(errors="replace")
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0 or not text:
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit {os.WEXITSTATUS(status)}")
        return {"verdict": f"DIED ({how})", "stderr": stderr[-3000:],
                "signature": abort_signature(stderr)}
    result = json.loads(text)
    result["logged"] = "[ERROR] Allocator:" in stderr
    complete = result["checked"] == STEPS and result["graphs"] == result["graphs_expected"]
    if result["corrupt"]:
        result["verdict"] = "CORRUPT"
    elif not result["fired"]:
        result["verdict"] = "not reached"
    elif result["errors"] or result["logged"]:
        result["verdict"] = "reported"
    elif complete:
        result["verdict"] = "no effect"
    else:
        result["verdict"] = "SILENT"
    return result


def is_bad(verdict: str) -> bool:
    return verdict.startswith(VERDICTS_BAD)


def abort_signature(stderr: str) -> str | None:
    """Where a C++ exception that ended the process came from, as PyTorch prints it: the
    exception's type and the function that raised it. None when the death says nothing of it
    (a signal without a C++ exception), or when ferrocache's library is on the stack."""
    if "libferrocache" in stderr:
        return None
    thrown = re.search(r"terminate called after throwing an instance of '([^']+)'", stderr)
    if thrown is None:
        return None
    # The frames after the terminate message belong to the exception that ended the process.
    raised = re.search(r"Exception raised from (\S+) at (\S+)", stderr[thrown.end():])
    return f"{thrown.group(1)} from {raised.group(1) if raised else 'an unknown function'}"


def sweep(args) -> int:
    """One worker: runs its share of the (kind, call) jobs and writes them to --out (or, with
    --one, runs one case and prints it)."""
    import ctypes

    # Read by the fake when CUDA starts, in each child.
    os.environ.update(FAKE_ENVIRONMENT)

    import torch  # imported before the fork, once

    if not args.native:
        import ferrocache

        ferrocache.install()
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_sweep_calls.restype = ctypes.c_uint64
    fake.fake_cuda_sweep_call_name.restype = ctypes.c_int64
    clean = run_forked(fake, 0, 0, 0, args.timeout, want_names=True)
    if clean.get("verdict") != "not reached" or clean.get("errors") or \
            clean.get("checked") != STEPS:
        print(f"the clean run failed: {clean}", file=sys.stderr)
        return 1
    total = clean["calls"]
    names = clean["names"]
    if args.one is not None:
        kind, index = args.one.split(":")
        outcome = run_forked(fake, int(index), *KINDS[kind], args.timeout)
        outcome["call"] = names[int(index) - 1]
        outcome["calls_before"] = names[max(0, int(index) - 8):int(index) - 1]
        print(json.dumps(outcome, indent=1))
        return 1 if is_bad(outcome["verdict"]) else 0
    only = set(args.calls.split(",")) if args.calls else None
    jobs = [(kind, index) for kind in args.kinds.split(",")
            for index in range(1, total + 1, args.stride)
            if only is None or names[index - 1] in only]
    worker, workers = args.shard
    results = []
    for kind, index in jobs[worker::workers]:
        code, sticky = KINDS[kind]
        outcome = run_forked(fake, index, code, sticky, args.timeout)
        results.append({"kind": kind, "index": index, "call": names[index - 1],
                        "verdict": outcome["verdict"],
                        "errors": outcome.get("errors", [])[:3],
                        "logged": outcome.get("logged", False),
                        "signature": outcome.get("signature"),
                        "stderr": outcome.get("stderr", "") if is_bad(outcome["verdict"]) else ""})
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "calls": total, "names": names,
                   "graphs": clean["graphs_expected"], "results": results}, f)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--stride", type=int, default=1, help="sweep every Nth call")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="target/torch-fault-sweep/summary.json")
    parser.add_argument("--calls", default=None, metavar="NAMES",
                        help="only the calls of these functions, e.g. cudaGetDevice,cuMemAlloc_v2")
    parser.add_argument("--native", action="store_true",
                        help="PyTorch's own allocator instead of ferrocache")
    parser.add_argument("--one", default=None, metavar="KIND:CALL",
                        help="run one case and print all it said, e.g. out_of_memory:12")
    parser.add_argument("--shard", type=lambda s: tuple(int(v) for v in s.split("/")),
                        default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard is not None or args.one is not None:
        return sweep(args)

    started = time.time()
    mine = run_workers(args, native=args.native)
    if mine is None:
        return 1
    total, names, results = mine
    bad = [r for r in results if is_bad(r["verdict"])]
    # A process that PyTorch itself ended (a C++ exception thrown where PyTorch cannot let one
    # out, after a sticky error) is PyTorch's doing when its own allocator's run ends the same
    # way: the native allocator's sweep, over every call of the functions whose failure ended a
    # process here (the call numbers differ between the two allocators), says which are.
    native_signatures: set[str] = set()
    native_summary = None
    died = [r for r in bad if r["verdict"].startswith("DIED")]
    if not args.native and died:
        kinds = sorted({r["kind"] for r in died}, key=list(KINDS).index)
        calls = sorted({r["call"] for r in died})
        print(f"runs died: PyTorch's own allocator with every call of {','.join(calls)} "
              f"failing ({','.join(kinds)})")
        native_args = {**vars(args), "kinds": ",".join(kinds), "calls": ",".join(calls),
                       "stride": 1}
        native = run_workers(argparse.Namespace(**native_args), native=True, tag="native")
        if native is None:
            return 1
        native_signatures = {r["signature"] for r in native[2]
                             if r["verdict"].startswith("DIED") and r["signature"]}
        native_summary = {"calls": native[0], "runs": len(native[2]),
                          "counts": count_verdicts(native[2])}
    for r in bad:
        r["pytorchs_own"] = (r["verdict"].startswith("DIED")
                             and r["signature"] in native_signatures)
    unexplained = [r for r in bad if not r["pytorchs_own"]]
    counts = count_verdicts(results)
    no_effect = dict(Counter(r["call"] for r in results if r["verdict"] == "no effect"))
    by_function = dict(Counter(names))
    summary = {"allocator": "native" if args.native else "ferrocache", "calls": total,
               "runs": len(results), "stride": args.stride, "counts": counts,
               "calls_by_function": by_function, "no_effect_by_function": no_effect,
               "pytorchs_own_aborts": sorted(native_signatures), "native": native_summary,
               "bad": bad, "seconds": round(time.time() - started)}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"the loop makes {total} runtime and driver calls; {len(results)} runs "
          f"({args.workers} workers, {summary['seconds']} s); summary in {args.out}")
    for kind, verdicts in counts.items():
        print(f"  {kind}: {verdicts}")
    if native_summary:
        print(f"  with PyTorch's allocator: {native_summary['calls']} calls, "
              f"{native_summary['counts']}")
    print(f"  no effect, by call: {no_effect}")
    for signature in sorted(native_signatures):
        print(f"  PyTorch's own abort, under its own allocator too: {signature}")
    for r in unexplained:
        print(f"  {r['verdict']}: {r['kind']} at call {r['index']} ({r['call']}): "
              f"{r['errors']} {r['stderr'][-300:]}")
    return 1 if unexplained else 0


def count_verdicts(results: list[dict]) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter[str]] = {}
    for r in results:
        verdict = r["verdict"].split(" (")[0]
        if r.get("pytorchs_own"):
            verdict = "DIED as under PyTorch's allocator"
        counts.setdefault(r["kind"], Counter())[verdict] += 1
    return {kind: dict(verdicts) for kind, verdicts in counts.items()}


def run_workers(args, native: bool, tag: str = "worker"):
    """Runs the sweep in `args.workers` processes; (calls, names, results) or None."""
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, **FAKE_ENVIRONMENT}
    shards = []
    for worker in range(args.workers):
        part = os.path.join(out_dir, f"{tag}-{worker}.json")
        command = [sys.executable, __file__, "--shard", f"{worker}/{args.workers}",
                   "--kinds", args.kinds, "--stride", str(args.stride),
                   "--timeout", str(args.timeout), "--out", part]
        if args.calls:
            command += ["--calls", args.calls]
        if native:
            command.append("--native")
        shards.append((part, subprocess.Popen(command, env=env)))
    if any(process.wait() != 0 for _, process in shards):
        print("a worker failed (its message above)")
        return None
    parts = []
    for part, _ in shards:
        with open(part) as f:
            parts.append(json.load(f))
    total, names = parts[0]["calls"], parts[0]["names"]
    if any(p["names"] != names for p in parts):
        print("the workers' clean runs made different calls: the loop is not deterministic")
        return None
    results = sorted((r for p in parts for r in p["results"]),
                     key=lambda r: (list(KINDS).index(r["kind"]), r["index"]))
    return total, names, results


if __name__ == "__main__":
    sys.exit(main())
