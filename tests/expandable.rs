//! Expandable segments (`expandable_segments:True`) on the simulated GPU.

use ferrocache::allocator::{AllocError, DeviceAllocator, ImportedBlock};
use ferrocache::config::{Config, OptIns};
use ferrocache::device::DeviceError;
use ferrocache::device::sim::{SimDevice, SimOp};
use ferrocache::policy::PoolKind;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn expandable(capacity: usize) -> DeviceAllocator<SimDevice> {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    DeviceAllocator::new(SimDevice::new(capacity), 0, config)
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
    assert_eq!(
        a.stats().reserved_bytes.all.current as usize,
        a.device().mapped_bytes(),
        "mapped bytes are reserved bytes"
    );
}

/// A driver error on `call`, as the simulated device injects it.
fn injected(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 1,
        message: "injected".into(),
    }
}

#[test]
fn one_growing_segment_per_stream_and_pool() {
    let mut a = expandable(16 * GIB);
    let p = a.malloc(30 * MIB, 0).unwrap();
    let q = a.malloc(70 * MIB, 0).unwrap();
    let s = a.malloc(4096, 0).unwrap();
    let t = a.malloc(30 * MIB, 5).unwrap();
    // Large pool of stream 0, small pool of stream 0, large pool of stream 5.
    assert_eq!(a.device().reserved_ranges(), 3);
    assert_eq!(a.device().counters().mallocs, 0, "no cudaMalloc at all");
    // The large pool's pages are 20 MiB: 30 MiB maps 40, then 70 more (60 free after p's 10)
    // grows the same range: q starts right after p.
    assert_eq!(q, p + 30 * MIB as u64);
    assert_eq!(
        a.stats().reserved_bytes.large_pool.current,
        (100 + 40) * MIB as i64
    );
    assert_eq!(a.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(
        a.stats().segment.all.current,
        0,
        "PyTorch counts no segments for maps"
    );
    assert!(a.stats().num_device_alloc >= 4);
    // The snapshot shows one contiguous range per segment.
    let segments = a.segments();
    assert_eq!(segments.len(), 3);
    assert!(segments.iter().all(|s| s.is_expandable));
    let large0 = segments.iter().find(|s| s.address == p).unwrap();
    assert_eq!(large0.total_size, 100 * MIB as u64);
    let _ = (s, t);
    checked(&a);
}

#[test]
fn free_space_at_the_end_is_extended_rather_than_mapped_anew() {
    let mut a = expandable(16 * GIB);
    let p = a.malloc(15 * MIB, 0).unwrap();
    // 5 MiB are free at the end of the first 20 MiB page: a 25 MiB request uses them and
    // maps one more page, so it starts inside the first page.
    let q = a.malloc(25 * MIB, 0).unwrap();
    assert_eq!(q, p + 15 * MIB as u64);
    assert_eq!(a.stats().reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(a.device().counters().creates, 2);
    checked(&a);
}

#[test]
fn empty_cache_synchronizes_unmaps_free_pages_and_releases_empty_segments() {
    let mut a = expandable(16 * GIB);
    let p = a.malloc(50 * MIB, 0).unwrap();
    let q = a.malloc(10 * MIB, 0).unwrap();
    let small = a.malloc(4096, 0).unwrap();
    a.free(p).unwrap();
    a.free(small).unwrap();
    let syncs = a.device().counters().stream_synchronizations;
    a.empty_cache().unwrap();
    assert!(a.device().counters().stream_synchronizations > syncs);
    // q (at 50..60 MiB) keeps its page (40..60); pages 0..40 and the small segment go back.
    assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB as i64);
    assert_eq!(
        a.device().reserved_ranges(),
        1,
        "the empty small segment's range is released"
    );
    checked(&a);
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().mapped_bytes(), 0);
    assert_eq!(a.device().live_physical_handles(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
    assert_eq!(a.device().physical_in_use(), 0);
    checked(&a);
}

#[test]
fn an_out_of_memory_retry_unmaps_other_streams_free_pages() {
    let mut a = expandable(GIB);
    let p = a.malloc(700 * MIB, 0).unwrap();
    a.free(p).unwrap();
    // Stream 1 cannot use stream 0's free pages, but they can be unmapped and mapped again.
    let q = a.malloc(600 * MIB, 1).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().reserved_bytes.all.current, 600 * MIB as i64);
    assert!(a.allocation_info(q).is_some());
    checked(&a);
    let err = a.malloc(600 * MIB, 0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)));
    checked(&a);
}

