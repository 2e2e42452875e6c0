//! The caching allocator on the simulated GPU: PyTorch's decisions, case by case.

use ferrocache::allocator::history::TraceAction;
use ferrocache::allocator::{AllocError, DeviceAllocator, ImportedBlock, PointerError};
use ferrocache::config::Config;
use ferrocache::device::sim::{SimDevice, SimOp};
use ferrocache::device::{Device, DeviceError, ProcessMemory};
use ferrocache::policy::PoolKind;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn allocator(capacity: usize) -> DeviceAllocator<SimDevice> {
    DeviceAllocator::new(SimDevice::new(capacity), 0, Config::default())
}

fn with_config(capacity: usize, config: Config) -> DeviceAllocator<SimDevice> {
    DeviceAllocator::new(SimDevice::new(capacity), 0, config)
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
}

#[test]
fn small_requests_share_a_2_mib_segment() {
    let mut a = allocator(GIB);
    let p1 = a.malloc(1, 0).unwrap();
    let p2 = a.malloc(1000, 0).unwrap();
    assert_eq!(p2, p1 + 512, "best fit carves the segment from the front");
    let s = a.stats();
    assert_eq!(s.segment.small_pool.current, 1);
    assert_eq!(s.reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(s.allocated_bytes.small_pool.current, 512 + 1024);
    assert_eq!(s.requested_bytes.all.current, 1001);
    assert_eq!(s.inactive_split.small_pool.current, 1);
    assert_eq!(
        s.inactive_split_bytes.small_pool.current,
        (2 * MIB - 1536) as i64
    );
    assert_eq!(s.num_splits, 2);
    assert_eq!(a.device().counters().mallocs, 1);
    checked(&a);
}

#[test]
fn medium_requests_share_a_20_mib_segment_and_large_ones_get_their_own() {
    let mut a = allocator(GIB);
    let p = a.malloc(5 * MIB, 0).unwrap();
    assert_eq!(a.stats().reserved_bytes.large_pool.current, 20 * MIB as i64);
    // 15 MiB remain (more than 1 MiB): split and cached.
    assert_eq!(
        a.stats().inactive_split_bytes.large_pool.current,
        15 * MIB as i64
    );
    let q = a.malloc(15 * MIB, 0).unwrap();
    assert_eq!(q, p + 5 * MIB as u64);
    assert_eq!(a.device().counters().mallocs, 1);
    // Rounded to 100_000_256 bytes in a 100_663_296-byte segment: the 663_040 left over are
    // less than 1 MiB, so the block keeps them.
    let big = a.malloc(100_000_000, 0).unwrap();
    assert_eq!(a.device().allocations()[&big], 100_663_296);
    assert_eq!(a.allocation_info(big).unwrap().size, 100_663_296);
    checked(&a);
}

#[test]
fn a_large_block_with_at_most_1_mib_left_is_not_split() {
    let mut a = allocator(GIB);
    let p = a.malloc(19 * MIB + 1, 0).unwrap();
    // Rounded to 19 MiB + 512: the 20 MiB segment's rest (1 MiB - 512) stays with the block.
    assert_eq!(a.allocation_info(p).unwrap().size, 20 * MIB);
    assert_eq!(a.stats().inactive_split.all.current, 0);
    assert_eq!(a.stats().allocated_bytes.all.current, 20 * MIB as i64);
    assert_eq!(a.stats().requested_bytes.all.current, (19 * MIB + 1) as i64);
    checked(&a);
}

#[test]
fn free_merges_with_free_neighbours() {
    let mut a = allocator(GIB);
    let ptrs: Vec<u64> = (0..4).map(|_| a.malloc(MIB / 4, 0).unwrap()).collect();
    // [a b c d rest]: free b, then d (merges with rest), then c (merges both sides).
    a.free(ptrs[1]).unwrap();
    a.free(ptrs[3]).unwrap();
    let merges = a.stats().num_merges;
    assert_eq!(merges, 1);
    a.free(ptrs[2]).unwrap();
    assert_eq!(a.stats().num_merges, 3);
    assert_eq!(a.stats().inactive_split.small_pool.current, 1);
    assert_eq!(
        a.stats().inactive_split_bytes.small_pool.current,
        (7 * MIB / 4) as i64
    );
    a.free(ptrs[0]).unwrap();
    assert_eq!(a.stats().inactive_split.small_pool.current, 0);
    assert_eq!(a.stats().active.all.current, 0);
    checked(&a);
    // The segment is whole again: one block serves 2 MiB of small requests.
    assert_eq!(a.largest_cached_block(), 2 * MIB);
}

#[test]
fn blocks_are_reused_only_on_their_stream() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 1).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, 2).unwrap();
    assert_ne!(
        a.base_allocation(q).unwrap().0,
        a.base_allocation(p).map(|b| b.0).unwrap_or(0)
    );
    assert_eq!(a.stats().segment.all.current, 2);
    let r = a.malloc(4096, 1).unwrap();
    assert_eq!(r, p);
    checked(&a);
}

