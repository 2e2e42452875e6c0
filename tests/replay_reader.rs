//! The replay reader over the three shared PyTorch snapshots and over hostile input.

use ferrocache::config::Config;
use ferrocache::policy::{self, TieRule};
use ferrocache::replay::{
    self, BlockSizeSource, DeviceWorkload, Op, ReplayError, ReplayErrorKind, Workload,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[path = "common/properties.rs"]
mod properties;
#[path = "common/snapshot_json.rs"]
mod snapshot_json;
#[path = "common/traces.rs"]
mod traces;
use snapshot_json::written_back;
use traces::traces_dir;

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

struct Expected {
    file: &'static str,
    events: usize,
    live_blocks: usize,
    live_gib: &'static str,
    reserved_at_start_gib: &'static str,
    peak_requested_gib: &'static str,
    peak_reserved_gib: &'static str,
    utilization_percent: &'static str,
    segment_allocs: usize,
}

/// The table of shared/traces/README.md.
const EXPECTED: [Expected; 3] = [
    Expected {
        file: "eor_nn.pickle",
        events: 5_803,
        live_blocks: 31,
        live_gib: "0.01",
        reserved_at_start_gib: "0.02",
        peak_requested_gib: "0.10",
        peak_reserved_gib: "0.12",
        utilization_percent: "80.7",
        segment_allocs: 7,
    },
    Expected {
        file: "cs336_memory_ctx128_forward.pickle",
        events: 4_657,
        live_blocks: 324,
        live_gib: "12.69",
        reserved_at_start_gib: "12.82",
        peak_requested_gib: "18.02",
        peak_reserved_gib: "18.32",
        utilization_percent: "98.4",
        segment_allocs: 289,
    },
    Expected {
        file: "bcrafton_0c0e8a7.pickle",
        events: 6_486,
        live_blocks: 447,
        live_gib: "2.85",
        reserved_at_start_gib: "3.95",
        peak_requested_gib: "3.58",
        peak_reserved_gib: "3.95",
        utilization_percent: "90.8",
        segment_allocs: 0,
    },
];

fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

/// Every op names an allocation that exists and is live (or not yet born) at that point.
fn assert_ops_well_formed(w: &DeviceWorkload) {
    assert_eq!(w.ops.len(), w.op_origins.len());
    let mut live = vec![false; w.allocations.len()];
    for a in &w.start_allocations {
        live[a.id as usize] = true;
        assert!(w.allocations[a.id as usize].live_at_start);
    }
    let mut next_new = w.start_allocations.len();
    for (i, op) in w.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, .. } => {
                assert_eq!(id as usize, next_new, "op {i}: ids are dense and in order");
                next_new += 1;
                live[id as usize] = true;
            }
            Op::Free { id } => {
                assert!(live[id as usize], "op {i}: free of a dead allocation {id}");
                live[id as usize] = false;
            }
            Op::EmptyCache | Op::Oom { .. } => {}
        }
    }
    assert_eq!(next_new, w.allocations.len());
}

