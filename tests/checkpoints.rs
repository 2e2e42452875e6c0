//! Checkpoints of a private pool on the simulated GPU (PyTorch's `getCheckpointState` and
//! `setCheckpointPoolState`, which CUDA graph trees call to record a new branch): a restore
//! puts the checkpoint's blocks back at their addresses, frees what was allocated since,
//! reports both, keeps the statistics true, and refuses, changing nothing, a pool whose
//! segments changed shape.

use ferrocache::allocator::DeviceAllocator;
use ferrocache::allocator::checkpoint::{CheckpointDelta, CheckpointError, PoolCheckpoint};
use ferrocache::allocator::private_pool::{MempoolId, StreamFilter};
use ferrocache::config::Config;
use ferrocache::device::StreamId;
use ferrocache::device::sim::SimDevice;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// The stream a tree records on (PyTorch captures on a side stream).
const CAPTURE: StreamId = 0x5000;
const OTHER: StreamId = 0x6000;
const POOL: MempoolId = (1, 0);

fn allocator(config: Config) -> DeviceAllocator<SimDevice> {
    DeviceAllocator::new(SimDevice::new(GIB), 0, config)
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
}

fn on(stream: StreamId) -> StreamFilter {
    Box::new(move |s| Ok(s == stream))
}

/// Runs `body` as a recording into the pool (a capture on `CAPTURE`).
fn recording<R>(
    a: &mut DeviceAllocator<SimDevice>,
    body: impl FnOnce(&mut DeviceAllocator<SimDevice>) -> R,
) -> R {
    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
    let result = body(a);
    a.end_allocate_to_pool(POOL).unwrap();
    result
}

/// What a restore must leave as it found it, or give back as the checkpoint had it: the
/// segments with their blocks (the pool's and the others').
fn layout(a: &DeviceAllocator<SimDevice>) -> Vec<(u64, Vec<(u64, bool)>)> {
    let mut segments: Vec<_> = a
        .segments()
        .into_iter()
        .map(|s| {
            (
                s.address,
                s.blocks
                    .iter()
                    .map(|b| (b.size, b.state == "active_allocated"))
                    .collect(),
            )
        })
        .collect();
    segments.sort();
    segments
}

/// The first recording of a tree: three outputs, one temporary freed inside it (a hole in
/// the small segment), and a large block.
struct FirstRecording {
    small: u64,
    hole: u64,
    after_hole: u64,
    large: u64,
}

fn record_first(a: &mut DeviceAllocator<SimDevice>) -> FirstRecording {
    recording(a, |a| {
        let small = a.malloc(4 * KIB, CAPTURE).unwrap();
        let hole = a.malloc(8 * KIB, CAPTURE).unwrap();
        let after_hole = a.malloc(16 * KIB, CAPTURE).unwrap();
        let large = a.malloc(3 * MIB, CAPTURE).unwrap();
        a.free(hole).unwrap();
        FirstRecording {
            small,
            hole,
            after_hole,
            large,
        }
    })
}