#[test]
fn unknown_pointers_and_double_frees_change_nothing() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 0).unwrap();
    let before = a.stats().clone();
    assert_eq!(a.free(p + 512), Err(PointerError::Unknown(p + 512)));
    assert_eq!(a.stats(), &before);
    a.free(p).unwrap();
    let after_free = a.stats().clone();
    assert_eq!(a.free(p), Err(PointerError::Unknown(p)));
    assert_eq!(a.record_stream(p, 3), Err(PointerError::Unknown(p)));
    assert_eq!(a.stats(), &after_free);
    checked(&a);
}

#[test]
fn record_stream_delays_reuse_until_the_other_stream_finishes() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 0).unwrap();
    a.record_stream(p, 7).unwrap();
    a.record_stream(p, 0).unwrap(); // its own stream: ignored
    a.free(p).unwrap();
    assert_eq!(
        a.stats().active.all.current,
        1,
        "still active: pending free"
    );
    let q = a.malloc(4096, 0).unwrap();
    assert_ne!(q, p, "not reused while stream 7 may still use it");
    let snapshot = a.segments();
    assert!(
        snapshot[0]
            .blocks
            .iter()
            .any(|b| b.state == "active_pending_free")
    );
    a.device_mut().complete_stream(7);
    a.free(q).unwrap();
    let r = a.malloc(4096, 0).unwrap();
    assert_eq!(r, p, "reused once stream 7 completed");
    assert_eq!(a.device().live_events(), 0, "events are given back");
    checked(&a);
}

fn injected(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 999,
        message: "unknown error".into(),
    }
}

/// A freed block for whose other stream the device would neither record an event nor
/// synchronize stays out of circulation, and its event is recorded by a later call. Found by
/// `device_faults_keep_every_invariant`: the block stayed out for good, and its segment with it.
#[test]
fn a_block_whose_stream_could_not_be_waited_for_is_cached_after_a_retry() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 0).unwrap();
    a.record_stream(p, 7).unwrap();
    a.device_mut()
        .fail_next(SimOp::RecordEvent, 1, injected("cuEventRecord"));
    a.device_mut()
        .fail_next(SimOp::SynchronizeStream, 1, injected("cuStreamSynchronize"));
    a.free(p).unwrap();
    checked(&a);
    // This malloc records the event for stream 7 that could not be recorded at the free.
    let q = a.malloc(4096, 0).unwrap();
    assert_ne!(q, p, "not reused while stream 7 may still use it");
    assert_eq!(a.device().live_events(), 1);
    a.device_mut().complete_stream(7);
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        a.stats().reserved_bytes.all.current,
        0,
        "the segment went back"
    );
    checked(&a);
}

/// Two other streams, an event recorded on the first, neither an event nor a synchronization
/// possible on the second: the first's event completing does not cache the block while the
/// second may still use it (before, it did).
#[test]
fn a_block_is_not_cached_while_a_stream_it_could_not_wait_for_may_still_use_it() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 0).unwrap();
    a.record_stream(p, 7).unwrap();
    a.record_stream(p, 9).unwrap();
    a.device_mut()
        .fail_nth(SimOp::RecordEvent, 2, injected("cuEventRecord"));
    a.device_mut()
        .fail_next(SimOp::SynchronizeStream, 1, injected("cuStreamSynchronize"));
    a.free(p).unwrap();
    a.device_mut().complete_stream(7);
    let q = a.malloc(4096, 0).unwrap();
    assert_ne!(q, p, "not reused while stream 9 may still use it");
    checked(&a);
    a.device_mut().complete_stream(9);
    a.free(q).unwrap();
    let r = a.malloc(4096, 0).unwrap();
    assert_eq!(r, p, "reused once stream 9 completed");
    assert_eq!(a.device().live_events(), 0);
    checked(&a);
}

#[test]
fn empty_cache_waits_for_pending_frees_and_releases_whole_segments() {
    let mut a = allocator(GIB);
    let small = a.malloc(4096, 0).unwrap();
    let keep = a.malloc(30 * MIB, 0).unwrap();
    let pending = a.malloc(50 * MIB, 0).unwrap();
    a.record_stream(pending, 9).unwrap();
    a.free(small).unwrap();
    a.free(pending).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().num_sync_all_streams, 1);
    assert_eq!(a.device().allocations().len(), 1);
    assert!(a.device().allocations().contains_key(&keep));
    assert_eq!(a.stats().num_device_free, 2);
    assert_eq!(a.stats().reserved_bytes.all.current, 30 * MIB as i64);
    checked(&a);
}

