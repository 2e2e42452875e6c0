//! The forward pass: the trace turned into ops with dense allocation ids, the segment decisions
//! and releases PyTorch made, and its accounting of requested and reserved bytes replayed.

use super::ranges::{Range, Ranges, pool_of_segment, rounded};
use super::start::{LiveBlock, start_allocations, start_state};
use crate::config::Config;
use crate::policy;
use crate::replay::snapshot::{Snapshot, TraceEvent};
use crate::replay::workload::{
    Allocation, DeviceWorkload, Diagnostics, Figures, Op, OpOrigin, Placement, SegmentDecision,
    SegmentDecisionKind, SegmentRef, SegmentRelease, StartSegment, TimelinePoint,
};
use crate::trace::TraceAction;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// Segment releases not yet attributed to a malloc retry or an `empty_cache()`.
struct ReleaseRun {
    origin: OpOrigin,
    bytes: u64,
    segments: usize,
    /// Ops that `free_completed` entries produced inside the run; they follow the run.
    held: Vec<(Op, OpOrigin)>,
}

/// The forward pass: ops, decisions, accounting.
struct Forward {
    ops: Vec<Op>,
    op_origins: Vec<OpOrigin>,
    allocations: Vec<Allocation>,
    decisions: Vec<SegmentDecision>,
    /// Decisions waiting for the alloc they were made for.
    awaiting_alloc: Vec<usize>,
    releases: Vec<SegmentRelease>,
    /// A retry's release waiting for the alloc whose malloc made it.
    awaiting_release: Option<usize>,
    run: Option<ReleaseRun>,
    requested: u64,
    reserved: u64,
    figures: Figures,
    timeline: Vec<TimelinePoint>,
    /// PyTorch's segments (mapped ranges for expandable ones) at this point of the trace.
    segments: Ranges,
    /// Addresses of the blocks that hold memory at this point (live, or freed but pending).
    occupied: BTreeSet<u64>,
}

impl Forward {
    /// Whether no segment (or mapped range of an expandable one) is left without a block that
    /// holds memory: what `empty_cache()` and `release_cached_blocks` leave behind.
    fn released_everything(&self) -> bool {
        self.segments.0.iter().all(|(&start, range)| {
            self.occupied
                .range(start..start.saturating_add(range.size))
                .next()
                .is_some()
        })
    }

    fn emit(&mut self, op: Op, origin: OpOrigin) {
        match &mut self.run {
            Some(run) => run.held.push((op, origin)),
            None => {
                self.ops.push(op);
                self.op_origins.push(origin);
            }
        }
    }

    fn free(&mut self, id: u32, origin: OpOrigin) {
        self.requested = self
            .requested
            .saturating_sub(self.allocations[id as usize].requested_size);
        self.figures.frees += 1;
        self.emit(Op::Free { id }, origin);
    }

    /// Ends an open release run: an `empty_cache()` call, or (`by_malloc`) a malloc's retry.
    /// Returns the bytes released.
    fn close_run(&mut self, by_malloc: bool, diagnostics: &mut Diagnostics) -> u64 {
        let Some(run) = self.run.take() else {
            return 0;
        };
        let mut release = SegmentRelease {
            op_index: None,
            segments: run.segments,
            bytes: run.bytes,
            trace_index: run.origin.trace_index,
        };
        if by_malloc && !self.released_everything() {
            diagnostics.retry_released_segments += run.segments;
            self.awaiting_release = Some(self.releases.len());
        } else {
            self.figures.empty_caches += 1;
            release.op_index = Some(self.ops.len());
            self.ops.push(Op::EmptyCache);
            self.op_origins.push(run.origin);
        }
        self.releases.push(release);
        for (op, origin) in run.held {
            self.ops.push(op);
            self.op_origins.push(origin);
        }
        run.bytes
    }

    fn decide(
        &mut self,
        kind: SegmentDecisionKind,
        event: &TraceEvent,
        origin: OpOrigin,
        released: u64,
    ) {
        self.reserved = self.reserved.saturating_add(event.size);
        self.decisions.push(SegmentDecision {
            kind,
            trace_index: origin.trace_index,
            time_us: origin.time_us,
            address: event.addr,
            size: event.size,
            stream: event.stream,
            pool: pool_of_segment(event.size, kind == SegmentDecisionKind::Map),
            serves_op: None,
            released_before: released,
        });
        self.awaiting_alloc.push(self.decisions.len() - 1);
    }
}

struct Pending {
    id: u32,
    requested_at: Option<usize>,
    /// Freed before recording: the op is emitted at `free_completed`.
    free_on_completion: bool,
}

