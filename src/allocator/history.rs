//! Allocation history (a ring buffer of trace entries) and snapshots in the format of
//! `torch.cuda.memory._snapshot()`, which PyTorch's memory viewer reads.

use super::DeviceAllocator;
use crate::device::{Device, DevicePtr, StreamId};
use crate::trace::{MempoolId, ORDINARY_POOL_ID, TraceTracker, TrackedEvent};
use serde::Serialize;
use std::sync::Arc;

/// A caller's stack trace, named by an id that the caller hands out (see
/// [`DeviceAllocator::malloc_with_stack`]); 0 means none. The allocator only stores it.
pub type StackId = u64;

/// What a trace entry records, with PyTorch's action names: the vocabulary the snapshot reader
/// shares ([`crate::trace`]).
pub use crate::trace::TraceAction;

/// One entry of `device_traces`.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    pub action: TraceAction,
    /// The address; for `oom` entries, the device's free bytes at the time (PyTorch reuses the
    /// field and names it `device_free` in snapshots).
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    pub time_us: i64,
    /// The caller's stack, as an id the caller gave (0: none). The Python package hands out
    /// these ids and turns them into PyTorch's `frames` when it reads a snapshot.
    pub stack_id: StackId,
    /// What `torch.cuda.memory._set_memory_metadata` set on the thread that caused the entry
    /// (`user_metadata` in snapshots; "" when none was set).
    pub user_metadata: Option<Arc<str>>,
}

impl Serialize for TraceEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(8))?;
        map.serialize_entry("action", &self.action)?;
        let address_key = if self.action == TraceAction::Oom {
            "device_free"
        } else {
            "addr"
        };
        map.serialize_entry(address_key, &self.addr)?;
        map.serialize_entry("size", &self.size)?;
        map.serialize_entry("stream", &self.stream)?;
        map.serialize_entry("time_us", &self.time_us)?;
        map.serialize_entry("frames", &[(); 0])?;
        if self.stack_id != 0 {
            map.serialize_entry("stack_id", &self.stack_id)?;
        }
        // PyTorch writes it on every entry, "" when the thread set none.
        map.serialize_entry("user_metadata", self.user_metadata.as_deref().unwrap_or(""))?;
        map.end()
    }
}

/// The ring buffer of trace entries, off until recording is asked for, and the allocator trace
/// tracker that receives every entry as it is made, recording or not (PyTorch's
/// `record_trace`).
#[derive(Debug, Default)]
pub(crate) struct History {
    enabled: bool,
    /// Whether entries are wanted at all: recording, or a tracker attached. The one flag the
    /// hit path tests.
    wanted: bool,
    tracker: Option<Tracked>,
    max_entries: usize,
    entries: Vec<TraceEntry>,
    /// Where the next entry goes once the buffer is full.
    next: usize,
    /// The stack of the malloc or free in progress, given to every entry it records (a
    /// `segment_alloc` or `oom` carries the stack of the allocation that caused it, as in
    /// PyTorch).
    current_stack: StackId,
    /// The caller's metadata, given to every entry the malloc or free in progress records.
    current_metadata: Option<Arc<str>>,
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// An attached tracker with the device its entries are for.
struct Tracked {
    device: i32,
    send: TraceTracker,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tracked(device {})", self.device)
    }
}

impl History {
    /// `_record_memory_history(enabled, max_entries)`: turning it off clears the buffer.
    pub(crate) fn set_recording(&mut self, enabled: bool, max_entries: usize) {
        self.enabled = enabled;
        self.max_entries = max_entries.max(1);
        if !enabled {
            self.entries.clear();
            self.next = 0;
        }
        self.wanted = self.enabled || self.tracker.is_some();
    }

    /// `attachAllocatorTraceTracker`: `tracker` (or none) receives every entry of `device`
    /// from now on, under the device's lock, as PyTorch calls its trackers.
    pub(crate) fn set_tracker(&mut self, device: i32, tracker: Option<TraceTracker>) {
        self.tracker = tracker.map(|send| Tracked { device, send });
        self.wanted = self.enabled || self.tracker.is_some();
    }

    #[inline]
    pub(crate) fn is_recording(&self) -> bool {
        self.enabled
    }

    /// An entry of the ordinary pools (or of no pool: an `oom`, a `snapshot`).
    #[inline]
    pub(crate) fn record(
        &mut self,
        action: TraceAction,
        addr: DevicePtr,
        size: usize,
        stream: StreamId,
    ) {
        self.record_in_pool(action, addr, size, stream, || ORDINARY_POOL_ID);
    }

