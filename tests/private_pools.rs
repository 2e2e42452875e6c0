//! Private pools (CUDA graph capture) on the simulated GPU: PyTorch's rules for
//! `beginAllocateToPool`, `endAllocateToPool`, `releasePool` and `empty_cache`, case by case.

use ferrocache::allocator::private_pool::{MempoolId, PoolError, StreamFilter};
use ferrocache::allocator::{AllocError, DeviceAllocator};
use ferrocache::config::Config;
use ferrocache::device::StreamId;
use ferrocache::device::sim::SimDevice;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// The stream a capture records on (PyTorch captures on a side stream).
const CAPTURE: StreamId = 0x5000;
const OTHER: StreamId = 0x6000;
const POOL: MempoolId = (1, 0);

fn allocator(capacity: usize) -> DeviceAllocator<SimDevice> {
    DeviceAllocator::new(SimDevice::new(capacity), 0, Config::default())
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
}

/// PyTorch's filter for a capture on `stream`: is this stream the capturing one?
fn on(stream: StreamId) -> StreamFilter {
    Box::new(move |s| Ok(s == stream))
}

fn pool_of(a: &DeviceAllocator<SimDevice>, ptr: u64) -> Option<MempoolId> {
    a.allocation_info(ptr)
        .expect("a live allocation")
        .private_pool
}

#[test]
fn allocations_on_the_capture_stream_come_from_the_pool_and_others_do_not() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    assert!(a.capture_underway());
    let inside = a.malloc(4096, CAPTURE).unwrap();
    let large = a.malloc(30 * MIB, CAPTURE).unwrap();
    let outside = a.malloc(4096, OTHER).unwrap();
    assert_eq!(pool_of(&a, inside), Some(POOL));
    assert_eq!(pool_of(&a, large), Some(POOL));
    assert_eq!(pool_of(&a, outside), None);
    a.end_allocate_to_pool(POOL).unwrap();
    let after = a.malloc(4096, CAPTURE).unwrap();
    assert_eq!(pool_of(&a, after), None);
    // Each allocation got its own segment: nothing is shared across pools.
    let pools: Vec<(u64, MempoolId)> = a
        .segments()
        .iter()
        .map(|s| (s.address, s.segment_pool_id))
        .collect();
    assert_eq!(pools.len(), 4, "{pools:x?}");
    assert_eq!(pools.iter().filter(|(_, id)| *id == POOL).count(), 2);
    let base = |ptr| a.base_allocation(ptr).unwrap().0;
    for (ptr, pool) in [
        (inside, POOL),
        (large, POOL),
        (outside, (0, 0)),
        (after, (0, 0)),
    ] {
        assert!(pools.contains(&(base(ptr), pool)), "{ptr:#x}");
    }
    checked(&a);
}

#[test]
fn a_block_freed_during_capture_is_reused_in_the_capture_but_never_after_it() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let p = a.malloc(4096, CAPTURE).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, CAPTURE).unwrap();
    assert_eq!(q, p, "inside the capture the pool reuses its freed block");
    a.free(q).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();

    // The graph may replay into p: no allocation after the capture gets it, even on the
    // capture's stream and at the very size.
    let segment_of_p = a.base_allocation_of_pool_block(p);
    for _ in 0..3 {
        let r = a.malloc(4096, CAPTURE).unwrap();
        assert_ne!(r, p);
        assert_eq!(pool_of(&a, r), None);
        assert!(!segment_of_p.contains(&r));
    }
    // Nor after empty_cache: the graph still holds its pool.
    a.empty_cache().unwrap();
    assert_eq!(a.pool_use_count(POOL), Some(1));
    let r = a.malloc(4096, CAPTURE).unwrap();
    assert!(!segment_of_p.contains(&r));
    checked(&a);
}

/// The address range of the (free) pool segment holding `ptr`, from the snapshot.
trait PoolSegment {
    fn base_allocation_of_pool_block(&self, ptr: u64) -> std::ops::Range<u64>;
}