#[test]
fn shared_traces_give_the_readme_figures() {
    let Some(dir) = traces_dir() else { return };
    for expected in &EXPECTED {
        let path = dir.join(expected.file);
        let started = Instant::now();
        let snapshot = replay::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let loaded = started.elapsed();
        let workload = Workload::reconstruct(&snapshot, TieRule::default());
        let reconstructed = started.elapsed() - loaded;
        assert_eq!(snapshot.event_count(), expected.events, "{}", expected.file);
        assert!(workload.settings_recorded || expected.file == "eor_nn.pickle");
        assert_eq!(workload.devices.len(), 1);
        let w = &workload.devices[0];
        let f = &w.figures;
        eprintln!(
            "{}: {f}; {} ops; load {loaded:?}, reconstruct {reconstructed:?}; {:?}",
            expected.file,
            w.ops.len(),
            w.diagnostics
        );
        assert_eq!(
            f.live_at_start_blocks, expected.live_blocks,
            "{}",
            expected.file
        );
        assert_eq!(w.start_allocations.len(), expected.live_blocks);
        assert_eq!(gib(f.live_at_start_requested), expected.live_gib);
        assert_eq!(gib(f.reserved_at_start), expected.reserved_at_start_gib);
        assert_eq!(gib(f.peak_requested), expected.peak_requested_gib);
        assert_eq!(gib(f.peak_reserved), expected.peak_reserved_gib);
        assert_eq!(
            format!("{:.1}", 100.0 * f.utilization()),
            expected.utilization_percent
        );
        assert_eq!(f.segment_allocs, expected.segment_allocs);
        assert_eq!(w.segment_decisions.len(), expected.segment_allocs);
        assert_eq!((f.ooms, f.empty_caches, f.segment_frees), (0, 0, 0));
        // Replaying the trace from the reconstructed start lands exactly on the end state.
        assert!(
            w.diagnostics.is_consistent(f),
            "{}: {:?}",
            expected.file,
            w.diagnostics
        );
        assert_eq!(w.diagnostics.deferred_frees, 0);
        assert_ops_well_formed(w);
        // Start allocations sit inside their segments.
        for a in &w.start_allocations {
            let s = &w.start_segments[a.segment.expect("inside a start segment")];
            assert!(a.offset + a.size <= s.size, "{a:?} overflows {s:?}");
        }
        // PyTorch's segment sizes follow its own rule for the request each was made for.
        let config = workload.config.clone();
        for d in &w.segment_decisions {
            let op = d.serves_op.expect("every segment served an alloc");
            let Op::Alloc { size, .. } = w.ops[op] else {
                panic!("decision points at {:?}", w.ops[op])
            };
            let rounded = policy::round_size(size as usize, &config);
            assert_eq!(
                d.size,
                policy::allocation_size(rounded, &config) as u64,
                "{d:?}"
            );
            assert_eq!(d.pool, policy::pool_for(rounded));
        }
    }
}

#[test]
fn older_blocks_freed_in_the_trace_get_sizes_by_the_rules() {
    let Some(dir) = traces_dir() else { return };
    let snapshot = replay::load(&dir.join("bcrafton_0c0e8a7.pickle")).unwrap();
    let w = &Workload::reconstruct(&snapshot, TieRule::default()).devices[0];
    let from_trace: Vec<_> = w
        .start_allocations
        .iter()
        .filter(|a| a.size_source != BlockSizeSource::EndState)
        .collect();
    // README: 222 frees of blocks allocated before recording.
    assert_eq!(from_trace.len(), 222);
    let d = &w.diagnostics;
    assert_eq!(d.inferred_block_sizes + d.estimated_block_sizes, 222);
    eprintln!(
        "bcrafton: {} older block sizes inferred, {} estimated",
        d.inferred_block_sizes, d.estimated_block_sizes
    );
    let config = Config::default();
    for a in from_trace {
        let rounded = policy::round_size(a.requested_size as usize, &config) as u64;
        assert!(a.size >= rounded && a.size <= rounded + MIB, "{a:?}");
    }
    // No two start allocations overlap.
    for pair in w.start_allocations.windows(2) {
        assert!(
            pair[0].address + pair[0].size <= pair[1].address,
            "{pair:?}"
        );
    }
}

