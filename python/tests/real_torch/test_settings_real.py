"""The user-visible texts and the newest PYTORCH_CUDA_ALLOC_CONF keys, through real PyTorch:
each scenario runs under PyTorch's allocator and after ``ferrocache.install()``, each in a fresh
process, and both must raise the same exceptions with the same messages and count the same
statistics.

- The out-of-memory message ends with the running PyTorch's advice (the link changed in 2.11,
  2.10 named ``PYTORCH_ALLOC_CONF``, 2.15 says something else with expandable segments on);
  ferrocache follows ``FERROCACHE_PYTORCH_VERSION``, which ``install()`` sets.
- ``throw_on_cudamalloc_oom`` (PyTorch 2.12 and later) refuses a device allocation past the
  configured ``per_process_memory_fraction`` (the whole device when none is given) at once,
  with no release of cached blocks, and counts it in ``num_oom_rejections``.
- ``expandable_segments_reserve`` (PyTorch 2.15) sets the address range each expandable segment
  reserves; an allocation larger than it says so in the out-of-memory message.
- ``memory_summary()`` is laid out as PyTorch lays it out.
- The out-of-memory message says what each process on the GPU uses, this one included, as NVML
  lists them (the fake's NVML: this process with what it holds on the device, and the processes
  of ``FAKE_NVML_OTHER_PROCESSES``); where an NVML call fails, PyTorch 2.14 and later leave those
  sentences out (older ones fail an internal assert instead).

The oracle programs at the end compare the device calls and every ``memory_stats()`` key after
every op (python/tools/oracle); the random programs of ``harness.SETTINGS`` use these keys too.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from torch_env import GIB, MIB, TORCH_VERSION, require_real_torch, run_torch, torch_env

require_real_torch()

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from oracle import harness  # noqa: E402

#: What each scenario's child records after every step: the outcome and these statistics.
STEPS = r"""
def E(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")

KEYS = ("num_oom_rejections", "num_ooms", "num_alloc_retries", "num_device_alloc",
        "num_device_free", "reserved_bytes.all.current", "allocated_bytes.all.current")
steps = []
kept = []
observed = []  # out-of-memory observer calls (PyTorch calls none for a preemptive rejection)
torch._C._cuda_attach_out_of_memory_observer(lambda *args: observed.append(args[1]))
_fake.fake_cuda_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_uint32]

def nvml_fails_next(function):
    _fake.fake_cuda_fail_next(function.encode(), 999)  # NVML_ERROR_UNKNOWN

def step(label, action):
    try:
        value = action()
        if value is not None:
            kept.append(value)
        outcome = ["ok"]
    except RuntimeError as err:
        outcome = ["OutOfMemoryError" if isinstance(err, torch.cuda.OutOfMemoryError) else type(err).__name__, str(err)]
    stats = torch.cuda.memory_stats()
    steps.append([label, outcome, {key: stats[key] for key in KEYS if key in stats}, len(observed)])
