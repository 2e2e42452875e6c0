//! The two parsers of outside input — `PYTORCH_CUDA_ALLOC_CONF` and the snapshot reader — hold
//! to the fuzzers' properties on the checked-in seeds, on every input the fuzzers ever found
//! (fuzz/regressions), and on large hostile inputs a fuzzer's short inputs cannot reach: no
//! panic, no runaway work, no deep recursion, and memory within a small multiple of the input
//! ([`harness::memory_bound`], the same bound the fuzz targets check).

#[path = "../fuzz/src/lib.rs"]
mod harness;

use ferrocache::config::{Config, LogLevel};
use ferrocache::policy::TieRule;
use ferrocache::replay::{self, ReplayErrorKind, Workload, pickle};
use harness::{CountingAllocator, within_memory_bound};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// The allocation counters are process-wide: each test holds this for its whole body, so that
/// nothing another test allocates meanwhile is counted against a measured parse.
static ONE_TEST_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_test_at_a_time() -> MutexGuard<'static, ()> {
    ONE_TEST_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn check_config(data: &[u8]) {
    let text = String::from_utf8_lossy(data).into_owned();
    within_memory_bound(data.len(), || {
        if let Ok(config) = Config::parse(&text) {
            let _ = config.describe();
            let _ = config.to_pytorch_settings();
        }
        let _ = LogLevel::parse(&text);
    });
}

/// Reads `data` as `ferrocache replay` does (and as the unpickler's owned tree); the result of
/// the snapshot reader.
fn check_snapshot(data: &[u8]) -> Result<(), replay::ReplayError> {
    let result = within_memory_bound(data.len(), || {
        replay::parse_snapshot(data, "input").map(|snapshot| {
            let _ = Workload::reconstruct(&snapshot, TieRule::default());
        })
    });
    within_memory_bound(data.len(), || {
        let _ = pickle::parse(data);
    });
    result
}

/// The files of `fuzz/<dir>/<target>`.
fn inputs(dir: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(dir)
        .join(target);
    let Ok(entries) = std::fs::read_dir(&path) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("readable input");
            (p.display().to_string(), bytes)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn config_seeds_and_regressions_hold_the_bounds() {
    let _serial = one_test_at_a_time();
    let seeds = inputs("corpus", "config");
    assert!(seeds.len() >= 30, "the config seeds are missing");
    for (_, bytes) in seeds.iter().chain(&inputs("regressions", "config")) {
        check_config(bytes);
    }
}

#[test]
fn snapshot_seeds_and_regressions_hold_the_bounds() {
    let _serial = one_test_at_a_time();
    let seeds = inputs("corpus", "snapshot");
    assert!(seeds.len() >= 8, "the snapshot seeds are missing");
    let mut read = 0;
    for (name, bytes) in seeds.iter().chain(&inputs("regressions", "snapshot")) {
        if check_snapshot(bytes).is_ok() {
            read += 1;
        } else {
            assert!(
                !name.contains("/slice_"),
                "the seed {name} is a slice of a real snapshot and must read"
            );
        }
    }
    // Without ../shared/traces only the hand-made (hostile) seeds exist.
    if seeds.iter().any(|(name, _)| name.contains("/slice_")) {
        assert!(read >= 6, "only {read} seeds read as snapshots");
    }
}

/// One 1 MiB input of each shape that costs the most per byte.
#[test]
fn large_hostile_inputs_stay_within_the_bound() {
    let _serial = one_test_at_a_time();
    const LEN: usize = 1 << 20;
    // Config: every byte a token of its own, and a key repeated with ever new trailing text.
    check_config(&b":".repeat(LEN));
    check_config(&b"[,".repeat(LEN / 2));
    let mut repeated = String::new();
    let mut i = 0u64;
    while repeated.len() < LEN {
        repeated.push_str(&format!("max_split_size_mb:40x{i},"));
        i += 1;
    }
    check_config(repeated.as_bytes());

    // Pickle: one empty list per byte, a memoized value pushed 2 bytes at a time, MARKs.
    let mut lists = b"\x80\x04".to_vec();
    lists.extend(std::iter::repeat_n(b']', LEN));
    assert!(check_snapshot(&lists).is_err());
    let mut gets = b"\x80\x04N\x94".to_vec();
    gets.extend(b"h\x00".repeat(LEN / 2));
    assert!(check_snapshot(&gets).is_err());
    let mut marks = b"\x80\x04".to_vec();
    marks.extend(std::iter::repeat_n(b'(', LEN));
    assert!(check_snapshot(&marks).is_err());
    let mut dups = b"\x80\x04N".to_vec();
    dups.extend(std::iter::repeat_n(b'2', LEN));
    assert!(check_snapshot(&dups).is_err());

    // JSON: an array of a million numbers, and nesting past serde_json's limit.
    let mut numbers = b"{\"segments\":[0".to_vec();
    numbers.extend(b",0".repeat(LEN / 2));
    numbers.extend(b"],\"device_traces\":[]}");
    assert!(check_snapshot(&numbers).is_err());
    let mut nested = b"{\"segments\":".to_vec();
    nested.extend(std::iter::repeat_n(b'[', LEN));
    let err = check_snapshot(&nested).unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::Malformed, "{err}");
}

