//! A private pool with an allocator of its own (`torch.cuda.MemPool(allocator=...)`, NCCL's
//! pool) on the simulated GPU: its segments come from that allocator and go back to it, as
//! PyTorch's `allocPrimitive` and `release_block` do, with the statistics, out-of-memory path and
//! limits of any segment; nothing else ever gets that memory, and that pool gets nothing else.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferrocache::allocator::private_pool::{MempoolId, PoolError, SegmentAllocator, StreamFilter};
use ferrocache::allocator::{AllocError, DeviceAllocator};
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use ferrocache::device::{DevicePtr, StreamId};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const POOL: MempoolId = (0, 1);
const STREAM: StreamId = 0x5000;
const OTHER: StreamId = 0x6000;
/// Where the pool's allocator puts its memory: far from the simulated device's addresses.
const EXTERNAL_BASE: DevicePtr = 0x1000_0000_0000;

/// What the pool's allocator saw, shared with the test.
#[derive(Debug, Default)]
struct Ledger {
    /// Sizes asked of `allocate`, in order (those it refused included).
    allocate_calls: Vec<usize>,
    /// Addresses given back, in order.
    deallocated: Vec<DevicePtr>,
    /// What it handed out and still holds out: address -> size.
    live: BTreeMap<DevicePtr, usize>,
    /// Bytes it may hand out in all.
    capacity: usize,
    /// Answer every `allocate` with this failure (a C++ exception, through the C ABI).
    fail_with: Option<String>,
    /// Refuse every `deallocate`.
    refuse_deallocate: bool,
    next: DevicePtr,
}

/// A counting allocator, as the Python tests' C one over `cudaMalloc`.
struct Counting {
    ledger: Arc<Mutex<Ledger>>,
    dropped: Arc<AtomicBool>,
}

impl SegmentAllocator for Counting {
    fn allocate(&mut self, size: usize) -> Result<Option<DevicePtr>, String> {
        let mut l = self.ledger.lock().unwrap();
        l.allocate_calls.push(size);
        if let Some(why) = &l.fail_with {
            return Err(why.clone());
        }
        let held: usize = l.live.values().sum();
        if held + size > l.capacity {
            return Ok(None);
        }
        let ptr = EXTERNAL_BASE + l.next;
        l.next += size.next_multiple_of(2 * MIB) as u64;
        l.live.insert(ptr, size);
        Ok(Some(ptr))
    }

    fn deallocate(&mut self, ptr: DevicePtr) -> Result<(), String> {
        let mut l = self.ledger.lock().unwrap();
        if l.refuse_deallocate {
            return Err("raw_delete threw".to_string());
        }
        assert!(
            l.live.remove(&ptr).is_some(),
            "{ptr:#x} given back twice, or never handed out"
        );
        l.deallocated.push(ptr);
        Ok(())
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

struct Pool {
    ledger: Arc<Mutex<Ledger>>,
    dropped: Arc<AtomicBool>,
}

impl Pool {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap()
    }
}

fn allocator(config: Config) -> DeviceAllocator<SimDevice> {
    DeviceAllocator::new(SimDevice::new(GIB), 0, config)
}

/// Makes `POOL` with a counting allocator of `capacity` bytes.
fn pool_with_allocator(a: &mut DeviceAllocator<SimDevice>, capacity: usize) -> Pool {
    let ledger = Arc::new(Mutex::new(Ledger {
        capacity,
        ..Ledger::default()
    }));
    let dropped = Arc::new(AtomicBool::new(false));
    let source = Counting {
        ledger: ledger.clone(),
        dropped: dropped.clone(),
    };
    a.create_pool_with_allocator(POOL, Box::new(source))
        .unwrap();
    Pool { ledger, dropped }
}

/// `use_mem_pool`'s filter: every allocation of `stream` goes to the pool.
fn on(stream: StreamId) -> StreamFilter {
    Box::new(move |s| Ok(s == stream))
}

/// SplitMix64: a fixed seed draws the same program every run.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `range`.
    fn within(&mut self, range: std::ops::Range<usize>) -> usize {
        range.start + (self.next() % (range.end - range.start) as u64) as usize
    }

