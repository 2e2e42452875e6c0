"""Snapshots: dump_snapshot's pickle against PyTorch's real ones and what the memory viewer
reads; record_memory_history's argument forms."""

from __future__ import annotations

import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
from conftest import GIB, MIB, TRACES, memory_env, run_json, run_python

pytestmark = pytest.mark.usefixtures("fake_libcuda")

#: The opcodes the unpickler of PyTorch's memory viewer (torch/utils/viz/MemoryViz.js) handles.
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
    "LONG_BINGET", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST",
    "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE",
    "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE",
}  # fmt: skip


class RestrictedUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, tuples, strings, numbers, booleans and None."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def load(path: Path) -> Any:
    with open(path, "rb") as f:
        return RestrictedUnpickler(f).load()


PROGRAM = """
import ferrocache as fc
fc.record_memory_history(max_entries=10_000)
a = fc.caching_allocator_alloc(1000)
b = fc.caching_allocator_alloc(5 * 2**20)
c = fc.caching_allocator_alloc(3 * 2**20)
fc.caching_allocator_delete(a)
try:
    fc.caching_allocator_alloc(512 * 2**20)
except fc.OutOfMemoryError:
    pass
fc.dump_snapshot({path!r})
result(True)
"""


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snapshot") / "run.pickle"
    run_json(PROGRAM.format(path=str(path)), env=memory_env(256 * MIB))
    return path


def test_the_pickle_holds_only_plain_python_values(dumped: Path) -> None:
    snapshot = load(dumped)
    assert isinstance(snapshot, dict)


def test_the_memory_viewer_can_read_the_pickle(dumped: Path) -> None:
    data = dumped.read_bytes()
    opcodes = {op.name for op, _, _ in pickletools.genops(data)}
    assert opcodes <= VIEWER_OPCODES, opcodes - VIEWER_OPCODES
    assert data[:2] == b"\x80\x04", "the viewer reads pickle protocols 2 to 4"