"""

TOO_LARGE_THEN_A_FRACTION = """
step("2 GiB", lambda: E(2 * GIB))
step("300 MiB", lambda: E(300 * MIB))
step("fraction 0.5", lambda: torch.cuda.set_per_process_memory_fraction(0.5))
step("600 MiB under 0.5", lambda: E(600 * MIB))
"""

#: Two other processes on the GPU, which NVML lists first on the fake.
OTHER_PROCESSES = {"FAKE_NVML_OTHER_PROCESSES": f"4242:{64 * MIB},77:1000"}

#: (name, PYTORCH_CUDA_ALLOC_CONF, oldest torch that has it, the steps[, the fake's settings])
#: on a 1 GiB GPU.
SCENARIOS = (
    (
        "defaults",
        "",
        (2, 4),
        TOO_LARGE_THEN_A_FRACTION,
    ),
    (
        "other_processes",
        "",
        (2, 4),
        TOO_LARGE_THEN_A_FRACTION,
        OTHER_PROCESSES,
    ),
    (
        "nvml_fails",
        "",
        (2, 14),  # older torches fail an internal assert where NVML fails
        """
        step("2 GiB", lambda: E(2 * GIB))
        step("NVML fails", lambda: nvml_fails_next("nvmlDeviceGetComputeRunningProcesses"))
        step("2 GiB without NVML's list", lambda: E(2 * GIB))
        step("NVML's device look-up fails", lambda: nvml_fails_next("nvmlDeviceGetHandleByPciBusId_v2"))
        step("2 GiB without NVML's device", lambda: E(2 * GIB))
        step("2 GiB with NVML again", lambda: E(2 * GIB))
        """,
        OTHER_PROCESSES,
    ),
    (
        "expandable",
        "expandable_segments:True",
        (2, 15),  # older torches' own expandable segments ask NVML, which the fake lacks
        TOO_LARGE_THEN_A_FRACTION,
    ),
    (
        "reserve_0.05",
        "expandable_segments:True,expandable_segments_reserve:0.05",
        (2, 15),
        """
        step("200 MiB + 1", lambda: E(200 * MIB + 1))
        step("5 MiB + 1", lambda: E(5 * MIB + 1))
        step("60 MiB + 1", lambda: E(60 * MIB + 1))
        step("1100 MiB", lambda: E(1100 * MIB))
        """,
    ),
    (
        "throw_on_cudamalloc_oom",
        "throw_on_cudamalloc_oom:True",
        (2, 12),
        """
        step("2 GiB", lambda: E(2 * GIB))
        step("300 MiB", lambda: E(300 * MIB))
        kept.clear()
        step("800 MiB + 1 beside 300 MiB cached", lambda: E(800 * MIB + 1))
        step("5000", lambda: E(5000))
        step("700 MiB", lambda: E(700 * MIB))
        """,
    ),
    (
        "throw_on_cudamalloc_oom_fraction",
        "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True",
        (2, 12),
        """
        step("300 MiB", lambda: E(300 * MIB))
        kept.clear()
        step("400 MiB (the fraction's retry)", lambda: E(400 * MIB))
        step("600 MiB", lambda: E(600 * MIB))
        step("fraction 0.9", lambda: torch.cuda.set_per_process_memory_fraction(0.9))
        step("200 MiB (past the configured 0.5)", lambda: E(200 * MIB))
        """,
    ),
)


def run_scenario(allocator: str, conf: str, steps: str, fake: dict) -> list:
    install = "ferrocache.install()\n" if allocator == "ferrocache" else ""
    code = install + f"GIB, MIB = {GIB}, {MIB}\n" + STEPS + textwrap.dedent(steps) + "\nresult(steps)\n"
    return run_torch(code, env=torch_env(GIB, PYTORCH_CUDA_ALLOC_CONF=conf, **fake))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_out_of_memory_messages_and_counts_are_pytorchs(scenario: tuple) -> None:
    name, conf, oldest, steps, fake = (*scenario, {})[:5]
    if TORCH_VERSION < oldest:
        pytest.skip(f"{name} needs PyTorch {oldest[0]}.{oldest[1]}")
    native = run_scenario("native", conf, steps, fake)
    ours = run_scenario("ferrocache", conf, steps, fake)
    for a, b in zip(native, ours):
        assert b == a, f"{name}: step {a[0]!r}:\npytorch    {a}\nferrocache {b}"
    assert len(ours) == len(native)
    # The scenarios show what they are meant to show (under PyTorch's own allocator).
    outcomes = {label: outcome for label, outcome, _, _ in native}
    assert any(outcome[0] == "OutOfMemoryError" for outcome in outcomes.values()), outcomes
    if "throw_on_cudamalloc_oom" in conf:
        assert native[-1][2]["num_oom_rejections"] > 0
    if name == "throw_on_cudamalloc_oom":
        assert native[-1][2]["num_ooms"] == 0 and native[-1][3] == 0, "rejections only, unobserved"
        assert any("preemptively rejected" in outcome[-1] for outcome in outcomes.values())
    if "reserve" in conf:
        assert "exceeds the expandable-segment reserve of 51.20 MiB" in outcomes["200 MiB + 1"][1]
    # NVML's sentences, after "... is free. ": this process's in every out-of-memory message
    # (a preemptive rejection's has none), the other processes' first where there are some.
    this_process = re.compile(
        r"is free\. (.*)Including non-PyTorch memory, this process has [0-9.]+ \w+ memory in use\. "
    )
    for label, outcome in outcomes.items():
        if outcome[0] != "OutOfMemoryError" or "preemptively rejected" in outcome[1]:
            continue
        listed = this_process.search(outcome[1])
        if "without NVML" in label:
            assert listed is None and "memory in use" not in outcome[1], outcome
        else:
            assert listed, outcome
            others = "Process 4242 has 64.00 MiB memory in use. Process 77 has 1000 bytes memory in use. "
            assert listed.group(1) == (others if fake else ""), outcome


#: Settings changed at run time, under every PyTorch version: what the running PyTorch keeps
#: and resets at each ``_set_allocator_settings`` parse shows in which cached block serves the
#: next request (src/config/parser.rs ``reset_before_each_parse``).
RUNTIME_CHANGES = """
S = torch.cuda.memory._set_allocator_settings
step("100 MiB", lambda: E(100 * MIB))
kept.clear()
step("max_split_size_mb:30", lambda: S("max_split_size_mb:30"))
# 100 MiB serves 70 MiB only within max_non_split_rounding_mb: 40 kept, or 20 put back.
step("70 MiB", lambda: E(70 * MIB))
kept.clear()
step("roundup_power2_divisions:4 (max_split_size_mb reset)", lambda: S("roundup_power2_divisions:4"))
step("10 MiB, split from a cached block", lambda: E(10 * MIB))
step("3 MiB + 1, rounded to 3.5 MiB", lambda: E(3 * MIB + 1))
step("empty text (roundup_power2_divisions reset)", lambda: S(""))
step("3 MiB + 1, rounded to 512 bytes", lambda: E(3 * MIB + 1))
"""

#: Expandable segments turned on and off at run time, where PyTorch's own expandable segments
#: run on the fake: measured on 2.8 to 2.11, 2.14 and 2.15; 2.13 fails at
#: nvmlDeviceGetGpuFabricInfoV, which the fake answers NVML_ERROR_NOT_SUPPORTED; 2.4 to 2.7 and
#: 2.12 were not measured.
EXPANDABLE_RUNS_ON_THE_FAKE = TORCH_VERSION >= (2, 8) and TORCH_VERSION not in ((2, 12), (2, 13))
EXPANDABLE_AT_RUN_TIME = """
S = torch.cuda.memory._set_allocator_settings
step("30 MiB", lambda: E(30 * MIB))
step("expandable_segments:True", lambda: S("expandable_segments:True"))
step("30 MiB, expandable", lambda: E(30 * MIB))
step("5 MiB, expandable", lambda: E(5 * MIB))
kept.clear()
step("expandable_segments:False,max_split_size_mb:40", lambda: S("expandable_segments:False,max_split_size_mb:40"))
step("20 MiB, not from the expandable blocks", lambda: E(20 * MIB))
step("max_split_size_mb:40 (expandable kept off)", lambda: S("max_split_size_mb:40"))
step("25 MiB", lambda: E(25 * MIB))
"""

#: The first PyTorch whose run-time parse puts max_non_split_rounding_mb back to
#: large_segment_size_mb (measured: 2.8.0 and 2.10.0 keep it; 2.11.0, 2.13.0, 2.14.1 and 2.15.0 put it back).
ROUNDING_PUT_BACK_SINCE = (2, 11)


@pytest.mark.parametrize("scenario", ["runtime_changes", "expandable_at_run_time"])
def test_settings_changed_at_run_time_decide_as_the_running_pytorch(scenario: str) -> None:
    """Both allocators under the installed PyTorch, with settings changed at run time: the same
    outcomes and device allocations, reserved and allocated bytes after every step."""
    if scenario == "expandable_at_run_time" and not EXPANDABLE_RUNS_ON_THE_FAKE:
        pytest.skip(f"PyTorch {TORCH_VERSION}'s own expandable segments do not run on the fake")
    steps = RUNTIME_CHANGES if scenario == "runtime_changes" else EXPANDABLE_AT_RUN_TIME
    conf = "max_split_size_mb:30,max_non_split_rounding_mb:40" if scenario == "runtime_changes" else ""
    native = run_scenario("native", conf, steps, {})
    ours = run_scenario("ferrocache", conf, steps, {})
    for a, b in zip(native, ours):
        assert b == a, f"{scenario}: step {a[0]!r}:\npytorch    {a}\nferrocache {b}"
    assert len(ours) == len(native)
    stats = {label: counts for label, _, counts, _ in native}
    if scenario == "runtime_changes":
        # The scenario tells the versions' rules apart, under PyTorch's own allocator.
        rounding_put_back = TORCH_VERSION >= ROUNDING_PUT_BACK_SINCE
        assert stats["70 MiB"]["num_device_alloc"] == (2 if rounding_put_back else 1), native
        assert stats["10 MiB, split from a cached block"]["num_device_alloc"] == stats["70 MiB"]["num_device_alloc"]
        rounded = [stats[label]["allocated_bytes.all.current"] for label in ("3 MiB + 1, rounded to 3.5 MiB", "3 MiB + 1, rounded to 512 bytes")]  # fmt: skip
        assert rounded[1] - rounded[0] == 3 * MIB + 512, rounded


#: max_split_size_mb lowered at run time below a free block that a split left inside a
#: segment, then a request that fails on the device (docs/python.md, "Settings changed at run
#: time").
OVERSIZE_REMAINDER = """
MIB = 1 << 20

