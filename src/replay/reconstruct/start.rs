//! The state when recording began: the trace undone on the end state, newest event first; then
//! the allocations live at the start placed in their segments with their block sizes settled.

use super::ranges::{Range, Ranges, pool_of_segment, rounded};
use crate::config::Config;
use crate::policy::{K_SMALL_SIZE, PoolKind};
use crate::replay::snapshot::{BlockStatus, Snapshot, TraceEvent};
use crate::replay::workload::{BlockSizeSource, Diagnostics, StartAllocation, StartSegment};
use crate::trace::TraceAction;
use rustc_hash::FxHashMap;

/// An allocation alive at some point of the backward walk.
#[derive(Debug, Clone, Copy)]
pub(super) struct LiveBlock {
    pub(super) requested: u64,
    pub(super) stream: u64,
    /// Known only for blocks taken from the end state.
    pub(super) size: Option<u64>,
    /// Free requested, waiting for `free_completed`.
    pub(super) pending: bool,
}

/// The state when recording began: undo the trace on the end state, newest event first.
pub(super) fn start_state(
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEvent],
    diagnostics: &mut Diagnostics,
) -> (Ranges, FxHashMap<u64, LiveBlock>) {
    let mut ranges = Ranges::default();
    let mut live: FxHashMap<u64, LiveBlock> = FxHashMap::default();
    for segment in snapshot.segments.iter().filter(|s| s.device == device) {
        diagnostics.end_state_reserved = diagnostics
            .end_state_reserved
            .saturating_add(segment.total_size);
        let range = Range {
            size: segment.total_size,
            stream: segment.stream,
            pool: if segment.is_small {
                PoolKind::Small
            } else {
                PoolKind::Large
            },
            expandable: segment.is_expandable,
            owner: None,
        };
        if !ranges.insert(segment.address, range) {
            diagnostics.segment_mismatches += 1;
        }
        for block in segment.blocks.iter().filter(|b| b.state.is_active()) {
            if block.state == BlockStatus::ActiveAllocated {
                diagnostics.end_state_requested = diagnostics
                    .end_state_requested
                    .saturating_add(block.requested_size);
            }
            live.insert(
                block.address,
                LiveBlock {
                    requested: block.requested_size,
                    stream: segment.stream,
                    size: Some(block.size),
                    pending: block.state == BlockStatus::ActivePendingFree,
                },
            );
        }
    }

    for event in trace.iter().rev() {
        let freed_block = |pending| LiveBlock {
            requested: event.size,
            stream: event.stream,
            size: None,
            pending,
        };
        match event.action {
            Some(TraceAction::Alloc) => {
                if live.remove(&event.addr).is_none() {
                    diagnostics.allocs_missing_at_end += 1;
                }
            }
            Some(TraceAction::FreeCompleted) => match live.get(&event.addr) {
                None => {
                    live.insert(event.addr, freed_block(true));
                }
                Some(_) => diagnostics.inconsistent_frees += 1,
            },
            Some(TraceAction::FreeRequested) => match live.get_mut(&event.addr) {
                Some(block) if block.pending => block.pending = false,
                Some(_) => diagnostics.inconsistent_frees += 1,
                // No free_completed recorded, and the end state does not show it pending.
                None => {
                    live.insert(event.addr, freed_block(false));
                }
            },
            Some(TraceAction::Free) => match live.get(&event.addr) {
                None => {
                    live.insert(event.addr, freed_block(false));
                }
                Some(_) => diagnostics.inconsistent_frees += 1,
            },
            Some(TraceAction::SegmentAlloc) => {
                if !ranges.remove_exact(event.addr) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Some(TraceAction::SegmentFree) => {
                let range = Range {
                    size: event.size,
                    stream: event.stream,
                    pool: pool_of_segment(event.size, false),
                    expandable: false,
                    owner: None,
                };
                if !ranges.insert(event.addr, range) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Some(TraceAction::SegmentMap) => {
                if !ranges.remove_range(event.addr, event.size) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Some(TraceAction::SegmentUnmap) => {
                if !ranges.add_mapped(event.addr, event.size, event.stream) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Some(TraceAction::Oom | TraceAction::Snapshot | TraceAction::UserDefined) | None => {}
        }
    }
    (ranges, live)
}

/// Places the allocations live at the start in their segments and settles their block sizes.
pub(super) fn start_allocations(
    start_blocks: &[(u64, LiveBlock)],
    start_segments: &[StartSegment],
    first_alloc_above: &FxHashMap<u32, u64>,
    config: &Config,
    diagnostics: &mut Diagnostics,
) -> Vec<StartAllocation> {
    let segment_of = |addr: u64| -> Option<usize> {
        let i = start_segments.partition_point(|s| s.address <= addr);
        let i = i.checked_sub(1)?;
        (addr - start_segments[i].address < start_segments[i].size).then_some(i)
    };
    start_blocks
        .iter()
        .enumerate()
        .map(|(i, &(address, block))| {
            let id = i as u32;
            let segment = segment_of(address);
            if segment.is_none() {
                diagnostics.start_blocks_outside_segments += 1;
            }
            let (size, size_source) = match block.size {
                Some(size) => (size, BlockSizeSource::EndState),
                None => {
                    let next_block = start_blocks.get(i + 1).map(|&(a, _)| a);
                    let bound = [
                        segment.map(|s| {
                            start_segments[s]
                                .address
                                .saturating_add(start_segments[s].size)
                        }),
                        next_block,
                        first_alloc_above.get(&id).copied(),
                    ]
                    .into_iter()
                    .flatten()
                    .min();
                    let (size, source) = settle_block_size(
                        address,
                        block.requested,
                        bound,
                        segment.map(|s| &start_segments[s]),
                        config,
                    );
                    match source {
                        BlockSizeSource::Inferred => diagnostics.inferred_block_sizes += 1,
                        _ => diagnostics.estimated_block_sizes += 1,
                    }
                    (size, source)
                }
            };
            StartAllocation {
                id,
                address,
                size,
                requested_size: block.requested,
                stream: block.stream,
                segment,
                offset: segment.map_or(0, |s| address - start_segments[s].address),
                size_source,
                pending_free: block.pending,
            }
        })
        .collect()
}

/// The block size of an older allocation freed in the trace; `bound` is the first address known
/// to lie beyond the block. See the module documentation for the rules.
fn settle_block_size(
    address: u64,
    requested: u64,
    bound: Option<u64>,
    segment: Option<&StartSegment>,
    config: &Config,
) -> (u64, BlockSizeSource) {
    let size = rounded(requested, config);
    let (Some(bound), Some(segment)) = (bound, segment) else {
        return (size, BlockSizeSource::Estimated);
    };
    let room = bound.saturating_sub(address);
    if room < size {
        // The recorded settings do not explain the layout; keep the plain estimate.
        return (size, BlockSizeSource::Estimated);
    }
    let gap = room - size;
    let splits_any_remainder =
        segment.pool == PoolKind::Small || segment.is_expandable || config.expandable_segments;
    if gap == 0 || splits_any_remainder {
        return (size, BlockSizeSource::Inferred);
    }
    let oversize = size >= config.max_split_size as u64;
    if !oversize && gap <= K_SMALL_SIZE as u64 {
        return (size + gap, BlockSizeSource::Inferred);
    }
    (size, BlockSizeSource::Estimated)
}
