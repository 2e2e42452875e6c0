//! Property tests: random programs of malloc / free / record_stream / empty_cache / injected
//! device failures, on several streams, with sizes from 1 byte to 1 GiB, checking after every
//! step that the allocator never hands out memory twice and that its books balance.

use ferrocache::allocator::{AllocError, DeviceAllocator};
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use ferrocache::device::{DevicePtr, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const STREAMS: [StreamId; 3] = [0, 0x1000, 0x2000];

#[derive(Debug, Clone)]
enum Op {
    Malloc { size: usize, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    CompleteStream { stream: usize },
    EmptyCache,
    FailNextMallocs { count: usize },
    ResetPeaks,
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
    ]
}

/// A freed range that must not be handed out again until its streams have moved on.
struct Protected {
    ptr: DevicePtr,
    size: usize,
    /// Per stream that used it: the stream's completion count when the block was freed.
    waits_for: Vec<(usize, u64)>,
}

struct Model {
    allocator: DeviceAllocator<SimDevice>,
    live: Vec<(DevicePtr, usize)>,
    /// Other streams each live allocation was used on, as the test recorded them.
    uses: BTreeMap<DevicePtr, Vec<usize>>,
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
                    self.lift_synchronized_protections();
                    self.check_not_protected(ptr, info.size)?;
                    self.live.push((ptr, info.size));
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
                let (ptr, size) = self.live.swap_remove(pick % self.live.len());
                let uses = self.uses.remove(&ptr).unwrap_or_default();
                self.allocator.free(ptr).unwrap();
                if !uses.is_empty() {
                    let waits_for = uses.iter().map(|&s| (s, self.completions[s])).collect();
                    self.protected.push(Protected {
                        ptr,
                        size,
                        waits_for,
                    });
                }
            }
            Op::RecordStream { pick, stream } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let (ptr, _) = self.live[pick % self.live.len()];
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
        }
        self.check()
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
        self.protected
            .retain(|p| p.waits_for.iter().any(|&(s, at)| completions[s] <= at));
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
        let holding: Vec<DevicePtr> = self
            .allocator
            .segments()
            .iter()
            .filter(|s| s.blocks.iter().any(|b| b.state == "active_allocated"))
            .map(|s| s.address)
            .collect();
        self.allocator.empty_cache().unwrap();
        self.lift_synchronized_protections();
        let after = self.allocator.device().allocations();
        if self.expandable {
            // Every whole page without a live byte is unmapped.
            for (base, size, page) in self.allocator.expandable_segment_ranges() {
                for s in self.allocator.segments() {
                    if s.address < base || s.address >= base + size as u64 {
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
            if self.live.is_empty() {
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

    fn check(&self) -> Result<(), TestCaseError> {
        if let Err(why) = self.allocator.check_invariants() {
            prop_assert!(false, "{}", why);
        }
        let mut live = self.live.clone();
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

fn run(config: Config, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Model::new(config);
    for op in ops {
        model.step(op)?;
    }
    // Wind down: free everything, empty the cache, nothing may remain.
    while let Some((ptr, _)) = model.live.pop() {
        model.allocator.free(ptr).unwrap();
    }
    model.allocator.empty_cache().unwrap();
    model.check()?;
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
