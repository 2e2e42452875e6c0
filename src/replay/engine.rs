//! The replay engine: runs one [`DeviceWorkload`] through ferrocache's allocator on a fresh
//! simulated GPU under a [`Config`], and measures what it did.
//!
//! A replay has two phases.
//! - **Start state.** Either the reconstructed one ([`StartState::Reconstructed`]): every segment
//!   that existed when recording began is taken from the device again and the allocations live
//!   then are placed at their recorded offsets in it ([`DeviceAllocator::import_segment`]), so
//!   the cache holds exactly what PyTorch's held; or an empty GPU ([`StartState::Fresh`]) on which
//!   the allocations live at the start are made first, in address order. The reconstructed start
//!   is the faithful one (it is what PyTorch's decisions were made from); the fresh start is the
//!   fair one for settings that would have laid the start out differently.
//! - **Operations,** in order: `Alloc` -> `malloc`, `Free` -> `free`, `EmptyCache` ->
//!   `empty_cache`; an `Oom` (PyTorch could not serve a request) is counted, not replayed.
//!
//! Only the operations are timed. Failures (an out-of-memory in ferrocache, a free of an
//! allocation that does not exist) are counted, never fatal.
//!
//! **Matching PyTorch's decisions.** For each `malloc` the engine notes whether ferrocache took
//! memory from the device (`num_device_alloc` before and after) and how much (the growth of the
//! accumulated reserved bytes), which costs two loads per `malloc` instead of a trace. A PyTorch
//! segment decision matches when ferrocache, in the malloc of the same op, made as many device
//! allocations of the same total size; when both made exactly one, that is the same size.
//! Releases are matched the same way (`num_device_free` and the freed bytes around each
//! `malloc` and `empty_cache`, against PyTorch's `segment_free` runs by op), and every
//! allocation the trace made in an ordinary segment is checked at PyTorch's offset in the same
//! segment (a start segment, or the one ferrocache made for PyTorch's decision): the
//! [`super::faithful`] self-check, and how the start order is found.
//!
//! **PyTorch's addresses.** From the reconstructed start, every start segment, and every segment
//! made for a request PyTorch made one for, is placed at PyTorch's address where that range is
//! free ([`SimDevice::prefer_next_address`]), so that ties broken by address (PyTorch up to
//! 2.11) break as they did; start segments are imported in `DeviceWorkload::start_order`.

use super::workload::{
    DeviceWorkload, Op, Placement, SegmentDecision, SegmentDecisionKind, SegmentRef,
    StartAllocation, StartSegment,
};
use crate::allocator::{AllocError, DeviceAllocator, ImportedBlock};
use crate::config::Config;
use crate::device::sim::SimDevice;
use crate::policy::{K_MIN_BLOCK_SIZE, TieRule};
use std::time::{Duration, Instant};

/// The simulated GPU's memory unless told otherwise: an 80 GiB card (A100/H100).
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

/// Requests above this are refused as out of memory without asking the allocator: no GPU has
/// 64 PiB, and PyTorch's rounding arithmetic would overflow near `usize::MAX`.
const LARGEST_SANE_REQUEST: u64 = 1 << 56;

/// Where a replay starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartState {
    /// The segments and live blocks PyTorch had when recording began, at their offsets.
    #[default]
    Reconstructed,
    /// An empty GPU; the allocations live at the start are made first, in address order.
    Fresh,
}

/// How to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Bytes of memory of the simulated GPU.
    pub capacity: u64,
    pub start: StartState,
    /// Record requested and reserved bytes after every operation (for plots; costs a push per
    /// operation, so benchmarks leave it off).
    pub record_timeline: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            capacity: DEFAULT_CAPACITY,
            start: StartState::Reconstructed,
            record_timeline: false,
        }
    }
}

/// Requested and reserved bytes (ferrocache's statistics) at one point of a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryPoint {
    pub requested: u64,
    pub reserved: u64,
}

/// A malloc where ferrocache and PyTorch did not take the same memory from the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMismatch {
    /// Index of the operation in `ops`; `None` for a PyTorch decision made in a malloc that
    /// then failed (its op is an `Oom`, which is not replayed).
    pub op_index: Option<usize>,
    /// Where the operation came from in the trace, when known.
    pub trace_index: Option<usize>,
    /// The requested size of the allocation, when the op is an `Alloc`.
    pub requested: Option<u64>,
    /// Sizes of PyTorch's `segment_alloc` / `segment_map` in this malloc (empty: none).
    pub pytorch_sizes: Vec<u64>,
    /// How many device allocations ferrocache made in this malloc, and their total size.
    pub ferrocache_count: u32,
    pub ferrocache_bytes: u64,
}