#[test]
fn a_restore_puts_the_checkpoints_blocks_back_at_their_addresses_and_frees_the_rest() {
    let mut a = allocator(Config::default());
    let first = record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let at_checkpoint = layout(&a);
    assert_eq!(checkpoint.pool_id(), POOL);
    assert_eq!(
        checkpoint.allocations().len(),
        3,
        "small, after_hole, large: {:x?}",
        checkpoint.allocations()
    );

    // A second branch: it takes the hole, more of the small segment, a new large segment,
    // and frees one of the first recording's outputs.
    let second = recording(&mut a, |a| {
        let in_hole = a.malloc(8 * KIB, CAPTURE).unwrap();
        let more = a.malloc(32 * KIB, CAPTURE).unwrap();
        let new_segment = a.malloc(30 * MIB, CAPTURE).unwrap();
        a.free(first.small).unwrap();
        vec![in_hole, more, new_segment]
    });
    assert_eq!(second[0], first.hole, "the hole is reused");
    checked(&a);

    let delta = a.restore_pool_checkpoint(&checkpoint).unwrap();
    checked(&a);
    let mut freed = delta.freed.clone();
    freed.sort_unstable();
    let mut live_before = vec![
        first.after_hole,
        first.large,
        second[0],
        second[1],
        second[2],
    ];
    live_before.sort_unstable();
    assert_eq!(freed, live_before, "every allocation of the pool was freed");
    let mut allocated = delta.allocated.clone();
    allocated.sort_unstable();
    let mut expected = vec![first.small, first.after_hole, first.large];
    expected.sort_unstable();
    assert_eq!(
        allocated, expected,
        "the checkpoint's allocations are live again"
    );
    assert_eq!(delta.allocated, checkpoint.allocations());
    assert_eq!(a.pool_live_allocations(POOL).unwrap(), expected);

    // The checkpointed segments are carved as they were; the new segment stays, wholly free.
    let now = layout(&a);
    for segment in &at_checkpoint {
        assert!(
            now.contains(segment),
            "{segment:x?} not restored in {now:x?}"
        );
    }
    assert_eq!(now.len(), at_checkpoint.len() + 1);

    // Recording again after the restore takes the same memory as after the checkpoint.
    let again = recording(&mut a, |a| a.malloc(8 * KIB, CAPTURE).unwrap());
    assert_eq!(again, first.hole);
    checked(&a);
}

#[test]
fn the_statistics_after_a_restore_are_those_of_its_allocations_and_frees() {
    let mut a = allocator(Config::default());
    let first = record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let at_checkpoint = a.stats().clone();
    recording(&mut a, |a| {
        a.malloc(64 * KIB, CAPTURE).unwrap();
        a.free(first.after_hole).unwrap();
    });
    let before = a.stats().clone();
    a.restore_pool_checkpoint(&checkpoint).unwrap();
    let after = a.stats().clone();
    checked(&a);

    // The same bytes and blocks in use as at the checkpoint, in the same segments.
    assert_eq!(
        after.allocated_bytes.all.current,
        at_checkpoint.allocated_bytes.all.current
    );
    assert_eq!(
        after.allocation.all.current,
        at_checkpoint.allocation.all.current
    );
    assert_eq!(
        after.active_bytes.all.current,
        at_checkpoint.active_bytes.all.current
    );
    assert_eq!(
        after.inactive_split.all.current,
        at_checkpoint.inactive_split.all.current
    );
    assert_eq!(
        after.inactive_split_bytes.all.current,
        at_checkpoint.inactive_split_bytes.all.current
    );
    assert_eq!(
        after.reserved_bytes, before.reserved_bytes,
        "a restore takes no memory"
    );
    assert_eq!(after.segment, before.segment);
    // As in PyTorch: each checkpointed block is allocated once more, each live one freed
    // once, and a restored block's requested size is its size.
    // The small segment: small, the hole, after_hole, the rest; the large one (20 MiB): large,
    // the rest.
    let restored_blocks = 4 + 2;
    assert_eq!(
        after.allocation.all.allocated - before.allocation.all.allocated,
        restored_blocks
    );
    assert_eq!(
        after.requested_bytes.all.current,
        (4 * KIB + 16 * KIB + 3 * MIB) as i64
    );
}

#[test]
fn restoring_twice_gives_the_same_pool_and_frees_the_restored_allocations() {
    let mut a = allocator(Config::default());
    record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let first = a.restore_pool_checkpoint(&checkpoint).unwrap();
    let layout_once = layout(&a);
    let second = a.restore_pool_checkpoint(&checkpoint).unwrap();
    assert_eq!(layout(&a), layout_once);
    let mut freed = second.freed.clone();
    freed.sort_unstable();
    let mut allocated = first.allocated.clone();
    allocated.sort_unstable();
    assert_eq!(freed, allocated);
    assert_eq!(second.allocated, first.allocated);
    checked(&a);
}