/// A small protocol-4 pickle writer for tests: dicts, lists, strings (memoized, as Python does),
/// ints, floats, bools, None.
fn to_pickle(value: &Value) -> Vec<u8> {
    struct Writer {
        out: Vec<u8>,
        strings: std::collections::HashMap<String, u32>,
        memo_len: u32,
    }
    impl Writer {
        fn memoize(&mut self) -> u32 {
            self.out.push(0x94);
            self.memo_len += 1;
            self.memo_len - 1
        }
        fn value(&mut self, value: &Value) {
            match value {
                Value::Null => self.out.push(b'N'),
                Value::Bool(true) => self.out.push(0x88),
                Value::Bool(false) => self.out.push(0x89),
                Value::Number(n) => {
                    if let Some(i) = n.as_i64() {
                        if (0..256).contains(&i) {
                            self.out.extend([b'K', i as u8]);
                        } else if i32::try_from(i).is_ok() {
                            self.out.push(b'J');
                            self.out.extend((i as i32).to_le_bytes());
                        } else {
                            self.out.extend([0x8a, 8]);
                            self.out.extend(i.to_le_bytes());
                        }
                    } else {
                        self.out.push(b'G');
                        self.out.extend(n.as_f64().unwrap().to_be_bytes());
                    }
                }
                Value::String(s) => {
                    if let Some(&key) = self.strings.get(s) {
                        self.out.push(b'j');
                        self.out.extend(key.to_le_bytes());
                        return;
                    }
                    self.out.push(b'X');
                    self.out.extend((s.len() as u32).to_le_bytes());
                    self.out.extend(s.as_bytes());
                    let key = self.memoize();
                    self.strings.insert(s.clone(), key);
                }
                Value::Array(items) => {
                    self.out.push(b']');
                    self.memoize();
                    if !items.is_empty() {
                        self.out.push(b'(');
                        items.iter().for_each(|v| self.value(v));
                        self.out.push(b'e');
                    }
                }
                Value::Object(map) => {
                    self.out.push(b'}');
                    self.memoize();
                    if !map.is_empty() {
                        self.out.push(b'(');
                        for (k, v) in map {
                            self.value(&Value::String(k.clone()));
                            self.value(v);
                        }
                        self.out.push(b'u');
                    }
                }
            }
        }
    }
    let mut w = Writer {
        out: vec![0x80, 4],
        strings: Default::default(),
        memo_len: 0,
    };
    w.value(value);
    w.out.push(b'.');
    w.out
}

const S1: u64 = 0x7f00_0000_0000;
const S2: u64 = 0x7f00_0200_0000;
const S3: u64 = 0x7f00_0400_0000;

/// A snapshot with one older block still live, one freed in the trace, a segment made in the
/// trace and an `empty_cache()` at the end.
fn small_snapshot() -> Value {
    let frame = json!({"name": "f", "filename": "x.py", "line": 3});
    let block = |address: u64, size: u64, requested: u64, state: &str| {
        json!({"address": address, "size": size, "requested_size": requested, "state": state,
               "frames": [frame.clone()]})
    };
    let event = |action: &str, addr: u64, size: u64, t: u64| {
        json!({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
               "frames": [frame.clone(), frame.clone()]})
    };
    json!({
        "segments": [
            {"device": 0, "address": S1, "total_size": 20 * MIB, "stream": 0,
             "segment_type": "large", "is_expandable": false, "segment_pool_id": [0, 0],
             "blocks": [
                block(S1, 4 * MIB, 4_000_000, "active_allocated"),
                block(S1 + 4 * MIB, 3 * MIB, 3 * MIB, "active_allocated"),
                block(S1 + 7 * MIB, 13 * MIB, 0, "inactive"),
             ]},
            {"device": 0, "address": S2, "total_size": 2 * MIB, "stream": 0,
             "segment_type": "small", "is_expandable": false, "segment_pool_id": [0, 0],
             "blocks": [
                block(S2, 512, 100, "active_allocated"),
                block(S2 + 512, 2 * MIB - 512, 0, "inactive"),
             ]},
        ],
        "device_traces": [[
            event("segment_alloc", S2, 2 * MIB, 1),
            event("alloc", S2, 100, 2),
            event("free_requested", S1 + 4 * MIB, 2_621_440, 3),
            event("free_completed", S1 + 4 * MIB, 2_621_440, 4),
            event("alloc", S1 + 4 * MIB, 3 * MIB, 5),
            event("segment_free", S3, 2 * MIB, 6),
        ]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "expandable_segments": false,
                               "garbage_collection_threshold": 0.0},
    })
}

fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocache-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn assert_one_line_naming(err: &ReplayError, file: &str) {
    let text = err.to_string();
    assert!(!text.contains('\n') && !text.contains('\r'), "{text:?}");
    assert!(text.starts_with(file), "{text:?} does not name {file}");
    assert!(text.len() > file.len() + 5, "{text:?} says nothing");
}