    /// True with probability `percent` in 100.
    fn chance(&mut self, percent: usize) -> bool {
        self.within(0..100) < percent
    }
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
}

fn pool_of(a: &DeviceAllocator<SimDevice>, ptr: DevicePtr) -> Option<MempoolId> {
    a.allocation_info(ptr)
        .expect("a live allocation")
        .private_pool
}

#[test]
fn the_pools_segments_come_from_its_allocator_and_go_back_to_it_when_the_pool_goes() {
    let mut a = allocator(Config::default());
    let pool = pool_with_allocator(&mut a, GIB);
    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
    let small = a.malloc(4 * KIB, STREAM).unwrap();
    let large = a.malloc(30 * MIB, STREAM).unwrap();
    let reused = a.malloc(4 * KIB, STREAM).unwrap();
    let outside = a.malloc(4 * KIB, OTHER).unwrap();
    // PyTorch's segment sizes: 2 MiB for the small pool, the rounded request for the large.
    assert_eq!(pool.ledger().allocate_calls, [2 * MIB, 30 * MIB]);
    assert_eq!(pool_of(&a, small), Some(POOL));
    assert_eq!(pool_of(&a, large), Some(POOL));
    assert_eq!(
        reused,
        small + 4 * KIB as u64,
        "split from the pool's small segment"
    );
    assert_eq!(pool_of(&a, outside), None);
    // The device gave only the ordinary segment.
    assert_eq!(a.device().allocations().len(), 1);
    assert!(
        !a.device()
            .allocations()
            .contains_key(&a.base_allocation(small).unwrap().0)
    );
    // Counted as any segment, under the pool's id.
    let stats = a.stats();
    assert_eq!(stats.segment.all.current, 3);
    assert_eq!(stats.num_device_alloc, 3);
    assert_eq!(a.reserved_bytes(), 2 * MIB + 30 * MIB + 2 * MIB);
    let segments = a.segments();
    let ours: Vec<(DevicePtr, u64, bool)> = segments
        .iter()
        .filter(|s| s.segment_pool_id == POOL)
        .map(|s| (s.address, s.total_size, s.is_expandable))
        .collect();
    assert_eq!(
        ours,
        [
            (EXTERNAL_BASE, 2 * MIB as u64, false),
            (EXTERNAL_BASE + 2 * MIB as u64, 30 * MIB as u64, false)
        ]
    );
    checked(&a);

    // A referenced pool keeps its memory through empty_cache.
    for ptr in [small, large, reused] {
        a.free(ptr).unwrap();
    }
    // use_mem_pool's exit: the reference its begin took goes.
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert!(pool.ledger().deallocated.is_empty());

    // MemPool's destructor: releasePool, then emptyCache(pool).
    a.release_pool(POOL).unwrap();
    a.empty_pool_cache(POOL).unwrap();
    let mut given_back = pool.ledger().deallocated.clone();
    given_back.sort_unstable();
    assert_eq!(given_back, [EXTERNAL_BASE, EXTERNAL_BASE + 2 * MIB as u64]);
    assert!(pool.ledger().live.is_empty());
    assert!(
        pool.dropped.load(Ordering::SeqCst),
        "the allocator goes with the pool"
    );
    assert!(a.private_pools().is_empty());
    assert_eq!(a.stats().num_device_free, 2);
    assert_eq!(a.reserved_bytes(), 2 * MIB, "the ordinary segment stays");
    checked(&a);
}

