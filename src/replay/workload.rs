//! The workload a snapshot describes, ready to replay, and PyTorch's own figures for it.
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

use super::snapshot::{Action, BlockStatus, Snapshot, TraceEvent};
use crate::config::Config;
use crate::policy::{self, K_LARGE_BUFFER, K_SMALL_BUFFER, K_SMALL_SIZE, PoolKind, TieRule};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet};
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
    /// The workload of `snapshot`, with the order PyTorch made its start segments in and its
    /// tie rule found from its decisions ([`super::faithful`]); where they do not tell, the
    /// rule of `FERROCACHE_PYTORCH_VERSION` (PyTorch 2.15's when unset) is assumed.
    pub fn reconstruct(snapshot: &Snapshot) -> Workload {
        let config = snapshot.config();
        let assumed = crate::config::tie_rule_from_env();
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
                let mut workload = reconstruct_device(snapshot, device, trace, &config);
                super::faithful::settle(&mut workload, &config, assumed);
                workload
            })
            .collect();
        Workload {
            config,
            settings_recorded: snapshot.allocator_settings.is_some(),
            devices,
            idle_devices: idle_devices.into_iter().collect(),
        }
    }

    pub fn device(&self, device: usize) -> Option<&DeviceWorkload> {
        self.devices.iter().find(|d| d.device == device)
    }
}

/// `round_size` under the recorded settings; absurd sizes (hostile input) stay as they are
/// instead of overflowing.
fn rounded(size: u64, config: &Config) -> u64 {
    const SANE: u64 = 1 << 56;
    if size > SANE {
        return size;
    }
    policy::round_size(size as usize, config) as u64
}

