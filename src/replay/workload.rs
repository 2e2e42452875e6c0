//! The workload a snapshot describes, ready to replay, and PyTorch's own figures for it: the
//! segments and allocations that existed when recording began, the ordered operations with
//! dense allocation ids, PyTorch's own segment decisions and releases to compare against, and
//! what the reconstruction could not make add up.
//!
//! [`super::reconstruct`] makes a workload from a snapshot (a pure function of it); the
//! faithful pass ([`super::faithful`]) then finds what the snapshot does not say (the order its
//! start segments were made in, the tie rule of the PyTorch that made it) by replaying.
//! [`Workload::reconstruct`] does both, as every reader of a snapshot does on loading it.

use crate::config::Config;
use crate::policy::{PoolKind, TieRule};
use std::fmt;

/// One step of a replay. Allocations are named by dense ids (`0..allocations.len()`): the ids of
/// allocations live when recording began come first, then one per `alloc` in trace order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` requested bytes on `stream`.
    Alloc { id: u32, size: u64, stream: u64 },
    /// Free allocation `id`.
    Free { id: u32 },
    /// `torch.cuda.empty_cache()`.
    EmptyCache,
    /// PyTorch could not satisfy a request of `size` (already rounded) bytes on `stream`.
    Oom { size: u64, stream: u64 },
}

/// Where an [`Op`] came from in the device's trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpOrigin {
    pub trace_index: usize,
    pub time_us: i64,
}

/// A segment that existed when recording began (for expandable segments: one mapped range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSegment {
    pub address: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: PoolKind,
    pub is_expandable: bool,
}

/// How the block size of an allocation live at the start is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSizeSource {
    /// The block is still there in the end state.
    EndState,
    /// Derived exactly from PyTorch's rounding and splitting rules and the layout around it.
    Inferred,
    /// `round_size(requested)`; the real block may be larger by an unsplit remainder.
    Estimated,
}

/// An allocation live when recording began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartAllocation {
    pub id: u32,
    pub address: u64,
    /// The block size.
    pub size: u64,
    pub requested_size: u64,
    pub stream: u64,
    /// Index into `start_segments` of the segment that holds it; `None` if no start segment does
    /// (an inconsistent snapshot).
    pub segment: Option<usize>,
    /// Offset of the block in that segment.
    pub offset: u64,
    pub size_source: BlockSizeSource,
    /// Freed before recording began but still waiting for other streams: it holds its memory
    /// until its `free_completed`.
    pub pending_free: bool,
}

/// Every allocation of the workload, by id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// PyTorch's address for it.
    pub address: u64,
    pub requested_size: u64,
    pub stream: u64,
    pub live_at_start: bool,
    /// Where PyTorch placed it, for an allocation the trace made in an ordinary segment: the
    /// segment and the offset in it. A faithful replay places it at the same offset of the
    /// same segment.
    pub placed: Option<Placement>,
}

/// One of PyTorch's segments, as a replay knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentRef {
    /// `start_segments[i]`: it existed when recording began.
    Start(u32),
    /// `segment_decisions[i]`: PyTorch made it while recording.
    Decision(u32),
}

/// Where PyTorch placed an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub segment: SegmentRef,
    pub offset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentDecisionKind {
    /// `segment_alloc`: a new `cudaMalloc`.
    Alloc,
    /// `segment_map`: pages mapped into an expandable segment.
    Map,
}

/// A segment PyTorch created while recording, in order: what a faithful replay must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDecision {
    pub kind: SegmentDecisionKind,
    pub trace_index: usize,
    pub time_us: i64,
    pub address: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: PoolKind,
    /// Index into `ops` of the [`Op::Alloc`] the segment was made for; `None` if the malloc
    /// failed.
    pub serves_op: Option<usize>,
    /// Bytes of cached segments the same malloc released first (after a failed `cudaMalloc`).
    pub released_before: u64,
}

/// Segments PyTorch gave back together: in an `empty_cache()` call, or in a malloc that
/// released cached segments after a failed `cudaMalloc` (its retry). What a faithful replay
/// must give back in the same op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentRelease {
    /// Index into `ops` of the [`Op::EmptyCache`], or of the [`Op::Alloc`] whose malloc
    /// released them; `None` when that malloc failed (its op is an `Oom`).
    pub op_index: Option<usize>,
    /// `segment_free` + `segment_unmap` entries.
    pub segments: usize,
    pub bytes: u64,
    /// Where the first of them is in the trace.
    pub trace_index: usize,
}

/// Requested and reserved bytes after a trace event that changed either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelinePoint {
    pub trace_index: usize,
    pub time_us: i64,
    pub requested: u64,
    pub reserved: u64,
}

/// PyTorch's own figures, replayed from the trace's accounting (no allocator involved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figures {
    pub live_at_start_blocks: usize,
    /// Requested bytes of the allocations live at the start.
    pub live_at_start_requested: u64,
    /// Block bytes of the allocations live at the start.
    pub live_at_start_size: u64,
    pub reserved_at_start: u64,
    pub peak_requested: u64,
    /// Trace index after which the peak was first reached; `None` when it is the start.
    pub peak_requested_at: Option<usize>,
    pub peak_reserved: u64,
    pub peak_reserved_at: Option<usize>,
    pub end_requested: u64,
    pub end_reserved: u64,
    pub allocs: usize,
    pub frees: usize,
    pub segment_allocs: usize,
    pub segment_frees: usize,
    pub segment_maps: usize,
    pub segment_unmaps: usize,
    pub ooms: usize,
    pub empty_caches: usize,
}