#[test]
fn an_allocator_that_returns_null_is_out_of_memory_and_the_device_is_not_asked() {
    let mut a = allocator(Config::default());
    let pool = pool_with_allocator(&mut a, 40 * MIB);
    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
    let first = a.malloc(30 * MIB, STREAM).unwrap();
    let device_allocations = a.device().allocations().len();
    let err = a.malloc(30 * MIB, STREAM).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert_eq!(a.device().allocations().len(), device_allocations);
    // Inside use_mem_pool with no graph capture (the stream does not capture), PyTorch 2.13+
    // releases every cached block and asks the pool's allocator once more (is_capture_context).
    assert_eq!(pool.ledger().allocate_calls, [30 * MIB, 30 * MIB, 30 * MIB]);
    let stats = a.stats();
    assert_eq!(stats.num_ooms, 1);
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.segment.all.current, 1);

    // A C++ exception out of raw_alloc is out of memory too.
    pool.ledger().fail_with = Some("ncclMemAlloc failed".to_string());
    let err = a.malloc(4 * KIB, STREAM).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert_eq!(a.stats().num_ooms, 2);
    a.free(first).unwrap();
    checked(&a);
}

#[test]
fn the_memory_fraction_limits_the_pools_allocator_as_it_limits_the_device() {
    let mut a = allocator(Config::default());
    let pool = pool_with_allocator(&mut a, GIB);
    a.set_memory_fraction(0.05).unwrap(); // about 51 MiB of the 1 GiB device
    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
    let kept = a.malloc(40 * MIB, STREAM).unwrap();
    let err = a.malloc(40 * MIB, STREAM).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert_eq!(
        pool.ledger().allocate_calls,
        [40 * MIB],
        "the second is refused before the allocator is asked"
    );
    a.free(kept).unwrap();
    checked(&a);
}

#[test]
fn expandable_segments_do_not_apply_to_the_pool_whose_blocks_split_as_ordinary_large_ones() {
    let config = Config::parse("expandable_segments:True").unwrap();
    let mut a = allocator(config);
    let pool = pool_with_allocator(&mut a, GIB);
    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
    let p = a.malloc(30 * MIB, STREAM).unwrap();
    a.free(p).unwrap();
    // 512 KiB would be left: an expandable block splits it off, an ordinary large one keeps it.
    let q = a.malloc(30 * MIB - 512 * KIB, STREAM).unwrap();
    assert_eq!(q, p);
    assert_eq!(a.allocation_info(q).unwrap().size, 30 * MIB);
    assert_eq!(pool.ledger().allocate_calls, [30 * MIB]);
    assert!(
        a.segments()
            .iter()
            .all(|s| s.segment_pool_id != POOL || !s.is_expandable)
    );
    // The ordinary pools still get expandable segments.
    let outside = a.malloc(30 * MIB, OTHER).unwrap();
    assert!(
        a.expandable_segment_ranges()
            .iter()
            .any(|&(base, size, _)| { (base..base + size as u64).contains(&outside) })
    );
    a.free(q).unwrap();
    a.free(outside).unwrap();
    checked(&a);
}

#[test]
fn a_segment_its_allocator_refuses_to_take_back_stays_cached_and_goes_at_the_next_empty_cache() {
    let mut a = allocator(Config::default());
    let pool = pool_with_allocator(&mut a, GIB);
    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
    let p = a.malloc(4 * KIB, STREAM).unwrap();
    a.free(p).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap(); // use_mem_pool's reference
    a.release_pool(POOL).unwrap(); // the MemPool's
    pool.ledger().refuse_deallocate = true;
    assert!(a.empty_cache().is_err());
    assert_eq!(a.reserved_bytes(), 2 * MIB);
    assert_eq!(
        a.private_pools().len(),
        1,
        "the pool stays while it holds memory"
    );
    assert!(!pool.dropped.load(Ordering::SeqCst));
    checked(&a);
    pool.ledger().refuse_deallocate = false;
    a.empty_cache().unwrap();
    assert_eq!(pool.ledger().deallocated, [EXTERNAL_BASE]);
    assert_eq!(a.reserved_bytes(), 0);
    assert!(pool.dropped.load(Ordering::SeqCst));
    checked(&a);
}