impl PoolSegment for DeviceAllocator<SimDevice> {
    fn base_allocation_of_pool_block(&self, ptr: u64) -> std::ops::Range<u64> {
        self.segments()
            .iter()
            .find(|s| s.address <= ptr && ptr < s.address + s.total_size)
            .map(|s| {
                assert_ne!(
                    s.segment_pool_id,
                    (0, 0),
                    "{ptr:#x} is not in a private pool"
                );
                s.address..s.address + s.total_size
            })
            .expect("a segment holds the block")
    }
}

#[test]
fn two_graphs_sharing_a_pool_reuse_each_others_freed_blocks_and_nobody_else_does() {
    let mut a = allocator(GIB);
    let shared: MempoolId = (0, 7);
    // Graph 1 allocates and frees a scratch buffer, and keeps an output.
    a.begin_allocate_to_pool(shared, on(CAPTURE)).unwrap();
    let scratch = a.malloc(3 * MIB, CAPTURE).unwrap();
    let output = a.malloc(2 * MIB, CAPTURE).unwrap();
    a.free(scratch).unwrap();
    a.end_allocate_to_pool(shared).unwrap();
    let between = a.malloc(3 * MIB, CAPTURE).unwrap();
    assert_ne!(
        between, scratch,
        "an ordinary allocation never gets the pool's block"
    );

    // Graph 2 captures into the same pool on the same stream: it gets graph 1's freed block.
    a.begin_allocate_to_pool(shared, on(CAPTURE)).unwrap();
    assert_eq!(a.pool_use_count(shared), Some(2));
    let reused = a.malloc(3 * MIB, CAPTURE).unwrap();
    assert_eq!(reused, scratch);
    a.free(reused).unwrap();
    a.end_allocate_to_pool(shared).unwrap();
    assert_eq!(
        a.device().counters().mallocs,
        2,
        "one pool segment, one ordinary"
    );

    // PyTorch's stream rule holds inside pools too: a capture on another stream does not get
    // blocks cached for the first one.
    a.begin_allocate_to_pool(shared, on(OTHER)).unwrap();
    let elsewhere = a.malloc(3 * MIB, OTHER).unwrap();
    assert_ne!(elsewhere, scratch);
    assert_eq!(pool_of(&a, elsewhere), Some(shared));
    a.end_allocate_to_pool(shared).unwrap();
    assert_eq!(a.pool_use_count(shared), Some(3));
    a.free(output).unwrap();
    a.free(elsewhere).unwrap();
    a.free(between).unwrap();
    checked(&a);
}

#[test]
fn a_pool_returns_its_memory_only_once_unreferenced_and_empty() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let kept = a.malloc(MIB, CAPTURE).unwrap();
    let scratch = a.malloc(12 * MIB, CAPTURE).unwrap();
    a.free(scratch).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let reserved = a.reserved_bytes();
    assert_eq!(reserved, 2 * MIB + 12 * MIB);

    // Referenced: empty_cache keeps everything, even the wholly free 12 MiB segment.
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), reserved);

    // g.reset(): no reference left, but a block is live (an output the program kept): the pool
    // keeps all its memory (PyTorch would already release the free 12 MiB segment).
    a.release_pool(POOL).unwrap();
    assert_eq!(a.pool_use_count(POOL), Some(0));
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), reserved);
    assert_eq!(a.pool_use_count(POOL), Some(0));
    checked(&a);

    // The output dies: the pool's last segment goes back and the pool is gone.
    a.free(kept).unwrap();
    assert_eq!(a.reserved_bytes(), reserved, "only empty_cache releases");
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.pool_use_count(POOL), None);
    assert!(a.private_pools().is_empty());
    assert!(a.device().allocations().is_empty());
    checked(&a);
}

#[test]
fn statistics_count_pool_memory_as_pytorch_does() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let small = a.malloc(1000, CAPTURE).unwrap();
    let large = a.malloc(5 * MIB, CAPTURE).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.all.current, 2);
    assert_eq!(s.allocated_bytes.small_pool.current, 1024);
    assert_eq!(s.allocated_bytes.large_pool.current, 5 * MIB as i64);
    assert_eq!(s.segment.small_pool.current, 1);
    assert_eq!(s.segment.large_pool.current, 1);
    assert_eq!(s.reserved_bytes.all.current, (2 + 20) as i64 * MIB as i64);
    assert_eq!(s.requested_bytes.all.current, 1000 + 5 * MIB as i64);
    a.free(small).unwrap();
    a.free(large).unwrap();
    assert_eq!(a.stats().allocated_bytes.all.current, 0);
    assert_eq!(a.stats().inactive_split.all.current, 0);
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    let s = a.stats();
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.segment.all.freed, 2);
    assert_eq!(s.num_device_free, 2);
    checked(&a);
}

