//! What PyTorch's C++ asks of an allocator beside allocation, answered from the allocator's own
//! books: the allocator trace tracker (`attachAllocatorTraceTracker`), which receives every
//! trace entry as it is made, with its device and pool (NCCL's register hook registers and
//! deregisters segments from it), and the sizes of the expandable segments
//! (`getExpandableSegmentSizes`).
//!
//! The entries are the history's ([`super::history`]): the ledger writes each change of the
//! memory held from the device ([`super::ledger`]), so a tracker sees every `segment_alloc`,
//! `segment_free` (before the device gets the memory back), `segment_map` and `segment_unmap`
//! (one per mapped or unmapped range of an expandable segment), and the `alloc`,
//! `free_requested`, `free_completed` and `oom` of the allocator, as PyTorch's `record_trace`
//! gives them to its trackers. With no tracker attached and no history recorded, the hit path
//! tests one flag, as before.

use super::DeviceAllocator;
use super::backing::Memory;
use super::owner::Owner;
use super::private_pool::{BlockPools, MempoolId, ORDINARY_POOL_ID};
use crate::device::{Device, DevicePtr, StreamId};
use crate::policy::K_SMALL_BUFFER;

pub use crate::trace::{TraceTracker, TrackedEvent};

/// One expandable segment's size, as PyTorch's `StreamSegmentSize` holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSegmentSize {
    pub stream: StreamId,
    /// Whether its pages are the small pool's 2 MiB (PyTorch asks the segment size).
    pub is_small_pool: bool,
    /// Bytes mapped now.
    pub mapped_size: u64,
}

impl BlockPools {
    /// The pool id of `owner`'s memory, as trace entries and snapshots give it.
    #[inline]
    pub(crate) fn id_of(&self, owner: Owner) -> MempoolId {
        owner
            .private()
            .map_or(ORDINARY_POOL_ID, |index| self.private(index).id)
    }
}

impl<D: Device> DeviceAllocator<D> {
    /// `attachAllocatorTraceTracker` for this device: `tracker` (`None`: detached) receives
    /// every trace entry from now on, whether history is recorded or not.
    pub fn set_trace_tracker(&mut self, tracker: Option<TraceTracker>) {
        self.ledger.history.set_tracker(self.device_index, tracker);
    }

    /// `getExpandableSegmentSizes`: each expandable segment's stream, pool and bytes mapped
    /// now, in address order (PyTorch lists them in the order it made them, which is address
    /// order while no address range was given back). As PyTorch's, it leaves out the segments
    /// of the legacy default stream: it skips a segment whose stream handle is NULL (meant for
    /// segments without a stream), and that stream's handle is NULL.
    pub fn expandable_segment_sizes(&self) -> Vec<StreamSegmentSize> {
        let mut sizes: Vec<(DevicePtr, StreamSegmentSize)> = self
            .segments
            .iter()
            .filter_map(|(_, segment)| match &segment.memory {
                Memory::Expandable(pages) if pages.stream() != 0 => Some((
                    pages.base(),
                    StreamSegmentSize {
                        stream: pages.stream(),
                        is_small_pool: pages.page_size() == K_SMALL_BUFFER,
                        mapped_size: pages.mapped_bytes() as u64,
                    },
                )),
                _ => None,
            })
            .collect();
        sizes.sort_by_key(|(base, _)| *base);
        sizes.into_iter().map(|(_, size)| size).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::Config;
    use crate::device::sim::SimDevice;
    use crate::trace::TraceAction;

    const MIB: usize = 1 << 20;

    fn tracked(allocator: &mut DeviceAllocator<SimDevice>) -> Arc<Mutex<Vec<TrackedEvent>>> {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&seen);
        allocator.set_trace_tracker(Some(Arc::new(move |event: &TrackedEvent| {
            sink.lock().unwrap().push(*event)
        })));
        seen
    }

    fn actions(seen: &Mutex<Vec<TrackedEvent>>) -> Vec<(TraceAction, u64)> {
        seen.lock()
            .unwrap()
            .iter()
            .map(|e| (e.action, e.size))
            .collect()
    }

