"""Sleep and wake under real PyTorch on the fake CUDA (docs/sleep.md): the memory goes back to
the driver, a raw driver allocation takes it (in the same process, and in a second process on
the same fake GPU), and after wake every tensor holds its bytes at the same ``data_ptr()``, and
a graph captured before sleep addresses mapped memory again. A copy into a sleeping tensor is
an illegal address, as on a GPU."""

from __future__ import annotations

import importlib.metadata
import json
import textwrap
from pathlib import Path

from torch_env import GIB, MIB, require_real_torch, run_torch, run_torch_process, torch_env



def torch_before_2_15() -> bool:
    """Whether the installed torch is older than 2.15 (the GPU machine's 2.11 is)."""
    release = importlib.metadata.version("torch").split("+")[0].split(".")[:2]
    return tuple(int(part) for part in release) < (2, 15)

require_real_torch()

#: A trainer's state written with host-to-device copies (no kernel runs on the fake), a raw
#: driver allocation as another user of the GPU would make, and where a pointer's segment is.
SETUP = """
    import ctypes
    ferrocache.install()
    torch.manual_seed(0)
    cuda = ctypes.CDLL("libcuda.so")

    def raw_alloc_and_free(size):
        torch.cuda.synchronize()  # the runtime made the primary context current on this thread
        ptr = ctypes.c_uint64()
        status = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        if status == 0:
            assert cuda.cuMemFree_v2(ptr) == 0
        return status

    def trainer_state(n_layers=6, width=512):
        state = {}
        for i in range(n_layers):
            for kind in ("weight", "grad", "exp_avg", "exp_avg_sq"):
                host = torch.randn(width, width)
                state[f"{kind}{i}"] = (host, host.to("cuda"))
        return state

    def intact(state):
        return all(torch.equal(dev.cpu(), host) for host, dev in state.values())

    def segment_of(ptr):
        for seg in ferrocache.snapshot()["segments"]:
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return seg["address"]
        return None
"""


def run(code: str, **env: str) -> dict:
    return run_torch(textwrap.dedent(SETUP) + textwrap.dedent(code), env=torch_env(2 * GIB, **env))


def test_everything_sleeps_with_backup_and_wakes_at_the_same_addresses() -> None:
    out = run(
        """
        state = trainer_state()
        ptrs = {k: dev.data_ptr() for k, (host, dev) in state.items()}
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            graph_out = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        graph_ptr = graph_out.data_ptr()
        out = {}
        reserved = torch.cuda.memory_reserved()
        free_before = torch.cuda.mem_get_info()[0]
        allocated = torch.cuda.memory_allocated()
        report = ferrocache.sleep(backup=True)
        out["slept all reserved"] = report.bytes == reserved
        # Only the live allocations' bytes are copied, into pinned host memory.
        out["copied"] = report.copied_bytes == allocated < report.bytes
        out["pinned"] = report.host_memory_pinned
        out["skipped"] = report.skipped_bytes
        out["reserved asleep"] = torch.cuda.memory_reserved()
        out["stats asleep"] = torch.cuda.memory_stats()["reserved_bytes.all.current"]
        out["snapshot asleep"] = len(ferrocache.snapshot()["segments"])
        out["free grew"] = torch.cuda.mem_get_info()[0] - free_before >= report.bytes
        out["raw allocation of what slept"] = raw_alloc_and_free(report.bytes)
        out["sleep again"] = ferrocache.sleep().segments
        woke = ferrocache.wake()
        out["woke what slept"] = woke.bytes == report.bytes
        out["same pointers"] = all(dev.data_ptr() == ptrs[k] for k, (host, dev) in state.items())
        out["bytes intact"] = intact(state)
        out["reserved awake"] = torch.cuda.memory_reserved() == reserved
        out["graph memory mapped"] = segment_of(graph_ptr) is not None
        graph_out.copy_(torch.ones(1 << 20, dtype=torch.uint8))
        out["graph output readable"] = bool(graph_out.cpu().eq(1).all())
        g.replay()
        torch.cuda.synchronize()
        out["wake again"] = ferrocache.wake().segments
        result(out)
        """,
        FERROCACHE_SLEEP="1",
    )
    assert out == {
        "slept all reserved": True,
        "copied": True,
        "pinned": True,
        "skipped": 0,
        "reserved asleep": 0,
        "stats asleep": 0,
        "snapshot asleep": 0,
        "free grew": True,
        "raw allocation of what slept": 0,
        "sleep again": 0,
        "woke what slept": True,
        "same pointers": True,
        "bytes intact": True,
        "reserved awake": True,
        "graph memory mapped": True,
        "graph output readable": True,
        "wake again": 0,
    }


