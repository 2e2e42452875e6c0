//! Property tests: random programs of malloc / free / record_stream / empty_cache / injected
//! device failures / CUDA graph captures into private pools (shared between captures through
//! a few pool ids), on several streams, with sizes from 1 byte to 1 GiB, checking after every
//! step that the allocator never hands out memory twice, that a pool's memory serves that pool
//! only and stays its own while the pool is referenced or holds a live block, and that its
//! books balance.

use ferrocache::allocator::private_pool::{MempoolId, PoolError};
use ferrocache::allocator::{AllocError, DeviceAllocator};
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use ferrocache::device::{DevicePtr, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const STREAMS: [StreamId; 3] = [0, 0x1000, 0x2000];
/// The pool ids captures use; several captures into one id share its pool, as graphs do through
/// `torch.cuda.graph_pool_handle()`.
const POOL_IDS: [MempoolId; 3] = [(1, 0), (2, 0), (0, 1)];
const ORDINARY: MempoolId = (0, 0);

#[derive(Debug, Clone)]
enum Op {
    Malloc {
        size: usize,
        stream: usize,
    },
    Free {
        pick: usize,
    },
    RecordStream {
        pick: usize,
        stream: usize,
    },
    CompleteStream {
        stream: usize,
    },
    EmptyCache,
    FailNextMallocs {
        count: usize,
    },
    ResetPeaks,
    /// `torch.cuda.graph(g, pool=...)` begins: allocations on `stream` go to the pool.
    BeginCapture {
        pool: usize,
        stream: usize,
    },
    EndCapture {
        pick: usize,
    },
    /// `g.reset()`: a graph holding the pool is gone.
    ReleasePool {
        pool: usize,
    },
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1..=MIB,
        3 => MIB..10 * MIB,
        2 => 10 * MIB..=200 * MIB,
        1 => 200 * MIB..=GIB,
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0..STREAMS.len()).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0..STREAMS.len()).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0..STREAMS.len()).prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
        1 => (1..3usize).prop_map(|count| Op::FailNextMallocs { count }),
        1 => Just(Op::ResetPeaks),
        2 => (0..POOL_IDS.len(), 0..STREAMS.len()).prop_map(|(pool, stream)| Op::BeginCapture { pool, stream }),
        2 => any::<usize>().prop_map(|pick| Op::EndCapture { pick }),
        1 => (0..POOL_IDS.len()).prop_map(|pool| Op::ReleasePool { pool }),
    ]
}

/// A freed range that must not be handed out again until its streams have moved on.
struct Protected {
    ptr: DevicePtr,
    size: usize,
    /// Per stream that used it: the stream's completion count when the block was freed.
    waits_for: Vec<(usize, u64)>,
    /// Freed during a capture with uses on other streams: not reusable at all before every
    /// capture has ended.
    until_no_capture: bool,
}

/// A live allocation, with the pool it must have come from.
#[derive(Debug, Clone, Copy)]
struct Live {
    ptr: DevicePtr,
    size: usize,
    pool: MempoolId,
}

struct Model {
    allocator: DeviceAllocator<SimDevice>,
    live: Vec<Live>,
    /// Other streams each live allocation was used on, as the test recorded them.
    uses: BTreeMap<DevicePtr, Vec<usize>>,
    /// The subset of `uses` recorded while a capture was under way.
    capture_uses: BTreeMap<DevicePtr, Vec<usize>>,
    /// Captures under way, oldest first: (pool, stream index).
    captures: Vec<(MempoolId, usize)>,
    /// The references each pool holds, as the test counts them.
    use_counts: BTreeMap<MempoolId, u32>,
    /// Each private pool's memory at the last step: (start, end) ranges from the snapshot.
    pool_memory: BTreeMap<MempoolId, Vec<(u64, u64)>>,
    protected: Vec<Protected>,
    completions: [u64; STREAMS.len()],
    syncs_seen: i64,
    expandable: bool,
}