#[test]
fn out_of_memory_retries_then_reports_pytorchs_message() {
    let mut a = allocator(100 * MIB);
    let p = a.malloc(60 * MIB, 0).unwrap();
    a.free(p).unwrap();
    // 60 MiB are cached; 70 MiB do not fit beside them: released, then retried.
    let q = a.malloc(70 * MIB, 0).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().num_device_free, 1);
    let message = oom_message(a.malloc(50 * MIB, 0).unwrap_err());
    assert_eq!(a.stats().num_ooms, 1);
    assert_eq!(
        message,
        "CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacity of 100.00 MiB \
         of which 30.00 MiB is free. Of the allocated memory 70.00 MiB is allocated by PyTorch, and \
         0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large \
         try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See \
         documentation for Memory Management  \
         (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    );
    // The allocator is intact: q is still live, and smaller requests succeed.
    assert!(a.allocation_info(q).is_some());
    a.malloc(10 * MIB, 0).unwrap();
    checked(&a);
}

#[test]
fn the_out_of_memory_message_says_what_each_process_on_the_gpu_uses() {
    let mut device = SimDevice::new(100 * MIB);
    let other = ProcessMemory {
        pid: 4242,
        used_bytes: 3 * GIB as u64,
    };
    device.report_processes(vec![other]);
    let mut a = DeviceAllocator::new(device, 0, Config::default());
    let _p = a.malloc(60 * MIB, 0).unwrap();
    let _small = a.malloc(1000, 0).unwrap();
    assert_eq!(
        a.device().counters().process_queries,
        0,
        "asked only to write an out-of-memory message"
    );
    let message = oom_message(a.malloc(50 * MIB, 0).unwrap_err());
    assert_eq!(a.device().counters().process_queries, 1);
    // NVML's order (the other process first here), this process with all it holds on the GPU.
    assert!(
        message.starts_with(
            "CUDA out of memory. Tried to allocate 50.00 MiB. GPU 0 has a total capacity of \
             100.00 MiB of which 38.00 MiB is free. Process 4242 has 3.00 GiB memory in use. \
             Including non-PyTorch memory, this process has 62.00 MiB memory in use. Of the \
             allocated memory 60.00 MiB is allocated by PyTorch, and 2.00 MiB is reserved by \
             PyTorch but unallocated. If reserved"
        ),
        "{message}"
    );
    checked(&a);
}

#[test]
fn other_driver_failures_are_not_retried() {
    let mut a = allocator(GIB);
    let failure = injected("cuMemAlloc_v2");
    a.device_mut().fail_next(SimOp::Malloc, 1, failure.clone());
    assert_eq!(a.malloc(4096, 0), Err(AllocError::Device(failure)));
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(a.stats().num_ooms, 0);
    a.malloc(4096, 0).unwrap();
    checked(&a);
}

#[test]
fn a_failing_device_free_keeps_the_segment() {
    let mut a = allocator(GIB);
    let p = a.malloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    let failure = DeviceError::Driver {
        call: "cuMemFree_v2",
        code: 700,
        message: "an illegal memory access was encountered".into(),
    };
    a.device_mut().fail_next(SimOp::Free, 1, failure.clone());
    assert_eq!(a.empty_cache(), Err(failure));
    assert_eq!(a.stats().reserved_bytes.all.current, 30 * MIB as i64);
    checked(&a);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    checked(&a);
}

#[test]
fn oversize_blocks_are_never_split_and_serve_only_close_requests() {
    let config = Config {
        max_split_size: 40 * MIB,
        ..Config::default()
    };
    let mut a = with_config(GIB, config);
    assert_eq!(a.stats().max_split_size, 40 * MIB as i64);
    let p = a.malloc(100 * MIB, 0).unwrap();
    assert_eq!(a.stats().oversize_allocations.current, 1);
    assert_eq!(a.stats().oversize_segments.current, 1);
    a.free(p).unwrap();
    // A small large-pool request may not take the oversize block.
    let q = a.malloc(30 * MIB, 0).unwrap();
    assert_ne!(q, p);
    // A request within 20 MiB of it takes it whole.
    let r = a.malloc(90 * MIB, 0).unwrap();
    assert_eq!(r, p);
    assert_eq!(a.allocation_info(r).unwrap().size, 100 * MIB);
    a.free(r).unwrap();
    // 79 MiB is more than 20 MiB smaller: a new segment.
    let s = a.malloc(79 * MIB, 0).unwrap();
    assert_ne!(s, p);
    checked(&a);
}