    /// An entry of the pool `pool` names (asked only when a tracker is attached): what
    /// PyTorch's `record_trace` gives its trackers as `mempool_`.
    #[inline(always)]
    pub(crate) fn record_in_pool(
        &mut self,
        action: TraceAction,
        addr: DevicePtr,
        size: usize,
        stream: StreamId,
        pool: impl FnOnce() -> MempoolId,
    ) {
        if self.wanted {
            self.record_wanted(action, addr, size, stream, pool);
        }
    }

    #[inline(never)]
    fn record_wanted(
        &mut self,
        action: TraceAction,
        addr: DevicePtr,
        size: usize,
        stream: StreamId,
        pool: impl FnOnce() -> MempoolId,
    ) {
        if let Some(tracked) = &self.tracker {
            (tracked.send)(&TrackedEvent {
                action,
                device: tracked.device,
                addr,
                size: size as u64,
                stream,
                pool: pool(),
            });
        }
        if self.enabled {
            self.push(action, addr, size, stream);
        }
    }

    #[inline(never)]
    fn push(&mut self, action: TraceAction, addr: DevicePtr, size: usize, stream: StreamId) {
        let entry = TraceEntry {
            action,
            addr,
            size: size as u64,
            stream,
            time_us: now_us(),
            stack_id: self.current_stack,
            user_metadata: self.current_metadata.clone(),
        };
        if self.entries.len() < self.max_entries {
            self.entries.push(entry);
        } else {
            self.entries[self.next] = entry;
            self.next = (self.next + 1) % self.max_entries;
        }
    }

    /// Sets the stack that the entries recorded from now on carry; returns the previous one.
    #[inline]
    pub(crate) fn set_current_stack(&mut self, stack: StackId) -> StackId {
        std::mem::replace(&mut self.current_stack, stack)
    }

    /// Sets the metadata that the entries recorded from now on carry; returns the previous.
    #[inline]
    pub(crate) fn set_current_metadata(&mut self, metadata: Option<Arc<str>>) -> Option<Arc<str>> {
        std::mem::replace(&mut self.current_metadata, metadata)
    }

    #[inline]
    pub(crate) fn current_stack(&self) -> StackId {
        self.current_stack
    }

    /// The entries, oldest first.
    pub(crate) fn entries(&self) -> Vec<TraceEntry> {
        let mut out = Vec::with_capacity(self.entries.len());
        out.extend_from_slice(&self.entries[self.next..]);
        out.extend_from_slice(&self.entries[..self.next]);
        out
    }
}

