//! Comparing a replay with its recording: what ferrocache took from and gave back to the device
//! in each op, against PyTorch's segment decisions and releases, and where PyTorch's segments
//! lie in the replay ([`SegmentMap`]) to check each allocation's place.

use super::report::{ReleaseMismatch, SegmentMismatch};
use crate::allocator::DeviceAllocator;
use crate::device::sim::SimDevice;
use crate::replay::workload::{
    DeviceWorkload, Op, Placement, SegmentDecision, SegmentDecisionKind, SegmentRef,
};

/// A malloc in which ferrocache took memory from the device, or an op in which it gave
/// memory back.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceAllocation {
    op_index: usize,
    count: u32,
    bytes: u64,
}

/// The device counters an op is measured by.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceCounts {
    allocs: i64,
    allocated: i64,
    frees: i64,
    freed: i64,
}

impl DeviceCounts {
    pub(super) fn of(allocator: &DeviceAllocator<SimDevice>) -> DeviceCounts {
        let stats = allocator.stats();
        DeviceCounts {
            allocs: stats.num_device_alloc,
            allocated: stats.reserved_bytes.all.allocated,
            frees: stats.num_device_free,
            freed: stats.reserved_bytes.all.freed,
        }
    }
}

/// Notes what ferrocache took from and gave back to the device in op `op_index`.
pub(super) fn note_device_calls(
    op_index: usize,
    before: DeviceCounts,
    after: DeviceCounts,
    taken: &mut Vec<DeviceAllocation>,
    given_back: &mut Vec<DeviceAllocation>,
) {
    if after.allocs != before.allocs {
        taken.push(DeviceAllocation {
            op_index,
            count: (after.allocs - before.allocs) as u32,
            bytes: (after.allocated - before.allocated) as u64,
        });
    }
    if after.frees != before.frees {
        given_back.push(DeviceAllocation {
            op_index,
            count: (after.frees - before.frees) as u32,
            bytes: (after.freed - before.freed) as u64,
        });
    }
}

/// Where each of PyTorch's segments lies in the replay, to check that every allocation lands
/// where PyTorch put it.
pub(super) struct SegmentMap {
    /// Per start segment, ferrocache's address for it (imported ordinary segments only).
    start: Vec<Option<u64>>,
    /// Imported start segments by ferrocache's address: (address, size, start segment).
    start_by_address: Vec<(u64, u64, usize)>,
    /// Per segment decision, the segment ferrocache made for it (when it made one alike).
    decisions: Vec<Option<u64>>,
    /// The next decision not yet passed.
    next_decision: usize,
}

impl SegmentMap {
    pub(super) fn new(workload: &DeviceWorkload, start: Vec<Option<u64>>) -> SegmentMap {
        let mut start_by_address: Vec<(u64, u64, usize)> = start
            .iter()
            .enumerate()
            .filter_map(|(i, base)| base.map(|b| (b, workload.start_segments[i].size, i)))
            .collect();
        start_by_address.sort_unstable();
        SegmentMap {
            start,
            start_by_address,
            decisions: vec![None; workload.segment_decisions.len()],
            next_decision: 0,
        }
    }

    /// After the malloc of op `op_index` returned `ptr`: when PyTorch made one segment for it
    /// and ferrocache one of the same size (`made`), the two are the same segment.
    pub(super) fn note_malloc(
        &mut self,
        decisions: &[SegmentDecision],
        op_index: usize,
        ptr: u64,
        made: Option<&DeviceAllocation>,
    ) {
        let first = self.next_decision;
        while self.next_decision < decisions.len()
            && decisions[self.next_decision]
                .serves_op
                .is_none_or(|op| op <= op_index)
        {
            self.next_decision += 1;
        }
        let here: Vec<usize> = (first..self.next_decision)
            .filter(|&d| decisions[d].serves_op == Some(op_index))
            .collect();
        if let ([decision], Some(made)) = (here.as_slice(), made)
            && made.op_index == op_index
            && made.count == 1
            && made.bytes == decisions[*decision].size
        {
            self.decisions[*decision] = Some(ptr);
        }
    }

    /// The address of the one segment PyTorch made in the malloc of op `op_index`, if it made
    /// exactly one (`cudaMalloc`, not mapped pages).
    pub(super) fn pytorch_segment_for(
        &self,
        decisions: &[SegmentDecision],
        op_index: usize,
    ) -> Option<u64> {
        let mut found = None;
        for decision in decisions[self.next_decision.min(decisions.len())..]
            .iter()
            .take_while(|d| d.serves_op.is_none_or(|op| op <= op_index))
            .filter(|d| d.serves_op == Some(op_index))
        {
            if found.is_some() || decision.kind != SegmentDecisionKind::Alloc {
                return None;
            }
            found = Some(decision.address);
        }
        found
    }

    /// Where PyTorch's placement lies in the replay, when its segment is known there.
    pub(super) fn address_of(&self, placement: Placement) -> Option<u64> {
        let base = match placement.segment {
            SegmentRef::Start(i) => *self.start.get(i as usize)?,
            SegmentRef::Decision(d) => *self.decisions.get(d as usize)?,
        }?;
        base.checked_add(placement.offset)
    }

    /// The start segment that holds `ptr` in the replay.
    pub(super) fn start_segment_of(&self, ptr: u64) -> Option<usize> {
        let i = self
            .start_by_address
            .partition_point(|&(base, _, _)| base <= ptr)
            .checked_sub(1)?;
        let (base, size, segment) = self.start_by_address[i];
        (ptr - base < size).then_some(segment)
    }
}