#[test]
fn release_available_cached_blocks_frees_oversize_blocks_first() {
    let config = Config {
        max_split_size: 40 * MIB,
        ..Config::default()
    };
    let mut a = with_config(200 * MIB, config);
    let x = a.malloc(60 * MIB, 0).unwrap();
    let y = a.malloc(50 * MIB, 0).unwrap();
    let small = a.malloc(4096, 0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.free(small).unwrap();
    // 112 MiB reserved; 100 MiB more needs one oversize block released: the smallest that
    // covers max(100, 40) MiB does not exist, so the largest first (60), then 50.
    let z = a.malloc(100 * MIB, 0).unwrap();
    assert!(a.allocation_info(z).is_some());
    assert_eq!(
        a.stats().num_alloc_retries,
        0,
        "the second attempt is not a retry"
    );
    assert_eq!(a.stats().num_device_free, 2);
    assert_eq!(
        a.stats().segment.small_pool.current,
        1,
        "small segment untouched"
    );
    checked(&a);
}

#[test]
fn oversize_blocks_are_released_even_when_together_too_small() {
    // PyTorch releases each oversize block as it picks it; when all of them are not enough,
    // release_cached_blocks then frees the rest (seen by the oracle: the order of cudaFree).
    let config = Config {
        max_split_size: 40 * MIB,
        ..Config::default()
    };
    let mut a = with_config(200 * MIB, config);
    let x = a.malloc(60 * MIB, 0).unwrap();
    let y = a.malloc(30 * MIB, 0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    a.record_history(true, 100);
    assert!(a.malloc(150 * MIB, 0).is_ok());
    let frees: Vec<u64> = a.snapshot().device_traces[0]
        .iter()
        .filter(|e| e.action == TraceAction::SegmentFree)
        .map(|e| e.size)
        .collect();
    assert_eq!(frees, vec![60 * MIB as u64, 30 * MIB as u64]);
    checked(&a);
}

#[test]
fn a_memory_fraction_of_one_sets_no_limit() {
    let mut a = allocator(GIB);
    a.set_memory_fraction(1.0).unwrap();
    assert_eq!(a.allowed_memory_maximum(), None);
    a.set_memory_fraction(0.5).unwrap();
    assert_eq!(a.allowed_memory_maximum(), Some(GIB / 2));
    a.set_memory_fraction(1.0).unwrap();
    assert_eq!(a.allowed_memory_maximum(), None);
}

#[test]
fn memory_fraction_limits_what_is_reserved() {
    let mut a = allocator(GIB);
    a.set_memory_fraction(0.25).unwrap();
    assert_eq!(a.allowed_memory_maximum(), Some(GIB / 4));
    a.malloc(200 * MIB, 0).unwrap();
    let message = oom_message(a.malloc(100 * MIB, 0).unwrap_err());
    assert!(message.contains("256.00 MiB allowed; "), "{message}");
    assert!(a.set_memory_fraction(1.5).is_err());
    checked(&a);
}

#[test]
fn garbage_collection_releases_old_cached_segments_above_the_threshold() {
    let config = Config {
        garbage_collection_threshold: 0.5,
        ..Config::default()
    };
    let mut a = with_config(GIB, config);
    a.set_memory_fraction(0.5).unwrap(); // allowed 512 MiB, threshold 256 MiB
    let old = a.malloc(200 * MIB, 0).unwrap();
    a.free(old).unwrap();
    // Stream 1 cannot use stream 0's cached block: 280 MiB reserved, above the threshold.
    let mid = a.malloc(80 * MIB, 1).unwrap();
    assert_eq!(a.stats().num_device_free, 0, "280 MiB only after this miss");
    // The next miss collects: the old 200 MiB segment goes back before asking the device.
    let _more = a.malloc(10 * MIB, 1).unwrap();
    assert_eq!(a.stats().num_device_free, 1);
    assert_eq!(a.stats().reserved_bytes.all.current, (80 + 10) * MIB as i64);
    assert!(a.allocation_info(mid).is_some());
    checked(&a);
}

#[test]
fn roundup_power2_divisions_change_block_sizes() {
    let config = Config {
        roundup_power2_divisions: [4; 16],
        ..Config::default()
    };
    let mut a = with_config(GIB, config);
    let p = a.malloc(33 * MIB, 0).unwrap();
    assert_eq!(a.allocation_info(p).unwrap().size, 40 * MIB);
    checked(&a);
}

#[test]
fn statistics_reset_like_pytorchs() {
    let mut a = allocator(GIB);
    let p = a.malloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    a.reset_peak_stats();
    assert_eq!(a.stats().allocated_bytes.all.peak, 0);
    assert_eq!(a.stats().reserved_bytes.all.peak, 30 * MIB as i64);
    a.reset_accumulated_stats();
    assert_eq!(a.stats().allocated_bytes.all.allocated, 0);
    assert_eq!(a.stats().num_device_alloc, 0);
    assert_eq!(a.stats().num_splits, 0);
    assert_eq!(a.stats().reserved_bytes.all.current, 30 * MIB as i64);
}

#[test]
fn base_allocation_names_the_whole_segment() {
    let mut a = allocator(GIB);
    let _p = a.malloc(MIB / 2, 0).unwrap();
    let q = a.malloc(MIB / 2, 0).unwrap();
    let (base, size) = a.base_allocation(q).unwrap();
    assert_eq!(base, q - (MIB / 2) as u64);
    assert_eq!(size, 2 * MIB);
}

#[test]
fn imported_segments_hold_live_blocks_at_their_offsets() {
    let mut a = allocator(GIB);
    let live = [
        ImportedBlock {
            offset: 0,
            size: MIB,
            requested_size: MIB - 100,
        },
        ImportedBlock {
            offset: 4 * MIB,
            size: 2 * MIB,
            requested_size: 2 * MIB,
        },
    ];
    let (base, ptrs) = a
        .import_segment(20 * MIB, 0, PoolKind::Large, &live)
        .unwrap();
    assert_eq!(ptrs, vec![base, base + 4 * MIB as u64]);
    assert_eq!(a.stats().allocated_bytes.all.current, 3 * MIB as i64);
    assert_eq!(a.stats().inactive_split.all.current, 2);
    checked(&a);
    // The 3 MiB gap serves a 3 MiB request without a device call.
    let gap = a.malloc(3 * MIB, 0).unwrap();
    assert_eq!(gap, base + MIB as u64);
    assert_eq!(a.device().counters().mallocs, 1);
    for p in ptrs {
        a.free(p).unwrap();
    }
    a.free(gap).unwrap();
    checked(&a);
    assert_eq!(a.stats().inactive_split.all.current, 0);
}

/// Regression (found by `ferrocache tune` on tests/data/oracle/training_expandable.pickle
/// under `max_split_size_mb:64,roundup_power2_divisions:2` on 0.75 GiB): a segment imported
/// with a live block holds a free split block larger than max_split_size, which PyTorch never
/// caches; releasing oversize blocks after a failed device allocation must pass it over, not
/// give part of a live segment back to the device.
#[test]
fn oversize_release_passes_over_split_blocks_of_imported_segments() {
    let mut a = with_config(300 * MIB, Config::parse("max_split_size_mb:64").unwrap());
    let live = [ImportedBlock {
        offset: 0,
        size: 20 * MIB,
        requested_size: 20 * MIB,
    }];
    let (base, ptrs) = a
        .import_segment(200 * MIB, 0, PoolKind::Large, &live)
        .unwrap();
    assert_eq!(ptrs, vec![base]);
    // 180 MiB free in the segment, too large to serve 150 MiB (more than 20 MiB over), and
    // only 100 MiB left on the device: an out-of-memory, with the segment untouched.
    let failed = a.malloc(150 * MIB, 0);
    assert!(
        matches!(failed, Err(AllocError::OutOfMemory(_))),
        "{failed:?}"
    );
    checked(&a);
    assert_eq!(a.device().counters().frees, 0);
    assert_eq!(a.stats().reserved_bytes.all.current, 200 * MIB as i64);
    a.free(base).unwrap();
    checked(&a);
    // Now the segment is whole: it is released and the request served.
    a.malloc(150 * MIB, 0).unwrap();
    checked(&a);
}

#[test]
fn snapshot_lists_segments_and_blocks_like_pytorch() {
    let mut a = allocator(GIB);
    a.record_history(true, 100);
    let p = a.malloc(1000, 0).unwrap();
    let _q = a.malloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2);
    let small = &snap.segments[0];
    assert_eq!(small.segment_type, "small");
    assert_eq!(small.total_size, 2 * MIB as u64);
    assert_eq!(small.blocks.len(), 1, "the freed block merged back");
    let actions: Vec<String> = snap.device_traces[0]
        .iter()
        .map(|e| {
            serde_json::to_value(e.action)
                .unwrap()
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "free_requested",
            "free_completed"
        ]
    );
    let json = serde_json::to_value(&snap).unwrap();
    assert_eq!(
        json["segments"][1]["blocks"][0]["state"],
        "active_allocated"
    );
    assert_eq!(
        json["segments"][0]["segment_pool_id"],
        serde_json::json!([0, 0])
    );
}

#[test]
fn the_simulated_device_is_never_asked_on_a_cache_hit() {
    let mut a = allocator(GIB);
    let p = a.malloc(4096, 0).unwrap();
    a.free(p).unwrap();
    let calls = a.device().counters().clone();
    for _ in 0..100 {
        let p = a.malloc(4096, 0).unwrap();
        a.free(p).unwrap();
    }
    assert_eq!(a.device().counters(), &calls);
    let _ = a.device_mut().mem_get_info();
}

#[test]
fn large_segment_size_sets_the_segments_of_medium_requests() {
    let config = Config::parse("large_segment_size_mb:64").unwrap();
    let mut a = with_config(GIB, config);
    let p = a.malloc(5 * MIB, 0).unwrap();
    assert_eq!(a.device().allocations()[&p], 64 * MIB);
    assert_eq!(
        a.stats().inactive_split_bytes.large_pool.current,
        59 * MIB as i64
    );
    checked(&a);
}

/// The segments of issue 20's first shape: B, a 2 MiB segment cut into 16 blocks of 128 KiB,
/// all live; then, with `with_a`, a newer segment A below B (a placeholder made first holds
/// the lowest addresses until B exists), filled by 720,896, 720,896, 262,144 and 262,144 bytes,
/// which leaves its 128 KiB tail free. B's blocks, and the address of A's tail.
fn older_b_and_newer_a(
    a: &mut DeviceAllocator<SimDevice>,
    with_a: bool,
) -> (Vec<u64>, Option<u64>) {
    const KIB: usize = 1 << 10;
    let placeholder = a.malloc(20 * MIB, 0).unwrap();
    let b: Vec<u64> = (0..16).map(|_| a.malloc(128 * KIB, 0).unwrap()).collect();
    a.free(placeholder).unwrap();
    a.empty_cache().unwrap();
    if !with_a {
        return (b, None);
    }
    let segment_a: Vec<u64> = [720_896, 720_896, 262_144, 262_144]
        .into_iter()
        .map(|size| a.malloc(size, 0).unwrap())
        .collect();
    assert!(segment_a[0] < b[0], "A, the newer segment, lies below B");
    (b, Some(segment_a[3] + 262_144))
}

/// Issue 20, first shape: two free 128 KiB blocks, the tail of a newer segment (A) at the lower
/// address and the freed last block of an older segment (B) at the higher one. PyTorch >= 2.13
/// breaks ties between equal blocks by segment creation order, so it hands out B's block; the
/// address order (ferrocache before the fix) handed out A's tail, and the small pool evolved
/// differently from there (231 segments instead of PyTorch's 230 on a recording).
#[test]
fn equal_blocks_go_to_the_older_segment_even_at_a_higher_address() {
    const KIB: usize = 1 << 10;
    let mut a = allocator(GIB);
    let (b, a_tail) = older_b_and_newer_a(&mut a, true);
    let a_tail = a_tail.expect("segment A was made");
    a.free(b[15]).unwrap();
    let chosen = a.malloc(128 * KIB, 0).unwrap();
    assert_eq!(
        chosen, b[15],
        "B's freed block, not A's tail at {a_tail:#x}"
    );
    // Within one segment the lower address still wins.
    a.free(b[3]).unwrap();
    a.free(b[10]).unwrap();
    assert_eq!(a.malloc(128 * KIB, 0).unwrap(), b[3]);
    checked(&a);
}

/// Issue 20, second shape, reduced: activations that grow step by step leave equal free blocks
/// in several large segments (two 128 MiB segments cut into 80, 20, 20 and 8 MiB). The next
/// 20 MiB request goes to the older segment's free block, although the newer segment's lies at
/// the lower address; with the address rule it went to the newer one, so the segments were cut
/// differently from PyTorch's from there (`inactive_split` peaks one apart, and under a memory
/// fraction with a garbage-collection threshold different segments released).
#[test]
fn equal_large_blocks_go_to_the_older_segment() {
    let mut a = allocator(GIB);
    // A 128 MiB segment carved into 80, 20, 20 and 8 MiB blocks.
    let carved_segment = |a: &mut DeviceAllocator<SimDevice>| -> Vec<u64> {
        let whole = a.malloc(128 * MIB, 0).unwrap();
        a.free(whole).unwrap();
        let blocks: Vec<u64> = [80, 20, 20, 8]
            .into_iter()
            .map(|m| a.malloc(m * MIB, 0).unwrap())
            .collect();
        assert_eq!(blocks[0], whole);
        blocks
    };
    // A placeholder at the lowest addresses, given back once the older segment is made, so
    // that the newer segment takes its place below the older one.
    let placeholder = a.malloc(200 * MIB, 0).unwrap();
    let older = carved_segment(&mut a);
    a.free(placeholder).unwrap();
    a.empty_cache().unwrap();
    let newer = carved_segment(&mut a);
    assert!(
        newer[0] < older[0],
        "the newer segment lies below the older one"
    );
    assert_eq!(a.stats().segment.large_pool.current, 2);
    a.free(newer[1]).unwrap();
    a.free(older[1]).unwrap();
    assert_eq!(a.malloc(20 * MIB, 0).unwrap(), older[1]);
    assert_eq!(a.malloc(20 * MIB, 0).unwrap(), newer[1]);
    checked(&a);
}

/// The three tie rules PyTorch has had, on the programs that tell them apart, with the choices
/// each PyTorch made through its own allocator on the fake CUDA (torch 2.11.0; 2.12.0 and
/// 2.12.1; 2.13 to 2.15): which of two equal free 128 KiB blocks a request gets.
#[test]
fn each_tie_rule_picks_what_its_pytorch_picked() {
    use ferrocache::policy::{TieRule, tie_rule_of_pytorch};
    const KIB: usize = 1 << 10;
    let pick = |rule: TieRule, program: &str| -> &'static str {
        let config = Config {
            modelled: ferrocache::config::ModelledPyTorch {
                tie_rule: rule,
                ..Default::default()
            },
            ..Config::default()
        };
        let mut a = with_config(GIB, config);
        // Only the first program has the newer segment A, below B, with its free tail.
        let (b, a_tail) = older_b_and_newer_a(&mut a, program == "older segment vs newer tail");
        let freed: &[usize] = match program {
            "older segment vs newer tail" => &[15],
            "front 3 vs original 15" => &[3, 15],
            "front 3 vs front 10" => &[3, 10],
            _ => unreachable!(),
        };
        for &i in freed {
            a.free(b[i]).unwrap();
        }
        let chosen = a.malloc(128 * KIB, 0).unwrap();
        checked(&a);
        match () {
            _ if Some(chosen) == a_tail => "A's tail",
            _ if chosen == b[3] => "B3",
            _ if chosen == b[15] => "B15",
            _ => "other",
        }
    };
    let expected = [
        (TieRule::Address, ["A's tail", "B3", "B3"]),
        (TieRule::BlockOrder, ["B15", "B15", "B3"]),
        (TieRule::SegmentOrder, ["B15", "B3", "B3"]),
    ];
    for (rule, choices) in expected {
        let got = [
            pick(rule, "older segment vs newer tail"),
            pick(rule, "front 3 vs original 15"),
            pick(rule, "front 3 vs front 10"),
        ];
        assert_eq!(got, choices, "{rule:?}");
    }
    assert_eq!(tie_rule_of_pytorch(2, 11), TieRule::Address);
    assert_eq!(tie_rule_of_pytorch(2, 12), TieRule::BlockOrder);
    assert_eq!(tie_rule_of_pytorch(2, 15), TieRule::SegmentOrder);
    assert_eq!(Config::default().modelled.tie_rule, TieRule::SegmentOrder);
    let from = |version: &str| {
        Config::from_vars(|name| (name == "FERROCACHE_PYTORCH_VERSION").then(|| version.into()))
            .unwrap()
    };
    assert_eq!(from("2.12.1+cu128").modelled.tie_rule, TieRule::BlockOrder);
    assert_eq!(from("2.9.0").modelled.tie_rule, TieRule::Address);
    let bad = from("nightly");
    assert_eq!(bad.modelled.tie_rule, TieRule::SegmentOrder);
    assert_eq!(
        bad.provenance.warnings.len(),
        1,
        "{:?}",
        bad.provenance.warnings
    );
}