/// One trace event with many keys, referred to from the trace many times: each reference makes
/// the reader walk all the keys again, so the work must be counted by keys, not by events.
#[test]
fn an_event_with_many_keys_referred_to_many_times_is_refused() {
    let _serial = one_test_at_a_time();
    const KEYS: usize = 60_000;
    const REFERENCES: usize = 100_000;
    let mut bytes = b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]](".to_vec();
    // The event (memo 0): {"action": "snapshot", "x": None, "x": None, ...}; "x" is memo 1.
    bytes.extend(b"}\x94(\x8c\x06action\x8c\x08snapshot\x8c\x01x\x94N");
    for _ in 1..KEYS {
        bytes.extend(b"h\x01N");
    }
    bytes.push(b'u');
    for _ in 0..REFERENCES {
        bytes.extend(b"h\x00");
    }
    bytes.extend(b"eau.");
    let err = check_snapshot(&bytes).unwrap_err();
    assert_eq!(err.kind, ReplayErrorKind::NotSnapshot, "{err}");
    assert!(err.detail.contains("more entries"), "{err}");
}

/// Nested lists shared through the memo: each level is shallow, but a level holds the previous
/// one, so the owned tree would nest 200 levels deeper per level (and overflow the stack when
/// dropped). The depth limit counts what a shared value brings along.
#[test]
fn shared_values_cannot_nest_past_the_depth_limit() {
    let _serial = one_test_at_a_time();
    const LEVELS: usize = 400;
    const CHAIN: usize = 200;
    let mut bytes = b"\x80\x04](".to_vec();
    for level in 0..LEVELS {
        bytes.extend(std::iter::repeat_n(b']', CHAIN));
        if level > 0 {
            // The previous level, by its memo key.
            bytes.push(b'j');
            bytes.extend(u32::try_from(level - 1).unwrap().to_le_bytes());
            bytes.push(b'a');
        }
        bytes.extend(std::iter::repeat_n(b'a', CHAIN - 1));
        bytes.push(0x94); // MEMOIZE: this level is memo `level`
    }
    bytes.extend(b"e.");
    let err = within_memory_bound(bytes.len(), || pickle::parse(&bytes)).unwrap_err();
    assert_eq!(err.kind, pickle::PickleErrorKind::TooDeep, "{err}");
}

/// A list that holds itself many times (found by the fuzzer, as a 1,274-byte input that
/// allocated 1.2 MB): converting it reserved room for all its items at every level down to the
/// depth limit, 256 times the list. A value that holds itself is refused at once now.
#[test]
fn a_list_holding_itself_many_times_is_refused_at_once() {
    let _serial = one_test_at_a_time();
    const REFERENCES: usize = 100_000;
    let mut bytes = b"\x80\x04]\x94(".to_vec();
    bytes.extend(b"h\x00".repeat(REFERENCES));
    bytes.extend(b"e.");
    let err = within_memory_bound(bytes.len(), || pickle::parse(&bytes)).unwrap_err();
    assert_eq!(err.kind, pickle::PickleErrorKind::TooDeep, "{err}");
    // The same as a snapshot's segments list: the reader never expands it.
    let mut snapshot = b"\x80\x04}(\x8c\x08segments]\x94(".to_vec();
    snapshot.extend(b"h\x00".repeat(REFERENCES));
    snapshot.extend(b"e\x8c\x0ddevice_traces]u.");
    assert!(check_snapshot(&snapshot).is_err());
}