/// Segments PyTorch and ferrocache gave back in one op that differ (in bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseMismatch {
    /// The `EmptyCache` op, or the `Alloc` whose malloc released them; `None` for PyTorch's
    /// release in a malloc that then failed.
    pub op_index: Option<usize>,
    pub trace_index: Option<usize>,
    pub pytorch_segments: usize,
    pub pytorch_bytes: u64,
    pub ferrocache_segments: u64,
    pub ferrocache_bytes: u64,
}

/// An allocation ferrocache placed elsewhere than PyTorch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misplacement {
    pub op_index: usize,
    pub trace_index: Option<usize>,
    pub requested: u64,
    /// Where PyTorch placed it.
    pub pytorch: Placement,
    /// The start segment ferrocache placed it in, if it did (index into `start_segments`).
    pub ferrocache_start_segment: Option<usize>,
}

/// What the start state needed and what did not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StartReport {
    /// Segments taken from the device and filled with their recorded blocks.
    pub imported_segments: usize,
    /// Allocations placed at their recorded offsets.
    pub placed_allocations: usize,
    /// Allocations made with `malloc` (all of them on a fresh start; otherwise those whose
    /// segment is unknown or whose recorded place does not fit).
    pub allocated_allocations: usize,
    /// Allocations placed with `malloc` because their recorded place was impossible (overlap,
    /// outside their segment, misaligned); 0 for a consistent snapshot.
    pub misplaced_allocations: usize,
    /// Segments or allocations the simulated GPU could not hold.
    pub failures: usize,
}

/// The figures of one replay.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplayReport {
    pub start: StartReport,
    /// Operations replayed (`Alloc`, `Free`, `EmptyCache`).
    pub events: u64,
    /// Peaks of ferrocache's requested and reserved bytes, start state included.
    pub peak_requested: u64,
    pub peak_reserved: u64,
    pub end_requested: u64,
    pub end_reserved: u64,
    /// Device allocations (`cudaMalloc`s and page mappings) made while replaying the operations:
    /// the figure to compare with PyTorch's `segment_alloc` + `segment_map` count.
    pub segment_allocs: u64,
    /// `num_device_alloc` / `num_device_free` over the whole replay, start state included.
    pub device_mallocs: u64,
    pub device_frees: u64,
    /// `num_alloc_retries` (mallocs that released cached memory and tried the device again).
    pub retries: u64,
    /// Allocations ferrocache could not serve (out of memory).
    pub ooms: u64,
    /// `Oom` operations: requests PyTorch could not serve, skipped.
    pub native_ooms: u64,
    /// Frees of allocations that do not exist (never made, failed, already freed).
    pub unknown_frees: u64,
    /// Device errors other than out-of-memory (from the simulated GPU: none expected).
    pub device_errors: u64,
    /// PyTorch's segment decisions that ferrocache made identically (see the module docs).
    pub matching_segment_allocs: u64,
    /// Every malloc where the two differ, in op order.
    pub mismatches: Vec<SegmentMismatch>,
    /// Segments PyTorch gave back (`segment_free` + `segment_unmap`) while recording, and how
    /// many of them ferrocache gave back in the same op, the same bytes.
    pub native_segment_releases: u64,
    pub matching_segment_releases: u64,
    /// Every op where the two gave back different bytes, in op order.
    pub release_mismatches: Vec<ReleaseMismatch>,
    /// Allocations whose place PyTorch's segment is known for in the replay, and how many of
    /// them ferrocache placed at PyTorch's offset in the same segment.
    pub placements_checked: u64,
    pub placements_matching: u64,
    pub first_misplacement: Option<Misplacement>,
    /// How ties between equal cached blocks were broken.
    pub tie_rule: TieRule,
    /// Blocks taken from another stream's cache (cross-stream reuse; one event wait each).
    pub cross_stream_reuses: u64,
    /// Wall time of the operations loop.
    pub elapsed: Duration,
    /// After the start state, then after every operation, when asked for.
    pub timeline: Vec<MemoryPoint>,
}

impl ReplayReport {
    /// Peak requested over peak reserved; 0 when nothing was reserved.
    pub fn utilization(&self) -> f64 {
        ratio(self.peak_requested, self.peak_reserved)
    }