def E(n):
    return torch.empty(n, dtype=torch.uint8, device="cuda")

a = E(230 * MIB)
del a
kept = E(1327756)  # split from the cached 230 MiB segment: a 229 MiB free remainder
torch.cuda.memory._set_allocator_settings("max_split_size_mb:40")
frees, live = fake_stat("cuMemFree_v2"), fake_stat("live_allocations")
try:
    E(1800 * MIB)
    outcome = "ok"
except RuntimeError as err:
    outcome = [isinstance(err, torch.cuda.OutOfMemoryError), str(err).splitlines()[0]]
result([outcome, fake_stat("cuMemFree_v2") - frees, fake_stat("live_allocations") - live])
"""


def test_a_lowered_max_split_size_makes_pytorch_free_the_middle_of_a_segment() -> None:
    """Why PyTorch's own allocator answers "CUDA error: invalid argument" instead of out of
    memory after max_split_size_mb was lowered at run time: when the device refuses a segment,
    release_available_cached_blocks frees cached blocks of max_split_size or more, assuming
    that such blocks are whole segments (never split). A remainder split off before the change
    is not: PyTorch hands cuMemFree an address inside a segment, which the driver refuses
    (cuMemFree: "dptr ... must have been returned by a previous call" to an allocation API),
    on a GPU as on the fake. ferrocache releases whole segments only and answers out of
    memory."""
    native = run_torch(OVERSIZE_REMAINDER, env=torch_env(GIB))
    ours = run_torch("ferrocache.install()\n" + OVERSIZE_REMAINDER, env=torch_env(GIB))
    # One cuMemFree, refused: the one live allocation (the segment) is still there.
    assert native == [[False, "CUDA error: invalid argument"], 1, 0], native
    assert ours[0][0] is True and "CUDA out of memory" in ours[0][1], ours
    assert ours[1:] == [0, 0], ours


SUMMARY = r"""
kept = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (3 << 20, 1000, 30 << 20, 700 << 10)]
del kept[1]
try:
    torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
