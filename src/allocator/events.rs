//! Streams and events: a block the program used on other streams (`recordStream`) is cached
//! only once the work queued on them when it was freed has completed (PyTorch's
//! `insert_events`, `process_events`, `synchronize_and_free_events`). During a CUDA graph
//! capture, event calls are illegal: such frees wait until the capture ends
//! (`insert_events_deferred_until_no_capture`). "During a capture" is PyTorch's
//! `is_capture_context()` ([`DeviceAllocator::is_capture_context`]): a private pool recording
//! inside `torch.cuda.use_mem_pool` outside any graph capture is not one.

use super::DeviceAllocator;
use super::PointerError;
use super::block::BlockId;
use crate::device::{Device, DeviceError, DevicePtr, EventHandle, StreamId};
use crate::logging;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};

/// Frees waiting for other streams.
#[derive(Debug, Default)]
pub(crate) struct StreamEvents {
    /// Freed blocks whose events are still to be recorded, by the next `process_events` or
    /// `synchronize_and_free_events`: blocks freed during a capture with uses on other streams
    /// (event calls are illegal during a capture), and blocks for whose streams the device would
    /// neither record an event nor synchronize.
    pub(crate) to_record: Vec<BlockId>,
    /// Streams a block was used on (`record_stream`) while a capture was under way.
    pub(crate) capture_stream_uses: FxHashMap<BlockId, Vec<StreamId>>,
    /// Per stream, events recorded when a block used on it was freed, oldest first.
    pub(crate) pending: BTreeMap<StreamId, VecDeque<(EventHandle, BlockId)>>,
    pub(crate) pending_count: usize,
}

impl<D: Device> DeviceAllocator<D> {
    // ----------------------------------------------------------------------------------------
    // streams and events
    // ----------------------------------------------------------------------------------------