    #[test]
    fn a_tracker_receives_segment_and_block_events_without_history_being_recorded() {
        let mut allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 3, Config::default());
        let seen = tracked(&mut allocator);
        let ptr = allocator.malloc(3 * MIB, 0).unwrap();
        allocator.free(ptr).unwrap();
        allocator.empty_cache().unwrap();
        assert!(!allocator.is_recording_history());
        assert_eq!(
            actions(&seen),
            vec![
                (TraceAction::SegmentAlloc, 20 * MIB as u64),
                (TraceAction::Alloc, 3 * MIB as u64),
                (TraceAction::FreeRequested, 3 * MIB as u64),
                (TraceAction::FreeCompleted, 3 * MIB as u64),
                (TraceAction::SegmentFree, 20 * MIB as u64),
            ]
        );
        let events = seen.lock().unwrap();
        assert!(events.iter().all(|e| e.device == 3 && e.pool == (0, 0)));
        assert_eq!(
            events[0].addr, events[4].addr,
            "the segment freed is the one allocated"
        );
    }

    #[test]
    fn a_private_pools_segments_carry_its_id() {
        let mut allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, Config::default());
        let seen = tracked(&mut allocator);
        let every_stream = Box::new(|_| Ok(true));
        allocator
            .begin_allocate_to_pool((0, 7), every_stream)
            .unwrap();
        let ptr = allocator.malloc(MIB, 0).unwrap();
        allocator.end_allocate_to_pool((0, 7)).unwrap();
        allocator.free(ptr).unwrap();
        allocator.release_pool((0, 7)).unwrap();
        allocator.empty_cache().unwrap();
        let events = seen.lock().unwrap();
        let segments: Vec<_> = events
            .iter()
            .filter(|e| {
                matches!(
                    e.action,
                    TraceAction::SegmentAlloc | TraceAction::SegmentFree
                )
            })
            .map(|e| (e.action, e.pool))
            .collect();
        assert_eq!(
            segments,
            vec![
                (TraceAction::SegmentAlloc, (0, 7)),
                (TraceAction::SegmentFree, (0, 7))
            ]
        );
    }

    #[test]
    fn expandable_segments_send_a_map_and_an_unmap_per_range_and_report_their_sizes() {
        let config = Config {
            expandable_segments: true,
            ..Config::default()
        };
        let mut allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, config);
        let seen = tracked(&mut allocator);
        let small = allocator.malloc(4096, 5).unwrap();
        let large = allocator.malloc(30 * MIB, 5).unwrap();
        let on_default_stream = allocator.malloc(4096, 0).unwrap();
        let mut sizes = allocator.expandable_segment_sizes();
        sizes.sort_by_key(|s| s.is_small_pool);
        assert_eq!(
            sizes,
            vec![
                StreamSegmentSize {
                    stream: 5,
                    is_small_pool: false,
                    mapped_size: 40 * MIB as u64
                },
                StreamSegmentSize {
                    stream: 5,
                    is_small_pool: true,
                    mapped_size: 2 * MIB as u64
                },
            ],
            "the default stream's segment is left out, as PyTorch leaves it out"
        );
        allocator.free(small).unwrap();
        allocator.free(large).unwrap();
        allocator.free(on_default_stream).unwrap();
        allocator.empty_cache().unwrap();
        let segment_events: Vec<_> = actions(&seen)
            .into_iter()
            .filter(|(a, _)| !matches!(a, TraceAction::Alloc | TraceAction::FreeRequested))
            .filter(|(a, _)| *a != TraceAction::FreeCompleted)
            .collect();
        assert_eq!(
            segment_events,
            vec![
                (TraceAction::SegmentMap, 2 * MIB as u64),
                (TraceAction::SegmentMap, 40 * MIB as u64),
                (TraceAction::SegmentMap, 2 * MIB as u64),
                (TraceAction::SegmentUnmap, 40 * MIB as u64),
                (TraceAction::SegmentUnmap, 2 * MIB as u64),
                (TraceAction::SegmentUnmap, 2 * MIB as u64),
            ]
        );
        assert!(allocator.expandable_segment_sizes().is_empty());
    }

    #[test]
    fn a_detached_tracker_receives_nothing_more() {
        let mut allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, Config::default());
        let seen = tracked(&mut allocator);
        allocator.set_trace_tracker(None);
        let ptr = allocator.malloc(MIB, 0).unwrap();
        allocator.free(ptr).unwrap();
        assert!(seen.lock().unwrap().is_empty());
    }
}