def test_a_tag_sleeps_without_backup_while_another_stays_awake() -> None:
    out = run(
        """
        with ferrocache.region("weights"):
            weights = trainer_state(n_layers=4)
        with ferrocache.region("kv_cache"):
            kv = torch.ones(64 << 20, dtype=torch.uint8).to("cuda")
        kv_ptr = kv.data_ptr()
        out = {}
        free_before = torch.cuda.mem_get_info()[0]
        reserved = torch.cuda.memory_reserved()
        report = ferrocache.sleep("kv_cache", backup=False)
        out["kv bytes"] = report.bytes
        out["copied"] = report.copied_bytes
        out["free grew"] = torch.cuda.mem_get_info()[0] - free_before >= report.bytes
        out["reserved shrank"] = reserved - torch.cuda.memory_reserved() == report.bytes
        out["raw allocation of what slept"] = raw_alloc_and_free(report.bytes)
        # The awake tag works on: a new allocation under it, and its bytes.
        with ferrocache.region("weights"):
            extra = torch.full((1 << 20,), 7, dtype=torch.uint8).to("cuda")
        out["weights intact"] = intact(weights)
        ferrocache.wake("kv_cache")
        out["kv same pointer"] = kv.data_ptr() == kv_ptr
        out["kv dropped reads zeros on the fake"] = int(kv.cpu().sum())
        out["weights intact after"] = intact(weights)
        out["extra intact"] = bool(extra.cpu().eq(7).all())
        result(out)
        """
    )
    assert out == {
        "kv bytes": 64 << 20,
        "copied": 0,
        "free grew": True,
        "reserved shrank": True,
        "raw allocation of what slept": 0,
        "weights intact": True,
        "kv same pointer": True,
        "kv dropped reads zeros on the fake": 0,
        "weights intact after": True,
        "extra intact": True,
    }