    /// `recordStream`: the program used the allocation at `ptr` on `stream` as well; when it is
    /// freed, it is not reused until the work queued on `stream` by then has completed.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), PointerError> {
        let id = *self.allocated.get(&ptr).ok_or(PointerError::Unknown(ptr))?;
        let block = self.arena.get_mut(id);
        // Uses on the allocation stream need no synchronization.
        if stream == block.stream {
            return Ok(());
        }
        let used_before = block.stream_uses.contains(&stream);
        if !used_before {
            block.stream_uses.push(stream);
        }
        // PyTorch asks whether the caller's current stream captures; the stream the block is
        // used on is the one whose work a capture makes part of the graph.
        if self.is_capture_context(stream) {
            // Only a use that a capture alone made is dropped when the capture's deferred free
            // is processed: one made outside it too still needs its event.
            if !used_before {
                self.note_capture_stream_use(id, stream);
            }
        } else if let Some(during_capture) = self.events.capture_stream_uses.get_mut(&id) {
            // A use outside any capture needs its event, whatever a capture noted before.
            // (PyTorch's block_to_cudagraph_stream_uses forgets this and can hand the block
            // out while that stream still works on it; found by the stream-order property.)
            during_capture.retain(|&s| s != stream);
        }
        Ok(())
    }

    /// `insert_events`: records an event on every stream that used the freed block.
    pub(super) fn insert_events(&mut self, id: BlockId) {
        let streams = std::mem::take(&mut self.arena.get_mut(id).stream_uses);
        let ptr = self.arena.get(id).ptr;
        logging::block_waits_for_streams(ptr, streams.len());
        let mut not_waited_for = Vec::new();
        for stream in streams {
            match self.device.record_event(stream) {
                Ok(event) => {
                    self.arena.get_mut(id).event_count += 1;
                    self.events
                        .pending
                        .entry(stream)
                        .or_default()
                        .push_back((event, id));
                    self.events.pending_count += 1;
                }
                Err(err) => {
                    // Without an event, waiting for the stream now is the only safe way.
                    logging::device_error("could not record an event; synchronizing instead", &err);
                    if let Err(err) = self.device.synchronize_stream(stream) {
                        // Neither worked: the block stays out of circulation rather than risk
                        // handing out memory a kernel may still be using, until a later try
                        // succeeds (the events of its other streams may complete meanwhile).
                        logging::device_error(
                            "could not synchronize; the block is not reused until an event \
                             can be recorded",
                            &err,
                        );
                        not_waited_for.push(stream);
                    }
                }
            }
        }
        let block = self.arena.get_mut(id);
        if !not_waited_for.is_empty() {
            block.stream_uses = not_waited_for;
            self.events.to_record.push(id);
        } else if block.event_count == 0 {
            self.free_block(id);
        }
    }

    /// `process_events`: caches the freed blocks whose streams have all finished with them.
    pub(super) fn process_events(&mut self) -> Result<(), DeviceError> {
        self.insert_events_deferred_until_no_capture();
        let mut completed = Vec::new();
        let mut outcome = Ok(());
        'streams: for queue in self.events.pending.values_mut() {
            while let Some(&(event, id)) = queue.front() {
                match self.device.query_event(event) {
                    Ok(true) => {
                        queue.pop_front();
                        self.device.release_event(event);
                        self.events.pending_count -= 1;
                        completed.push(id);
                    }
                    Ok(false) => break,
                    Err(err) => {
                        outcome = Err(err);
                        break 'streams;
                    }
                }
            }
        }
        self.events.pending.retain(|_, q| !q.is_empty());
        for id in completed {
            self.event_completed(id);
        }
        outcome
    }

    /// One of the block's events completed: the block is cached once none is left, unless
    /// events of other streams are still to be recorded.
    pub(super) fn event_completed(&mut self, id: BlockId) {
        let block = self.arena.get_mut(id);
        block.event_count -= 1;
        if block.is_available() {
            self.free_block(id);
        }
    }

    /// `synchronize_and_free_events`: waits for every pending event and caches its block.
    pub(super) fn synchronize_and_free_events(&mut self) -> Result<(), DeviceError> {
        self.ledger.stats.num_sync_all_streams += 1;
        self.insert_events_deferred_until_no_capture();
        let streams: Vec<StreamId> = self.events.pending.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, id)) =
                self.events.pending.get(&stream).and_then(VecDeque::front)
            {
                self.device.synchronize_event(event)?;
                if let Some(queue) = self.events.pending.get_mut(&stream) {
                    queue.pop_front();
                }
                self.device.release_event(event);
                self.events.pending_count -= 1;
                self.event_completed(id);
            }
            self.events.pending.remove(&stream);
        }
        Ok(())
    }

    /// While a private pool records: whether the block's stream or one it was used on captures
    /// (under the modelled PyTorch's rule: [`DeviceAllocator::is_capture_context`]). PyTorch
    /// asks the caller's current stream, which a free does not tell the allocator; these are
    /// the streams whose work a free would otherwise record events after.
    #[cold]
    pub(super) fn block_streams_capture(&mut self, id: BlockId) -> bool {
        let block = self.arena.get(id);
        let streams: Vec<StreamId> = std::iter::once(block.stream)
            .chain(block.stream_uses.iter().copied())
            .collect();
        self.any_capturing(streams)
    }

    /// `record_stream` while a capture is under way: the use is remembered apart, because the
    /// capture's work on that stream is part of the graph and needs no event (PyTorch's
    /// `block_to_cudagraph_stream_uses`).
    pub(super) fn note_capture_stream_use(&mut self, id: BlockId, stream: StreamId) {
        let uses = self.events.capture_stream_uses.entry(id).or_default();
        if !uses.contains(&stream) {
            uses.push(stream);
        }
    }

    /// `insert_events_deferred_until_no_capture`: blocks freed during a capture with uses on
    /// other streams get their events now, for the uses recorded outside a capture only
    /// (`remove_cudagraph_stream_uses`); so do the blocks whose events the device refused
    /// before (a retry).
    ///
    /// Called outside a capture context while a private pool records (`use_mem_pool`, or
    /// another thread's capture), a block one of whose streams captures keeps waiting: an event
    /// recorded there would be the graph's, and querying it is illegal.
    pub(super) fn insert_events_deferred_until_no_capture(&mut self) {
        for id in std::mem::take(&mut self.events.to_record) {
            if !self.pools.captures.is_empty() && self.block_streams_capture(id) {
                self.events.to_record.push(id);
                continue;
            }
            if let Some(during_capture) = self.events.capture_stream_uses.remove(&id) {
                self.arena
                    .get_mut(id)
                    .stream_uses
                    .retain(|s| !during_capture.contains(s));
            }
            let block = self.arena.get(id);
            if block.is_available() {
                self.free_block(id);
            } else if !block.stream_uses.is_empty() {
                self.insert_events(id);
            }
            // Otherwise only recorded events are left: the last to complete caches the block.
        }
    }
}
