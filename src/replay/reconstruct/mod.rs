//! Reconstruction: the workload a snapshot describes ([`Workload`]), and PyTorch's own figures
//! for it, from the snapshot's end state and trace.
//!
//! Recording usually starts after the model is loaded, so the trace alone is not the workload.
//! The state when recording began is found by undoing the trace, newest event first, on the end
//! state (`segments`), as PyTorch's memory viewer does:
//! - undoing `alloc` removes the block; undoing a free brings the block back (a free of a block
//!   the trace never allocated is how allocations older than the recording show up);
//! - undoing `segment_alloc` removes the segment, undoing `segment_free` brings it back;
//!   `segment_map` / `segment_unmap` shrink and grow the mapped ranges of expandable segments.
//!
//! Then one forward pass turns the trace into [`Op`]s with dense allocation ids, finds the
//! `empty_cache()` calls, collects the segment decisions PyTorch made and replays the trace's own
//! accounting of requested and reserved bytes.
//!
//! Choices, briefly:
//! - **Free point.** An allocation ends at its `free_requested`: that is when the program freed
//!   it and when PyTorch's `allocated_bytes` drop. A block used on other streams
//!   (`record_stream`) returns to the cache only at its later `free_completed`; the trace does
//!   not record the `record_stream` calls that caused it, so a replay cannot reproduce the delay
//!   faithfully either way. [`Diagnostics::deferred_frees`] counts such blocks, so a replay knows
//!   whether the choice matters (it is 0 in all three shared traces). A block whose free was
//!   requested before recording began ends at its `free_completed`.
//! - **empty_cache.** PyTorch releases cached segments in three places: `empty_cache()`, and
//!   inside `malloc` after a failed `cudaMalloc` (release_available_cached_blocks /
//!   release_cached_blocks), where the releases are always followed by that malloc's
//!   `segment_alloc` / `segment_map` (success) or `oom` (failure). So a run of `segment_free` /
//!   `segment_unmap` (with only `free_completed` entries among it) that ends in a segment
//!   allocation or an oom belongs to a malloc and is not replayed (the replayed allocator makes
//!   its own retries); a run that ends any other way is an `empty_cache()` call, replayed as
//!   [`Op::EmptyCache`] where the run began. One exception ([`Forward::released_everything`]):
//!   a run that ends in a segment allocation but leaves no wholly free segment (or mapped range)
//!   behind is replayed as [`Op::EmptyCache`] too. That is `empty_cache()` followed by a malloc
//!   (recording started, then `torch.cuda.empty_cache()`: a burst of `segment_free` first), or
//!   a retry's `release_cached_blocks`, whose effect is the same; treating it as a retry would
//!   keep, in the replay, segments PyTorch had given back. A partial release (the oversize
//!   blocks of `release_available_cached_blocks`, garbage collection) stays a retry.
//! - **Block sizes of older allocations** that the trace frees are not recorded anywhere. Small
//!   pool blocks are exactly `round_size(requested)` (a small block always splits off a remainder
//!   of 512 bytes or more). A large block may also hold an unsplit remainder of up to 1 MiB; as
//!   every free or allocated large block is larger than 1 MiB, a gap of at most 1 MiB between
//!   `round_size(requested)` and the next thing known to start after the block (a live block,
//!   an allocation made while the block lived, the segment's end) must belong to the block. Other
//!   sizes are `round_size(requested)`, marked [`BlockSizeSource::Estimated`].
//!
//! A pure function of the snapshot: no replay runs and nothing is read from the environment.
//! The start segments keep address order and no tie rule is fixed: the faithful pass
//! ([`super::faithful`], which [`Workload::reconstruct`] runs after this) settles both.

mod forward;
mod ranges;
mod start;

use super::snapshot::Snapshot;
use super::workload::Workload;
use std::collections::BTreeSet;