#[test]
fn a_pool_with_no_allocation_at_the_checkpoint_is_restored_wholly_free() {
    let mut a = allocator(Config::default());
    let p = recording(&mut a, |a| a.malloc(4 * KIB, CAPTURE).unwrap());
    a.free(p).unwrap();
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    assert!(checkpoint.allocations().is_empty());
    let q = recording(&mut a, |a| a.malloc(4 * KIB, CAPTURE).unwrap());
    let delta = a.restore_pool_checkpoint(&checkpoint).unwrap();
    assert_eq!(
        delta,
        CheckpointDelta {
            freed: vec![q],
            allocated: vec![]
        }
    );
    assert_eq!(a.pool_live_allocations(POOL).unwrap(), Vec::<u64>::new());
    assert_eq!(a.stats().allocated_bytes.all.current, 0);
    checked(&a);
}

#[test]
fn ordinary_allocations_are_untouched_by_a_restore() {
    let mut a = allocator(Config::default());
    let ordinary = a.malloc(4 * KIB, OTHER).unwrap();
    record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let delta = a.restore_pool_checkpoint(&checkpoint).unwrap();
    assert!(!delta.freed.contains(&ordinary) && !delta.allocated.contains(&ordinary));
    assert_eq!(a.allocation_info(ordinary).unwrap().private_pool, None);
    checked(&a);
}

#[test]
fn a_checkpoint_of_an_unknown_or_released_pool_is_refused() {
    let mut a = allocator(Config::default());
    assert_eq!(
        a.checkpoint_pool(POOL),
        Err(CheckpointError::UnknownPool(POOL))
    );
    record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    a.release_pool(POOL).unwrap();
    assert_eq!(
        a.checkpoint_pool(POOL),
        Err(CheckpointError::Unreferenced(POOL))
    );
    assert_eq!(
        a.restore_pool_checkpoint(&checkpoint),
        Err(CheckpointError::Unreferenced(POOL))
    );
    assert!(
        CheckpointError::Unreferenced(POOL)
            .to_string()
            .starts_with("Not expected to checkpoint freeable graph")
    );
}

#[test]
fn a_checkpoint_while_a_block_waits_for_another_stream_is_refused() {
    let mut a = allocator(Config::default());
    let p = recording(&mut a, |a| a.malloc(4 * KIB, CAPTURE).unwrap());
    a.record_stream(p, OTHER).unwrap();
    a.device_mut().submit_work(OTHER);
    a.free(p).unwrap();
    assert_eq!(
        a.checkpoint_pool(POOL),
        Err(CheckpointError::EventsPending { pool: POOL, ptr: p })
    );
    a.device_mut().complete_stream(OTHER);
    a.malloc(512, OTHER).unwrap(); // processes the completed event
    assert!(a.checkpoint_pool(POOL).is_ok());
}

/// Refuses, and leaves everything as it was.
fn refused_unchanged(
    a: &mut DeviceAllocator<SimDevice>,
    checkpoint: &PoolCheckpoint,
) -> CheckpointError {
    let (layout_before, stats_before) = (layout(a), a.stats().clone());
    let live_before = a.pool_live_allocations(POOL);
    let err = a.restore_pool_checkpoint(checkpoint).unwrap_err();
    assert_eq!(layout(a), layout_before);
    assert_eq!(*a.stats(), stats_before);
    assert_eq!(a.pool_live_allocations(POOL), live_before);
    checked(a);
    err
}

#[test]
fn a_restore_is_refused_unchanged_when_an_expandable_segment_grew_since_the_checkpoint() {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    let mut a = allocator(config);
    let first = recording(&mut a, |a| a.malloc(4 * MIB, CAPTURE).unwrap());
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    // More pages are mapped into the same segment: its mapped run is longer than it was.
    recording(&mut a, |a| a.malloc(40 * MIB, CAPTURE).unwrap());
    let segment = a.base_allocation(first).unwrap().0;
    let err = refused_unchanged(&mut a, &checkpoint);
    assert_eq!(
        err,
        CheckpointError::SegmentChanged {
            pool: POOL,
            ptr: segment
        }
    );
}