impl Model {
    fn new(config: Config) -> Model {
        let expandable = config.expandable_segments;
        Model {
            allocator: DeviceAllocator::new(SimDevice::new(4 * GIB), 0, config),
            live: Vec::new(),
            uses: BTreeMap::new(),
            capture_uses: BTreeMap::new(),
            captures: Vec::new(),
            use_counts: BTreeMap::new(),
            pool_memory: BTreeMap::new(),
            protected: Vec::new(),
            completions: [0; STREAMS.len()],
            syncs_seen: 0,
            expandable,
        }
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Malloc { size, stream } => match self.allocator.malloc(size, STREAMS[stream]) {
                Ok(ptr) => {
                    let info = self.allocator.allocation_info(ptr).unwrap();
                    prop_assert!(info.size >= size);
                    prop_assert_eq!(info.stream, STREAMS[stream]);
                    // PyTorch's get_pool: the first capture whose filter accepts the stream.
                    let pool = self
                        .captures
                        .iter()
                        .find(|&&(_, s)| s == stream)
                        .map_or(ORDINARY, |&(id, _)| id);
                    prop_assert_eq!(info.private_pool.unwrap_or(ORDINARY), pool);
                    self.lift_synchronized_protections();
                    self.check_not_protected(ptr, info.size)?;
                    self.live.push(Live {
                        ptr,
                        size: info.size,
                        pool,
                    });
                }
                Err(AllocError::OutOfMemory(oom)) => {
                    prop_assert!(
                        oom.message
                            .starts_with("CUDA out of memory. Tried to allocate")
                    );
                    self.lift_synchronized_protections();
                }
                Err(other) => prop_assert!(false, "unexpected error {other}"),
            },
            Op::Free { pick } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let Live { ptr, size, .. } = self.live.swap_remove(pick % self.live.len());
                let mut uses = self.uses.remove(&ptr).unwrap_or_default();
                let during_capture = self.capture_uses.remove(&ptr).unwrap_or_default();
                self.allocator.free(ptr).unwrap();
                let deferred = !uses.is_empty() && !self.captures.is_empty();
                if deferred {
                    // The capture's own work on those streams is part of the graph.
                    uses.retain(|s| !during_capture.contains(s));
                }
                if !uses.is_empty() || deferred {
                    let waits_for = uses.iter().map(|&s| (s, self.completions[s])).collect();
                    self.protected.push(Protected {
                        ptr,
                        size,
                        waits_for,
                        until_no_capture: deferred,
                    });
                }
            }
            Op::RecordStream { pick, stream } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let ptr = self.live[pick % self.live.len()].ptr;
                self.allocator.record_stream(ptr, STREAMS[stream]).unwrap();
                self.record_use(ptr, stream);
            }
            Op::CompleteStream { stream } => {
                self.allocator.device_mut().complete_stream(STREAMS[stream]);
                self.completions[stream] += 1;
            }
            Op::EmptyCache => self.empty_cache()?,
            Op::FailNextMallocs { count } => {
                if self.expandable {
                    self.allocator.device_mut().fail_next(
                        ferrocache::device::sim::SimOp::CreatePhysical,
                        count,
                        ferrocache::device::DeviceError::OutOfMemory,
                    );
                } else {
                    self.allocator.device_mut().fail_next_mallocs(count);
                }
            }
            Op::ResetPeaks => self.allocator.reset_peak_stats(),
            Op::BeginCapture { pool, stream } => {
                let id = POOL_IDS[pool];
                let capture_stream = STREAMS[stream];
                let result = self
                    .allocator
                    .begin_allocate_to_pool(id, Box::new(move |s| Ok(s == capture_stream)));
                if self.captures.iter().any(|&(p, _)| p == id) {
                    prop_assert_eq!(result, Err(PoolError::AlreadyRecording(id)));
                } else {
                    prop_assert_eq!(result, Ok(()));
                    self.captures.push((id, stream));
                    *self.use_counts.entry(id).or_default() += 1;
                }
            }
            Op::EndCapture { pick } => {
                if self.captures.is_empty() {
                    let id = POOL_IDS[pick % POOL_IDS.len()];
                    prop_assert_eq!(
                        self.allocator.end_allocate_to_pool(id),
                        Err(PoolError::NotRecording(id))
                    );
                } else {
                    let (id, _) = self.captures.remove(pick % self.captures.len());
                    prop_assert_eq!(self.allocator.end_allocate_to_pool(id), Ok(()));
                    if self.captures.is_empty() {
                        for p in &mut self.protected {
                            p.until_no_capture = false;
                        }
                    }
                }
            }
            Op::ReleasePool { pool } => {
                let id = POOL_IDS[pool];
                let result = self.allocator.release_pool(id);
                let count = self.use_counts.get(&id).copied().unwrap_or(0);
                let recording = self.captures.iter().any(|&(p, _)| p == id);
                if count == 0 {
                    prop_assert!(
                        matches!(
                            result,
                            Err(PoolError::NotReferenced(_) | PoolError::Unknown(_))
                        ),
                        "{:?}",
                        result
                    );
                } else if count == 1 && recording {
                    prop_assert_eq!(result, Err(PoolError::StillRecording(id)));
                } else {
                    prop_assert_eq!(result, Ok(()));
                    self.use_counts.insert(id, count - 1);
                }
            }
        }
        self.check()
    }

    /// Whether pool `id` must keep its memory: a graph holds it, or a block in it is live.
    fn pool_is_alive(&self, id: MempoolId) -> bool {
        self.use_counts.get(&id).is_some_and(|&c| c > 0) || self.live.iter().any(|l| l.pool == id)
    }

    /// Whether empty_cache may give back memory of segments reported under `id`;
    /// `holding_live` lists the private pools with a live block.
    fn may_release(&self, id: MempoolId, holding_live: &[MempoolId]) -> bool {
        if id == ORDINARY {
            // Releasing the ordinary pools synchronizes, which a capture forbids.
            self.captures.is_empty()
        } else {
            self.use_counts.get(&id).is_none_or(|&c| c == 0) && !holding_live.contains(&id)
        }
    }

    fn record_use(&mut self, ptr: DevicePtr, stream: usize) {
        let own = self.allocator.allocation_info(ptr).unwrap().stream;
        if STREAMS[stream] == own {
            return;
        }
        let list = self.uses.entry(ptr).or_default();
        if !list.contains(&stream) {
            list.push(stream);
        }
        if !self.captures.is_empty() {
            let list = self.capture_uses.entry(ptr).or_default();
            if !list.contains(&stream) {
                list.push(stream);
            }
        }
    }

    /// A full synchronization (empty_cache, or the out-of-memory path) legitimately ends every
    /// wait.
    fn lift_synchronized_protections(&mut self) {
        let syncs = self.allocator.stats().num_sync_all_streams;
        if syncs != self.syncs_seen {
            self.syncs_seen = syncs;
            self.protected.clear();
        }
    }

    fn check_not_protected(&mut self, ptr: DevicePtr, size: usize) -> Result<(), TestCaseError> {
        let completions = self.completions;
        // A stream the allocator synchronized (unmapping pages waits for the segment's stream)
        // has finished too.
        let device = self.allocator.device();
        self.protected.retain(|p| {
            p.until_no_capture
                || p.waits_for
                    .iter()
                    .any(|&(s, at)| completions[s] <= at && !device.stream_is_idle(STREAMS[s]))
        });
        for p in &self.protected {
            let overlaps = ptr < p.ptr + p.size as u64 && p.ptr < ptr + size as u64;
            prop_assert!(
                !overlaps,
                "{ptr:#x} reused before the streams that used {:#x} completed",
                p.ptr
            );
        }
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), TestCaseError> {
        let before = self.allocator.device().allocations();
        let segments = self.allocator.segments();
        // Pending frees wait for a synchronization, which a capture forbids.
        let pending_stays = !self.captures.is_empty();
        let live_in = |s: &ferrocache::allocator::history::SnapshotSegment| {
            s.blocks.iter().any(|b| {
                b.state == "active_allocated" || (pending_stays && b.state == "active_pending_free")
            })
        };
        let holding_live: Vec<MempoolId> = segments
            .iter()
            .filter(|s| s.segment_pool_id != ORDINARY && live_in(s))
            .map(|s| s.segment_pool_id)
            .collect();
        let holding: Vec<DevicePtr> = segments
            .iter()
            .filter(|s| live_in(s) || !self.may_release(s.segment_pool_id, &holding_live))
            .map(|s| s.address)
            .collect();
        self.allocator.empty_cache().unwrap();
        self.lift_synchronized_protections();
        let after = self.allocator.device().allocations();
        if self.expandable {
            // Every whole page without a live byte is unmapped.
            for (base, size, page) in self.allocator.expandable_segment_ranges() {
                for s in self.allocator.segments() {
                    if s.address < base
                        || s.address >= base + size as u64
                        || !self.may_release(s.segment_pool_id, &holding_live)
                    {
                        continue;
                    }
                    for b in s.blocks.iter().filter(|b| b.state == "inactive") {
                        let first_page = (b.address - base).div_ceil(page as u64);
                        let end_page = (b.address + b.size - base) / page as u64;
                        prop_assert!(
                            first_page >= end_page,
                            "free block {:#x} still maps a whole page",
                            b.address
                        );
                    }
                }
            }
            let everything_releasable = self.captures.is_empty()
                && self.use_counts.values().all(|&c| c == 0)
                && self.protected.is_empty();
            if self.live.is_empty() && everything_releasable {
                prop_assert_eq!(self.allocator.device().mapped_bytes(), 0);
                prop_assert_eq!(self.allocator.device().live_physical_handles(), 0);
                // Address ranges may stay reserved: one whose first growth failed keeps its
                // range, as in PyTorch (it holds no memory: nothing is mapped, checked above).
                prop_assert!(
                    self.allocator.device().reserved_ranges()
                        <= self.allocator.expandable_segment_ranges().len()
                );
            }
        } else {
            // Exactly the segments holding nothing went back.
            let expected: BTreeMap<DevicePtr, usize> = before
                .into_iter()
                .filter(|(ptr, _)| holding.contains(ptr))
                .collect();
            prop_assert_eq!(after, expected);
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        if let Err(why) = self.allocator.check_invariants() {
            prop_assert!(false, "{}", why);
        }
        let mut live: Vec<(DevicePtr, usize)> = self.live.iter().map(|l| (l.ptr, l.size)).collect();
        live.sort();
        for w in live.windows(2) {
            prop_assert!(
                w[0].0 + w[0].1 as u64 <= w[1].0,
                "live blocks overlap: {w:x?}"
            );
        }
        for &(ptr, size) in &live {
            prop_assert_eq!(ptr % 512, 0);
            prop_assert!(
                self.allocator.device().is_accessible(ptr, size),
                "live block {ptr:#x} is not backed by device memory"
            );
        }
        self.check_pools()?;
        let stats = self.allocator.stats();
        prop_assert_eq!(stats.allocation.all.current as usize, live.len());
        let device = self.allocator.device();
        if self.expandable {
            prop_assert_eq!(
                stats.reserved_bytes.all.current as usize,
                device.mapped_bytes()
            );
        } else {
            let held: usize = device.allocations().values().sum();
            prop_assert_eq!(stats.reserved_bytes.all.current as usize, held);
        }
        prop_assert_eq!(
            device.physical_in_use(),
            stats.reserved_bytes.all.current as usize
        );
        Ok(())
    }
}