#[test]
fn a_failure_while_growing_leaks_nothing() {
    let failure = injected("cuMemMap");
    for (op, nth) in [
        (SimOp::CreatePhysical, 2),
        (SimOp::Map, 2),
        (SimOp::SetAccess, 1),
    ] {
        let mut a = expandable(16 * GIB);
        let p = a.malloc(10 * MIB, 0).unwrap();
        a.device_mut().fail_nth(op, nth, failure.clone());
        // 60 MiB: 10 MiB free at the end of the first page, 3 new pages needed.
        let err = a.malloc(60 * MIB, 0).unwrap_err();
        assert_eq!(err, AllocError::Device(failure.clone()), "{op:?}");
        assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB as i64);
        assert_eq!(
            a.device().live_physical_handles(),
            1,
            "{op:?}: only p's page"
        );
        checked(&a);
        // And it grows fine afterwards.
        let q = a.malloc(60 * MIB, 0).unwrap();
        assert!(a.device().is_accessible(q, 60 * MIB));
        a.free(p).unwrap();
        checked(&a);
    }
}

#[test]
fn out_of_memory_while_growing_is_retried_like_cudamalloc() {
    let mut a = expandable(GIB);
    a.device_mut()
        .fail_next(SimOp::CreatePhysical, 1, DeviceError::OutOfMemory);
    let p = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert!(a.device().is_accessible(p, 30 * MIB));
    checked(&a);
}

#[test]
fn expandable_blocks_are_not_inactive_splits() {
    let mut a = expandable(16 * GIB);
    let p = a.malloc(5 * MIB, 0).unwrap();
    let _q = a.malloc(5 * MIB, 0).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.stats().inactive_split.all.current, 0);
    assert_eq!(a.stats().inactive_split_bytes.all.current, 0);
    checked(&a);
}

/// pytorch/pytorch#123548: with `max_split_size_mb:128,expandable_segments:True`, PyTorch's
/// reserved memory grows by ~138 MiB a cycle (220 MiB to 14 GiB over 100 cycles) while at most
/// ~300 MiB are allocated, because its oversize rule refuses the merged free block inside the
/// expandable segment and maps new pages instead. ferrocache does the same by default (PyTorch's
/// decisions); with `FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT=1` it does not apply the oversize
/// rules to expandable blocks (they are always split), and reserved memory stays flat.
/// Returns the peak reserved; 200 MiB are allocated at the end.
fn peak_reserved_of_the_pytorch_123548_pattern(ignore_max_split: bool) -> i64 {
    let config = Config {
        expandable_segments: true,
        max_split_size: 128 * MIB,
        opt_in: OptIns {
            expandable_ignore_max_split: ignore_max_split,
            ..OptIns::default()
        },
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(16 * GIB), 0, config);
    let mut peak_reserved = 0;
    let mut kept = Vec::new();
    for _cycle in 0..100 {
        let big = a.malloc(91 * MIB, 0).unwrap();
        let half = a.malloc(91 * MIB / 2, 0).unwrap();
        kept.push(a.malloc(2 * MIB, 0).unwrap());
        a.free(big).unwrap();
        a.free(half).unwrap();
        peak_reserved = peak_reserved.max(a.stats().reserved_bytes.all.current);
    }
    let allocated = a.stats().allocated_bytes.all.current;
    eprintln!(
        "pytorch#123548 pattern (exempt: {ignore_max_split}): peak reserved {} MiB, {} MiB allocated",
        peak_reserved >> 20,
        allocated >> 20
    );
    assert_eq!(allocated, 200 * MIB as i64);
    assert_eq!(a.stats().num_alloc_retries, 0);
    checked(&a);
    peak_reserved
}