except RuntimeError:
    pass
result([torch.cuda.memory_summary(), torch.cuda.memory_summary(abbreviated=True)])
"""


def test_memory_summary_is_laid_out_as_pytorchs() -> None:
    native = run_torch(SUMMARY, env=torch_env(GIB))
    ours = run_torch("ferrocache.install()\n" + SUMMARY, env=torch_env(GIB))
    assert "CUDA OOMs: 1" in native[0]
    assert ours == native


def oracle_case(name: str, conf: str, streams: int, ops: list[dict]) -> harness.Case:
    return harness.Case(0, name, conf, GIB, streams, 0, ops)


def alloc(i: int, size: int, stream: int = 0) -> dict:
    return {"op": "alloc", "id": i, "size": size, "stream": stream}


def free(i: int) -> dict:
    return {"op": "free", "id": i}


@pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="the oracle is PyTorch >= 2.15's allocator")
def test_throw_on_cudamalloc_oom_agrees_op_by_op() -> None:
    """Rejections past the configured fraction (0.6) while set_per_process_memory_fraction allows
    0.9, between allocations served from the cache, made on the device and released."""
    case = oracle_case(
        "throw_fraction",
        "per_process_memory_fraction:0.6,throw_on_cudamalloc_oom:True",
        2,
        [
            {"op": "fraction", "value": 0.9},
            alloc(0, 300 * MIB),
            alloc(1, 100 * MIB, 1),
            free(0),
            alloc(2, 400 * MIB),  # 400 MiB held + 400: rejected, the cache kept
            alloc(3, 150 * MIB),  # from the cached 300 MiB block
            alloc(4, 200 * MIB),  # 600 MiB held, within 0.6
            alloc(5, 100 * MIB, 1),  # rejected
            alloc(6, 5000, 1),  # a small segment fits
            free(3),
            {"op": "empty_cache"},
            alloc(7, 300 * MIB),
            {"op": "fraction", "value": 0.3},
            alloc(8, 100 * MIB),  # the fraction's own limit: released and retried, no rejection
            alloc(9, 50 * MIB, 1),
        ],
    )
    native, ours = harness.run_both(case)
    rejections = [stats["num_oom_rejections"] for stats in harness.full_stats(native)]
    assert rejections[4] == 1 and rejections[7] == 2, rejections
    divergence = harness.first_divergence(case, native, ours)
    assert divergence is None, str(divergence)


@pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="the oracle is PyTorch >= 2.15's allocator")
def test_expandable_segments_reserve_agrees_op_by_op() -> None:
    """Segments of 0.3 of the device on two streams, an allocation larger than that (a range
    reserved and given back twice), growth, unmapping and release."""
    case = oracle_case(
        "expandable_reserve",
        "expandable_segments:True,expandable_segments_reserve:0.3",
        2,
        [
            alloc(0, 1000),
            alloc(1, 3 * MIB),
            alloc(2, 100 * MIB, 1),
            alloc(3, 400 * MIB),  # larger than 0.3 GiB: out of memory
            alloc(4, 250 * MIB),
            free(1),
            alloc(5, 290 * MIB, 1),  # too much for stream 1's segment: a second one
            free(2),
            {"op": "empty_cache"},
            alloc(6, 64 * MIB, 1),
        ],
    )
    native, ours = harness.run_both(case)
    # The calls end with the range's offset from the fake's base (" +0x...").
    reserves = [call.split(" +")[0] for step in native["steps"] for call in step["calls"] if call.startswith("cuMemAddressReserve")]
    assert reserves[:2] == ["cuMemAddressReserve r0 322961408", "cuMemAddressReserve r1 335544320"], reserves
    assert native["steps"][3]["oom"]
    divergence = harness.first_divergence(case, native, ours)
    assert divergence is None, str(divergence)


#: A good and a bad value for every key PyTorch 2.15's parser knows (the strings of its
#: libc10.so and libc10_cuda.so; README "Configuration"), and a key it does not know although
#: one of its messages names it. ``large_segment_size_mb`` comes last: PyTorch keeps it between
#: parses, and the limits of two other keys depend on it.
EVERY_KEY = [
    "max_split_size_mb:40", "max_split_size_mb:10",
    "max_non_split_rounding_mb:30", "max_non_split_rounding_mb:5",
    "garbage_collection_threshold:0.5", "garbage_collection_threshold:1.5",
    "roundup_power2_divisions:4", "roundup_power2_divisions:3",
    "roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[3:4]",
    "expandable_segments:False", "expandable_segments:maybe",
    "pinned_use_background_threads:True", "pinned_use_background_threads:1",
    "pinned_max_round_threshold_mb:64", "pinned_max_round_threshold_mb:x",
    "pinned_max_cached_size_mb:1024", "pinned_max_cached_size_mb:-",
    "backend:native", "backend:malloc",
    "release_lock_on_cudamalloc:True", "release_lock_on_cudamalloc:true",
    "release_lock_on_hipmalloc:False", "release_lock_on_hipmalloc:0",
    "pinned_use_cuda_host_register:True", "pinned_use_cuda_host_register:yes",
    "pinned_use_hip_host_register:False", "pinned_use_hip_host_register:no",
    "graph_capture_record_stream_reuse:True", "graph_capture_record_stream_reuse:on",
    "pinned_reserve_segment_size_mb:16", "pinned_reserve_segment_size_mb:0",
    "pinned_num_register_threads:8", "pinned_num_register_threads:3",
    "pinned_num_register_threads:256",
    "per_process_memory_fraction:0.9", "per_process_memory_fraction:1.5",
    "pinned_free_catch_all:True", "pinned_free_catch_all:maybe",
    "throw_on_cudamalloc_oom:False", "throw_on_cudamalloc_oom:true",
    "expandable_segments_reserve:0.5", "expandable_segments_reserve:abc",
    "expandable_segments_reserve_by_class:[a:0.5,b:8G]", "expandable_segments_reserve_by_class:[a:0.5",
    "expandable_segments_handle_type:posix_fd",
    "large_segment_size_mb:64", "large_segment_size_mb:10",
]


@pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="the keys of PyTorch 2.15's parser")
def test_every_key_is_accepted_or_refused_as_by_pytorch() -> None:
    """PyTorch's parser, driven through torch.cuda.memory._set_allocator_settings in one
    process, against ferrocache.check_config: the same settings accepted, the same refused,
    with PyTorch's words (where PyTorch has words: a bare std::stoull failure says only
    'stoull', and ferrocache says which key and value)."""
    code = """
    out = {}
    for conf in %r:
        try:
            CHECK(conf)
            out[conf] = None
        except (ValueError, RuntimeError) as err:
            out[conf] = str(err).split("\\n")[0]
    result(out)
    """ % (EVERY_KEY,)
    native = run_torch(code.replace("CHECK", "torch.cuda.memory._set_allocator_settings"), env=torch_env(GIB))
    ours = run_torch(code.replace("CHECK", "ferrocache.check_config"), env=torch_env(GIB))
    for conf in EVERY_KEY:
        accepted = native[conf] is None
        assert (ours[conf] is None) == accepted, (conf, native[conf], ours[conf])
        if not accepted and native[conf] not in ("stoull", "stod"):
            assert ours[conf] in native[conf], (conf, native[conf], ours[conf])
    refused = sum(message is not None for message in native.values())
    assert refused >= len(EVERY_KEY) // 2, native


@pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="the snapshot format of PyTorch 2.15")
@pytest.mark.parametrize(
    "conf",
    [
        "",
        "max_split_size_mb:40,roundup_power2_divisions:[64:8,>:2],garbage_collection_threshold:0.7,"
        "pinned_max_cached_size_mb:32,pinned_max_round_threshold_mb:64,pinned_num_register_threads:4,"
        "pinned_use_cuda_host_register:True,graph_capture_record_stream_reuse:True,"
        "release_lock_on_cudamalloc:True,throw_on_cudamalloc_oom:True,expandable_segments_reserve:0.5",
    ],
)
def test_snapshot_allocator_settings_are_pytorchs(conf: str) -> None:
    code = 'torch.empty(10, device="cuda")\nresult(torch.cuda.memory._snapshot()["allocator_settings"])\n'
    env = torch_env(GIB, PYTORCH_CUDA_ALLOC_CONF=conf)
    native = run_torch(code, env=env)
    assert run_torch("ferrocache.install()\n" + code, env=env) == native


#: Tags streams through PyTorch 2.15's C++ API (a caller ferrocache does not see), for
#: expandable_segments_reserve_by_class. Declared here: c10/cuda's headers need CUDA's.
TAGGER = r"""
#include <string>
struct CUstream_st;
namespace c10::cuda::CUDACachingAllocator {
void setExpandableSegmentReserveClassForStream(CUstream_st* stream, const std::string& name);
}
extern "C" void tag_stream(CUstream_st* stream, const char* name) {
    c10::cuda::CUDACachingAllocator::setExpandableSegmentReserveClassForStream(stream, name);
}
"""

TAGGED_STREAMS = r"""
import ctypes
tagger = ctypes.CDLL(os.environ["TAGGER"])
log = open(os.environ["FAKE_CUDA_CALL_LOG"])
torch.cuda.init()
log.read()
tiny, other = torch.cuda.Stream(), torch.cuda.Stream()
tagger.tag_stream(ctypes.c_void_p(tiny.cuda_stream), b"tiny")
tagger.tag_stream(ctypes.c_void_p(other.cuda_stream), b"other")
kept, steps = [], []
for label, stream, size in [
    ("tiny 1000", tiny, 1000), ("tiny 3 MiB", tiny, 3 << 20), ("tiny 200 MiB + 1", tiny, (200 << 20) + 1),
    ("other 3 MiB", other, 3 << 20), ("untagged 3 MiB", torch.cuda.current_stream(), 3 << 20),
]:
    try:
        with torch.cuda.stream(stream):
            kept.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        outcome = "ok"
    except RuntimeError as err:
        outcome = str(err)
    steps.append([label, outcome, [c.split(" +")[0] for c in log.read().splitlines() if "Address" in c]])