def test_structure(dumped: Path) -> None:
    snapshot = load(dumped)
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    segments, traces = snapshot["segments"], snapshot["device_traces"]
    assert [s["total_size"] for s in segments] and isinstance(traces, list)
    assert all(isinstance(trace, list) for trace in traces) and len(traces) >= 1
    for segment in segments:
        assert isinstance(segment["segment_pool_id"], tuple) and segment["segment_pool_id"] == (0, 0)
        assert isinstance(segment["frames"], list)
        # The viewer places blocks by adding up sizes from the segment's address.
        address = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == address and isinstance(block["frames"], list)
            assert block["state"] in ("active_allocated", "active_pending_free", "inactive")
            address += block["size"]
        assert address == segment["address"] + segment["total_size"]
        active = sum(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
        assert segment["allocated_size"] == active
    assert sorted((s["segment_type"], s["total_size"]) for s in segments) == [
        ("large", 20 * MIB)  # b and c share one segment; the small one went back at the OOM
    ]
    actions = [entry["action"] for entry in traces[0]]
    assert actions == [
        "segment_alloc", "alloc",  # a
        "segment_alloc", "alloc",  # b
        "alloc",  # c: from b's segment
        "free_requested", "free_completed",  # a
        "segment_free",  # the OOM path releases the free small segment before giving up
        "oom",
    ]  # fmt: skip
    oom = traces[0][-1]
    assert "addr" not in oom and oom["size"] == 512 * MIB
    assert 0 < oom["device_free"] <= 256 * MIB
    settings = snapshot["allocator_settings"]
    assert settings["max_split_size"] == -1 and settings["expandable_segments"] is False


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no real snapshots at {TRACES}")
def test_the_keys_are_those_of_pytorchs_own_snapshots(dumped: Path) -> None:
    ours = load(dumped)
    reals = [load(path) for path in sorted(TRACES.glob("*.pickle"))]
    assert reals, f"no .pickle files in {TRACES}"
    real_top = set().union(*(set(r) for r in reals))
    assert {"segments", "device_traces"} <= set(ours) <= real_top
    for real in reals:
        real_segments = {frozenset(s) for s in real["segments"]}
        real_blocks = {frozenset(b) for s in real["segments"] for b in s["blocks"]}
        assert {frozenset(s) for s in ours["segments"]} == real_segments
        assert {frozenset(b) for s in ours["segments"] for b in s["blocks"]} == real_blocks
        for segment in real["segments"]:
            assert type(segment["segment_pool_id"]) is type(ours["segments"][0]["segment_pool_id"])
    real_entry_keys = set().union(*(set(e) for r in reals for t in r["device_traces"] for e in t))
    for entry in ours["device_traces"][0]:
        if entry["action"] == "oom":
            # PyTorch gives every entry the thread's user_metadata ("" when none), OOM ones too.
            assert set(entry) == {"action", "device_free", "size", "stream", "time_us", "frames", "user_metadata"}
        else:
            assert {"action", "addr", "size", "stream", "time_us"} <= set(entry) <= real_entry_keys
    real_settings = next(r["allocator_settings"] for r in reals if "allocator_settings" in r)
    assert set(real_settings) - {"graph_capture_record_stream_reuse"} <= set(ours["allocator_settings"])
    assert set(ours["allocator_settings"]["roundup_power2_divisions"]) == set(
        real_settings["roundup_power2_divisions"]
    )


def test_snapshot_and_memory_snapshot_in_process() -> None:
    out = run_json(
        """
        import ferrocache as fc
        p = fc.caching_allocator_alloc(4096)
        s = fc.snapshot()
        result([type(s["segments"][0]["segment_pool_id"]).__name__, s["device_traces"],
                fc.memory_snapshot() == s["segments"], len(s["segments"])])
        """,
        env=memory_env(GIB),
    )
    assert out == ["tuple", [[]], True, 1]


HISTORY = """
import ferrocache as fc
def actions():
    return [e["action"] for e in fc.snapshot()["device_traces"][0]]
def cycle():
    fc.caching_allocator_delete(fc.caching_allocator_alloc(4096))
out = {}
cycle(); out["off by default"] = actions()
fc.record_memory_history(True, trace_alloc_max_entries=2); cycle(); out["legacy, 2 entries"] = actions()
fc.record_memory_history(None); out["stopped"] = actions()
fc.record_memory_history("all", max_entries=100, skip_actions=["free_requested"]); cycle()
out["skip free_requested"] = actions()
fc.record_memory_history(enabled=True, max_entries=100, clear_history=True); cycle()
out["bool with max_entries, cleared"] = actions()
fc.record_memory_history("state"); cycle(); out["state"] = actions()
errors = []
for call in (lambda: fc.record_memory_history("everything"),
             lambda: fc.record_memory_history(skip_actions=["malloc"]),
             lambda: fc.record_memory_history(max_entries=-1),
             lambda: fc.record_memory_history(colour="red")):
    try:
        call()
    except (TypeError, ValueError) as err:
        errors.append(type(err).__name__)
out["errors"] = errors
result(out)
"""


def test_record_memory_history_accepts_pytorchs_forms() -> None:
    out = run_json(HISTORY, env=memory_env(GIB))
    assert out == {
        "off by default": [],
        "legacy, 2 entries": ["free_requested", "free_completed"],
        "stopped": [],
        "skip free_requested": ["alloc", "free_completed"],
        "bool with max_entries, cleared": ["alloc", "free_requested", "free_completed"],
        "state": [],
        "errors": ["ValueError", "ValueError", "ValueError", "TypeError"],
    }


def test_dump_snapshot_default_name(tmp_path: Path) -> None:
    run_python(
        "import ferrocache as fc; fc.caching_allocator_alloc(8); fc.dump_snapshot()",
        env=memory_env(GIB),
        cwd=tmp_path,
    )
    assert load(tmp_path / "dump_snapshot.pickle")["segments"][0]["blocks"][0]["requested_size"] == 8