#[test]
fn small_snapshot_reconstructs_from_pickle_and_json_alike() {
    let value = small_snapshot();
    let from_pickle = replay::parse_snapshot(&to_pickle(&value), "small.pickle").unwrap();
    let json_text = format!("  \n{}", serde_json::to_string(&value).unwrap());
    let from_json = replay::parse_snapshot(json_text.as_bytes(), "small.json").unwrap();
    assert_eq!(from_pickle, from_json);
    let path = write_temp("small.json", json_text.as_bytes());
    assert_eq!(replay::load(&path).unwrap(), from_json);

    let w = &Workload::reconstruct(&from_pickle, TieRule::default()).devices[0];
    let f = &w.figures;
    assert_eq!(f.live_at_start_blocks, 2);
    assert_eq!(f.live_at_start_requested, 4_000_000 + 2_621_440);
    assert_eq!(f.reserved_at_start, 22 * MIB);
    assert_eq!(f.peak_reserved, 24 * MIB);
    assert_eq!(f.peak_requested, 4_000_000 + 100 + 3 * MIB);
    assert_eq!(f.empty_caches, 1);
    assert_eq!(w.start_segments.len(), 2);
    assert_eq!(w.start_segments[1].address, S3);
    assert_eq!(w.start_segments[1].pool, policy::PoolKind::Small);
    let older = &w.start_allocations[1];
    assert_eq!((older.offset, older.size), (4 * MIB, 2_621_440));
    assert_eq!(older.size_source, BlockSizeSource::Estimated);
    assert_eq!(
        w.ops,
        vec![
            Op::Alloc {
                id: 2,
                size: 100,
                stream: 0
            },
            Op::Free { id: 1 },
            Op::Alloc {
                id: 3,
                size: 3 * MIB,
                stream: 0
            },
            Op::EmptyCache,
        ]
    );
    assert_eq!(w.segment_decisions.len(), 1);
    assert_eq!(w.segment_decisions[0].serves_op, Some(0));
    assert_eq!(w.segment_decisions[0].pool, policy::PoolKind::Small);
    assert!(w.diagnostics.is_consistent(f), "{:?}", w.diagnostics);
    assert_ops_well_formed(w);
}

#[test]
fn classes_are_refused_by_name() {
    // pickle.dumps(collections.OrderedDict(), protocol=4)
    let ordered_dict = b"\x80\x04\x95\"\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94.";
    let err = replay::parse_snapshot(ordered_dict, "od.pickle").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Refused);
    assert_one_line_naming(&err, "od.pickle");
    assert!(err.detail.contains("STACK_GLOBAL") && err.detail.contains("collections.OrderedDict"));

    // A snapshot dict whose value is built by a GLOBAL + REDUCE: refused before it is called.
    let evil = b"\x80\x02}(X\x08\x00\x00\x00segmentscos\nsystem\nX\x04\x00\x00\x00echo\x85Ru.";
    let err = replay::parse_snapshot(evil, "evil.pickle").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Refused);
    assert!(err.detail.contains("GLOBAL") && err.detail.contains("os.system"));
    assert_one_line_naming(&err, "evil.pickle");

    for (code, name) in [
        (b'R', "REDUCE"),
        (b'b', "BUILD"),
        (0x81, "NEWOBJ"),
        (b'Q', "BINPERSID"),
    ] {
        let bytes = [0x80, 4, b'N', b'N', code, b'.'];
        let err = replay::parse_snapshot(&bytes, "op.pickle").unwrap_err();
        assert_eq!(err.kind, ReplayErrorKind::Refused, "{name}");
        assert!(err.detail.contains(name), "{err}");
    }
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = to_pickle(&small_snapshot());
    for len in 0..bytes.len() {
        let err = replay::parse_snapshot(&bytes[..len], "cut.pickle").unwrap_err();
        assert_one_line_naming(&err, "cut.pickle");
        if len > 0 {
            assert_eq!(err.kind, ReplayErrorKind::Truncated, "prefix {len}: {err}");
        }
    }
    let json_text = serde_json::to_string(&small_snapshot()).unwrap();
    for len in 1..json_text.len() {
        let err = replay::parse_snapshot(&json_text.as_bytes()[..len], "cut.json").unwrap_err();
        assert_one_line_naming(&err, "cut.json");
    }
}