/// What `FERROCACHE_PYTORCH_VERSION` (set by `ferrocache.install()`) chooses.
fn under_pytorch(version: &str, conf: &str) -> Config {
    let conf = conf.to_string();
    let version = version.to_string();
    Config::from_vars(|name| match name {
        "PYTORCH_CUDA_ALLOC_CONF" => Some(conf.clone()),
        "FERROCACHE_PYTORCH_VERSION" => Some(version.clone()),
        _ => None,
    })
    .unwrap()
}

fn oom_message(err: AllocError) -> String {
    match err {
        AllocError::OutOfMemory(oom) => oom.message,
        other => panic!("expected an out-of-memory error, got {other}"),
    }
}

/// The end of the out-of-memory message of each PyTorch, read from its libc10_cuda.so and
/// checked by running it on the fake CUDA (README, "Out of memory").
#[test]
fn the_out_of_memory_advice_is_that_of_the_running_pytorch() {
    const BODY: &str = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
                        capacity of 1024.00 MiB of which 1024.00 MiB is free. Of the allocated \
                        memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by \
                        PyTorch but unallocated.";
    const SUGGESTION: &str = " If reserved but unallocated memory is large try setting";
    const FRAGMENTATION: &str = "=expandable_segments:True to avoid fragmentation.  See \
                                 documentation for Memory Management  ";
    const OLD_LINK: &str =
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";
    const NEW_LINK: &str = "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
    const EXPANDABLE_NOTE: &str = " expandable_segments is enabled. If instead the process is \
        running out of virtual address space (VSZ), expandable segments may be over-reserving VA \
        (each segment reserves ~9/8 of device memory, times the number of streams); reduce it \
        via PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve / \
        expandable_segments_reserve_by_class.";
    let old = format!("{BODY}{SUGGESTION} PYTORCH_CUDA_ALLOC_CONF{FRAGMENTATION}{OLD_LINK}");
    let v2_10 = format!("{BODY}{SUGGESTION} PYTORCH_ALLOC_CONF{FRAGMENTATION}{OLD_LINK}");
    let new = format!("{BODY}{SUGGESTION} PYTORCH_CUDA_ALLOC_CONF{FRAGMENTATION}{NEW_LINK}");
    let expandable_note = format!("{BODY}{EXPANDABLE_NOTE}");
    for (version, conf, expected) in [
        ("2.4.1", "", &old),
        ("2.9.1", "expandable_segments:True", &old),
        ("2.10.0", "", &v2_10),
        ("2.11.0", "", &new),
        ("2.14.1", "expandable_segments:True", &new),
        ("2.15.0", "", &new),
        ("2.15.0", "expandable_segments:True", &expandable_note),
        ("2.16.0a0", "expandable_segments:True", &expandable_note),
    ] {
        let mut a = with_config(GIB, under_pytorch(version, conf));
        let message = oom_message(a.malloc(2 * GIB, 0).unwrap_err());
        assert_eq!(&message, expected, "torch {version}, {conf:?}");
    }
    // Unset: PyTorch 2.15's.
    let mut a = with_config(GIB, Config::default());
    assert_eq!(oom_message(a.malloc(2 * GIB, 0).unwrap_err()), new);
}

