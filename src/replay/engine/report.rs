//! What a replay measured: its figures, the decisions and placements that departed from
//! PyTorch's, and PyTorch's own figures to compare with.

use crate::policy::TieRule;
use crate::replay::workload::{DeviceWorkload, Placement};
use std::time::Duration;

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