#[test]
fn huge_length_fields_do_not_allocate() {
    let cases: [&[u8]; 5] = [
        b"\x80\x04X\xff\xff\xff\xff",                      // BINUNICODE 4 GiB
        b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff",   // BINUNICODE8
        b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\x7fab", // BINBYTES8
        b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff}\x94.", // FRAME
        b"\x80\x04\x8b\xff\xff\xff\x7f\x00",               // LONG4
    ];
    for bytes in cases {
        let err = replay::parse_snapshot(bytes, "huge.pickle").unwrap_err();
        assert_eq!(err.kind, ReplayErrorKind::Truncated, "{err}");
        assert_one_line_naming(&err, "huge.pickle");
    }
    // A 200-byte LONG1 integer is refused, not misread.
    let mut long = vec![0x80, 4, 0x8a, 200];
    long.extend([1u8; 200]);
    long.push(b'.');
    let err = replay::parse_snapshot(&long, "long.pickle").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Malformed);
}

#[test]
fn shared_references_cannot_multiply_the_work() {
    // One event dict, a list that refers to it 1,000 times, and device_traces that refer to that
    // list 1,000 times: a million events from a few kilobytes.
    let mut bytes = vec![0x80, 4, b'}', 0x94, b'('];
    bytes.extend(b"X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces]\x94(");
    // memo 0: the root dict; memo 1: device_traces list. Event dict -> memo 2.
    bytes.extend(b"]\x94(}\x94(X\x06\x00\x00\x00actionX\x05\x00\x00\x00allocX\x04\x00\x00\x00addrK\x01X\x04\x00\x00\x00sizeK\x02u");
    for _ in 0..999 {
        bytes.extend(b"h\x03");
    }
    bytes.push(b'e');
    for _ in 0..999 {
        bytes.extend(b"h\x02");
    }
    bytes.extend(b"eu.");
    let value = replay::pickle::parse(&bytes).unwrap();
    let traces = value.get("device_traces").unwrap().as_seq().unwrap();
    assert_eq!(traces.len(), 1000);
    assert_eq!(traces[0].as_seq().unwrap().len(), 1000);
    let err = replay::parse_snapshot(&bytes, "shared.pickle").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::NotSnapshot);
    assert!(err.detail.contains("more entries"), "{err}");
}

#[test]
fn empty_traces_are_an_error() {
    let empty = json!({"segments": [], "device_traces": [[], []]});
    for (bytes, file) in [
        (to_pickle(&empty), "empty.pickle"),
        (serde_json::to_vec(&empty).unwrap(), "empty.json"),
    ] {
        let err = replay::parse_snapshot(&bytes, file).unwrap_err();
        assert_eq!(err.kind, ReplayErrorKind::NoTraceEvents);
        assert_one_line_naming(&err, file);
    }
}