impl Model {
    /// A pool's block is never another pool's or an ordinary allocation's, and a pool that is
    /// referenced or holds a live block keeps all the memory it had.
    fn check_pools(&mut self) -> Result<(), TestCaseError> {
        let segments = self.allocator.segments();
        for l in &self.live {
            let segment = segments
                .iter()
                .find(|s| s.address <= l.ptr && l.ptr + l.size as u64 <= s.address + s.total_size);
            prop_assert!(
                segment.is_some(),
                "live block {:#x} is in no segment",
                l.ptr
            );
            prop_assert_eq!(
                segment.map(|s| s.segment_pool_id),
                Some(l.pool),
                "block {:#x} lies in memory of another pool",
                l.ptr
            );
        }
        let mut memory: BTreeMap<MempoolId, Vec<(u64, u64)>> = BTreeMap::new();
        for s in &segments {
            if s.segment_pool_id != ORDINARY {
                memory
                    .entry(s.segment_pool_id)
                    .or_default()
                    .push((s.address, s.address + s.total_size));
            }
        }
        for (id, before) in &self.pool_memory {
            if !self.pool_is_alive(*id) {
                continue;
            }
            let now = memory.get(id).map(Vec::as_slice).unwrap_or_default();
            for &(start, end) in before {
                prop_assert!(
                    covered(now, start, end),
                    "pool {:?} lost [{:#x}, {:#x}) while referenced or holding a live block",
                    id,
                    start,
                    end
                );
            }
        }
        self.pool_memory = memory;
        for &id in &POOL_IDS {
            let count = self.use_counts.get(&id).copied().unwrap_or(0);
            match self.allocator.pool_use_count(id) {
                Some(kept) => prop_assert_eq!(kept, count),
                None => prop_assert!(
                    count == 0 && !self.pool_is_alive(id),
                    "pool {id:?} is gone while alive"
                ),
            }
        }
        Ok(())
    }
}

