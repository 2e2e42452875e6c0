//! The trace vocabulary of PyTorch's memory snapshots: the actions that `device_traces`
//! entries record, by PyTorch's names (`TraceEntry::Action` in c10/cuda/CUDACachingAllocator.h,
//! written by `torch.cuda.memory._snapshot()`). The allocator's history records them
//! ([`crate::allocator::history`]) and the snapshot reader reads them ([`crate::replay::snapshot`]),
//! so a name is spelt here once.

#![forbid(unsafe_code)]

use serde::Serialize;
use std::sync::Arc;

use crate::device::{DevicePtr, StreamId};

/// What a trace entry records, with PyTorch's action names (`alloc`, `free_requested`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    Alloc,
    /// The program freed the block (`size` is its requested size).
    FreeRequested,
    /// The block went back to the cache: right after `FreeRequested`, or later when the block
    /// was used on other streams.
    FreeCompleted,
    /// `free` of older and profiler-made snapshots: requested and completed at once. The
    /// allocator never records it.
    Free,
    SegmentAlloc,
    SegmentFree,
    /// Pages mapped into an expandable segment.
    SegmentMap,
    SegmentUnmap,
    /// An allocation the allocator could not satisfy.
    Oom,
    /// A snapshot was taken (`size` is the active bytes then).
    Snapshot,
    /// A user annotation (`torch.cuda.memory._record_memory_history` callers). The allocator
    /// never records it.
    UserDefined,
}

impl TraceAction {
    /// Every action, in the order above.
    pub const ALL: [TraceAction; 11] = [
        TraceAction::Alloc,
        TraceAction::FreeRequested,
        TraceAction::FreeCompleted,
        TraceAction::Free,
        TraceAction::SegmentAlloc,
        TraceAction::SegmentFree,
        TraceAction::SegmentMap,
        TraceAction::SegmentUnmap,
        TraceAction::Oom,
        TraceAction::Snapshot,
        TraceAction::UserDefined,
    ];

    /// PyTorch's name for the action.
    pub fn name(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::Free => "free",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
            TraceAction::UserDefined => "user_defined",
        }
    }

    /// The action PyTorch names `name`; `None` for a name outside this vocabulary. (A match,
    /// not a search of [`TraceAction::ALL`]: it runs once per entry of a snapshot; a test keeps
    /// it equal to [`TraceAction::name`].)
    pub fn from_name(name: &str) -> Option<TraceAction> {
        Some(match name {
            "alloc" => TraceAction::Alloc,
            "free_requested" => TraceAction::FreeRequested,
            "free_completed" => TraceAction::FreeCompleted,
            "free" => TraceAction::Free,
            "segment_alloc" => TraceAction::SegmentAlloc,
            "segment_free" => TraceAction::SegmentFree,
            "segment_map" => TraceAction::SegmentMap,
            "segment_unmap" => TraceAction::SegmentUnmap,
            "oom" => TraceAction::Oom,
            "snapshot" => TraceAction::Snapshot,
            "user_defined" => TraceAction::UserDefined,
            _ => return None,
        })
    }

    /// Actions whose `addr` and `size` describe a block or a segment.
    pub fn names_a_block_or_segment(self) -> bool {
        matches!(
            self,
            TraceAction::Alloc
                | TraceAction::FreeRequested
                | TraceAction::FreeCompleted
                | TraceAction::Free
                | TraceAction::SegmentAlloc
                | TraceAction::SegmentFree
                | TraceAction::SegmentMap
                | TraceAction::SegmentUnmap
        )
    }
}

/// PyTorch's `MempoolId_t`: the id of a private pool. `(0, 0)` names the ordinary pools.
pub type MempoolId = (u64, u64);

/// The id PyTorch reports for memory of the ordinary pools (`segment_pool_id` in snapshots).
pub const ORDINARY_POOL_ID: MempoolId = (0, 0);

/// One trace entry as an allocator trace tracker receives it (PyTorch's `TraceEntry`, less the
/// time and the stack, which the receiver adds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrackedEvent {
    pub action: TraceAction,
    pub device: i32,
    /// The address; for `oom`, the device's free bytes (PyTorch's use of the field).
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    /// The pool of the block or segment: `(0, 0)` for the ordinary pools (and a tag's), else
    /// the private pool's id (a CUDA graph's, a `torch.cuda.MemPool`'s).
    pub pool: MempoolId,
}

/// Receives every trace entry of a device, under the device's lock (as PyTorch calls its
/// trackers under its own): it must not call the allocator of that device.
pub type TraceTracker = Arc<dyn Fn(&TrackedEvent) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_as_its_action() {
        for action in TraceAction::ALL {
            assert_eq!(TraceAction::from_name(action.name()), Some(action));
        }
        assert_eq!(TraceAction::from_name("segment_resize"), None);
    }

    #[test]
    fn serde_writes_the_same_names() {
        for action in TraceAction::ALL {
            let json = serde_json::to_string(&action).unwrap();
            assert_eq!(json, format!("\"{}\"", action.name()));
        }
    }
}
