//! Reading PyTorch memory snapshots and reconstructing the workload they describe.
//!
//! A snapshot (`torch.cuda.memory._dump_snapshot()`) holds the allocator's state at the END of
//! recording and the trace of what happened while recording. This module reads it
//! ([`pickle`], [`snapshot`]) and turns it into what a replay needs ([`workload`], made by
//! [`reconstruct`] and settled by [`faithful`]'s replays against the recording): the segments and
//! allocations that existed when recording began, the ordered operations to replay with dense ids,
//! PyTorch's own segment decisions to compare against, and PyTorch's own figures (peak requested
//! and reserved bytes) replayed from the trace's accounting. [`engine`] replays a workload through
//! ferrocache's allocator on a simulated GPU and compares; [`demo`] makes a synthetic training
//! workload; [`plot`] draws memory over a replay.
//!
//! ```no_run
//! use ferrocache::policy::TieRule;
//! use ferrocache::replay::{load, Workload};
//! let snapshot = load(std::path::Path::new("snapshot.pickle")).unwrap();
//! let workload = Workload::reconstruct(&snapshot, TieRule::default());
//! for device in &workload.devices {
//!     println!("peak requested {} bytes", device.figures.peak_requested);
//! }
//! ```

#![forbid(unsafe_code)]

pub mod demo;
pub mod demo_fsdp;
pub mod engine;
pub mod faithful;
pub mod job;
mod op_list;
pub mod pickle;
pub mod plot;
pub mod program;
pub mod reconstruct;
pub mod snapshot;
pub mod workload;

pub use crate::trace::TraceAction;
pub use engine::{
    DEFAULT_CAPACITY, MemoryPoint, Misplacement, NativeFigures, ReleaseMismatch, ReplayOptions,
    ReplayReport, SegmentMismatch, StartReport, StartState, replay,
};
pub use job::{JobSummary, RankError, assign_ranks, rank_of_path};
pub use pickle::{Document, PickleError, PickleErrorKind, PickleValue, ValueRef};
pub use plot::{PlotPanel, PlotSeries, render_svg};
pub use snapshot::{
    AllocatorSettings, BlockState, BlockStatus, Segment, Snapshot, TraceEvent, load, parse_snapshot,
};
pub use workload::{
    Allocation, BlockSizeSource, DeviceWorkload, Diagnostics, Figures, Op, OpOrigin, Placement,
    SegmentDecision, SegmentDecisionKind, SegmentRef, SegmentRelease, StartAllocation,
    StartSegment, TimelinePoint, Workload,
};

use std::fmt;

/// Bytes as GiB from 1 GiB up, else as MiB.
pub fn bytes(value: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    const GIB: f64 = (1u64 << 30) as f64;
    let v = value as f64;
    if v >= GIB {
        format!("{:.2} GiB", v / GIB)
    } else {
        format!("{:.1} MiB", v / MIB)
    }
}

/// What kind of problem stopped a snapshot from being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayErrorKind {
    /// The file could not be read.
    Io,
    /// Neither a pickle (protocol 2 to 5) nor JSON.
    NotPickleOrJson,
    /// The pickle or JSON ends early.
    Truncated,
    /// The pickle names a class or calls code.
    Refused,
    /// The pickle or JSON is damaged or uses forms this reader does not build.
    Malformed,
    /// Plain data, but not a PyTorch memory snapshot (missing keys, wrong types).
    NotSnapshot,
    /// A valid snapshot whose traces are all empty: nothing to replay.
    NoTraceEvents,
}

/// A snapshot that could not be read. Displays as one line that names the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayError {
    /// The file (or the name given to [`parse_snapshot`]).
    pub file: String,
    pub kind: ReplayErrorKind,
    /// What is wrong, in one line.
    pub detail: String,
}

impl ReplayError {
    pub(crate) fn new(file: &str, kind: ReplayErrorKind, detail: impl Into<String>) -> Self {
        ReplayError {
            file: one_line(file),
            kind,
            detail: one_line(&detail.into()),
        }
    }
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.file, self.detail)
    }
}

impl std::error::Error for ReplayError {}

/// Replaces control characters (newlines above all) so that every message stays on one line.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}
