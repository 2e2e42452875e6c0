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

mod compare;
mod report;
mod start;

pub use report::{
    MemoryPoint, Misplacement, NativeFigures, ReleaseMismatch, ReplayReport, SegmentMismatch,
    StartReport,
};

use super::workload::{DeviceWorkload, Op, Placement};
use crate::allocator::{AllocError, DeviceAllocator};
use crate::config::Config;
use crate::device::sim::SimDevice;
use compare::{
    DeviceAllocation, DeviceCounts, SegmentMap, compare_decisions, compare_releases,
    note_device_calls,
};
use start::{LARGEST_SANE_REQUEST, fresh_start, reconstructed_start};
use std::time::Instant;

/// The simulated GPU's memory unless told otherwise: an 80 GiB card (A100/H100).
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

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
                        | AllocError::StreamFilter { .. }
                        | AllocError::RunFreeMemoryCallbacks,
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