#[test]
fn refused_pool_calls_change_nothing() {
    let mut a = allocator(GIB);
    assert_eq!(a.release_pool(POOL), Err(PoolError::Unknown(POOL)));
    assert_eq!(
        a.end_allocate_to_pool(POOL),
        Err(PoolError::NotRecording(POOL))
    );
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    assert_eq!(
        a.begin_allocate_to_pool(POOL, on(OTHER)),
        Err(PoolError::AlreadyRecording(POOL))
    );
    assert_eq!(
        a.pool_use_count(POOL),
        Some(1),
        "the refused begin took no reference"
    );
    assert_eq!(a.release_pool(POOL), Err(PoolError::StillRecording(POOL)));
    let p = a.malloc(4096, OTHER).unwrap();
    assert_eq!(
        pool_of(&a, p),
        None,
        "the refused capture's filter is not used"
    );
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    assert_eq!(a.release_pool(POOL), Err(PoolError::NotReferenced(POOL)));
    assert_eq!(
        a.begin_allocate_to_pool((0, 0), on(OTHER)),
        Err(PoolError::OrdinaryId)
    );
    assert_eq!(
        PoolError::AlreadyRecording(POOL).to_string(),
        "beginAllocateToPool: already recording to mempool_id (1, 0)"
    );
    checked(&a);
}

#[test]
fn a_failing_stream_filter_refuses_the_allocation() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(
        POOL,
        Box::new(|_| Err("cudaErrorInvalidResourceHandle".into())),
    )
    .unwrap();
    let err = a.malloc(4096, CAPTURE).unwrap_err();
    assert!(
        matches!(&err, AllocError::StreamFilter { pool, message } if *pool == POOL && message == "cudaErrorInvalidResourceHandle"),
        "{err:?}"
    );
    assert!(err.to_string().contains("pool (1, 0) failed"), "{err}");
    assert_eq!(a.live_allocations(), 0);
    assert_eq!(a.reserved_bytes(), 0);
    a.end_allocate_to_pool(POOL).unwrap();
    a.malloc(4096, CAPTURE).unwrap();
    checked(&a);
}

#[test]
fn a_capture_into_a_released_pool_takes_it_back() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let p = a.malloc(4096, CAPTURE).unwrap();
    a.free(p).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    assert_eq!(a.pool_use_count(POOL), Some(1));
    assert_eq!(a.malloc(4096, CAPTURE).unwrap(), p);
    a.end_allocate_to_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        a.reserved_bytes(),
        2 * MIB,
        "referenced again: nothing released"
    );
    checked(&a);
}

#[test]
fn stream_uses_recorded_during_capture_need_no_event_but_earlier_ones_do() {
    let mut a = allocator(GIB);
    let before = a.malloc(4096, CAPTURE).unwrap();
    a.record_stream(before, OTHER).unwrap();
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    // The graph captures on CAPTURE and on OTHER, which it forked.
    a.device_mut().begin_capture(CAPTURE);
    a.device_mut().begin_capture(OTHER);
    let during = a.malloc(4096, CAPTURE).unwrap();
    a.record_stream(during, OTHER).unwrap();
    // Freed during the capture: no event may be recorded now.
    a.free(during).unwrap();
    a.free(before).unwrap();
    assert_eq!(a.device().counters().events_recorded, 0);
    assert_ne!(a.malloc(4096, CAPTURE).unwrap(), during, "not yet reusable");
    a.device_mut().end_capture(OTHER);
    a.device_mut().end_capture(CAPTURE);
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);

    // After the capture, the next allocation records the deferred events: `during` was used on
    // OTHER only inside the capture (that work is part of the graph), so it is free at once;
    // `before` waits for OTHER's work from before the capture.
    let _ordinary = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.device().counters().events_recorded, 1);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let again = a.malloc(4096, CAPTURE).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(again, during, "free in its pool without waiting");
    assert_ne!(
        a.malloc(4096, CAPTURE).unwrap(),
        before,
        "still waiting for OTHER"
    );
    a.device_mut().complete_stream(OTHER);
    assert_eq!(a.malloc(4096, CAPTURE).unwrap(), before);
    checked(&a);
}

