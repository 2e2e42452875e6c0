//! A snapshot file as `ferrocache replay` reads it: any bytes, pickle or JSON. A snapshot that is
//! read is then reconstructed into a workload, as the replay does next; the restricted unpickler
//! is also asked for its owned tree ([`ferrocache::replay::pickle::parse`]).
//! Properties: no panic, no hang, no stack overflow, memory within the bound.
#![no_main]

use ferrocache::policy::TieRule;
use ferrocache::replay::{Workload, parse_snapshot, pickle};
use ferrocache_fuzz::{CountingAllocator, within_memory_bound};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fuzz_target!(|data: &[u8]| {
    within_memory_bound(data.len(), || {
        if let Ok(snapshot) = parse_snapshot(data, "fuzz-input") {
            let _ = Workload::reconstruct(&snapshot, TieRule::default());
        }
    });
    within_memory_bound(data.len(), || {
        let _ = pickle::parse(data);
    });
});