/// `throw_on_cudamalloc_oom:True` alone: the limit is the whole device (the fraction of
/// PYTORCH_CUDA_ALLOC_CONF, 1 by default), checked before the driver is asked; a refusal skips
/// the release-and-retry of cached blocks and counts in num_oom_rejections, not num_ooms
/// (measured through torch 2.15's own allocator on the fake CUDA).
#[test]
fn throw_on_cudamalloc_oom_refuses_before_the_driver_is_asked_and_keeps_the_cache() {
    let config = Config::parse("throw_on_cudamalloc_oom:True").unwrap();
    assert!(config.throw_on_cudamalloc_oom);
    let mut a = with_config(GIB, config);
    let message = oom_message(a.malloc(2 * GIB, 0).unwrap_err());
    assert_eq!(
        message,
        "CUDA out of memory. Allocation was preemptively rejected because it would exceed \
         per_process_memory_fraction limit. Requested size: 2.00 GiB"
    );
    assert_eq!(a.device().counters().mallocs, 0, "the driver is not asked");
    assert_eq!(a.stats().num_oom_rejections, 1);
    assert_eq!(a.stats().num_ooms, 0);
    assert_eq!(a.stats().num_alloc_retries, 0);
    // 300 MiB cached; 800 MiB + 1 would fit once the cache is released, but 300 MiB + 802 MiB
    // exceed the device: refused at once, the cache kept. The message names the request.
    let p = a.malloc(300 * MIB, 0).unwrap();
    a.free(p).unwrap();
    let message = oom_message(a.malloc(800 * MIB + 1, 0).unwrap_err());
    assert!(message.ends_with("Requested size: 800.00 MiB"), "{message}");
    assert_eq!(a.stats().num_oom_rejections, 2);
    assert_eq!(a.stats().num_device_free, 0, "nothing released");
    assert_eq!(a.reserved_bytes(), 300 * MIB);
    // Within the limit, the cache's segment is kept and a new one made beside it.
    a.malloc(5000, 0).unwrap();
    a.malloc(700 * MIB, 0).unwrap();
    assert_eq!(a.stats().num_oom_rejections, 2);
    assert_eq!(a.device().counters().mallocs, 3);
    checked(&a);
}