#[test]
fn an_expandable_segment_that_kept_its_pages_is_restored() {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    let mut a = allocator(config);
    let (kept, gone) = recording(&mut a, |a| {
        let kept = a.malloc(4 * MIB, CAPTURE).unwrap();
        let gone = a.malloc(6 * MIB, CAPTURE).unwrap();
        (kept, gone)
    });
    a.free(gone).unwrap();
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let at_checkpoint = layout(&a);
    let reused = recording(&mut a, |a| a.malloc(2 * MIB, CAPTURE).unwrap());
    assert_eq!(reused, gone);
    a.free(kept).unwrap();
    let delta = a.restore_pool_checkpoint(&checkpoint).unwrap();
    assert_eq!(delta.freed, vec![reused]);
    assert_eq!(delta.allocated, vec![kept]);
    assert_eq!(layout(&a), at_checkpoint);
    checked(&a);
}

#[test]
fn a_restore_is_refused_unchanged_when_a_live_block_waits_for_another_stream() {
    let mut a = allocator(Config::default());
    let first = record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    a.record_stream(first.after_hole, OTHER).unwrap();
    let segment = a.base_allocation(first.after_hole).unwrap().0;
    let err = refused_unchanged(&mut a, &checkpoint);
    assert_eq!(
        err,
        CheckpointError::SegmentChanged {
            pool: POOL,
            ptr: segment
        }
    );
}

#[test]
fn a_restore_is_refused_when_the_checkpointed_segments_are_gone() {
    let mut a = allocator(Config::default());
    let p = recording(&mut a, |a| a.malloc(4 * KIB, CAPTURE).unwrap());
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let segment = a.base_allocation(p).unwrap().0;
    // The pool goes with its memory, and a pool of the same id is made anew.
    a.free(p).unwrap();
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    a.create_or_incref_pool(POOL).unwrap();
    let err = refused_unchanged(&mut a, &checkpoint);
    assert_eq!(
        err,
        CheckpointError::SegmentMissing {
            pool: POOL,
            ptr: segment
        }
    );
}

#[test]
fn a_checkpoint_of_another_devices_pool_is_refused() {
    let mut a = allocator(Config::default());
    record_first(&mut a);
    let checkpoint = a.checkpoint_pool(POOL).unwrap();
    let mut b = DeviceAllocator::new(SimDevice::new(GIB), 1, Config::default());
    b.create_or_incref_pool(POOL).unwrap();
    assert_eq!(
        b.restore_pool_checkpoint(&checkpoint),
        Err(CheckpointError::OtherDevice {
            checkpoint: 0,
            device: 1
        })
    );
}

#[path = "common/properties.rs"]
mod properties;