    /// Operations replayed per second of the loop; `None` when too fast to time.
    pub fn events_per_second(&self) -> Option<f64> {
        let seconds = self.elapsed.as_secs_f64();
        (seconds > 0.0).then(|| self.events as f64 / seconds)
    }
}

/// PyTorch's own figures for a recorded workload, as the replay compares with them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NativeFigures {
    pub peak_requested: u64,
    pub peak_reserved: u64,
    /// `segment_alloc` + `segment_map` events while recording.
    pub segment_allocs: u64,
    pub utilization: f64,
}

impl NativeFigures {
    pub fn of(workload: &DeviceWorkload) -> NativeFigures {
        let figures = &workload.figures;
        NativeFigures {
            peak_requested: figures.peak_requested,
            peak_reserved: figures.peak_reserved,
            segment_allocs: workload.segment_decisions.len() as u64,
            utilization: figures.utilization(),
        }
    }
}

fn ratio(numerator: u64, denominator: u64) -> f64 {
    if denominator == 0 {
        0.0
    } else {
        numerator as f64 / denominator as f64
    }
}

/// A malloc in which ferrocache took memory from the device, or an op in which it gave
/// memory back.
#[derive(Debug, Clone, Copy)]
struct DeviceAllocation {
    op_index: usize,
    count: u32,
    bytes: u64,
}

/// The device counters an op is measured by.
#[derive(Debug, Clone, Copy)]
struct DeviceCounts {
    allocs: i64,
    allocated: i64,
    frees: i64,
    freed: i64,
}