/// The lead's first experiment: with the fraction in PYTORCH_CUDA_ALLOC_CONF only, the
/// fraction's own limit (checked first) fails the device allocation, so PyTorch 2.15 releases
/// the cache and retries as always and never rejects preemptively; a later
/// `set_per_process_memory_fraction` above the configured one leaves the configured fraction as
/// the rejection limit.
#[test]
fn throw_on_cudamalloc_oom_rejects_only_past_the_configured_fraction() {
    let config =
        Config::parse("per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True").unwrap();
    let mut a = with_config(GIB, config.clone());
    let p = a.malloc(300 * MIB, 0).unwrap();
    a.free(p).unwrap();
    a.malloc(400 * MIB, 0).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().num_device_free, 1);
    let message = oom_message(a.malloc(600 * MIB, 0).unwrap_err());
    assert!(message.contains("512.00 MiB allowed; "), "{message}");
    assert_eq!(a.stats().num_oom_rejections, 0);
    assert_eq!(a.stats().num_ooms, 1);

    let mut a = with_config(GIB, config);
    a.set_memory_fraction(0.9).unwrap();
    let p = a.malloc(300 * MIB, 0).unwrap();
    a.free(p).unwrap();
    let message = oom_message(a.malloc(400 * MIB, 0).unwrap_err());
    assert!(message.contains("preemptively rejected"), "{message}");
    assert_eq!(a.stats().num_oom_rejections, 1);
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(a.reserved_bytes(), 300 * MIB);
    checked(&a);
}