impl Figures {
    /// Peak requested over peak reserved, 0 when nothing was reserved.
    pub fn utilization(&self) -> f64 {
        if self.peak_reserved == 0 {
            0.0
        } else {
            self.peak_requested as f64 / self.peak_reserved as f64
        }
    }
}

impl fmt::Display for Figures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "live at start {} blocks, {:.2} GiB; reserved at start {:.2} GiB; \
             peak requested {:.2} GiB; peak reserved {:.2} GiB; utilization {:.1}%; \
             {} segment_alloc",
            self.live_at_start_blocks,
            gib(self.live_at_start_requested),
            gib(self.reserved_at_start),
            gib(self.peak_requested),
            gib(self.peak_reserved),
            100.0 * self.utilization(),
            self.segment_allocs,
        )
    }
}

/// What did not add up, and what was guessed. All zero for a consistent snapshot, except the
/// counts of choices (`deferred_frees`, `retry_released_segments`, block size sources).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Diagnostics {
    /// Frees of addresses that hold no allocation at that point (after reconstruction).
    pub unknown_frees: usize,
    /// Allocs at an address that still held an allocation (the older one is freed first).
    pub allocs_over_live: usize,
    /// Allocations the trace made and never freed that the end state does not show.
    pub allocs_missing_at_end: usize,
    /// Frees of blocks that, going backwards, were still live after the free.
    pub inconsistent_frees: usize,
    /// Segment events that do not fit the segments known at that point.
    pub segment_mismatches: usize,
    /// Entries with an action this reader does not know.
    pub unknown_actions: usize,
    /// Frees whose `free_completed` did not follow right after `free_requested` (stream uses).
    pub deferred_frees: usize,
    /// Segments released inside a malloc (after a failed `cudaMalloc`), not replayed.
    pub retry_released_segments: usize,
    pub inferred_block_sizes: usize,
    pub estimated_block_sizes: usize,
    /// Allocations live at the start that no start segment holds.
    pub start_blocks_outside_segments: usize,
    /// Requested bytes of `active_allocated` blocks in the end state (and of blocks pending
    /// from before recording to the end), to compare with [`Figures::end_requested`].
    pub end_state_requested: u64,
    /// Bytes of the end state's segments, to compare with [`Figures::end_reserved`].
    pub end_state_reserved: u64,
}

impl Diagnostics {
    /// Whether the trace, replayed from the reconstructed start, lands on the recorded end state.
    pub fn is_consistent(&self, figures: &Figures) -> bool {
        self.unknown_frees == 0
            && self.allocs_over_live == 0
            && self.allocs_missing_at_end == 0
            && self.inconsistent_frees == 0
            && self.segment_mismatches == 0
            && self.start_blocks_outside_segments == 0
            && self.end_state_requested == figures.end_requested
            && self.end_state_reserved == figures.end_reserved
    }
}

/// One device's workload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceWorkload {
    pub device: usize,
    /// Segments when recording began, by address.
    pub start_segments: Vec<StartSegment>,
    /// Allocations live when recording began, by address; their ids are `0..len`.
    pub start_allocations: Vec<StartAllocation>,
    /// Every allocation, indexed by id.
    pub allocations: Vec<Allocation>,
    /// What to replay, in order.
    pub ops: Vec<Op>,
    /// Where each op came from (`op_origins[i]` for `ops[i]`).
    pub op_origins: Vec<OpOrigin>,
    /// The segments PyTorch created, in order.
    pub segment_decisions: Vec<SegmentDecision>,
    /// The segments PyTorch gave back, in order.
    pub segment_releases: Vec<SegmentRelease>,
    /// The order in which PyTorch made the start segments (indices into `start_segments`),
    /// oldest first: the order a reconstructed start imports them in, since PyTorch 2.13 breaks
    /// ties between equal cached blocks by it. Address order unless the recording's own
    /// decisions showed otherwise ([`super::faithful`]).
    pub start_order: Vec<usize>,
    /// The tie rule of the PyTorch that made the recording, when its decisions tell
    /// ([`super::faithful`]); every replay of the workload then decides ties by it. `None`:
    /// no rule reproduces the recording better than another, and the replay follows its
    /// settings' rule.
    pub tie_rule: Option<TieRule>,
    /// The rules that reproduce the recording equally well, the one used first; empty when
    /// they were not tried (an inconsistent reconstruction, a built workload).
    pub tie_rules_alike: Vec<TieRule>,
    pub figures: Figures,
    pub timeline: Vec<TimelinePoint>,
    pub diagnostics: Diagnostics,
}

/// A snapshot's workload, per device.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// The settings PyTorch ran with (its defaults when the snapshot does not say).
    pub config: Config,
    /// Whether the snapshot recorded its allocator settings.
    pub settings_recorded: bool,
    /// Devices that have trace events, by device index.
    pub devices: Vec<DeviceWorkload>,
    /// Devices that hold segments but have no trace events: nothing happened on them while
    /// recording (a snapshot lists every device's trace, most of them empty on a process that
    /// recorded one GPU), so there is nothing to replay.
    pub idle_devices: Vec<usize>,
}

impl Workload {
    pub fn device(&self, device: usize) -> Option<&DeviceWorkload> {
        self.devices.iter().find(|d| d.device == device)
    }
}