/// The workload of `snapshot`, per device, before the faithful pass: the start segments in
/// address order, no tie rule.
pub fn reconstruct(snapshot: &Snapshot) -> Workload {
    let config = snapshot.config();
    let device_ids: BTreeSet<usize> = snapshot
        .device_traces
        .iter()
        .enumerate()
        .filter(|(_, trace)| !trace.is_empty())
        .map(|(d, _)| d)
        .collect();
    let idle_devices: BTreeSet<usize> = snapshot
        .segments
        .iter()
        .map(|s| s.device)
        .filter(|d| !device_ids.contains(d))
        .collect();
    let devices = device_ids
        .into_iter()
        .map(|device| {
            let trace = snapshot
                .device_traces
                .get(device)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            forward::reconstruct_device(snapshot, device, trace, &config)
        })
        .collect();
    Workload {
        config,
        settings_recorded: snapshot.allocator_settings.is_some(),
        devices,
        idle_devices: idle_devices.into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PoolKind;
    use crate::replay::snapshot::{BlockState, BlockStatus, Segment, TraceEvent};
    use crate::replay::workload::{BlockSizeSource, DeviceWorkload, Op, SegmentDecisionKind};
    use crate::trace::TraceAction;

    const MIB: u64 = 1 << 20;

    fn event(action: TraceAction, addr: u64, size: u64) -> TraceEvent {
        TraceEvent {
            action: Some(action),
            addr,
            size,
            stream: 0,
            time_us: 0,
            device_free: None,
        }
    }

    fn segment(address: u64, total_size: u64, blocks: Vec<BlockState>) -> Segment {
        Segment {
            device: 0,
            address,
            total_size,
            stream: 0,
            is_small: total_size == 2 * MIB,
            is_expandable: false,
            blocks,
        }
    }

    fn block(address: u64, size: u64, requested_size: u64, state: BlockStatus) -> BlockState {
        BlockState {
            address,
            size,
            requested_size,
            state,
        }
    }

    fn workload(segments: Vec<Segment>, trace: Vec<TraceEvent>) -> DeviceWorkload {
        let snapshot = Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: None,
        };
        reconstruct(&snapshot).devices.remove(0)
    }

    fn free(addr: u64, size: u64) -> [TraceEvent; 2] {
        [
            event(TraceAction::FreeRequested, addr, size),
            event(TraceAction::FreeCompleted, addr, size),
        ]
    }

    #[test]
    fn older_allocations_come_from_end_state_and_from_frees() {
        let base = 0x1000_0000;
        // End: one 20 MiB segment holding an older 4 MiB block and a block the trace made.
        let segments = vec![segment(
            base,
            20 * MIB,
            vec![
                block(base, 4 * MIB, 4 * MIB, BlockStatus::ActiveAllocated),
                block(
                    base + 4 * MIB,
                    3 * MIB,
                    3 * MIB,
                    BlockStatus::ActiveAllocated,
                ),
                block(base + 7 * MIB, 13 * MIB, 0, BlockStatus::Inactive),
            ],
        )];
        // The trace frees an older block at +4 MiB (2.5 MiB requested), then allocates there.
        let mut trace = free(base + 4 * MIB, 5 * MIB / 2).to_vec();
        trace.push(event(TraceAction::Alloc, base + 4 * MIB, 3 * MIB));
        let w = workload(segments, trace);
        assert_eq!(w.start_allocations.len(), 2);
        assert_eq!(
            w.start_allocations[0].size_source,
            BlockSizeSource::EndState
        );
        let older = &w.start_allocations[1];
        assert_eq!(older.offset, 4 * MIB);
        assert_eq!(older.requested_size, 5 * MIB / 2);
        // 13.5 MiB free after the 2.5 MiB it needs: the size cannot be told, so it is estimated.
        assert_eq!(older.size_source, BlockSizeSource::Estimated);
        assert_eq!(older.size, 5 * MIB / 2);
        assert_eq!(
            w.ops,
            vec![
                Op::Free { id: 1 },
                Op::Alloc {
                    id: 2,
                    size: 3 * MIB,
                    stream: 0
                }
            ]
        );
        assert_eq!(w.figures.live_at_start_requested, 4 * MIB + 5 * MIB / 2);
        assert_eq!(w.figures.peak_requested, 7 * MIB);
        assert!(
            w.diagnostics.is_consistent(&w.figures),
            "{:?}",
            w.diagnostics
        );
    }

    #[test]
    fn an_unsplit_remainder_of_at_most_one_mib_belongs_to_the_block() {
        let base = 0x1000_0000;
        let segments = vec![segment(
            base,
            20 * MIB,
            vec![
                block(base, 11 * MIB, 0, BlockStatus::Inactive),
                block(
                    base + 11 * MIB,
                    9 * MIB,
                    9 * MIB,
                    BlockStatus::ActiveAllocated,
                ),
            ],
        )];
        // An older 10.5 MiB request at the start of the segment: 0.5 MiB is left before the next
        // block, which PyTorch would not have split off.
        let trace = free(base, 21 * MIB / 2).to_vec();
        let w = workload(segments, trace);
        let older = &w.start_allocations[0];
        assert_eq!(older.size_source, BlockSizeSource::Inferred);
        assert_eq!(older.size, 11 * MIB);
    }

    #[test]
    fn release_runs_are_empty_cache_unless_a_malloc_follows() {
        let a = 0x1000_0000;
        let b = 0x2000_0000;
        let trace = vec![
            event(TraceAction::SegmentAlloc, a, 20 * MIB),
            event(TraceAction::Alloc, a, 5 * MIB),
            event(TraceAction::FreeRequested, a, 5 * MIB),
            event(TraceAction::FreeCompleted, a, 5 * MIB),
            // Followed by a segment_alloc: a malloc released it after a failed cudaMalloc.
            event(TraceAction::SegmentFree, a, 20 * MIB),
            event(TraceAction::SegmentAlloc, b, 20 * MIB),
            event(TraceAction::Alloc, b, 5 * MIB),
            // Followed by an alloc served from the cache: empty_cache().
            event(TraceAction::SegmentFree, a + 40 * MIB, 2 * MIB),
            event(TraceAction::Alloc, b + 5 * MIB, 5 * MIB),
            // At the end of the trace: empty_cache().
            event(TraceAction::SegmentFree, a + 60 * MIB, 2 * MIB),
        ];
        // The small segments at a+40 and a+60 MiB existed at the start (freed, never allocated).
        let segments = vec![segment(
            b,
            20 * MIB,
            vec![
                block(b, 5 * MIB, 5 * MIB, BlockStatus::ActiveAllocated),
                block(b + 5 * MIB, 5 * MIB, 5 * MIB, BlockStatus::ActiveAllocated),
                block(b + 10 * MIB, 10 * MIB, 0, BlockStatus::Inactive),
            ],
        )];
        let w = workload(segments, trace);
        assert_eq!(w.start_segments.len(), 2);
        assert_eq!(w.start_segments[0].pool, PoolKind::Small);
        assert_eq!(w.figures.empty_caches, 2);
        assert_eq!(w.diagnostics.retry_released_segments, 1);
        assert_eq!(w.segment_decisions.len(), 2);
        assert_eq!(w.segment_decisions[1].released_before, 20 * MIB);
        assert_eq!(w.segment_decisions[1].serves_op, Some(2));
        assert_eq!(w.segment_decisions[1].pool, PoolKind::Large);
        let alloc = |id| Op::Alloc {
            id,
            size: 5 * MIB,
            stream: 0,
        };
        assert_eq!(
            w.ops,
            vec![
                alloc(0),
                Op::Free { id: 0 },
                alloc(1),
                Op::EmptyCache,
                alloc(2),
                Op::EmptyCache,
            ]
        );
        assert_eq!(w.op_origins[3].trace_index, 7);
        assert_eq!(w.figures.reserved_at_start, 4 * MIB);
        assert_eq!(w.figures.peak_reserved, 24 * MIB);
        assert!(
            w.diagnostics.is_consistent(&w.figures),
            "{:?}",
            w.diagnostics
        );
    }

    #[test]
    fn a_release_that_leaves_nothing_free_is_empty_cache_even_before_a_segment_alloc() {
        // Recording started, then empty_cache() released both cached segments; the next malloc
        // found nothing cached and took a new segment: PyTorch logs the frees, then the
        // segment_alloc, then the alloc.
        let a = 0x1000_0000;
        let b = 0x2000_0000;
        let trace = vec![
            event(TraceAction::SegmentFree, a, 20 * MIB),
            event(TraceAction::SegmentFree, a + 40 * MIB, 2 * MIB),
            event(TraceAction::SegmentAlloc, b, 20 * MIB),
            event(TraceAction::Alloc, b, 5 * MIB),
        ];
        let segments = vec![segment(
            b,
            20 * MIB,
            vec![
                block(b, 5 * MIB, 5 * MIB, BlockStatus::ActiveAllocated),
                block(b + 5 * MIB, 15 * MIB, 0, BlockStatus::Inactive),
            ],
        )];
        let w = workload(segments, trace);
        assert_eq!(w.start_segments.len(), 2);
        assert_eq!(w.figures.empty_caches, 1);
        assert_eq!(w.diagnostics.retry_released_segments, 0);
        assert_eq!(
            w.ops,
            vec![
                Op::EmptyCache,
                Op::Alloc {
                    id: 0,
                    size: 5 * MIB,
                    stream: 0
                }
            ]
        );
        assert_eq!(w.segment_decisions[0].serves_op, Some(1));
    }

    #[test]
    fn deferred_double_and_early_frees_are_counted() {
        let a = 0x1000_0000;
        let trace = vec![
            event(TraceAction::SegmentAlloc, a, 2 * MIB),
            event(TraceAction::Alloc, a, 512),
            event(TraceAction::FreeRequested, a, 512),
            event(TraceAction::Alloc, a + 512, 512),
            // Completed late: the block was used on another stream.
            event(TraceAction::FreeCompleted, a, 512),
            // Requested before recording began: live at the start, pending.
            event(TraceAction::FreeCompleted, a + 4096, 512),
            event(TraceAction::FreeRequested, a + 512, 512),
            event(TraceAction::FreeCompleted, a + 512, 512),
            // A double free.
            event(TraceAction::FreeRequested, a + 512, 512),
            event(TraceAction::FreeCompleted, a + 512, 512),
            event(TraceAction::Oom, 0, 1 << 40),
        ];
        let segments = vec![segment(
            a,
            2 * MIB,
            vec![block(a, 2 * MIB, 0, BlockStatus::Inactive)],
        )];
        let w = workload(segments, trace);
        assert_eq!(w.start_allocations.len(), 1);
        assert!(w.start_allocations[0].pending_free);
        assert_eq!(w.diagnostics.deferred_frees, 2);
        assert_eq!(w.diagnostics.unknown_frees, 2);
        assert_eq!(w.diagnostics.inconsistent_frees, 2);
        // The segment holding it was allocated in the trace: inconsistent input.
        assert_eq!(w.diagnostics.start_blocks_outside_segments, 1);
        assert_eq!(w.figures.ooms, 1);
        assert_eq!(w.figures.end_requested, 0);
        assert_eq!(w.ops[3], Op::Free { id: 0 });
        assert_eq!(
            w.ops.last(),
            Some(&Op::Oom {
                size: 1 << 40,
                stream: 0
            })
        );
        assert_eq!(w.segment_decisions[0].pool, PoolKind::Small);
    }

    #[test]
    fn a_block_pending_throughout_holds_its_memory() {
        let a = 0x1000_0000;
        let segments = vec![segment(
            a,
            2 * MIB,
            vec![
                block(a, 512, 300, BlockStatus::ActivePendingFree),
                block(a + 512, 512, 200, BlockStatus::ActiveAllocated),
                block(a + 1024, 2 * MIB - 1024, 0, BlockStatus::Inactive),
            ],
        )];
        let trace = vec![event(TraceAction::Alloc, a + 512, 200)];
        let w = workload(segments, trace);
        assert_eq!(w.start_allocations.len(), 1);
        assert!(w.start_allocations[0].pending_free);
        assert_eq!(w.figures.live_at_start_requested, 300);
        assert_eq!(w.figures.end_requested, 500);
        assert!(
            w.diagnostics.is_consistent(&w.figures),
            "{:?}",
            w.diagnostics
        );
    }

    #[test]
    fn expandable_ranges_shrink_and_grow_backwards() {
        let a = 0x7000_0000_0000;
        let mut seg = segment(
            a,
            60 * MIB,
            vec![block(a, 60 * MIB, 0, BlockStatus::Inactive)],
        );
        seg.is_expandable = true;
        // 80 MiB mapped at the start; 40 MiB unmapped, then 20 MiB mapped again.
        let trace = vec![
            event(TraceAction::SegmentUnmap, a + 40 * MIB, 40 * MIB),
            event(TraceAction::SegmentMap, a + 40 * MIB, 20 * MIB),
        ];
        let w = workload(vec![seg], trace);
        assert_eq!(w.start_segments.len(), 1);
        assert_eq!(w.start_segments[0].size, 80 * MIB);
        assert_eq!(w.figures.empty_caches, 0);
        assert_eq!(w.diagnostics.retry_released_segments, 1);
        assert_eq!(w.segment_decisions[0].kind, SegmentDecisionKind::Map);
        assert!(
            w.diagnostics.is_consistent(&w.figures),
            "{:?}",
            w.diagnostics
        );
    }
}