/// The pool of a segment known only by its size: small segments are always 2 MiB, large ones
/// never are; expandable large pages are 20 MiB.
fn pool_of_segment(size: u64, expandable: bool) -> PoolKind {
    let small = if expandable {
        !size.is_multiple_of(K_LARGE_BUFFER as u64)
    } else {
        size == K_SMALL_BUFFER as u64
    };
    if small {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

#[derive(Debug, Clone, Copy)]
struct Range {
    size: u64,
    stream: u64,
    pool: PoolKind,
    expandable: bool,
    /// Which segment it is, in the forward pass (`None` for expandable ranges and in the
    /// backward walk).
    owner: Option<SegmentRef>,
}

/// Segments (or mapped ranges) by start address.
#[derive(Default)]
struct Ranges(BTreeMap<u64, Range>);

impl Ranges {
    fn containing(&self, addr: u64) -> Option<(u64, Range)> {
        let (&start, &range) = self.0.range(..=addr).next_back()?;
        (addr - start < range.size).then_some((start, range))
    }

    fn overlaps(&self, addr: u64, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else {
            return true;
        };
        self.containing(addr).is_some() || self.0.range(addr..end).next().is_some()
    }

    fn insert(&mut self, addr: u64, range: Range) -> bool {
        if range.size == 0 || self.overlaps(addr, range.size) {
            return false;
        }
        self.0.insert(addr, range);
        true
    }

    fn remove_exact(&mut self, addr: u64) -> bool {
        self.0.remove(&addr).is_some()
    }

    /// Takes `[addr, addr + size)` out of the range that holds it.
    fn remove_range(&mut self, addr: u64, size: u64) -> bool {
        let Some((start, range)) = self.containing(addr) else {
            return false;
        };
        let (Some(cut_end), Some(end)) = (addr.checked_add(size), start.checked_add(range.size))
        else {
            return false;
        };
        if cut_end > end {
            return false;
        }
        self.0.remove(&start);
        if start < addr {
            self.0.insert(
                start,
                Range {
                    size: addr - start,
                    ..range
                },
            );
        }
        if cut_end < end {
            self.0.insert(
                cut_end,
                Range {
                    size: end - cut_end,
                    ..range
                },
            );
        }
        true
    }

    /// Adds a mapped range, merging it with adjacent mapped ranges of the same stream.
    fn add_mapped(&mut self, addr: u64, size: u64, stream: u64) -> bool {
        if size == 0 || self.overlaps(addr, size) {
            return false;
        }
        let mut start = addr;
        let mut merged = Range {
            size,
            stream,
            pool: pool_of_segment(size, true),
            expandable: true,
            owner: None,
        };
        let joins = |r: &Range| r.expandable && r.stream == stream;
        if let Some((&prev_start, &prev)) = self.0.range(..addr).next_back()
            && joins(&prev)
            && prev_start.checked_add(prev.size) == Some(addr)
        {
            self.0.remove(&prev_start);
            start = prev_start;
            merged.size += prev.size;
            merged.pool = prev.pool;
        }
        if let Some(&next) = self.0.get(&(addr + size))
            && joins(&next)
        {
            self.0.remove(&(addr + size));
            merged.size = merged.size.saturating_add(next.size);
            merged.pool = next.pool;
        }
        self.0.insert(start, merged);
        true
    }
}

/// An allocation alive at some point of the backward walk.
#[derive(Debug, Clone, Copy)]
struct LiveBlock {
    requested: u64,
    stream: u64,
    /// Known only for blocks taken from the end state.
    size: Option<u64>,
    /// Free requested, waiting for `free_completed`.
    pending: bool,
}

/// The state when recording began: undo the trace on the end state, newest event first.
fn start_state(
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
        match &event.action {
            Action::Alloc => {
                if live.remove(&event.addr).is_none() {
                    diagnostics.allocs_missing_at_end += 1;
                }
            }
            Action::FreeCompleted => match live.get(&event.addr) {
                None => {
                    live.insert(event.addr, freed_block(true));
                }
                Some(_) => diagnostics.inconsistent_frees += 1,
            },
            Action::FreeRequested => match live.get_mut(&event.addr) {
                Some(block) if block.pending => block.pending = false,
                Some(_) => diagnostics.inconsistent_frees += 1,
                // No free_completed recorded, and the end state does not show it pending.
                None => {
                    live.insert(event.addr, freed_block(false));
                }
            },
            Action::Free => match live.get(&event.addr) {
                None => {
                    live.insert(event.addr, freed_block(false));
                }
                Some(_) => diagnostics.inconsistent_frees += 1,
            },
            Action::SegmentAlloc => {
                if !ranges.remove_exact(event.addr) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Action::SegmentFree => {
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
            Action::SegmentMap => {
                if !ranges.remove_range(event.addr, event.size) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Action::SegmentUnmap => {
                if !ranges.add_mapped(event.addr, event.size, event.stream) {
                    diagnostics.segment_mismatches += 1;
                }
            }
            Action::Oom | Action::Snapshot | Action::UserDefined | Action::Other(_) => {}
        }
    }
    (ranges, live)
}

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

fn reconstruct_device(
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
        match &event.action {
            Action::Alloc => {
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
            Action::FreeRequested | Action::Free => {
                forward.close_run(false, &mut diagnostics);
                if event.action == Action::Free {
                    forward.occupied.remove(&event.addr);
                }
                match live_ids.remove(&event.addr) {
                    Some(id) => {
                        forward.free(id, origin);
                        note_start_freed(id, &allocated_addresses);
                        if event.action == Action::FreeRequested {
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
            Action::FreeCompleted => {
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
            Action::SegmentAlloc | Action::SegmentMap => {
                let released = forward.close_run(true, &mut diagnostics);
                let kind = if event.action == Action::SegmentAlloc {
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
            Action::SegmentFree | Action::SegmentUnmap => {
                if event.action == Action::SegmentFree {
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
            Action::Oom => {
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
            Action::Snapshot | Action::UserDefined => {
                forward.close_run(false, &mut diagnostics);
            }
            Action::Other(_) => diagnostics.unknown_actions += 1,
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

/// Places the allocations live at the start in their segments and settles their block sizes.
fn start_allocations(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::snapshot::{BlockState, Segment};

    const MIB: u64 = 1 << 20;

    fn event(action: Action, addr: u64, size: u64) -> TraceEvent {
        TraceEvent {
            action,
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
        Workload::reconstruct(&snapshot).devices.remove(0)
    }

    fn free(addr: u64, size: u64) -> [TraceEvent; 2] {
        [
            event(Action::FreeRequested, addr, size),
            event(Action::FreeCompleted, addr, size),
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
        trace.push(event(Action::Alloc, base + 4 * MIB, 3 * MIB));
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
            event(Action::SegmentAlloc, a, 20 * MIB),
            event(Action::Alloc, a, 5 * MIB),
            event(Action::FreeRequested, a, 5 * MIB),
            event(Action::FreeCompleted, a, 5 * MIB),
            // Followed by a segment_alloc: a malloc released it after a failed cudaMalloc.
            event(Action::SegmentFree, a, 20 * MIB),
            event(Action::SegmentAlloc, b, 20 * MIB),
            event(Action::Alloc, b, 5 * MIB),
            // Followed by an alloc served from the cache: empty_cache().
            event(Action::SegmentFree, a + 40 * MIB, 2 * MIB),
            event(Action::Alloc, b + 5 * MIB, 5 * MIB),
            // At the end of the trace: empty_cache().
            event(Action::SegmentFree, a + 60 * MIB, 2 * MIB),
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
            event(Action::SegmentFree, a, 20 * MIB),
            event(Action::SegmentFree, a + 40 * MIB, 2 * MIB),
            event(Action::SegmentAlloc, b, 20 * MIB),
            event(Action::Alloc, b, 5 * MIB),
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
            event(Action::SegmentAlloc, a, 2 * MIB),
            event(Action::Alloc, a, 512),
            event(Action::FreeRequested, a, 512),
            event(Action::Alloc, a + 512, 512),
            // Completed late: the block was used on another stream.
            event(Action::FreeCompleted, a, 512),
            // Requested before recording began: live at the start, pending.
            event(Action::FreeCompleted, a + 4096, 512),
            event(Action::FreeRequested, a + 512, 512),
            event(Action::FreeCompleted, a + 512, 512),
            // A double free.
            event(Action::FreeRequested, a + 512, 512),
            event(Action::FreeCompleted, a + 512, 512),
            event(Action::Oom, 0, 1 << 40),
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
        let trace = vec![event(Action::Alloc, a + 512, 200)];
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
            event(Action::SegmentUnmap, a + 40 * MIB, 40 * MIB),
            event(Action::SegmentMap, a + 40 * MIB, 20 * MIB),
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
