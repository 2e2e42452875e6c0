//! Property tests for sleep and wake, in the model style of `allocator_properties.rs`: random
//! programs of tagged and untagged malloc / free / write / sleep (with or without backup) /
//! wake / empty_cache / injected driver failures, on two streams, checking after every step
//! that no memory is handed out twice, that awake memory holds what the program last wrote (or
//! zeros after a sleep without backup), that sleeping memory is unmapped and never handed out,
//! and that the books balance. The same with expandable segments, whose pages sleep one by one.
//! Fixed seeds in CI (see `common/properties.rs`).

use ferrocache::allocator::DeviceAllocator;
use ferrocache::allocator::sleep::Tags;
use ferrocache::config::Config;
use ferrocache::device::sim::{SimDevice, SimOp};
use ferrocache::device::{Device, DeviceError, DevicePtr, StreamId};
use proptest::prelude::*;

#[path = "common/properties.rs"]
mod properties;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const STREAMS: [StreamId; 2] = [0, 0x1000];
/// `None` is untagged; the others are tags.
const TAGS: [Option<u32>; 3] = [None, Some(1), Some(2)];
/// How many bytes at the start of each allocation the model writes and checks.
const CHECKED: usize = 64;

#[derive(Debug, Clone)]
enum Op {
    Malloc {
        size: usize,
        stream: usize,
        tag: usize,
    },
    Free {
        pick: usize,
    },
    Write {
        pick: usize,
        byte: u8,
    },
    /// `which`: 0 every tag, else one tag.
    Sleep {
        which: usize,
        backup: bool,
    },
    Wake {
        which: usize,
    },
    EmptyCache,
    /// The next call of `FAULTABLE[call]` fails with a driver error.
    Fail {
        call: usize,
        nth: usize,
    },
}

const FAULTABLE: [SimOp; 14] = [
    SimOp::SynchronizeDevice,
    SimOp::CopyToHost,
    SimOp::CopyFromHost,
    SimOp::Unmap,
    SimOp::ReleasePhysical,
    SimOp::CreatePhysical,
    SimOp::Map,
    SimOp::SetAccess,
    SimOp::FreeAddressRange,
    // Sleep's pinned copies (appended: the stored regressions name calls by index).
    SimOp::CopyToPinnedAsync,
    SimOp::CopyFromPinnedAsync,
    SimOp::SynchronizeStream,
    SimOp::QueryEvent,
    SimOp::AllocPinnedHost,
];

fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1usize..4096, 4096..(2 * MIB), (2 * MIB)..(40 * MIB)];
    prop_oneof![
        6 => (size, 0..STREAMS.len(), 0..TAGS.len()).prop_map(|(size, stream, tag)| Op::Malloc { size, stream, tag }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (any::<usize>(), 1..=255u8).prop_map(|(pick, byte)| Op::Write { pick, byte }),
        2 => (0..TAGS.len(), any::<bool>()).prop_map(|(which, backup)| Op::Sleep { which, backup }),
        2 => (0..TAGS.len()).prop_map(|which| Op::Wake { which }),
        1 => Just(Op::EmptyCache),
        1 => (0..FAULTABLE.len(), 1..4usize).prop_map(|(call, nth)| Op::Fail { call, nth }),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Live {
    ptr: DevicePtr,
    size: usize,
    tag: Option<u32>,
    /// What its first `CHECKED` bytes hold while awake (one byte repeated).
    byte: u8,
}

struct Model {
    allocator: DeviceAllocator<SimDevice>,
    live: Vec<Live>,
    faulted: bool,
    /// `expandable_segments:True`: a sleep that fails part-way leaves a segment's pages before
    /// the failure asleep and the rest mapped, so an allocation is checked when it is mapped
    /// whole, whatever its segment.
    expandable: bool,
}

fn tags_of(which: usize) -> Vec<u32> {
    match TAGS[which] {
        None => Vec::new(),
        Some(tag) => vec![tag],
    }
}

impl Model {
    fn asleep(&self, live: &Live) -> bool {
        !self.allocator.device().is_accessible(live.ptr, live.size)
    }

    /// The program writes `bytes` at `ptr`, stepping past faults injected for the allocator.
    fn poke(&mut self, ptr: DevicePtr, bytes: &[u8]) {
        while self
            .allocator
            .device_mut()
            .copy_from_host(ptr, bytes)
            .is_err()
        {}
    }

    /// The live allocations a sleep or wake of `which` covers.
    fn covered(&self, which: usize) -> Vec<usize> {
        (0..self.live.len())
            .filter(|&i| which == 0 || self.live[i].tag == TAGS[which])
            .collect()
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Malloc { size, stream, tag } => {
                if let Ok(ptr) = self
                    .allocator
                    .malloc_tagged(size, STREAMS[stream], TAGS[tag])
                {
                    let size = self.allocator.allocation_info(ptr).unwrap().size;
                    prop_assert!(
                        self.allocator.device().is_accessible(ptr, size),
                        "handed out asleep"
                    );
                    for other in &self.live {
                        prop_assert!(
                            ptr + size as u64 <= other.ptr || other.ptr + other.size as u64 <= ptr,
                            "overlap"
                        );
                    }
                    let byte = 0xA5;
                    self.poke(ptr, &[byte; CHECKED][..CHECKED.min(size)]);
                    self.live.push(Live {
                        ptr,
                        size,
                        tag: TAGS[tag],
                        byte,
                    });
                }
            }
            Op::Free { pick } => {
                if !self.live.is_empty() {
                    let live = self.live.swap_remove(pick % self.live.len());
                    self.allocator.free(live.ptr).unwrap();
                }
            }
            Op::Write { pick, byte } => {
                if !self.live.is_empty() {
                    let index = pick % self.live.len();
                    let live = self.live[index];
                    if !self.asleep(&live) {
                        let n = CHECKED.min(live.size);
                        self.poke(live.ptr, &vec![byte; n]);
                        self.live[index].byte = byte;
                    }
                }
            }
            Op::Sleep { which, backup } => {
                let tags = tags_of(which);
                let scope = if which == 0 {
                    Tags::All
                } else {
                    Tags::Only(&tags)
                };
                let before: Vec<bool> = self.live.iter().map(|l| self.asleep(l)).collect();
                let result = self.allocator.sleep(scope, backup);
                prop_assert!(result.is_ok() || self.faulted, "{:?}", result);
                for i in self.covered(which) {
                    let now_asleep = self.asleep(&self.live[i]);
                    if now_asleep && !before[i] && !backup {
                        self.live[i].byte = 0; // dropped: a fresh page reads zeros
                    }
                    if result.is_ok() && self.allocator.is_sleepable() {
                        // Made sleep-able from the start (see `run`): everything covered sleeps.
                        prop_assert!(now_asleep, "{:#x} still awake", self.live[i].ptr);
                    }
                }
            }
            Op::Wake { which } => {
                let tags = tags_of(which);
                let scope = if which == 0 {
                    Tags::All
                } else {
                    Tags::Only(&tags)
                };
                let result = self.allocator.wake(scope);
                prop_assert!(result.is_ok() || self.faulted, "{:?}", result);
                if result.is_ok() {
                    for i in self.covered(which) {
                        prop_assert!(!self.asleep(&self.live[i]));
                    }
                }
            }
            Op::EmptyCache => {
                let result = self.allocator.empty_cache();
                prop_assert!(result.is_ok() || self.faulted, "{:?}", result);
            }
            Op::Fail { call, nth } => {
                self.faulted = true;
                let error = DeviceError::Driver {
                    call: "injected",
                    code: 999,
                    message: "injected".into(),
                };
                self.allocator
                    .device_mut()
                    .fail_nth(FAULTABLE[call], nth, error);
            }
        }
        self.check()
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        if let Err(why) = self.allocator.check_invariants() {
            prop_assert!(false, "invariant broken: {}", why);
        }
        for live in self.live.clone() {
            let whole = if self.expandable {
                self.allocator.device().is_accessible(live.ptr, live.size)
            } else {
                let (base, segment) = self.allocator.base_allocation(live.ptr).unwrap();
                let whole = self.allocator.device().is_accessible(base, segment);
                // A segment is mapped whole or not at all.
                prop_assert!(
                    whole || !self.allocator.device().is_accessible(live.ptr, 1),
                    "half-mapped {:#x}",
                    base
                );
                whole
            };
            if whole {
                let n = CHECKED.min(live.size);
                let mut bytes = vec![0; n];
                // The program's own copies step past faults injected for the allocator's.
                while self
                    .allocator
                    .device_mut()
                    .copy_to_host(live.ptr, &mut bytes)
                    .is_err()
                {}
                prop_assert_eq!(bytes, vec![live.byte; n], "bytes of {:#x}", live.ptr);
            }
        }
        if !self.faulted {
            prop_assert_eq!(
                self.allocator.reserved_bytes(),
                self.allocator.device().physical_in_use()
            );
        }
        Ok(())
    }
}

fn run(ops: &[Op], expandable: bool) -> Result<(), TestCaseError> {
    let config = Config {
        expandable_segments: expandable,
        ..Config::default()
    };
    let mut model = Model {
        allocator: DeviceAllocator::new(SimDevice::new(4 * GIB), 0, config),
        live: Vec::new(),
        faulted: false,
        expandable,
    };
    model.allocator.set_sleepable(true);
    model.allocator.device_mut().set_complete_immediately(true);
    for op in ops {
        model.step(op)?;
    }
    // Whatever failed on the way, a clean wake brings every byte back.
    model.allocator.device_mut().clear_faults();
    model.allocator.wake(Tags::All).unwrap();
    model.check()?;
    for live in std::mem::take(&mut model.live) {
        model.allocator.free(live.ptr).unwrap();
    }
    model.allocator.empty_cache().unwrap();
    prop_assert_eq!(model.allocator.device().physical_in_use(), 0);
    // An expandable segment whose first growth failed keeps its address range, as PyTorch's
    // does (it serves the next request of its stream).
    if !(model.expandable && model.faulted) {
        prop_assert_eq!(model.allocator.device().reserved_ranges(), 0);
    }
    Ok(())
}

proptest! {
    #![proptest_config(properties::config(64))]
    #[test]
    fn sleep_and_wake_keep_every_byte_address_and_invariant(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run(&ops, false)?;
    }

    #[test]
    fn expandable_segments_sleep_and_wake_keep_every_byte_address_and_invariant(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run(&ops, true)?;
    }
}