#[test]
fn data_that_is_no_snapshot_is_named_as_such() {
    let mut no_traces = small_snapshot();
    no_traces.as_object_mut().unwrap().remove("device_traces");
    let mut bad_size = small_snapshot();
    bad_size["device_traces"][0][1]["size"] = json!("big");
    let mut bad_state = small_snapshot();
    bad_state["segments"][0]["blocks"][0]["state"] = json!("weird\nstate");
    let cases = [
        (json!([1, 2]), "top level"),
        (json!({"device_traces": [[]]}), "segments"),
        (no_traces, "device_traces"),
        (json!({"segments": 5, "device_traces": []}), "segments"),
        (bad_size, "device_traces[0][1].size"),
        (bad_state, "state"),
    ];
    for (value, mentions) in cases {
        for (bytes, file) in [
            (to_pickle(&value), "x.pickle"),
            (serde_json::to_vec(&value).unwrap(), "x.json"),
        ] {
            let result = replay::parse_snapshot(&bytes, file);
            let err = match result {
                Err(err) => err,
                // A JSON top-level array is not JSON here (the first byte is not `{`).
                Ok(_) => panic!("{value} was accepted"),
            };
            assert_one_line_naming(&err, file);
            if file.ends_with(".pickle") || value.is_object() {
                assert_eq!(err.kind, ReplayErrorKind::NotSnapshot, "{err}");
                assert!(
                    err.detail.contains(mentions),
                    "{err} should mention {mentions}"
                );
            }
        }
    }
    let err = replay::load(Path::new("/nonexistent/snap.pickle")).unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Io);
    assert_one_line_naming(&err, "/nonexistent/snap.pickle");
    let err = replay::parse_snapshot(b"{\"segments\": [}", "bad.json").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Malformed);
    let err = replay::parse_snapshot(b"GIF89a", "img.gif").unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::NotPickleOrJson);
    assert_one_line_naming(&err, "img.gif");
}

/// xorshift64*: deterministic noise without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Reads and, where that works, reconstructs; says whether it got that far.
fn read_anything(bytes: &[u8], file: &str) -> bool {
    match replay::parse_snapshot(bytes, file) {
        Ok(snapshot) => {
            // Whatever parses must also reconstruct without panicking.
            let _ = Workload::reconstruct(&snapshot, TieRule::default());
            true
        }
        Err(err) => {
            assert_one_line_naming(&err, file);
            false
        }
    }
}

#[test]
fn random_bytes_never_panic() {
    for seed in properties::numbered_seeds(2_000) {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let len = rng.below(600) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Half of them look like a pickle, so that the parser gets past the first byte.
        if seed % 2 == 0 && bytes.len() >= 2 {
            bytes[0] = 0x80;
            bytes[1] = 4;
        }
        read_anything(&bytes, "random.pickle");
    }
}

#[test]
fn mutated_snapshots_never_panic() {
    let pickle = to_pickle(&small_snapshot());
    let json_text = serde_json::to_vec(&small_snapshot()).unwrap();
    let mut reconstructed = 0;
    let mut cases = 0;
    for seed in properties::numbered_seeds(3_000) {
        cases += 1;
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut bytes = if seed % 3 == 0 {
            json_text.clone()
        } else {
            pickle.clone()
        };
        for _ in 0..1 + rng.below(6) {
            let at = rng.below(bytes.len() as u64) as usize;
            match rng.below(3) {
                0 => bytes[at] = rng.next() as u8,
                1 => {
                    bytes.remove(at);
                }
                _ => bytes.insert(at, rng.next() as u8),
            }
        }
        if read_anything(&bytes, "mutated") {
            reconstructed += 1;
        }
    }
    eprintln!("{reconstructed} of {cases} mutated snapshots still read");
    // One in 60 or more (50 of CI's 3000); too few cases say nothing.
    assert!(
        cases < 1000 || reconstructed * 60 > cases,
        "the mutations should leave some snapshots readable"
    );
}