impl DeviceCounts {
    fn of(allocator: &DeviceAllocator<SimDevice>) -> DeviceCounts {
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
fn note_device_calls(
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
struct SegmentMap {
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
    fn new(workload: &DeviceWorkload, start: Vec<Option<u64>>) -> SegmentMap {
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
    fn note_malloc(
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
    fn pytorch_segment_for(&self, decisions: &[SegmentDecision], op_index: usize) -> Option<u64> {
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
    fn address_of(&self, placement: Placement) -> Option<u64> {
        let base = match placement.segment {
            SegmentRef::Start(i) => *self.start.get(i as usize)?,
            SegmentRef::Decision(d) => *self.decisions.get(d as usize)?,
        }?;
        base.checked_add(placement.offset)
    }

    /// The start segment that holds `ptr` in the replay.
    fn start_segment_of(&self, ptr: u64) -> Option<usize> {
        let i = self
            .start_by_address
            .partition_point(|&(base, _, _)| base <= ptr)
            .checked_sub(1)?;
        let (base, size, segment) = self.start_by_address[i];
        (ptr - base < size).then_some(segment)
    }
}

/// Replays `workload` under `config` on a new simulated GPU.
pub fn replay(workload: &DeviceWorkload, config: &Config, options: &ReplayOptions) -> ReplayReport {
    let capacity = usize::try_from(options.capacity).unwrap_or(usize::MAX);
    let mut device = SimDevice::new(capacity);
    // Traces record no cross-stream waits: work is complete as soon as it is submitted.
    device.set_complete_immediately(true);
    let mut config = config.clone();
    // Ties break as the recording's PyTorch broke them, whatever the setting replayed.
    if let Some(rule) = workload.tie_rule {
        config.modelled.tie_rule = rule;
    }
    let mut report = ReplayReport {
        tie_rule: config.modelled.tie_rule,
        ..ReplayReport::default()
    };
    let mut allocator = DeviceAllocator::new(device, 0, config);

    // Pointer of each allocation id; 0 = not live (the simulated GPU never hands out 0).
    let mut pointers = vec![0u64; workload.allocations.len()];
    let mut start_bases = vec![None; workload.start_segments.len()];
    report.start = match options.start {
        StartState::Reconstructed => {
            reconstructed_start(&mut allocator, workload, &mut pointers, &mut start_bases)
        }
        StartState::Fresh => {
            fresh_start(&mut allocator, &workload.start_allocations, &mut pointers)
        }
    };
    let mut segments = SegmentMap::new(workload, start_bases);
    // From the reconstructed start, segments go where PyTorch's were, as far as known.
    let faithful_addresses = options.start == StartState::Reconstructed;
    let device_allocs_at_start = allocator.stats().num_device_alloc;

    if options.record_timeline {
        report.timeline.reserve(workload.ops.len() + 1);
        report.timeline.push(memory_point(&allocator));
    }
    let mut device_allocations: Vec<DeviceAllocation> = Vec::new();
    let mut device_releases: Vec<DeviceAllocation> = Vec::new();
    let started = Instant::now();
    for (op_index, op) in workload.ops.iter().enumerate() {
        let before = DeviceCounts::of(&allocator);
        let allocations_before = device_allocations.len();
        // For an allocation: its id, requested size and where ferrocache put it (0: nowhere).
        let mut allocated: Option<(u32, u64, u64)> = None;
        match *op {
            Op::Alloc { id, size, stream } => {
                report.events += 1;
                if faithful_addresses {
                    // A segment made here lands where PyTorch's did (ties by address).
                    let address =
                        segments.pytorch_segment_for(&workload.segment_decisions, op_index);
                    allocator.device_mut().prefer_next_address(address);
                }
                let result = if size > LARGEST_SANE_REQUEST {
                    None
                } else {
                    Some(allocator.malloc(size as usize, stream))
                };
                allocator.device_mut().prefer_next_address(None);
                let mut placed_at = 0;
                match result {
                    Some(Ok(ptr)) => {
                        placed_at = ptr;
                        if let Some(slot) = pointers.get_mut(id as usize) {
                            *slot = ptr;
                        }
                    }
                    None | Some(Err(AllocError::OutOfMemory(_))) => report.ooms += 1,
                    Some(Err(
                        AllocError::Device(_)
                        | AllocError::InvalidArgument(_)
                        | AllocError::StreamFilter { .. },
                    )) => report.device_errors += 1,
                }
                allocated = Some((id, size, placed_at));
            }
            Op::Free { id } => {
                report.events += 1;
                match pointers.get_mut(id as usize) {
                    Some(slot) if *slot != 0 => {
                        let ptr = std::mem::take(slot);
                        if allocator.free(ptr).is_err() {
                            report.unknown_frees += 1;
                        }
                    }
                    _ => report.unknown_frees += 1,
                }
            }
            Op::EmptyCache => {
                report.events += 1;
                if allocator.empty_cache().is_err() {
                    report.device_errors += 1;
                }
            }
            Op::Oom { .. } => report.native_ooms += 1,
        }
        note_device_calls(
            op_index,
            before,
            DeviceCounts::of(&allocator),
            &mut device_allocations,
            &mut device_releases,
        );
        if let Some((id, size, placed_at)) = allocated {
            segments.note_malloc(
                &workload.segment_decisions,
                op_index,
                placed_at,
                device_allocations.get(allocations_before),
            );
            if let Some(placement) = workload
                .allocations
                .get(id as usize)
                .and_then(|allocation| allocation.placed)
            {
                check_placement(
                    &mut report,
                    &segments,
                    workload,
                    (op_index, size, placement),
                    placed_at,
                );
            }
        }
        if options.record_timeline {
            report.timeline.push(memory_point(&allocator));
        }
    }
    report.elapsed = started.elapsed();

    let stats = allocator.stats();
    report.peak_requested = stats.requested_bytes.all.peak.max(0) as u64;
    report.peak_reserved = stats.reserved_bytes.all.peak.max(0) as u64;
    report.end_requested = stats.requested_bytes.all.current.max(0) as u64;
    report.end_reserved = stats.reserved_bytes.all.current.max(0) as u64;
    report.segment_allocs = (stats.num_device_alloc - device_allocs_at_start).max(0) as u64;
    report.device_mallocs = stats.num_device_alloc.max(0) as u64;
    report.device_frees = stats.num_device_free.max(0) as u64;
    report.retries = stats.num_alloc_retries.max(0) as u64;
    report.cross_stream_reuses = allocator.cross_stream_counts().reuses;
    let (matching, mismatches) = compare_decisions(workload, &device_allocations);
    report.matching_segment_allocs = matching;
    report.mismatches = mismatches;
    let (matching, mismatches) = compare_releases(workload, &device_releases);
    report.native_segment_releases = workload
        .segment_releases
        .iter()
        .map(|r| r.segments as u64)
        .sum();
    report.matching_segment_releases = matching;
    report.release_mismatches = mismatches;
    report
}

/// Counts an allocation PyTorch placed in a segment the replay knows, and notes the first
/// one ferrocache placed elsewhere. `op` is the op's index, its requested size and PyTorch's
/// placement; `ptr` ferrocache's address (0 when it failed).
fn check_placement(
    report: &mut ReplayReport,
    segments: &SegmentMap,
    workload: &DeviceWorkload,
    (op_index, requested, placement): (usize, u64, Placement),
    ptr: u64,
) {
    let Some(expected) = segments.address_of(placement) else {
        return;
    };
    report.placements_checked += 1;
    if ptr == expected {
        report.placements_matching += 1;
    } else if report.first_misplacement.is_none() {
        report.first_misplacement = Some(Misplacement {
            op_index,
            trace_index: workload.op_origins.get(op_index).map(|o| o.trace_index),
            requested,
            pytorch: placement,
            ferrocache_start_segment: segments.start_segment_of(ptr),
        });
    }
}

fn memory_point(allocator: &DeviceAllocator<SimDevice>) -> MemoryPoint {
    let stats = allocator.stats();
    MemoryPoint {
        requested: stats.requested_bytes.all.current.max(0) as u64,
        reserved: stats.reserved_bytes.all.current.max(0) as u64,
    }
}

/// Makes one allocation live at the start with `malloc`; false if the GPU cannot hold it.
fn allocate_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    allocation: &StartAllocation,
    pointers: &mut [u64],
) -> bool {
    if allocation.requested_size > LARGEST_SANE_REQUEST {
        return false;
    }
    match allocator.malloc(allocation.requested_size as usize, allocation.stream) {
        Ok(ptr) => {
            if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                *slot = ptr;
            }
            true
        }
        Err(_) => false,
    }
}

fn fresh_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    start_allocations: &[StartAllocation],
    pointers: &mut [u64],
) -> StartReport {
    let mut report = StartReport::default();
    // `start_allocations` is in address order already; PyTorch would have made them in some
    // order we do not know, and address order is the closest guess to allocation order.
    for allocation in start_allocations {
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    report
}

/// Imports the start segments in `workload.start_order` (the order PyTorch made them in, as far
/// as the recording tells), noting in `bases` where each ordinary one landed.
fn reconstructed_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    workload: &DeviceWorkload,
    pointers: &mut [u64],
    bases: &mut [Option<u64>],
) -> StartReport {
    let mut report = StartReport::default();
    let segments = &workload.start_segments;
    // Allocations per start segment, in address (so offset) order.
    let mut by_segment: Vec<Vec<&StartAllocation>> = vec![Vec::new(); segments.len()];
    let mut unplaced: Vec<&StartAllocation> = Vec::new();
    for allocation in &workload.start_allocations {
        match allocation.segment.and_then(|s| by_segment.get_mut(s)) {
            Some(list) => list.push(allocation),
            None => unplaced.push(allocation),
        }
    }
    // Allocations whose segment is unknown get segments of their own first, so that they do
    // not take the free space of the imported segments, which PyTorch's cache held.
    for allocation in unplaced {
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    let mut misplaced: Vec<&StartAllocation> = Vec::new();
    let mut imported = vec![false; segments.len()];
    if allocator.config().expandable_segments {
        misplaced = import_expandable_segments(
            allocator,
            segments,
            &by_segment,
            pointers,
            &mut imported,
            &mut report,
        );
    }
    // Every segment once: the order given, then any it left out.
    let order = workload
        .start_order
        .iter()
        .copied()
        .chain(0..segments.len());
    for index in order.filter(|&i| i < segments.len()) {
        let (segment, allocations) = (&segments[index], &by_segment[index]);
        if imported[index] {
            continue;
        }
        imported[index] = true;
        let (fitting, rest) = fit_in_segment(segment, allocations);
        misplaced.extend(rest);
        let blocks: Vec<ImportedBlock> = fitting
            .iter()
            .map(|a| ImportedBlock {
                offset: a.offset as usize,
                size: a.size as usize,
                requested_size: requested_within_block(a),
            })
            .collect();
        // At PyTorch's address, where it is free: ties by address break as in PyTorch.
        allocator
            .device_mut()
            .prefer_next_address(Some(segment.address));
        let imported = usize::try_from(segment.size).ok().and_then(|size| {
            allocator
                .import_segment(size, segment.stream, segment.pool, &blocks)
                .ok()
        });
        allocator.device_mut().prefer_next_address(None);
        match imported {
            Some((base, placed)) => {
                bases[index] = Some(base);
                report.imported_segments += 1;
                report.placed_allocations += placed.len();
                for (allocation, ptr) in fitting.iter().zip(placed) {
                    if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                        *slot = ptr;
                    }
                }
            }
            None => {
                report.failures += 1;
                misplaced.extend(fitting);
            }
        }
    }
    for allocation in misplaced {
        report.misplaced_allocations += 1;
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    report
}

/// The mapped ranges of PyTorch's expandable segments, imported as expandable segments (one
/// per stream and pool, as PyTorch has them), so that the replay grows them as PyTorch did.
/// Each stream's ranges are mapped from the first to the end of the last, gaps included (a gap
/// is free mapped space in the replay, where PyTorch had unmapped it). Ranges that cannot be
/// imported so are left for [`reconstructed_start`] to import as ordinary segments. Returns
/// the allocations of imported ranges whose recorded place was impossible.
fn import_expandable_segments<'a>(
    allocator: &mut DeviceAllocator<SimDevice>,
    segments: &[StartSegment],
    by_segment: &[Vec<&'a StartAllocation>],
    pointers: &mut [u64],
    imported: &mut [bool],
    report: &mut StartReport,
) -> Vec<&'a StartAllocation> {
    let mut misplaced = Vec::new();
    let mut groups: Vec<((u64, crate::policy::PoolKind), Vec<usize>)> = Vec::new();
    for (index, segment) in segments.iter().enumerate() {
        if !segment.is_expandable {
            continue;
        }
        let key = (segment.stream, segment.pool);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(index),
            None => groups.push((key, vec![index])),
        }
    }
    for ((stream, pool), members) in groups {
        let first = segments[members[0]].address;
        let last = &segments[members[members.len() - 1]];
        let span = last.address.saturating_add(last.size) - first;
        let mut placed: Vec<&StartAllocation> = Vec::new();
        let mut unfit: Vec<&StartAllocation> = Vec::new();
        let mut blocks: Vec<ImportedBlock> = Vec::new();
        for &member in &members {
            let segment = &segments[member];
            let (fitting, rest) = fit_in_segment(segment, &by_segment[member]);
            unfit.extend(rest);
            for allocation in fitting {
                blocks.push(ImportedBlock {
                    offset: (segment.address - first + allocation.offset) as usize,
                    size: allocation.size as usize,
                    requested_size: requested_within_block(allocation),
                });
                placed.push(allocation);
            }
        }
        let Ok(span) = usize::try_from(span) else {
            continue;
        };
        let Ok((_, addresses)) = allocator.import_expandable_segment(span, stream, pool, &blocks)
        else {
            continue;
        };
        for &member in &members {
            imported[member] = true;
        }
        misplaced.extend(unfit);
        report.imported_segments += 1;
        report.placed_allocations += addresses.len();
        // Allocations whose recorded place was impossible are made by the caller's malloc.
        for (allocation, ptr) in placed.iter().zip(addresses) {
            if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                *slot = ptr;
            }
        }
    }
    misplaced
}

/// An imported block's requested size: never more than the block (as in PyTorch; a hostile
/// snapshot's larger figure would overflow the statistics).
fn requested_within_block(allocation: &StartAllocation) -> usize {
    allocation.requested_size.min(allocation.size) as usize
}

/// Splits a segment's allocations into those whose recorded place is possible (aligned, inside
/// the segment, not overlapping the one before) and the rest.
fn fit_in_segment<'a>(
    segment: &StartSegment,
    allocations: &[&'a StartAllocation],
) -> (Vec<&'a StartAllocation>, Vec<&'a StartAllocation>) {
    let align = K_MIN_BLOCK_SIZE as u64;
    let mut fitting = Vec::with_capacity(allocations.len());
    let mut rest = Vec::new();
    let mut cursor = 0u64;
    for &allocation in allocations {
        let end = allocation.offset.checked_add(allocation.size);
        let fits = allocation.size > 0
            && allocation.offset >= cursor
            && allocation.offset.is_multiple_of(align)
            && allocation.size.is_multiple_of(align)
            && end.is_some_and(|end| end <= segment.size);
        if fits {
            cursor = allocation.offset + allocation.size;
            fitting.push(allocation);
        } else {
            rest.push(allocation);
        }
    }
    (fitting, rest)
}

/// Counts PyTorch's decisions that ferrocache made identically and lists the mallocs where the
/// two differ. Both lists are in op order.
fn compare_decisions(
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
fn compare_releases(
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