#[test]
fn out_of_memory_counts_cached_pool_memory_as_allocated() {
    let mut a = allocator(64 * MIB);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let scratch = a.malloc(40 * MIB, CAPTURE).unwrap();
    a.free(scratch).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    let syncs = a.stats().num_sync_all_streams;
    let err = a.malloc(40 * MIB, 0).unwrap_err();
    let AllocError::OutOfMemory(oom) = err else {
        panic!("{err:?}")
    };
    assert!(
        oom.message.contains(
            "Of the allocated memory 40.00 MiB is allocated by PyTorch, with 40.00 MiB allocated \
             in private pools (e.g., CUDA Graphs), and 0 bytes is reserved by PyTorch but unallocated."
        ),
        "{}",
        oom.message
    );
    // The retry released every cached block it could, and none of the graph's.
    assert_eq!(a.stats().num_sync_all_streams, syncs + 1);
    assert_eq!(a.reserved_bytes(), 40 * MIB);
    checked(&a);
}

#[test]
fn during_a_capture_the_out_of_memory_path_does_not_synchronize() {
    let config = Config {
        max_split_size: 16 * MIB,
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(64 * MIB), 0, config);
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    a.device_mut().begin_capture(CAPTURE);
    let big = a.malloc(40 * MIB, CAPTURE).unwrap();
    a.free(big).unwrap();
    // An oversize free block of the pool would be released by PyTorch here; not by ferrocache.
    assert!(matches!(
        a.malloc(50 * MIB, CAPTURE),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(a.stats().num_sync_all_streams, 0);
    assert_eq!(a.reserved_bytes(), 40 * MIB);
    assert_eq!(a.malloc(40 * MIB, CAPTURE).unwrap(), big);
    a.device_mut().end_capture(CAPTURE);
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
}

#[test]
fn expandable_segments_of_a_pool_are_its_own() {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(GIB), 0, config);
    let ordinary = a.malloc(30 * MIB, CAPTURE).unwrap();
    a.free(ordinary).unwrap();
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let inside = a.malloc(30 * MIB, CAPTURE).unwrap();
    assert_ne!(
        inside, ordinary,
        "the ordinary segment's free pages are not the pool's"
    );
    assert_eq!(pool_of(&a, inside), Some(POOL));
    a.free(inside).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    assert_eq!(a.expandable_segment_ranges().len(), 2);
    a.empty_cache().unwrap();
    // The ordinary segment gave everything back; the pool's keeps its pages.
    assert_eq!(a.reserved_bytes(), 40 * MIB);
    assert_eq!(a.expandable_segment_ranges().len(), 1);
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
    assert!(a.private_pools().is_empty());
    checked(&a);
}

/// `torch.cuda.MemPool(use_on_oom=True)`'s pool, id `(0, 1)` as PyTorch numbers user pools.
const USER_POOL: MempoolId = (0, 1);

#[test]
fn a_use_on_oom_pool_lends_its_cached_block_to_an_allocation_that_would_run_out() {
    let mut a = allocator(GIB);
    a.set_memory_fraction(300.0 / 1024.0).unwrap();
    a.create_or_incref_pool(USER_POOL).unwrap();
    // torch.cuda.use_mem_pool: a reference for the block, on the stream used outside it too.
    a.begin_allocate_to_pool(USER_POOL, on(OTHER)).unwrap();
    let in_pool = a.malloc(200 * MIB, OTHER).unwrap();
    a.end_allocate_to_pool(USER_POOL).unwrap();
    a.release_pool(USER_POOL).unwrap();
    a.free(in_pool).unwrap();
    // 200 MiB cached in the pool; 150 MiB more would pass the 300 MiB limit.
    assert!(
        a.malloc(150 * MIB, OTHER).is_err(),
        "without use_on_oom: out of memory"
    );
    a.set_pool_options(USER_POOL, true, false).unwrap();
    let lent = a.malloc(150 * MIB, OTHER).unwrap();
    assert_eq!(lent, in_pool, "the pool's cached block serves it");
    assert_eq!(pool_of(&a, lent), Some(USER_POOL));
    a.free(lent).unwrap();
    assert_eq!(
        a.reserved_bytes(),
        200 * MIB,
        "the block went back to the pool"
    );
    checked(&a);
}

#[test]
fn a_no_split_pool_hands_its_blocks_out_whole() {
    let mut a = allocator(GIB);
    a.create_or_incref_pool(USER_POOL).unwrap();
    a.set_pool_options(USER_POOL, false, true).unwrap();
    a.begin_allocate_to_pool(USER_POOL, on(CAPTURE)).unwrap();
    let first = a.malloc(100_000, CAPTURE).unwrap();
    let second = a.malloc(100_000, CAPTURE).unwrap();
    a.end_allocate_to_pool(USER_POOL).unwrap();
    let sizes: Vec<u64> = a.segments().iter().map(|s| s.total_size).collect();
    assert_eq!(
        sizes,
        [2 * MIB as u64, 2 * MIB as u64],
        "one small segment each"
    );
    assert_eq!(a.allocation_info(first).unwrap().size, 2 * MIB);
    assert_ne!(
        a.base_allocation(first).unwrap().0,
        a.base_allocation(second).unwrap().0
    );
    checked(&a);
}

#[test]
fn emptying_a_released_pool_returns_its_free_segments_even_while_one_block_lives() {
    let mut a = allocator(GIB);
    a.create_or_incref_pool(USER_POOL).unwrap();
    a.begin_allocate_to_pool(USER_POOL, on(CAPTURE)).unwrap();
    let kept = a.malloc(30 * MIB, CAPTURE).unwrap();
    let scratch = a.malloc(4096, CAPTURE).unwrap();
    a.end_allocate_to_pool(USER_POOL).unwrap();
    a.release_pool(USER_POOL).unwrap();
    a.free(scratch).unwrap();
    let ordinary = a.malloc(4096, OTHER).unwrap();
    a.free(ordinary).unwrap();
    a.empty_pool_cache(USER_POOL).unwrap();
    assert_eq!(
        a.reserved_bytes(),
        34 * MIB,
        "a referenced pool keeps its memory"
    );
    a.release_pool(USER_POOL).unwrap();
    a.empty_pool_cache(USER_POOL).unwrap();
    assert_eq!(
        a.reserved_bytes(),
        32 * MIB,
        "the pool's free small segment went back; the ordinary pools kept theirs"
    );
    a.free(kept).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.pool_use_count(USER_POOL), None, "the pool is forgotten");
    checked(&a);
}