pub(super) fn reconstruct_device(
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEvent],
    config: &Config,
) -> DeviceWorkload {
    let mut diagnostics = Diagnostics::default();
    let (mut ranges, live) = start_state(snapshot, device, trace, &mut diagnostics);

    let start_segments: Vec<StartSegment> = ranges
        .0
        .iter()
        .map(|(&address, r)| StartSegment {
            address,
            size: r.size,
            stream: r.stream,
            pool: r.pool,
            is_expandable: r.expandable,
        })
        .collect();
    for (index, range) in ranges.0.values_mut().enumerate() {
        range.owner = Some(SegmentRef::Start(index as u32));
    }
    let mut start_blocks: Vec<(u64, LiveBlock)> = live.into_iter().collect();
    start_blocks.sort_unstable_by_key(|&(addr, _)| addr);

    let mut forward = Forward {
        ops: Vec::with_capacity(trace.len()),
        op_origins: Vec::with_capacity(trace.len()),
        allocations: Vec::with_capacity(start_blocks.len() + trace.len() / 2),
        decisions: Vec::new(),
        awaiting_alloc: Vec::new(),
        releases: Vec::new(),
        awaiting_release: None,
        run: None,
        requested: 0,
        reserved: start_segments
            .iter()
            .fold(0u64, |sum, s| sum.saturating_add(s.size)),
        figures: Figures::default(),
        timeline: Vec::new(),
        segments: ranges,
        occupied: start_blocks.iter().map(|&(addr, _)| addr).collect(),
    };
    let mut live_ids: FxHashMap<u64, u32> = FxHashMap::default();
    let mut pending: FxHashMap<u64, Pending> = FxHashMap::default();
    for (id, (addr, block)) in start_blocks.iter().enumerate() {
        let id = id as u32;
        forward.allocations.push(Allocation {
            address: *addr,
            requested_size: block.requested,
            stream: block.stream,
            live_at_start: true,
            placed: None,
        });
        forward.requested = forward.requested.saturating_add(block.requested);
        if block.pending {
            let entry = Pending {
                id,
                requested_at: None,
                free_on_completion: true,
            };
            pending.insert(*addr, entry);
        } else {
            live_ids.insert(*addr, id);
        }
    }
    forward.figures.live_at_start_blocks = start_blocks.len();
    forward.figures.live_at_start_requested = forward.requested;
    forward.figures.reserved_at_start = forward.reserved;
    forward.figures.peak_requested = forward.requested;
    forward.figures.peak_reserved = forward.reserved;

    // For the sizes of older blocks: the first address allocated above each one while it lived.
    let mut allocated_addresses: BTreeSet<u64> = BTreeSet::new();
    let mut first_alloc_above: FxHashMap<u32, u64> = FxHashMap::default();
    let start_count = start_blocks.len() as u32;
    let needs_bound = |id: u32| id < start_count && start_blocks[id as usize].1.size.is_none();
    let mut note_start_freed = |id: u32, allocated: &BTreeSet<u64>| {
        if needs_bound(id) {
            let addr = start_blocks[id as usize].0;
            if let Some(&above) = allocated.range(addr.saturating_add(1)..).next() {
                first_alloc_above.insert(id, above);
            }
        }
    };

    for (index, event) in trace.iter().enumerate() {
        let origin = OpOrigin {
            trace_index: index,
            time_us: event.time_us,
        };
        let before = (forward.requested, forward.reserved);
        match event.action {
            Some(TraceAction::Alloc) => {
                forward.close_run(false, &mut diagnostics);
                if let Some(old) = live_ids.remove(&event.addr) {
                    diagnostics.allocs_over_live += 1;
                    forward.free(old, origin);
                }
                let id = forward.allocations.len() as u32;
                let placed = forward
                    .segments
                    .containing(event.addr)
                    .and_then(|(start, range)| {
                        let segment = range.owner.filter(|_| !range.expandable)?;
                        Some(Placement {
                            segment,
                            offset: event.addr - start,
                        })
                    });
                forward.allocations.push(Allocation {
                    address: event.addr,
                    requested_size: event.size,
                    stream: event.stream,
                    live_at_start: false,
                    placed,
                });
                live_ids.insert(event.addr, id);
                allocated_addresses.insert(event.addr);
                forward.occupied.insert(event.addr);
                let op_index = forward.ops.len();
                let pool =
                    policy::pool_for(rounded(event.size, config).min(usize::MAX as u64) as usize);
                for decision in std::mem::take(&mut forward.awaiting_alloc) {
                    forward.decisions[decision].serves_op = Some(op_index);
                    forward.decisions[decision].pool = pool;
                }
                if let Some(release) = forward.awaiting_release.take() {
                    forward.releases[release].op_index = Some(op_index);
                }
                forward.requested = forward.requested.saturating_add(event.size);
                forward.figures.allocs += 1;
                forward.emit(
                    Op::Alloc {
                        id,
                        size: event.size,
                        stream: event.stream,
                    },
                    origin,
                );
            }
            Some(TraceAction::FreeRequested | TraceAction::Free) => {
                forward.close_run(false, &mut diagnostics);
                if event.action == Some(TraceAction::Free) {
                    forward.occupied.remove(&event.addr);
                }
                match live_ids.remove(&event.addr) {
                    Some(id) => {
                        forward.free(id, origin);
                        note_start_freed(id, &allocated_addresses);
                        if event.action == Some(TraceAction::FreeRequested) {
                            let entry = Pending {
                                id,
                                requested_at: Some(index),
                                free_on_completion: false,
                            };
                            pending.insert(event.addr, entry);
                        }
                    }
                    None => diagnostics.unknown_frees += 1,
                }
            }
            Some(TraceAction::FreeCompleted) => {
                // Neutral for release runs: malloc's and empty_cache's own event syncs log these.
                forward.occupied.remove(&event.addr);
                if let Some(done) = pending.remove(&event.addr) {
                    if done.free_on_completion {
                        forward.free(done.id, origin);
                        note_start_freed(done.id, &allocated_addresses);
                    }
                    if done.requested_at.is_none_or(|at| at + 1 != index) {
                        diagnostics.deferred_frees += 1;
                    }
                } else if let Some(id) = live_ids.remove(&event.addr) {
                    diagnostics.inconsistent_frees += 1;
                    forward.free(id, origin);
                    note_start_freed(id, &allocated_addresses);
                } else {
                    diagnostics.unknown_frees += 1;
                }
            }
            Some(TraceAction::SegmentAlloc | TraceAction::SegmentMap) => {
                let released = forward.close_run(true, &mut diagnostics);
                let kind = if event.action == Some(TraceAction::SegmentAlloc) {
                    forward.figures.segment_allocs += 1;
                    let range = Range {
                        size: event.size,
                        stream: event.stream,
                        pool: pool_of_segment(event.size, false),
                        expandable: false,
                        owner: Some(SegmentRef::Decision(forward.decisions.len() as u32)),
                    };
                    forward.segments.insert(event.addr, range);
                    SegmentDecisionKind::Alloc
                } else {
                    forward.figures.segment_maps += 1;
                    forward
                        .segments
                        .add_mapped(event.addr, event.size, event.stream);
                    SegmentDecisionKind::Map
                };
                forward.decide(kind, event, origin, released);
            }
            Some(TraceAction::SegmentFree | TraceAction::SegmentUnmap) => {
                if event.action == Some(TraceAction::SegmentFree) {
                    forward.figures.segment_frees += 1;
                    forward.segments.remove_exact(event.addr);
                } else {
                    forward.figures.segment_unmaps += 1;
                    forward.segments.remove_range(event.addr, event.size);
                }
                forward.reserved = forward.reserved.saturating_sub(event.size);
                let run = forward.run.get_or_insert_with(|| ReleaseRun {
                    origin,
                    bytes: 0,
                    segments: 0,
                    held: Vec::new(),
                });
                run.bytes = run.bytes.saturating_add(event.size);
                run.segments += 1;
            }
            Some(TraceAction::Oom) => {
                forward.close_run(true, &mut diagnostics);
                forward.awaiting_alloc.clear();
                forward.awaiting_release = None;
                forward.figures.ooms += 1;
                forward.emit(
                    Op::Oom {
                        size: event.size,
                        stream: event.stream,
                    },
                    origin,
                );
            }
            Some(TraceAction::Snapshot | TraceAction::UserDefined) => {
                forward.close_run(false, &mut diagnostics);
            }
            None => diagnostics.unknown_actions += 1,
        }
        if (forward.requested, forward.reserved) != before {
            forward.timeline.push(TimelinePoint {
                trace_index: index,
                time_us: event.time_us,
                requested: forward.requested,
                reserved: forward.reserved,
            });
            if forward.requested > forward.figures.peak_requested {
                forward.figures.peak_requested = forward.requested;
                forward.figures.peak_requested_at = Some(index);
            }
            if forward.reserved > forward.figures.peak_reserved {
                forward.figures.peak_reserved = forward.reserved;
                forward.figures.peak_reserved_at = Some(index);
            }
        }
    }
    forward.close_run(false, &mut diagnostics);
    // Blocks pending from before recording to the end count as live in the accounting above.
    for waiting in pending.values().filter(|p| p.free_on_completion) {
        diagnostics.end_state_requested = diagnostics
            .end_state_requested
            .saturating_add(forward.allocations[waiting.id as usize].requested_size);
    }
    // Older blocks never freed in the trace (inconsistent input) are bounded by every alloc.
    for id in 0..start_count {
        if needs_bound(id) && !first_alloc_above.contains_key(&id) {
            let addr = start_blocks[id as usize].0;
            if let Some(&above) = allocated_addresses.range(addr.saturating_add(1)..).next() {
                first_alloc_above.insert(id, above);
            }
        }
    }
    forward.figures.end_requested = forward.requested;
    forward.figures.end_reserved = forward.reserved;

    let start_allocations = start_allocations(
        &start_blocks,
        &start_segments,
        &first_alloc_above,
        config,
        &mut diagnostics,
    );
    forward.figures.live_at_start_size = start_allocations
        .iter()
        .fold(0u64, |sum, a| sum.saturating_add(a.size));

    DeviceWorkload {
        device,
        start_order: (0..start_segments.len()).collect(),
        start_segments,
        start_allocations,
        allocations: forward.allocations,
        ops: forward.ops,
        op_origins: forward.op_origins,
        segment_decisions: forward.decisions,
        segment_releases: forward.releases,
        tie_rule: None,
        tie_rules_alike: Vec::new(),
        figures: forward.figures,
        timeline: forward.timeline,
        diagnostics,
    }
}