/// Whether the sorted, disjoint `ranges` cover `[start, end)`.
fn covered(ranges: &[(u64, u64)], start: u64, end: u64) -> bool {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    let mut reached = start;
    for (s, e) in sorted {
        if s <= reached && e > reached {
            reached = e;
        }
    }
    reached >= end
}

fn run(config: Config, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Model::new(config);
    for op in ops {
        model.step(op)?;
    }
    // Wind down: end the captures, free everything, release every graph, empty the cache:
    // nothing may remain.
    while let Some((id, _)) = model.captures.pop() {
        model.allocator.end_allocate_to_pool(id).unwrap();
    }
    while let Some(live) = model.live.pop() {
        model.allocator.free(live.ptr).unwrap();
    }
    for (&id, count) in &mut model.use_counts {
        for _ in 0..*count {
            model.allocator.release_pool(id).unwrap();
        }
        *count = 0;
    }
    model.allocator.empty_cache().unwrap();
    model.check()?;
    prop_assert!(model.allocator.private_pools().is_empty());
    prop_assert_eq!(model.allocator.stats().reserved_bytes.all.current, 0);
    prop_assert_eq!(model.allocator.device().physical_in_use(), 0);
    prop_assert_eq!(model.allocator.device().live_events(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn default_settings_keep_every_invariant(ops in prop::collection::vec(op_strategy(), 1..160)) {
        run(Config::default(), &ops)?;
    }

    #[test]
    fn max_split_size_keeps_every_invariant(ops in prop::collection::vec(op_strategy(), 1..160)) {
        let config = Config { max_split_size: 64 * MIB, ..Config::default() };
        run(config, &ops)?;
    }

    #[test]
    fn power2_rounding_keeps_every_invariant(ops in prop::collection::vec(op_strategy(), 1..160)) {
        let config = Config { roundup_power2_divisions: [4; 16], ..Config::default() };
        run(config, &ops)?;
    }

    #[test]
    fn expandable_segments_keep_every_invariant(ops in prop::collection::vec(op_strategy(), 1..160)) {
        let config = Config { expandable_segments: true, ..Config::default() };
        run(config, &ops)?;
    }

    #[test]
    fn expandable_segments_with_max_split_size_keep_every_invariant(ops in prop::collection::vec(op_strategy(), 1..160)) {
        let config = Config { expandable_segments: true, max_split_size: 64 * MIB, ..Config::default() };
        run(config, &ops)?;
    }
}