#[test]
fn max_split_size_with_expandable_segments_grows_as_in_pytorch_unless_exempted() {
    let pytorchs = peak_reserved_of_the_pytorch_123548_pattern(false);
    assert!(
        pytorchs > 5 * GIB as i64,
        "PyTorch's rule grows reserved memory (14 GiB in the issue); here {} MiB",
        pytorchs >> 20
    );
    let exempt = peak_reserved_of_the_pytorch_123548_pattern(true);
    assert!(
        exempt <= 500 * MIB as i64,
        "reserved grew to {} MiB with 200 MiB allocated",
        exempt >> 20
    );
}

/// A page whose release the device refuses is not forgotten: the next `empty_cache` gives it
/// back (found by the fault sweep: `cuMemRelease` failing once leaked the page for good).
#[test]
fn a_page_the_device_would_not_release_is_released_later() {
    let refused = injected("cuMemRelease");
    let mut a = expandable(16 * GIB);
    let p = a.malloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    a.device_mut()
        .fail_next(SimOp::ReleasePhysical, 1, refused.clone());
    assert_eq!(a.empty_cache(), Err(refused));
    checked(&a);
    // Two pages: the refused one, kept as a leftover, and the one after it, still mapped.
    assert_eq!(a.device().live_physical_handles(), 2, "kept, not lost");
    a.empty_cache().unwrap();
    assert_eq!(a.device().live_physical_handles(), 0);
    assert_eq!(a.device().mapped_bytes(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
    checked(&a);
}

/// When growing fails and undoing it fails too (a page the device will not unmap), the page is
/// kept and given back by the next `empty_cache`, before the address range.
#[test]
fn a_page_left_mapped_by_a_failed_rollback_is_released_later() {
    let mut a = expandable(16 * GIB);
    a.device_mut()
        .fail_next(SimOp::SetAccess, 1, injected("cuMemSetAccess"));
    a.device_mut()
        .fail_next(SimOp::Unmap, 1, injected("cuMemUnmap"));
    assert!(a.malloc(30 * MIB, 0).is_err());
    // Not `checked`: the leftover page is mapped on the device but reserved by no segment.
    a.check_invariants().unwrap();
    assert_eq!(
        a.device().live_physical_handles(),
        1,
        "the page left mapped"
    );
    a.empty_cache().unwrap();
    assert_eq!(a.device().live_physical_handles(), 0);
    assert_eq!(a.device().mapped_bytes(), 0);
    // The segment's first growth failed, so, as in PyTorch, it keeps its address range for the
    // next request of its stream (see the test after next).
    assert_eq!(a.device().reserved_ranges(), 1);
    checked(&a);
}

/// An address range the device refuses to free (`cuMemAddressFree` failing once) is retried
/// by the next `empty_cache`, as leftover pages are (issue 21: it stayed reserved until a new
/// segment happened to reuse it).
#[test]
fn an_address_range_the_device_would_not_free_is_freed_by_the_next_empty_cache() {
    let refused = injected("cuMemAddressFree");
    let mut a = expandable(16 * GIB);
    let p = a.malloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    a.device_mut()
        .fail_next(SimOp::FreeAddressRange, 1, refused.clone());
    assert_eq!(a.empty_cache(), Err(refused));
    // The pages went back; the segment is gone from the books; its range is still reserved.
    assert_eq!(a.device().mapped_bytes(), 0);
    assert_eq!(a.device().live_physical_handles(), 0);
    assert!(a.expandable_segment_ranges().is_empty());
    assert_eq!(a.device().reserved_ranges(), 1);
    checked(&a);
    a.empty_cache().unwrap();
    assert_eq!(a.device().reserved_ranges(), 0);
    assert_eq!(a.device().counters().address_frees, 2);
    // Nothing is left to retry: a third call frees nothing.
    a.empty_cache().unwrap();
    assert_eq!(a.device().counters().address_frees, 2);
    checked(&a);
}

/// The same for a private pool's segment.
#[test]
fn a_private_pools_address_range_the_device_would_not_free_is_freed_later() {
    let refused = injected("cuMemAddressFree");
    let mut a = expandable(16 * GIB);
    let pool = (1, 0);
    a.begin_allocate_to_pool(pool, Box::new(|_| Ok(true)))
        .unwrap();
    let p = a.malloc(30 * MIB, 0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.free(p).unwrap();
    a.release_pool(pool).unwrap();
    a.device_mut()
        .fail_next(SimOp::FreeAddressRange, 1, refused.clone());
    assert_eq!(a.empty_cache(), Err(refused));
    assert_eq!(a.device().reserved_ranges(), 1);
    assert_eq!(a.device().mapped_bytes(), 0);
    checked(&a);
    a.empty_cache().unwrap();
    assert_eq!(a.device().reserved_ranges(), 0);
    assert!(a.private_pools().is_empty());
    checked(&a);
}

#[test]
fn a_request_larger_than_the_address_range_maps_nothing_and_gives_the_range_back() {
    // PyTorch reserves 9/8 of the device per segment; a larger request reserves a range, finds
    // it too small and frees it at once, on the first try and on the retry (seen by the oracle).
    let mut a = expandable(GIB);
    let err = a.malloc(GIB + GIB / 4, 0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(a.device().reserved_ranges(), 0);
    assert_eq!(
        a.device().counters().reserves,
        2,
        "the first try and the retry"
    );
    assert_eq!(a.device().counters().creates, 0, "nothing mapped");
    assert_eq!(a.stats().num_alloc_retries, 1);
    checked(&a);
}

#[test]
fn a_segment_whose_first_growth_failed_keeps_its_range_and_serves_the_next_request() {
    let mut a = expandable(GIB);
    a.device_mut()
        .fail_next(SimOp::CreatePhysical, 2, DeviceError::OutOfMemory);
    assert!(a.malloc(30 * MIB, 0).is_err());
    // As in PyTorch: the retry's release kept the empty segment, and the retry used it again.
    assert_eq!(a.device().counters().reserves, 1);
    assert_eq!(a.device().counters().address_frees, 0);
    let p = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.device().counters().reserves, 1);
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    // Unmapped to nothing: the range goes back at once.
    assert_eq!(a.device().reserved_ranges(), 0);
    checked(&a);
}

#[test]
fn an_imported_expandable_segment_grows_from_its_free_end() {
    // The replay's start state for PyTorch's expandable segments: 50 MiB mapped (three 20 MiB
    // pages), a live 40 MiB block at the start; the free end joins the next page mapped.
    let mut a = expandable(GIB);
    let live = [ImportedBlock {
        offset: 0,
        size: 40 * MIB,
        requested_size: 40 * MIB,
    }];
    let (base, placed) = a
        .import_expandable_segment(50 * MIB, 0, PoolKind::Large, &live)
        .unwrap();
    assert_eq!(placed, vec![base]);
    assert_eq!(a.stats().reserved_bytes.all.current, 60 * MIB as i64);
    assert_eq!(a.device().reserved_ranges(), 1);
    checked(&a);
    let maps = a.device().counters().maps;
    let p = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(p, base + 40 * MIB as u64, "the free end, grown");
    assert_eq!(a.device().counters().maps, maps + 1);
    assert_eq!(a.device().reserved_ranges(), 1);
    checked(&a);
    // A block past the mapped bytes is refused, and nothing is left behind.
    let outside = [ImportedBlock {
        offset: 40 * MIB,
        size: 20 * MIB,
        requested_size: 1,
    }];
    assert!(
        a.import_expandable_segment(50 * MIB, 0, PoolKind::Large, &outside)
            .is_err()
    );
    assert_eq!(a.device().reserved_ranges(), 1);
}

fn expandable_with(capacity: usize, conf: &str) -> DeviceAllocator<SimDevice> {
    let config = Config::parse(conf).unwrap();
    DeviceAllocator::new(SimDevice::new(capacity), 0, config)
}

/// The address range of each new segment (its size), newest last.
fn reserved_sizes(a: &DeviceAllocator<SimDevice>) -> Vec<usize> {
    a.expandable_segment_ranges()
        .iter()
        .map(|&(_, size, _)| size)
        .collect()
}

/// `expandable_segments_reserve` (PyTorch 2.15): a fraction of the device or a number of GiB,
/// at most 9/8 of the device, in whole pages of the pool (2 MiB small, 20 MiB large). The sizes
/// are those of torch 2.15's cuMemAddressReserve calls on a 1 GiB fake CUDA.
#[test]
fn expandable_segments_reserve_sets_each_segments_address_range() {
    for (reserve, small, large) in [
        ("", 1_207_959_552, 1_216_348_160),
        ("0.5", 536_870_912, 545_259_520),
        ("1G", 1_073_741_824, 1_090_519_040),
        ("0.5g", 536_870_912, 545_259_520),
        ("2.0", 1_207_959_552, 1_216_348_160),
        ("0.3", 322_961_408, 335_544_320),
        ("0.05", 54_525_952, 62_914_560),
        ("1e-9", 2_097_152, 20_971_520),
        ("abc", 1_207_959_552, 1_216_348_160),
    ] {
        let conf = if reserve.is_empty() {
            "expandable_segments:True".to_string()
        } else {
            format!("expandable_segments:True,expandable_segments_reserve:{reserve}")
        };
        let mut a = expandable_with(GIB, &conf);
        a.malloc(1000, 0).unwrap();
        a.malloc(3 * MIB, 0).unwrap();
        assert_eq!(reserved_sizes(&a), [small, large], "{conf}");
        checked(&a);
    }
}

/// An allocation larger than the configured reserve but not than the device: PyTorch 2.15
/// reserves a range, finds it too small, gives it back (on the first try and the retry), and
/// says why in the out-of-memory message, naming the reserve and the allocation size.
#[test]
fn an_allocation_larger_than_the_configured_reserve_says_so() {
    let mut a = expandable_with(
        GIB,
        "expandable_segments:True,expandable_segments_reserve:0.05",
    );
    let err = a.malloc(200 * MIB + 1, 0).unwrap_err();
    let AllocError::OutOfMemory(oom) = err else {
        panic!("expected OOM, got {err:?}")
    };
    assert_eq!(
        oom.message,
        "CUDA out of memory. Tried to allocate 202.00 MiB. GPU 0 has a total capacity of 1024.00 \
         MiB of which 1024.00 MiB is free. Of the allocated memory 0 bytes is allocated by \
         PyTorch, and 0 bytes is reserved by PyTorch but unallocated. This allocation exceeds the \
         expandable-segment reserve of 51.20 MiB for this stream, and a single allocation cannot \
         span expandable segments. Raise PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve or \
         expandable_segments_reserve_by_class (or unset it) so that a segment is at least 202.00 \
         MiB."
    );
    assert_eq!(a.device().counters().reserves, 2);
    assert_eq!(a.device().reserved_ranges(), 0);
    // Within the reserve's pages (3 x 20 MiB) a request fits.
    a.malloc(5 * MIB + 1, 0).unwrap();
    a.malloc(50 * MIB, 0).unwrap();
    // Larger than the device: the reserve is not the reason, the note on address space is.
    let err = a.malloc(1100 * MIB, 0).unwrap_err();
    let AllocError::OutOfMemory(oom) = err else {
        panic!("expected OOM")
    };
    assert!(
        oom.message.ends_with(
            " expandable_segments is enabled. If instead the process is running out \
                        of virtual address space (VSZ), expandable segments may be \
                        over-reserving VA (each segment reserves ~9/8 of device memory, times \
                        the number of streams); reduce it via PYTORCH_CUDA_ALLOC_CONF \
                        expandable_segments_reserve / expandable_segments_reserve_by_class."
        ),
        "{}",
        oom.message
    );
    checked(&a);
}

/// A reserve that resolves to 0 bytes asks the device for an empty range, which it refuses: a
/// driver error, not an out of memory, as with torch 2.15 ("CUDA driver error: invalid
/// argument").
#[test]
fn a_reserve_of_zero_bytes_is_a_driver_error() {
    let mut a = expandable_with(
        GIB,
        "expandable_segments:True,expandable_segments_reserve:1e-300",
    );
    let err = a.malloc(1000, 0).unwrap_err();
    assert!(matches!(err, AllocError::Device(_)), "{err:?}");
    assert_eq!(a.device().reserved_ranges(), 0);
    checked(&a);
}

/// `expandable_segments_reserve_by_class` (PyTorch 2.15): a stream tagged through PyTorch's C++
/// API gets its class's reserve; a class with no entry, and an untagged stream, get
/// `expandable_segments_reserve` or the default; an allocation past the class's reserve names
/// the class. The sizes are torch 2.15's on a 1 GiB fake CUDA (`test_settings_real.py`).
#[test]
fn a_tagged_stream_gets_its_reserve_class() {
    let mut a = expandable_with(
        GIB,
        "expandable_segments:True,expandable_segments_reserve_by_class:[tiny:0.05,big:0.5]",
    );
    a.set_reserve_class_lookup(Box::new(|stream| {
        match stream {
            5 => "tiny",
            6 => "other",
            _ => "",
        }
        .to_string()
    }));
    a.malloc(1000, 5).unwrap();
    a.malloc(3 * MIB, 5).unwrap();
    let err = a.malloc(200 * MIB + 1, 5).unwrap_err();
    let AllocError::OutOfMemory(oom) = err else {
        panic!("expected OOM, got {err:?}")
    };
    assert!(
        oom.message.contains(
            "exceeds the expandable-segment reserve of 51.20 MiB for stream reserve class 'tiny'"
        ),
        "{}",
        oom.message
    );
    a.malloc(3 * MIB, 6).unwrap();
    a.malloc(3 * MIB, 0).unwrap();
    assert_eq!(
        reserved_sizes(&a),
        [54_525_952, 62_914_560, 1_216_348_160, 1_216_348_160]
    );
    checked(&a);
}

/// With cross-stream reuse (issue 21): stream A grows its free block through unmapped pages
/// of a segment whose unmapped space carries stream B. The pages mapped there used to keep
/// B's stream, so they did not merge with A's block, and the request of A was handed a block
/// of B (which B could then reuse, once freed, while A's work still ran on it), mapped anew
/// past the 58.5 MiB A already had free. Shrunk by the property
/// `cross_stream_reuse_with_expandable_segments_keeps_every_invariant`.
#[test]
fn pages_mapped_to_grow_a_block_take_its_stream_with_cross_stream_reuse() {
    const A: u64 = 0;
    const B: u64 = 0x1000;
    let config = Config {
        expandable_segments: true,
        opt_in: OptIns {
            cross_stream: true,
            ..OptIns::default()
        },
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(4 * GIB), 0, config);
    let page = 20 * MIB as u64;
    // B's segment: page 0 holds x (1.5 MiB); A's first request takes B's free tail, grown
    // into page 1, then B's own request maps page 2.
    let x = a.malloc(3 * MIB / 2, B).unwrap();
    let first = a.malloc(20 * MIB, A).unwrap();
    assert_eq!(first, x + 3 * MIB as u64 / 2, "B's free tail, moved to A");
    let y = a.malloc(20 * MIB, B).unwrap();
    assert_eq!(y, x + 2 * page);
    a.free(first).unwrap();
    // Page 1 is wholly free: it is unmapped; [1.5 MiB, 20 MiB) stays mapped, free, of A.
    a.empty_cache().unwrap();
    a.free(y).unwrap();
    // A takes y's page from B's cache, and frees it: A now has free memory on both sides of
    // the unmapped page 1, and B's unmapped space starts at page 3.
    let second = a.malloc(20 * MIB, A).unwrap();
    assert_eq!(second, y);
    a.free(second).unwrap();
    checked(&a);
    let reserved = a.stats().reserved_bytes.all.current;
    // 60 MiB for A: its free 1.5..20 MiB, page 1 mapped again, its free page 2, and 1.5 MiB
    // of page 3, all of them one block of A.
    let wanted = a.malloc(60 * MIB, A).unwrap();
    let info = a.allocation_info(wanted).unwrap();
    assert_eq!(
        info.stream, A,
        "the block belongs to the stream that asked for it"
    );
    assert_eq!(wanted, first, "A's free memory is used, not mapped anew");
    assert_eq!(
        a.stats().reserved_bytes.all.current,
        reserved + 2 * page as i64,
        "pages 1 and 3"
    );
    checked(&a);
    // Freed, the block is cached for A: B takes it only after waiting for A's work.
    let waits = a.cross_stream_counts().waits;
    a.free(wanted).unwrap();
    let z = a.malloc(60 * MIB, B).unwrap();
    assert_eq!(z, wanted);
    assert_eq!(a.allocation_info(z).unwrap().stream, B);
    assert_eq!(a.cross_stream_counts().waits, waits + 1);
    checked(&a);
}