result(steps)
"""


@pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="reserve classes are PyTorch 2.15's")
def test_reserve_classes_given_through_pytorchs_cpp_api_apply(tmp_path: Path) -> None:
    """expandable_segments_reserve_by_class: streams that C++ code tagged get their class's
    reserve under ferrocache too (the shim install() builds asks PyTorch for the tag); a class
    with no entry gets the default; an allocation past the class's reserve names the class."""
    import importlib.util
    import shutil
    import subprocess

    compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no C++ compiler to build the stream tagger")
    lib = Path(importlib.util.find_spec("torch").origin).parent / "lib"
    source, tagger = tmp_path / "tagger.cpp", tmp_path / "tagger.so"
    source.write_text(TAGGER)
    subprocess.run(
        [compiler, "-std=c++17", "-shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1", str(source), "-o", str(tagger),
         f"-L{lib}", "-lc10_cuda", f"-Wl,-rpath,{lib}"],
        check=True,
    )  # fmt: skip
    runs = {}
    for allocator in ("native", "ferrocache"):
        calls = tmp_path / f"{allocator}.log"
        calls.touch()
        env = torch_env(
            GIB,
            PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,expandable_segments_reserve_by_class:[tiny:0.05,big:0.5]",
            FAKE_CUDA_CALL_LOG=str(calls),
            TAGGER=str(tagger),
        )
        install = "ferrocache.install()\n" if allocator == "ferrocache" else ""
        runs[allocator] = run_torch(install + TAGGED_STREAMS, env=env)
    assert runs["ferrocache"] == runs["native"]
    steps = {label: (outcome, calls) for label, outcome, calls in runs["native"]}
    assert steps["tiny 1000"][1] == ["cuMemAddressReserve r0 54525952"]
    assert steps["tiny 3 MiB"][1] == ["cuMemAddressReserve r1 62914560"]
    assert "reserve of 51.20 MiB for stream reserve class 'tiny'" in steps["tiny 200 MiB + 1"][0]
    assert steps["other 3 MiB"][1] == ["cuMemAddressReserve r4 1216348160"]