/// `torch.cuda.use_mem_pool(pool)`'s filter: every allocation of the calling thread.
fn mem_pool_filter() -> StreamFilter {
    Box::new(|_| Ok(true))
}

/// A `Config` modelling PyTorch `major.minor`.
fn modelling(version: (u32, u32)) -> Config {
    Config {
        modelled: ferrocache::config::ModelledPyTorch::of_version(version),
        ..Config::default()
    }
}

#[test]
fn inside_a_mem_pool_the_last_out_of_memory_retry_releases_the_ordinary_cache() {
    let mut a = allocator(64 * MIB);
    let cached = a.malloc(40 * MIB, 0).unwrap();
    a.free(cached).unwrap();
    // A pool records, but no stream captures: PyTorch 2.15's is_capture_context() is false,
    // so the retry that releases every cached block runs and the allocation succeeds.
    a.begin_allocate_to_pool(POOL, mem_pool_filter()).unwrap();
    let ptr = a.malloc(50 * MIB, 0).unwrap();
    assert_eq!(pool_of(&a, ptr), Some(POOL));
    let stats = a.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(stats.num_sync_all_streams, 1);
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
}

#[test]
fn pytorch_before_2_13_treats_a_recording_mem_pool_as_a_capture() {
    let mut a = DeviceAllocator::new(SimDevice::new(64 * MIB), 0, modelling((2, 12)));
    let cached = a.malloc(40 * MIB, 0).unwrap();
    a.free(cached).unwrap();
    a.begin_allocate_to_pool(POOL, mem_pool_filter()).unwrap();
    assert!(matches!(
        a.malloc(50 * MIB, 0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(a.stats().num_device_free, 0);
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
}

#[test]
fn inside_a_mem_pool_frees_used_on_other_streams_wait_for_events_processed_by_the_next_malloc() {
    let mut a = allocator(GIB);
    a.begin_allocate_to_pool(POOL, mem_pool_filter()).unwrap();
    let used = a.malloc(MIB, 0).unwrap();
    a.record_stream(used, OTHER).unwrap();
    a.free(used).unwrap();
    // Not a capture: the event is recorded at once, as outside any pool.
    assert_eq!(a.device().counters().events_recorded, 1);
    assert_ne!(a.malloc(MIB, 0).unwrap(), used, "OTHER has not finished");
    a.device_mut().complete_stream(OTHER);
    // The next malloc processes the completed event and reuses the block in the pool.
    let again = a.malloc(MIB, 0).unwrap();
    assert_eq!(again, used);
    assert_eq!(pool_of(&a, again), Some(POOL));
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
}

#[test]
fn inside_a_mem_pool_empty_cache_releases_the_ordinary_pools_but_during_a_capture_it_does_not() {
    let mut a = allocator(GIB);
    let ordinary = a.malloc(30 * MIB, 0).unwrap();
    a.free(ordinary).unwrap();
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let inside = a.malloc(MIB, CAPTURE).unwrap();
    // A graph captures on CAPTURE, the caller's current stream: the ordinary pools stay.
    a.device_mut().begin_capture(CAPTURE);
    a.empty_cache_for(Some(CAPTURE)).unwrap();
    assert_eq!(a.stats().num_device_free, 0);
    // The same pool recording with no stream capturing (`use_mem_pool`): they go.
    a.device_mut().end_capture(CAPTURE);
    a.empty_cache_for(Some(CAPTURE)).unwrap();
    assert_eq!(a.stats().num_device_free, 1);
    assert!(
        a.allocation_info(inside).is_some(),
        "the pool keeps its memory"
    );
    a.end_allocate_to_pool(POOL).unwrap();
    checked(&a);
}

#[test]
fn empty_cache_not_told_the_current_stream_takes_a_recording_pool_for_a_capture() {
    let mut a = allocator(GIB);
    let ordinary = a.malloc(30 * MIB, 0).unwrap();
    a.free(ordinary).unwrap();
    // The pool already has memory on stream 0; a graph now captures into it on CAPTURE, where
    // no block lives yet. Without the current stream nothing says which stream the caller is
    // on: no synchronization, no release of the ordinary pools (the rule before 2.13).
    a.begin_allocate_to_pool(POOL, on(0)).unwrap();
    let inside = a.malloc(MIB, 0).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    a.device_mut().begin_capture(CAPTURE);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().num_device_free, 0);
    a.device_mut().end_capture(CAPTURE);
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(inside).unwrap();
    checked(&a);
}

#[test]
fn a_free_deferred_by_a_capture_waits_while_its_streams_still_capture() {
    let mut a = allocator(GIB);
    // One thread captures a graph on CAPTURE, another allocates in a mem pool on stream 0.
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    a.begin_allocate_to_pool((0, 9), Box::new(|s| Ok(s == 0)))
        .unwrap();
    a.device_mut().begin_capture(CAPTURE);
    let during = a.malloc(MIB, CAPTURE).unwrap();
    a.record_stream(during, OTHER).unwrap();
    a.free(during).unwrap();
    // The mem pool's thread processes events: the capture's deferred free must not record an
    // event on its capturing stream (the device would refuse to query it).
    let _elsewhere = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.device().counters().events_recorded, 0);
    a.device_mut().end_capture(CAPTURE);
    a.end_allocate_to_pool(POOL).unwrap();
    a.end_allocate_to_pool((0, 9)).unwrap();
    let _ = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.device().counters().events_recorded, 1, "now OTHER's");
    checked(&a);
}
