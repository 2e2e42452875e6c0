//! Streams and events: work submitted and completed per stream, stream order as a vector
//! clock, and the log of waits.

use super::SimDevice;
use crate::device::StreamId;
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub(super) struct SimEvent {
    pub(super) stream: StreamId,
    pub(super) sequence: u64,
    /// What the recording stream had waited for by then: a stream that waits for this event
    /// waits for all of it too (stream order is transitive).
    pub(super) waited_for: HashMap<StreamId, u64>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct StreamProgress {
    pub(super) submitted: u64,
    pub(super) completed: u64,
    /// Stream order, as a vector clock: per other stream, the last of its work (a sequence
    /// number) that this stream's later work was made to wait for, directly or through
    /// another stream's wait (`wait_event`).
    pub(super) waited_for: HashMap<StreamId, u64>,
}

/// One `wait_event` call, as the simulated device saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimWait {
    /// The stream told to wait.
    pub stream: StreamId,
    /// The stream the event was recorded on.
    pub event_stream: StreamId,
    /// The last work of `event_stream` that the event covers.
    pub sequence: u64,
}

impl SimDevice {
    /// Completes all work submitted so far on `stream`: its recorded events become complete.
    /// Work the stream waited for on other streams has necessarily completed too.
    pub fn complete_stream(&mut self, stream: StreamId) {
        let progress = self.streams.entry(stream).or_default();
        progress.completed = progress.submitted;
        let waited: Vec<(StreamId, u64)> =
            progress.waited_for.iter().map(|(&s, &q)| (s, q)).collect();
        for (other, sequence) in waited {
            let other = self.streams.entry(other).or_default();
            other.completed = other.completed.max(sequence);
        }
    }

    /// Completes all work on every stream.
    pub fn complete_all_streams(&mut self) {
        for progress in self.streams.values_mut() {
            progress.completed = progress.submitted;
        }
    }

    /// Queues a piece of work (a kernel) on `stream`; returns its sequence number there. Tests
    /// use it to model the program's use of memory on a stream.
    pub fn submit_work(&mut self, stream: StreamId) -> u64 {
        let immediate = self.complete_immediately;
        let progress = self.stream_progress(stream);
        progress.submitted += 1;
        if immediate {
            progress.completed = progress.submitted;
        }
        progress.submitted
    }

    /// The sequence number of the last completed work of `stream` (0: none yet).
    pub fn last_completed(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |p| p.completed)
    }

    /// The sequence number of the last work queued on `stream` (0: none yet).
    pub fn last_submitted(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |p| p.submitted)
    }

    /// Stream order: whether work queued on `later` from now on is sure to run after work
    /// number `sequence` of `earlier` — the same stream, that work has completed, or `later`
    /// waited for an event recorded on `earlier` after it.
    pub fn is_ordered_after(&self, later: StreamId, earlier: StreamId, sequence: u64) -> bool {
        if later == earlier || sequence == 0 {
            return true;
        }
        let completed = self.streams.get(&earlier).map_or(0, |p| p.completed);
        let waited = self
            .streams
            .get(&later)
            .and_then(|p| p.waited_for.get(&earlier).copied())
            .unwrap_or(0);
        completed >= sequence || waited >= sequence
    }

    /// Keeps (or stops keeping) the log of waits that [`SimDevice::waits`] returns; stream
    /// order is modelled either way. Benchmarks switch it off so memory stays flat.
    pub fn set_record_waits(&mut self, on: bool) {
        self.record_waits = on;
    }

    /// Every `wait_event` so far, in call order.
    pub fn waits(&self) -> &[SimWait] {
        &self.waits
    }

    /// Whether all work submitted on `stream` so far has completed.
    pub fn stream_is_idle(&self, stream: StreamId) -> bool {
        self.streams
            .get(&stream)
            .is_none_or(|p| p.completed == p.submitted)
    }

    pub(super) fn stream_progress(&mut self, stream: StreamId) -> &mut StreamProgress {
        self.streams.entry(stream).or_default()
    }

    pub(super) fn event_is_complete(&self, event: &SimEvent) -> bool {
        self.streams
            .get(&event.stream)
            .is_some_and(|p| p.completed >= event.sequence)
    }
}