mod random_trees {
    //! Random trees of recordings: recordings into the pool, outputs dropped, ordinary
    //! allocations beside, checkpoints taken and restored in any order. After every step the
    //! allocator's invariants hold; after every restore the pool's live allocations are the
    //! checkpoint's and its checkpointed segments are carved as they were; a refused restore
    //! changes nothing.

    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// A recording: allocations of these sizes, those marked freed within it.
        Record(Vec<(usize, bool)>),
        /// The program drops one of the pool's live outputs.
        DropOutput(usize),
        /// An ordinary allocation beside the pool, or the free of one.
        Ordinary(usize),
        FreeOrdinary(usize),
        Checkpoint,
        /// Restores one of the checkpoints taken so far.
        Restore(usize),
    }

    fn size() -> impl Strategy<Value = usize> {
        prop_oneof![
            3 => 1usize..(1 << 20),
            1 => (1usize << 20)..(24 << 20),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => prop::collection::vec((size(), any::<bool>()), 1..6).prop_map(Op::Record),
            2 => any::<usize>().prop_map(Op::DropOutput),
            1 => size().prop_map(Op::Ordinary),
            1 => any::<usize>().prop_map(Op::FreeOrdinary),
            2 => Just(Op::Checkpoint),
            3 => any::<usize>().prop_map(Op::Restore),
        ]
    }

    type Layout = Vec<(u64, Vec<(u64, bool)>)>;

    /// The pool's segments (mapped ranges) with their blocks.
    fn pool_layout(a: &DeviceAllocator<SimDevice>) -> Layout {
        let mut segments: Layout = a
            .segments()
            .into_iter()
            .filter(|s| s.segment_pool_id == POOL)
            .map(|s| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|b| (b.size, b.state == "active_allocated"));
                (s.address, blocks.collect())
            })
            .collect();
        segments.sort();
        segments
    }

    fn sorted(mut addresses: Vec<u64>) -> Vec<u64> {
        addresses.sort_unstable();
        addresses
    }

    fn run(config: Config, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut a = allocator(config);
        a.create_or_incref_pool(POOL).unwrap();
        let mut outputs: Vec<u64> = Vec::new();
        let mut ordinary: Vec<u64> = Vec::new();
        let mut checkpoints: Vec<(PoolCheckpoint, Layout)> = Vec::new();
        for op in ops {
            match op {
                Op::Record(sizes) => {
                    a.begin_allocate_to_pool(POOL, on(CAPTURE)).unwrap();
                    for &(size, freed) in sizes {
                        let Ok(ptr) = a.malloc(size, CAPTURE) else {
                            continue;
                        };
                        if freed {
                            a.free(ptr).unwrap();
                        } else {
                            outputs.push(ptr);
                        }
                    }
                    a.end_allocate_to_pool(POOL).unwrap();
                    a.release_pool(POOL).unwrap(); // each recording's own reference
                }
                Op::DropOutput(i) if !outputs.is_empty() => {
                    a.free(outputs.swap_remove(i % outputs.len())).unwrap();
                }
                Op::Ordinary(size) => ordinary.extend(a.malloc(*size, OTHER).ok()),
                Op::FreeOrdinary(i) if !ordinary.is_empty() => {
                    a.free(ordinary.swap_remove(i % ordinary.len())).unwrap();
                }
                Op::Checkpoint => {
                    let checkpoint = a.checkpoint_pool(POOL).unwrap();
                    prop_assert_eq!(sorted(checkpoint.allocations()), sorted(outputs.clone()));
                    checkpoints.push((checkpoint, pool_layout(&a)));
                }
                Op::Restore(i) if !checkpoints.is_empty() => {
                    let (checkpoint, layout) = &checkpoints[i % checkpoints.len()];
                    let before = (pool_layout(&a), a.stats().clone());
                    match a.restore_pool_checkpoint(checkpoint) {
                        Ok(delta) => {
                            prop_assert_eq!(sorted(delta.freed), sorted(outputs.clone()));
                            outputs = checkpoint.allocations();
                            prop_assert_eq!(sorted(delta.allocated), sorted(outputs.clone()));
                            prop_assert_eq!(
                                a.pool_live_allocations(POOL).unwrap(),
                                sorted(outputs.clone())
                            );
                            let now = pool_layout(&a);
                            for segment in layout {
                                prop_assert!(now.contains(segment), "{:x?} in {:x?}", segment, now);
                            }
                        }
                        Err(CheckpointError::SegmentChanged { .. }) => {
                            // Only an expandable segment changes shape (pages mapped since).
                            prop_assert!(a.config().expandable_segments);
                            prop_assert_eq!((pool_layout(&a), a.stats().clone()), before);
                        }
                        Err(other) => prop_assert!(false, "refused: {}", other),
                    }
                }
                _ => {}
            }
            if let Err(why) = a.check_invariants() {
                prop_assert!(false, "after {:?}: {}", op, why);
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(properties::config(64))]

        #[test]
        fn restores_of_random_trees_give_back_each_checkpoint(
            ops in prop::collection::vec(op(), 1..40)
        ) {
            run(Config::default(), &ops)?;
        }

        #[test]
        fn restores_of_random_trees_over_expandable_segments_give_back_or_refuse_unchanged(
            ops in prop::collection::vec(op(), 1..40)
        ) {
            run(Config { expandable_segments: true, ..Config::default() }, &ops)?;
        }
    }
}