/// Counts PyTorch's decisions that ferrocache made identically and lists the mallocs where the
/// two differ. Both lists are in op order.
pub(super) fn compare_decisions(
    workload: &DeviceWorkload,
    ours: &[DeviceAllocation],
) -> (u64, Vec<SegmentMismatch>) {
    let decisions: &[SegmentDecision] = &workload.segment_decisions;
    let mut matching = 0u64;
    let mut mismatches = Vec::new();
    let mismatch =
        |op_index: Option<usize>, pytorch_sizes: Vec<u64>, ours: Option<&DeviceAllocation>| {
            let (trace_index, requested) = match op_index {
                Some(i) => (
                    workload.op_origins.get(i).map(|o| o.trace_index),
                    match workload.ops.get(i) {
                        Some(Op::Alloc { size, .. }) => Some(*size),
                        _ => None,
                    },
                ),
                None => (None, None),
            };
            SegmentMismatch {
                op_index,
                trace_index,
                requested,
                pytorch_sizes,
                ferrocache_count: ours.map_or(0, |a| a.count),
                ferrocache_bytes: ours.map_or(0, |a| a.bytes),
            }
        };

    // PyTorch's decisions grouped by the op they served (consecutive in trace order).
    let mut groups: Vec<(Option<usize>, Vec<u64>)> = Vec::new();
    for decision in decisions {
        match groups.last_mut() {
            Some((op, sizes)) if decision.serves_op.is_some() && *op == decision.serves_op => {
                sizes.push(decision.size)
            }
            _ => groups.push((decision.serves_op, vec![decision.size])),
        }
    }
    let mut our_index = 0;
    for (op, sizes) in groups {
        let Some(op) = op else {
            // Made in a malloc that failed: the op is an Oom, which a replay skips.
            mismatches.push(mismatch(None, sizes, None));
            continue;
        };
        // Our device allocations at ops before this one were made where PyTorch made none.
        while our_index < ours.len() && ours[our_index].op_index < op {
            mismatches.push(mismatch(
                Some(ours[our_index].op_index),
                Vec::new(),
                Some(&ours[our_index]),
            ));
            our_index += 1;
        }
        let ours_here = ours.get(our_index).filter(|a| a.op_index == op).copied();
        if ours_here.is_some() {
            our_index += 1;
        }
        let total: u64 = sizes.iter().fold(0u64, |sum, s| sum.saturating_add(*s));
        let matched = match ours_here {
            Some(a) if a.count as usize == sizes.len() && a.bytes == total => sizes.len(),
            // One device allocation of ours: it matches one of PyTorch's of the same size.
            Some(a) if a.count == 1 && sizes.contains(&a.bytes) => 1,
            _ => 0,
        };
        matching += matched as u64;
        if matched != sizes.len() || ours_here.is_some_and(|a| a.count as usize != matched) {
            mismatches.push(mismatch(Some(op), sizes, ours_here.as_ref()));
        }
    }
    for extra in &ours[our_index..] {
        mismatches.push(mismatch(Some(extra.op_index), Vec::new(), Some(extra)));
    }
    (matching, mismatches)
}

/// Counts the segments PyTorch gave back that ferrocache gave back in the same op, the same
/// bytes in all, and lists the ops where the two differ. Both lists are in op order.
pub(super) fn compare_releases(
    workload: &DeviceWorkload,
    ours: &[DeviceAllocation],
) -> (u64, Vec<ReleaseMismatch>) {
    let trace_index = |op: Option<usize>| {
        op.and_then(|i| workload.op_origins.get(i))
            .map(|o| o.trace_index)
    };
    let mismatch =
        |op_index: Option<usize>, pytorch: (usize, u64), ours: Option<&DeviceAllocation>| {
            ReleaseMismatch {
                op_index,
                trace_index: trace_index(op_index),
                pytorch_segments: pytorch.0,
                pytorch_bytes: pytorch.1,
                ferrocache_segments: ours.map_or(0, |a| u64::from(a.count)),
                ferrocache_bytes: ours.map_or(0, |a| a.bytes),
            }
        };
    // PyTorch's releases by op (a malloc's retry and an empty_cache never share one).
    let mut groups: Vec<(Option<usize>, usize, u64)> = Vec::new();
    for release in &workload.segment_releases {
        match groups.last_mut() {
            Some((op, segments, bytes))
                if release.op_index.is_some() && *op == release.op_index =>
            {
                *segments += release.segments;
                *bytes = bytes.saturating_add(release.bytes);
            }
            _ => groups.push((release.op_index, release.segments, release.bytes)),
        }
    }
    let mut matching = 0u64;
    let mut mismatches = Vec::new();
    let mut our_index = 0;
    for (op, segments, bytes) in groups {
        let Some(op) = op else {
            mismatches.push(mismatch(None, (segments, bytes), None));
            continue;
        };
        while our_index < ours.len() && ours[our_index].op_index < op {
            mismatches.push(mismatch(
                Some(ours[our_index].op_index),
                (0, 0),
                Some(&ours[our_index]),
            ));
            our_index += 1;
        }
        let ours_here = ours.get(our_index).filter(|a| a.op_index == op);
        if ours_here.is_some() {
            our_index += 1;
        }
        if ours_here.is_some_and(|a| a.bytes == bytes) {
            matching += segments as u64;
        } else {
            mismatches.push(mismatch(Some(op), (segments, bytes), ours_here));
        }
    }
    for extra in &ours[our_index..] {
        mismatches.push(mismatch(Some(extra.op_index), (0, 0), Some(extra)));
    }
    (matching, mismatches)
}
