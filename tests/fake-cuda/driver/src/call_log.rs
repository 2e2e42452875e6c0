//! An optional log of the memory calls, one line each, for comparing two allocators that ran
//! the same program (`FAKE_CUDA_CALL_LOG=path` appends to `path`; unset, nothing is written).
//!
//! Absolute addresses can differ from process to process (`address_space.rs`), so none is
//! written: an allocation is named by its offset in its device's arena (`+0x...`, the same in
//! every process that made the same calls), an expandable range by its ordinal (`r0`, `r1`, ...
//! in reservation order) and its offset in the arena of reservations, a mapping by its offset in
//! its range. Lines: `cuMemAlloc_v2 SIZE ok +OFFSET` or `cuMemAlloc_v2 SIZE oom`,
//! `cuMemFree_v2 SIZE +OFFSET`, `cuMemAddressReserve rN SIZE +OFFSET`,
//! `cuMemAddressFree rN SIZE`, `cuMemCreate SIZE ok|oom`, `cuMemMap rN OFFSET SIZE`,
//! `cuMemUnmap rN OFFSET SIZE`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::sync::{LazyLock, Mutex};

struct CallLog {
    file: File,
    /// Start address of each live reservation -> its ordinal.
    ranges: BTreeMap<u64, u64>,
    next_range: u64,
}

static LOG: LazyLock<Option<Mutex<CallLog>>> = LazyLock::new(|| {
    let path = std::env::var_os("FAKE_CUDA_CALL_LOG")?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .ok()?;
    Some(Mutex::new(CallLog {
        file,
        ranges: BTreeMap::new(),
        next_range: 0,
    }))
});

fn with_log(body: impl FnOnce(&mut CallLog) -> Option<String>) {
    let Some(log) = LOG.as_ref() else {
        return;
    };
    let mut log = log.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(line) = body(&mut log) {
        // Written at once (no buffer), so a reader sees each line as soon as the call returns.
        let _ = writeln!(log.file, "{line}");
    }
}

fn outcome(ok: bool) -> &'static str {
    if ok { "ok" } else { "oom" }
}

/// A `cuMemAlloc_v2` of `size` bytes placed at `offset` in its device's arena, or that ran out
/// of memory (None).
pub fn alloc(size: u64, offset: Option<u64>) {
    with_log(|_| {
        Some(match offset {
            Some(offset) => format!("cuMemAlloc_v2 {size} ok +{offset:#x}"),
            None => format!("cuMemAlloc_v2 {size} oom"),
        })
    });
}

pub fn free(size: u64, offset: u64) {
    with_log(|_| Some(format!("cuMemFree_v2 {size} +{offset:#x}")));
}

pub fn create(size: u64, ok: bool) {
    with_log(|_| Some(format!("cuMemCreate {size} {}", outcome(ok))));
}

/// A range of `size` bytes reserved at `start`, `offset` into the arena of reservations.
pub fn reserve(start: u64, size: u64, offset: u64) {
    with_log(|log| {
        let ordinal = log.next_range;
        log.next_range += 1;
        log.ranges.insert(start, ordinal);
        Some(format!(
            "cuMemAddressReserve r{ordinal} {size} +{offset:#x}"
        ))
    });
}

pub fn address_free(start: u64, size: u64) {
    with_log(|log| {
        let ordinal = log.ranges.remove(&start)?;
        Some(format!("cuMemAddressFree r{ordinal} {size}"))
    });
}

/// `cuMemMap` (`map`) or `cuMemUnmap` of `size` bytes at `ptr`, inside the range at `start`.
pub fn mapping(map: bool, start: u64, ptr: u64, size: u64) {
    with_log(|log| {
        let ordinal = *log.ranges.get(&start)?;
        let name = if map { "cuMemMap" } else { "cuMemUnmap" };
        Some(format!("{name} r{ordinal} {} {size}", ptr - start))
    });
}