#: The other process, a stand-in for an inference engine: raw driver calls through ctypes, no
#: torch. It tries to allocate ``argv[1]`` bytes, says how that went, waits for a line on stdin,
#: tries again, frees, and says how that went.
OTHER_PROCESS = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
context = ctypes.c_void_p()
assert cuda.cuInit(0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0
assert cuda.cuCtxSetCurrent(context) == 0
size = ctypes.c_size_t(int(sys.argv[1]))

def allocate_and_free():
    free, total, ptr = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint64()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    status = cuda.cuMemAlloc_v2(ctypes.byref(ptr), size)
    if status == 0:
        assert cuda.cuMemsetD8_v2(ptr, 0xAB, 1 << 20) == 0  # it is this process's memory now
        assert cuda.cuMemFree_v2(ptr) == 0
    print(status, free.value, flush=True)

allocate_and_free()
sys.stdin.readline()
allocate_and_free()
"""


def test_another_process_allocates_what_slept(tmp_path: Path) -> None:
    out = run(
        f"""
        import subprocess, sys
        state = trainer_state()
        activations = torch.empty({1536 * MIB}, dtype=torch.uint8, device="cuda")
        ptrs = {{k: dev.data_ptr() for k, (host, dev) in state.items()}}
        activations_ptr = activations.data_ptr()
        free_awake = torch.cuda.mem_get_info()[0]
        wanted = free_awake + {GIB}  # more than is free, less than what will sleep
        other = subprocess.Popen([sys.executable, "-c", {OTHER_PROCESS!r}, str(wanted)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        out = {{}}
        status, free_seen = map(int, other.stdout.readline().split())
        out["other: out of memory while awake"] = status == 2
        out["other sees what this one sees"] = free_seen == free_awake
        report = ferrocache.sleep(backup=True)
        out["slept more than the other wants"] = report.bytes > {GIB}
        other.stdin.write("go\\n")
        other.stdin.flush()
        status, free_seen = map(int, other.stdout.readline().split())
        out["other: allocated what slept"] = status
        out["other saw it free"] = free_seen >= free_awake + report.bytes
        out["other exited"] = other.wait()
        woke = ferrocache.wake()
        out["woke what slept"] = woke.bytes == report.bytes
        out["same pointers"] = (
            all(dev.data_ptr() == ptrs[k] for k, (host, dev) in state.items())
            and activations.data_ptr() == activations_ptr
        )
        out["bytes intact"] = intact(state)
        out["free as before"] = torch.cuda.mem_get_info()[0] == free_awake
        result(out)
        """,
        FERROCACHE_SLEEP="1",
        FAKE_LIBCUDA_SHARED_DEVICES=str(tmp_path / "devices"),
    )
    assert out == {
        "other: out of memory while awake": True,
        "other sees what this one sees": True,
        "slept more than the other wants": True,
        "other: allocated what slept": 0,
        "other saw it free": True,
        "other exited": 0,
        "woke what slept": True,
        "same pointers": True,
        "bytes intact": True,
        "free as before": True,
    }


def test_a_copy_into_a_sleeping_tensor_is_an_illegal_address() -> None:
    process = run_torch_process(
        """
        ferrocache.install()
        tensor = torch.ones(1 << 20, dtype=torch.uint8).to("cuda")
        print("PTR " + str(tensor.data_ptr()), flush=True)
        ferrocache.sleep()
        try:
            tensor.copy_(torch.zeros(1 << 20, dtype=torch.uint8))
            torch.cuda.synchronize()
            error = None
        except Exception as e:  # torch.AcceleratorError in torch 2.15
            error = str(e)
        print("OUTCOME " + json.dumps({"error": error}), flush=True)
        os._exit(0)  # CUDA is unusable in this process: no teardown
        """,
        env=torch_env(FERROCACHE_SLEEP="1"),
        check=False,
    )
    ptr = next(int(line.removeprefix("PTR ")) for line in process.stdout.splitlines() if line.startswith("PTR "))
    outcomes = [json.loads(line.removeprefix("OUTCOME ")) for line in process.stdout.splitlines()
                if line.startswith("OUTCOME ")]  # fmt: skip
    if outcomes:  # torch 2.15: the copy raises
        assert process.returncode == 0, process.stderr
        assert outcomes[0]["error"] is not None, "the copy went through"
        assert "illegal memory access" in outcomes[0]["error"]
    else:
        # torch 2.11 meets the sticky error first where it cannot throw (c10::cuda::MaybeSetDevice
        # asks _hasPrimaryContext inside a noexcept path), so the process terminates; the copy
        # never went through either way.
        assert torch_before_2_15(), process.stderr
        assert process.returncode != 0 and "an illegal memory access was encountered" in process.stderr
    named = [line for line in process.stderr.splitlines() if "ILLEGAL ADDRESS" in line]
    assert len(named) == 1, process.stderr
    assert f"[{ptr:#x}, " in named[0]
    assert "reserved but not mapped" in named[0]


def test_expandable_segments_sleep_with_backup_and_wake_at_the_same_addresses() -> None:
    out = run(
        """
        state = trainer_state()
        small = torch.arange(1000, dtype=torch.int32).to("cuda")  # the small pool's segment
        for i in range(3):  # freed blocks in the mapped pages: cached, not copied
            del state[f"grad{i}"]
        ptrs = {k: dev.data_ptr() for k, (host, dev) in state.items()}
        out = {}
        out["expandable"] = all(s["is_expandable"] for s in ferrocache.snapshot()["segments"])
        mapped = [(s["address"], s["address"] + s["total_size"]) for s in ferrocache.snapshot()["segments"]]
        reserved = torch.cuda.memory_reserved()
        allocated = torch.cuda.memory_allocated()
        free_before = torch.cuda.mem_get_info()[0]
        report = ferrocache.sleep(backup=True)
        out["slept all reserved"] = report.bytes == reserved
        # The live allocations' bytes, not the mapped pages', into pinned memory; at most one
        # host wait (none when the copies had finished by the time sleep asked, as on the fake).
        out["copied"] = report.copied_bytes == allocated < report.bytes
        out["pinned"] = (report.host_memory_pinned, report.host_allocations, report.host_synchronizations <= 1)
        out["skipped"] = report.skipped_bytes
        out["reserved asleep"] = torch.cuda.memory_reserved()
        out["free grew"] = torch.cuda.mem_get_info()[0] - free_before >= report.bytes
        out["raw allocation of what slept"] = raw_alloc_and_free(report.bytes)
        out["sleep again"] = ferrocache.sleep().segments
        # Allocations while asleep come from new segments: a sleeping one neither serves nor
        # grows (growing would map pages at the end of its mapped range).
        during = torch.full((3 << 20,), 5, dtype=torch.uint8).to("cuda")
        out["new memory elsewhere"] = not any(a <= during.data_ptr() <= b for a, b in mapped)
        reserved_during = torch.cuda.memory_reserved()
        woke = ferrocache.wake()
        out["woke what slept"] = woke.bytes == report.bytes
        out["woke pinned"] = (woke.copied_bytes == report.copied_bytes, woke.host_memory_pinned,
                              woke.host_synchronizations)
        out["same pointers"] = all(dev.data_ptr() == ptrs[k] for k, (host, dev) in state.items())
        out["bytes intact"] = intact(state)
        out["small intact"] = bool(small.cpu().eq(torch.arange(1000, dtype=torch.int32)).all())
        out["during intact"] = bool(during.cpu().eq(5).all())
        out["reserved awake"] = torch.cuda.memory_reserved() == reserved_during + report.bytes
        # Awake, they grow again.
        grown = torch.full((4 << 20,), 9, dtype=torch.uint8).to("cuda")
        out["grown intact"] = bool(grown.cpu().eq(9).all())
        out["wake again"] = ferrocache.wake().segments
        # A second cycle of the same live bytes reuses the pinned memory kept from the first.
        del during, grown
        again = ferrocache.sleep(backup=True)
        ferrocache.wake()
        out["second cycle"] = (again.host_allocations, again.host_memory_pinned, intact(state))
        del state, small
        torch.cuda.empty_cache()
        out["all given back"] = torch.cuda.memory_reserved()
        result(out)
        """,
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    assert out == {
        "expandable": True,
        "slept all reserved": True,
        "copied": True,
        "pinned": [True, 1, True],
        "skipped": 0,
        "reserved asleep": 0,
        "free grew": True,
        "raw allocation of what slept": 0,
        "new memory elsewhere": True,
        "sleep again": 0,
        "woke what slept": True,
        "woke pinned": [True, True, 1],
        "same pointers": True,
        "bytes intact": True,
        "small intact": True,
        "during intact": True,
        "reserved awake": True,
        "grown intact": True,
        "wake again": 0,
        "second cycle": [0, True, True],
        "all given back": 0,
    }


def test_wake_stops_at_the_memory_fraction() -> None:
    out = run(
        """
        state = trainer_state()
        ptrs = {k: dev.data_ptr() for k, (host, dev) in state.items()}
        out = {}
        report = ferrocache.sleep(backup=True)
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(report.bytes / 2 / total)
        try:
            ferrocache.wake()
            out["refused"] = "no"
        except RuntimeError as err:
            out["refused"] = "memory fraction" in str(err)
        out["within the limit"] = torch.cuda.memory_reserved() <= report.bytes / 2
        torch.cuda.set_per_process_memory_fraction(1.0)
        ferrocache.wake()
        out["all awake"] = torch.cuda.memory_reserved() == report.bytes
        out["same pointers"] = all(dev.data_ptr() == ptrs[k] for k, (host, dev) in state.items())
        out["bytes intact"] = intact(state)
        result(out)
        """,
        FERROCACHE_SLEEP="1",
    )
    assert out == {
        "refused": True,
        "within the limit": True,
        "all awake": True,
        "same pointers": True,
        "bytes intact": True,
    }