/// A block in a snapshot segment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotBlock {
    pub address: DevicePtr,
    pub size: u64,
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` (freed, waiting for other streams) or `inactive`.
    pub state: &'static str,
    /// Always empty here: the Python package fills it from `stack_id`.
    pub frames: Vec<serde_json::Value>,
    /// The stack of the allocation that handed the block out (0: none recorded); absent from
    /// the JSON when 0.
    #[serde(skip_serializing_if = "is_no_stack")]
    pub stack_id: StackId,
}

fn is_no_stack(stack: &StackId) -> bool {
    *stack == 0
}

/// A segment (or, for an expandable segment, one contiguous mapped range) in a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotSegment {
    pub device: i32,
    pub address: DevicePtr,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: StreamId,
    pub segment_type: &'static str,
    pub segment_pool_id: (u64, u64),
    pub is_expandable: bool,
    /// PyTorch's `SegmentInfo::registration_counter`: the order in which the segment's first
    /// block was made (from 0; 0 for every segment under the address tie rule), by which NCCL's
    /// `registerMemPool` orders a pool's segments alike on every rank. C++ callers only.
    #[serde(skip)]
    pub registration_counter: u64,
    pub frames: Vec<serde_json::Value>,
    pub blocks: Vec<SnapshotBlock>,
}

/// `torch.cuda.memory._snapshot()` for one device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemorySnapshot {
    pub segments: Vec<SnapshotSegment>,
    pub device_traces: Vec<Vec<TraceEntry>>,
    pub allocator_settings: serde_json::Value,
}

impl<D: Device> DeviceAllocator<D> {
    /// The segments and their blocks, by address: one entry per ordinary segment and per
    /// contiguous mapped range of an expandable segment, as PyTorch's `snapshot()` reports them.
    pub fn segments(&self) -> Vec<SnapshotSegment> {
        let mut out = Vec::new();
        for (_, head) in self.arena.iter() {
            // A segment (or mapped range) starts at a mapped block with no mapped block before.
            let starts_range = head.mapped
                && !self.segments.is_asleep(head.segment)
                && head.prev.is_none_or(|p| !self.arena.get(p).mapped);
            if !starts_range {
                continue;
            }
            let mut segment = SnapshotSegment {
                device: self.device_index,
                address: head.ptr,
                total_size: 0,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: head.stream,
                segment_type: head.pool.segment_type(),
                segment_pool_id: self.pool_id_of(head),
                is_expandable: head.expandable,
                registration_counter: head.segment_order.saturating_sub(1),
                frames: Vec::new(),
                blocks: Vec::new(),
            };
            let mut cursor = Some(head);
            while let Some(b) = cursor.filter(|b| b.mapped) {
                let active = b.allocated || b.event_count > 0 || !b.stream_uses.is_empty();
                segment.total_size += b.size as u64;
                if b.allocated {
                    segment.allocated_size += b.size as u64;
                }
                if active {
                    segment.active_size += b.size as u64;
                    segment.requested_size += b.requested_size as u64;
                }
                segment.blocks.push(SnapshotBlock {
                    address: b.ptr,
                    size: b.size as u64,
                    requested_size: b.requested_size as u64,
                    state: if b.allocated {
                        "active_allocated"
                    } else if active {
                        "active_pending_free"
                    } else {
                        "inactive"
                    },
                    frames: Vec::new(),
                    stack_id: if active { b.stack_id } else { 0 },
                });
                cursor = b.next.map(|n| self.arena.get(n));
            }
            out.push(segment);
        }
        out.sort_by_key(|s| s.address);
        out
    }

    /// `torch.cuda.memory._snapshot()` for this device.
    pub fn snapshot(&mut self) -> MemorySnapshot {
        // As PyTorch does, the trace is read before the snapshot marks itself in it.
        let snapshot = self.history_snapshot();
        let total_active: u64 = snapshot.segments.iter().map(|s| s.active_size).sum();
        self.ledger
            .history
            .record(TraceAction::Snapshot, 0, total_active as usize, 0);
        snapshot
    }

    /// The same as [`DeviceAllocator::snapshot`] without marking the trace: for advice that
    /// reads the history without the program asking for a snapshot.
    pub fn history_snapshot(&self) -> MemorySnapshot {
        MemorySnapshot {
            segments: self.segments(),
            device_traces: vec![self.ledger.history.entries()],
            allocator_settings: self.config.to_pytorch_settings(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_buffer_keeps_the_newest_entries_in_order() {
        let mut h = History::default();
        h.record(TraceAction::Alloc, 1, 1, 0);
        assert!(h.entries().is_empty(), "off by default");
        h.set_recording(true, 3);
        for addr in 1..=5 {
            h.record(TraceAction::Alloc, addr, 512, 0);
        }
        let addrs: Vec<u64> = h.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, vec![3, 4, 5]);
        h.set_recording(false, 3);
        assert!(h.entries().is_empty());
    }

    #[test]
    fn oom_entries_carry_device_free_like_pytorchs() {
        let entry = |action| TraceEntry {
            action,
            addr: 42,
            size: 512,
            stream: 0,
            time_us: 1,
            stack_id: 0,
            user_metadata: None,
        };
        let oom = serde_json::to_value(entry(TraceAction::Oom)).unwrap();
        assert_eq!(oom["device_free"], 42);
        assert!(oom.get("addr").is_none());
        let alloc = serde_json::to_value(entry(TraceAction::Alloc)).unwrap();
        assert_eq!(alloc["addr"], 42);
        assert_eq!(alloc["action"], "alloc");
        assert!(alloc.get("stack_id").is_none(), "no stack, no key");
    }

    #[test]
    fn entries_carry_the_stack_of_the_operation_in_progress() {
        let mut h = History::default();
        h.set_recording(true, 10);
        h.record(TraceAction::Alloc, 1, 512, 0);
        let previous = h.set_current_stack(7);
        assert_eq!(previous, 0);
        h.record(TraceAction::SegmentAlloc, 2, 512, 0);
        h.set_current_stack(0);
        let stacks: Vec<StackId> = h.entries().iter().map(|e| e.stack_id).collect();
        assert_eq!(stacks, vec![0, 7]);
        let json = serde_json::to_value(&h.entries()[1]).unwrap();
        assert_eq!(json["stack_id"], 7);
        assert_eq!(json["frames"], serde_json::json!([]));
    }

    #[test]
    fn actions_serialize_with_pytorchs_names() {
        let json = serde_json::to_string(&TraceAction::FreeRequested).unwrap();
        assert_eq!(json, "\"free_requested\"");
        let json = serde_json::to_string(&TraceAction::SegmentAlloc).unwrap();
        assert_eq!(json, "\"segment_alloc\"");
    }
}