#[test]
fn random_traces_reconstruct_without_panicking() {
    let actions = [
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
        "user_defined",
        "mystery",
    ];
    let mut reconstructed = 0;
    let mut cases = 0;
    for seed in properties::numbered_seeds(300) {
        cases += 1;
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let pick = |rng: &mut Rng| {
            [0u64, 512, MIB, 20 * MIB, u64::MAX / 2, u64::MAX][rng.below(6) as usize]
        };
        let events: Vec<Value> = (0..rng.below(60))
            .map(|_| {
                json!({"action": actions[rng.below(actions.len() as u64) as usize],
                       "addr": rng.below(8) * MIB + pick(&mut rng) % 3,
                       "size": pick(&mut rng), "stream": rng.below(2)})
            })
            .collect();
        let blocks: Vec<Value> = (0..rng.below(5))
            .map(|i| {
                let state = ["active_allocated", "active_pending_free", "inactive"];
                json!({"address": i * MIB, "size": pick(&mut rng), "requested_size": pick(&mut rng),
                       "state": state[rng.below(3) as usize]})
            })
            .collect();
        let snapshot = json!({
            "segments": [{"device": rng.below(3), "address": 0, "total_size": pick(&mut rng),
                          "stream": 0, "segment_type": "large", "is_expandable": rng.below(2) == 1,
                          "blocks": blocks}],
            "device_traces": [events.clone(), events],
            "allocator_settings": {"max_split_size": pick(&mut rng),
                                   "expandable_segments": rng.below(2) == 1},
        });
        let from_json = read_anything(&serde_json::to_vec(&snapshot).unwrap(), "random.json");
        let from_pickle = read_anything(&to_pickle(&snapshot), "random.pickle");
        reconstructed += usize::from(from_json) + usize::from(from_pickle);
    }
    eprintln!(
        "{reconstructed} of {} random traces reconstructed",
        2 * cases
    );
    // One in six or more (100 of CI's 600); too few cases say nothing.
    assert!(
        cases < 100 || reconstructed * 6 > 2 * cases,
        "many random traces should be readable"
    );
}

/// A committed calibration recording (tests/data/calibration).
fn calibration_snapshot(name: &str) -> replay::Snapshot {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/calibration")
        .join(name);
    replay::load(&path).expect("the committed recording loads")
}

/// The self-check of every device of a snapshot, under PyTorch's defaults.
fn self_checks(snapshot: &replay::Snapshot) -> Vec<(usize, replay::faithful::Reproduction)> {
    Workload::reconstruct(snapshot, TieRule::default())
        .devices
        .iter()
        .map(|d| {
            let check =
                replay::faithful::self_check(d, &Config::default(), replay::DEFAULT_CAPACITY);
            (d.device, check)
        })
        .collect()
}

#[test]
fn several_device_traces_with_one_filled_replay_that_device() {
    let snapshot = calibration_snapshot("calibration_two_devices.pickle");
    assert_eq!(snapshot.device_traces.len(), 2);
    assert!(snapshot.device_traces[0].is_empty());
    let workload = Workload::reconstruct(&snapshot, TieRule::default());
    // Device 0 holds a segment made before recording, and nothing happened on it.
    assert_eq!(workload.idle_devices, vec![0]);
    assert_eq!(workload.devices.len(), 1);
    assert_eq!(workload.devices[0].device, 1);
    let checks = self_checks(&snapshot);
    assert!(checks[0].1.reproduced(), "{}", checks[0].1.describe());
    assert!(checks[0].1.segment_allocs > 10);
    // Segments that do not name their device belong to the one traced device.
    let older = written_back(&snapshot, true, false, None);
    let older = replay::parse_snapshot(&older, "older.json").unwrap();
    assert!(older.segments.iter().all(|s| s.device == 1));
    let workload = Workload::reconstruct(&older, TieRule::default());
    assert!(workload.idle_devices.is_empty());
    assert_eq!(
        self_checks(&older)[0].1.segment_allocs,
        checks[0].1.segment_allocs
    );
}

#[test]
fn recordings_without_time_us_replay_alike() {
    let snapshot = calibration_snapshot("calibration.pickle");
    let with_time =
        replay::parse_snapshot(&written_back(&snapshot, true, true, None), "t.json").unwrap();
    let without =
        replay::parse_snapshot(&written_back(&snapshot, false, true, None), "n.json").unwrap();
    assert!(without.device_traces[0].iter().all(|e| e.time_us == 0));
    assert!(with_time.device_traces[0].iter().any(|e| e.time_us != 0));
    let (a, b) = (self_checks(&with_time), self_checks(&without));
    assert!(b[0].1.reproduced(), "{}", b[0].1.describe());
    assert_eq!(a, b);
    let (a, b) = (
        Workload::reconstruct(&with_time, TieRule::default()),
        Workload::reconstruct(&without, TieRule::default()),
    );
    assert_eq!(a.devices[0].ops, b.devices[0].ops);
    assert_eq!(a.devices[0].start_order, b.devices[0].start_order);
}