#[test]
fn an_allocator_for_a_pool_that_exists_is_refused_and_dropped() {
    let mut a = allocator(Config::default());
    a.create_or_incref_pool(POOL).unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let source = Counting {
        ledger: Arc::default(),
        dropped: dropped.clone(),
    };
    assert_eq!(
        a.create_pool_with_allocator(POOL, Box::new(source)),
        Err(PoolError::AllocatorOfExistingPool(POOL))
    );
    assert!(dropped.load(Ordering::SeqCst));
    let source = Counting {
        ledger: Arc::default(),
        dropped: Arc::default(),
    };
    assert_eq!(
        a.create_pool_with_allocator((0, 0), Box::new(source)),
        Err(PoolError::OrdinaryId)
    );
}

#[test]
fn random_work_inside_and_outside_the_pool_never_hands_memory_to_two_owners() {
    let mut rng = Draw(35);
    let mut a = allocator(Config::default());
    let pool = pool_with_allocator(&mut a, 256 * MIB);
    let mut live: Vec<(DevicePtr, usize, bool)> = Vec::new();
    let mut recording = false;
    for step in 0..3000 {
        match rng.within(0..100) {
            0..3 => {
                if recording {
                    a.end_allocate_to_pool(POOL).unwrap();
                } else {
                    a.begin_allocate_to_pool(POOL, on(STREAM)).unwrap();
                    // begin takes a reference; drop it again so that the pool's count stays 1.
                    a.release_pool(POOL).unwrap();
                }
                recording = !recording;
            }
            3..5 => {
                if !recording {
                    a.empty_cache().unwrap();
                }
            }
            5..50 if !live.is_empty() => {
                let (ptr, _, _) = live.swap_remove(rng.within(0..live.len()));
                a.free(ptr).unwrap();
            }
            _ => {
                let size = if rng.chance(70) {
                    rng.within(1..MIB)
                } else {
                    rng.within(MIB..40 * MIB)
                };
                let stream = if rng.chance(50) { STREAM } else { OTHER };
                match a.malloc(size, stream) {
                    Ok(ptr) => {
                        let in_pool = recording && stream == STREAM;
                        assert_eq!(pool_of(&a, ptr), in_pool.then_some(POOL), "step {step}");
                        live.push((ptr, size, in_pool));
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(err) => panic!("step {step}: {err}"),
                }
            }
        }
        // Every live allocation lies in memory of its own owner, and in no other allocation.
        let external = pool.ledger().live.clone();
        let device = a.device().allocations();
        let within = |map: &BTreeMap<DevicePtr, usize>, ptr: DevicePtr, size: usize| {
            map.range(..=ptr)
                .next_back()
                .is_some_and(|(&base, &len)| ptr + size as u64 <= base + len as u64)
        };
        let mut spans: Vec<(DevicePtr, DevicePtr)> = Vec::new();
        for &(ptr, size, in_pool) in &live {
            let size = size.max(1);
            if in_pool {
                assert!(
                    within(&external, ptr, size),
                    "step {step}: {ptr:#x} not the pool's"
                );
            } else {
                assert!(
                    within(&device, ptr, size),
                    "step {step}: {ptr:#x} not the device's"
                );
            }
            spans.push((ptr, ptr + size as u64));
        }
        spans.sort_unstable();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "step {step}: two live allocations overlap"
        );
        if step % 100 == 0 {
            checked(&a);
        }
    }
    for (ptr, _, _) in live.drain(..) {
        a.free(ptr).unwrap();
    }
    if recording {
        a.end_allocate_to_pool(POOL).unwrap();
    }
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert!(
        pool.ledger().live.is_empty(),
        "every segment went back to its allocator"
    );
    assert!(pool.dropped.load(Ordering::SeqCst));
    assert_eq!(a.reserved_bytes(), 0);
    checked(&a);
}
