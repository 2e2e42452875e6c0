//! Sleep and wake: give a segment's physical memory back to the device and take it again later,
//! at the same addresses.
//!
//! Once sleep-ability is on ([`DeviceAllocator::set_sleepable`], or the first tagged
//! allocation), every new ordinary segment is VMM-backed (`allocator/backing/vmm.rs`): an
//! address range reserved with `cuMemAddressReserve`, one physical allocation of the same size
//! (`cuMemCreate`) mapped into it and made accessible. Its size and its blocks are PyTorch's, as
//! for a `cudaMalloc`'d segment: only what it is made of differs.
//!
//! Sleep and wake are a loop over the segments of the chosen owners (the segment table), each
//! segment's backing doing the driver's part:
//! - [`DeviceAllocator::sleep`] waits for the device, copies the live blocks of each chosen
//!   segment to pinned host memory (when asked to), unmaps it and releases its physical memory. The address range stays
//!   reserved, every block stays where it was, live ones included; the segment's free blocks
//!   leave their pools, so that they serve no request;
//! - [`DeviceAllocator::wake`] passes the guard (the memory fraction and
//!   `throw_on_cudamalloc_oom` bound what the allocator reserves, as for a new segment),
//!   creates physical memory again, maps it at the same address, grants access and copies the
//!   backup back; the free blocks return to their pools with the same tie keys and ages.
//!
//! The copies are the fast path (docs/sleep.md, "Backups"), the same for VMM-backed and
//! expandable segments (each backing says which live bytes its awake memory holds, copies them
//! and keeps them): only live blocks are copied, into page-locked host memory kept from one
//! sleep to the next (`allocator/staging.rs`), queued on a stream of the allocator's own. That
//! stream first waits, on the device, for the work queued so far on every stream that may
//! touch the memory (the blocks' streams and recorded uses), so the host never waits before the
//! copies. Each segment's copies are followed by an event; a segment is unmapped once its event
//! has completed, found by asking without waiting while the next segments' copies are queued;
//! the host waits once, at the end, for the rest. Wake maps each segment (an expandable one a
//! group of pages at a time) and queues its copies, so the next map overlaps them, and waits
//! once at the end. A sleep without backup waits for the device once instead.
//!
//! Both are idempotent (a segment asleep is not slept again) and all-or-nothing per segment: a
//! driver call that fails leaves that segment either fully awake or fully asleep with its
//! backup, and the call can be repeated. Each segment's change goes through the ledger.
//!
//! Expandable segments are VMM-backed already, one physical allocation per page: their mapped
//! pages sleep and wake at the same addresses. Their sleep is all or nothing per page (an unmap
//! that fails leaves the pages before it asleep, the rest mapped, and the segment counts as
//! asleep until a wake), their wake all or nothing per segment. A sleeping expandable segment
//! does not grow: a request that would need it reserves a new segment, as when the stream had
//! none.

use super::DeviceAllocator;
use super::backing::{Backup, Memory};
use super::block::BlockId;
use super::guard::{Announce, Refusal};
use super::owner::Owner;
use super::segments::SegmentId;
use crate::device::{Device, DeviceError, EventHandle, PinnedHostBuffer, StreamId};
use crate::logging;
use std::time::{Duration, Instant};

/// What a sleep or a wake moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Segments that went to sleep (or woke).
    pub segments: usize,
    /// Their bytes (physical memory given back, or taken again).
    pub bytes: usize,
    /// Live blocks in them: allocations whose memory slept (or woke).
    pub blocks: usize,
    /// Bytes copied to host memory (sleep) or back from it (wake): the live blocks' bytes, not
    /// the segments' (nor an expandable segment's mapped pages').
    pub copied_bytes: usize,
    /// Whether the bytes copied went to (or came from) page-locked host memory (always, when
    /// something was copied); false when nothing was.
    pub host_memory_pinned: bool,
    /// Pinned host buffers this call allocated: 0 when the one kept from an earlier sleep was
    /// large enough.
    pub host_allocations: usize,
    /// Times this call made the host wait for the device.
    pub host_synchronizations: usize,
    /// Bytes of segments that matched but cannot sleep: `cudaMalloc`'d before sleep-ability
    /// was on.
    pub skipped_bytes: usize,
    pub elapsed: Duration,
}

/// Why a sleep or wake stopped. What was done before the failure stays done (and is in
/// `done`, boxed to keep the error small); the segment being worked on is left whole, awake or
/// asleep with its backup; the call may be repeated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SleepError {
    /// Sleep and wake wait for the device, which a CUDA graph capture forbids.
    Capturing,
    /// A driver call failed.
    Device {
        error: DeviceError,
        done: Box<SleepReport>,
    },
    /// Waking the next segment would take the memory reserved past the memory-fraction limit
    /// (`set_per_process_memory_fraction`), which bounds what the allocator reserves from the
    /// device, as for a new segment. It stays asleep.
    OverMemoryFraction {
        /// The bytes the segment would take.
        needed: usize,
        /// The bytes reserved now.
        reserved: usize,
        /// The limit.
        allowed: usize,
        done: Box<SleepReport>,
    },
    /// Waking the next segment would take the memory reserved past `throw_on_cudamalloc_oom`'s
    /// limit (the configured `per_process_memory_fraction` of the device), which refuses such
    /// a device allocation before the device is asked, as for a new segment. It stays asleep.
    PreemptivelyRejected {
        /// The bytes the segment would take.
        needed: usize,
        /// The bytes reserved now.
        reserved: usize,
        /// The limit.
        limit: usize,
        done: Box<SleepReport>,
    },
}

/// What stops a sleep or wake part-way (made into a [`SleepError`] with what was done).
enum Stop {
    Device(DeviceError),
    OverMemoryFraction {
        needed: usize,
        reserved: usize,
        allowed: usize,
    },
    PreemptivelyRejected {
        needed: usize,
        reserved: usize,
        limit: usize,
    },
}

impl From<DeviceError> for Stop {
    fn from(error: DeviceError) -> Stop {
        Stop::Device(error)
    }
}

impl std::fmt::Display for SleepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SleepError::Capturing => {
                f.write_str("cannot sleep or wake while a CUDA graph capture is under way")
            }
            SleepError::Device { error, done } => write!(
                f,
                "CUDA error: {error} (after {} segment(s), {} bytes; call again to retry)",
                done.segments, done.bytes
            ),
            SleepError::OverMemoryFraction {
                needed,
                reserved,
                allowed,
                done,
            } => write!(
                f,
                "waking a segment of {needed} bytes would reserve {} bytes, past the memory \
                 fraction's limit of {allowed} bytes (after {} segment(s), {} bytes woke); free \
                 memory (empty_cache) or raise the fraction, and call again",
                reserved + needed,
                done.segments,
                done.bytes
            ),
            SleepError::PreemptivelyRejected {
                needed,
                reserved,
                limit,
                done,
            } => write!(
                f,
                "waking a segment of {needed} bytes would reserve {} bytes, past the limit of \
                 {limit} bytes that throw_on_cudamalloc_oom enforces (after {} segment(s), {} \
                 bytes woke); free memory (empty_cache), and call again",
                reserved + needed,
                done.segments,
                done.bytes
            ),
        }
    }
}

impl std::error::Error for SleepError {}

/// Which segments a sleep or wake is about.
#[derive(Debug, Clone, Copy)]
pub enum Tags<'a> {
    /// Everything the allocator holds.
    All,
    /// The memory allocated under these tags.
    Only(&'a [u32]),
}

impl<D: Device> DeviceAllocator<D> {
    /// Makes new ordinary segments VMM-backed (on), so that they can sleep, or `cudaMalloc`'d
    /// again (off). Segments already made keep their backing.
    pub fn set_sleepable(&mut self, on: bool) {
        self.source.sleepable = on;
    }

    pub fn is_sleepable(&self) -> bool {
        self.source.sleepable
    }

    /// The owner of tag `tag`'s allocations; a tag turns sleep-ability on.
    pub(super) fn tagged_owner(&mut self, tag: u32) -> Owner {
        self.source.sleepable = true;
        Owner::Tagged(self.pools.tag_index(tag))
    }

    /// Bytes asleep now, in VMM-backed segments and in expandable segments' pages.
    pub fn sleeping_bytes(&self) -> usize {
        self.segments.sleeping_bytes()
    }

    /// The segments of `tags`, in table order.
    fn segments_of(&self, tags: Tags<'_>) -> Vec<SegmentId> {
        self.segments.of_owners(|owner| match (tags, owner) {
            (Tags::All, _) => true,
            (Tags::Only(tags), Owner::Tagged(index)) => tags.contains(&self.pools.tag_of(index)),
            (Tags::Only(_), _) => false,
        })
    }

    /// Runs `per_segment` on each segment of `tags` after `prepare`, then `finish` (always,
    /// to complete what was queued), refused during a capture, timed, and stopped at the first
    /// failure (a driver call, or a wake the guard refuses) with what was done by then.
    fn each_segment<S>(
        &mut self,
        tags: Tags<'_>,
        state: &mut S,
        prepare: impl FnOnce(&mut Self, &mut S, &[SegmentId], &mut SleepReport) -> Result<(), Stop>,
        mut per_segment: impl FnMut(&mut Self, &mut S, SegmentId, &mut SleepReport) -> Result<(), Stop>,
        finish: impl FnOnce(&mut Self, &mut S, &mut SleepReport) -> Result<(), Stop>,
    ) -> Result<SleepReport, SleepError> {
        if !self.pools.captures.is_empty() {
            return Err(SleepError::Capturing);
        }
        let started = Instant::now();
        let mut report = SleepReport::default();
        let segments = self.segments_of(tags);
        let outcome = prepare(self, state, &segments, &mut report).and_then(|()| {
            segments
                .iter()
                .try_for_each(|&segment| per_segment(self, state, segment, &mut report))
        });
        let finished = finish(self, state, &mut report);
        let outcome = outcome.and(finished);
        report.elapsed = started.elapsed();
        match outcome {
            Ok(()) => Ok(report),
            Err(Stop::Device(error)) => Err(SleepError::Device {
                error,
                done: Box::new(report),
            }),
            Err(Stop::OverMemoryFraction {
                needed,
                reserved,
                allowed,
            }) => Err(SleepError::OverMemoryFraction {
                needed,
                reserved,
                allowed,
                done: Box::new(report),
            }),
            Err(Stop::PreemptivelyRejected {
                needed,
                reserved,
                limit,
            }) => Err(SleepError::PreemptivelyRejected {
                needed,
                reserved,
                limit,
                done: Box::new(report),
            }),
        }
    }

    /// Puts the memory of `tags` to sleep: copies the live blocks of each segment to pinned
    /// host memory when `backup` (otherwise its contents are dropped), unmaps it and releases
    /// its physical memory, after the work queued on the streams that may use it. Addresses,
    /// blocks and live allocations stay. Segments already asleep are left as they are.
    pub fn sleep(&mut self, tags: Tags<'_>, backup: bool) -> Result<SleepReport, SleepError> {
        let mut copies = SleepCopies::default();
        let report = self.each_segment(
            tags,
            &mut copies,
            |this, copies, segments, report| this.prepare_sleep(copies, segments, backup, report),
            |this, copies, segment, report| {
                if copies.buffer.is_some() {
                    this.queue_sleep(copies, segment, report)?;
                    Ok(this.sleep_copied(copies, report, false)?)
                } else {
                    Ok(this.put_to_sleep(segment, None, report)?)
                }
            },
            |this, copies, report| {
                let outcome = this.sleep_copied(copies, report, true);
                report.host_memory_pinned = report.copied_bytes > 0;
                Ok(outcome?)
            },
        )?;
        logging::slept(
            report.bytes,
            report.segments,
            report.blocks,
            report.copied_bytes,
            report.skipped_bytes,
            backup,
            report.elapsed,
        );
        Ok(report)
    }

    /// With live bytes to back up: takes a pinned buffer large enough for them, and makes the
    /// copy stream wait, on the device, for the work queued so far on every stream that may
    /// touch the memory (the copies must see its results, and the unmaps come after the
    /// copies). Otherwise waits for the device once (unmapping does not wait for kernels still
    /// using the memory).
    fn prepare_sleep(
        &mut self,
        copies: &mut SleepCopies,
        segments: &[SegmentId],
        backup: bool,
        report: &mut SleepReport,
    ) -> Result<(), Stop> {
        let live: usize = if backup {
            segments
                .iter()
                .map(|&id| {
                    self.backup_ranges(id)
                        .iter()
                        .map(|&(_, len)| len)
                        .sum::<usize>()
                })
                .sum()
        } else {
            0
        };
        if live == 0 {
            report.host_synchronizations += 1;
            self.device.synchronize_device()?;
            return Ok(self.synchronize_and_free_events()?);
        }
        // Frees made during a capture get their events now, so that their streams are waited for.
        self.insert_events_deferred_until_no_capture();
        let stream = self.staging.stream(&mut self.device)?;
        copies.stream = Some(stream);
        self.order_after_the_streams_of(segments, stream)?;
        let (buffer, allocated) = self.staging.take(&mut self.device, live)?;
        report.host_allocations += allocated;
        copies.buffer = Some(buffer);
        Ok(())
    }

    /// Makes `copy_stream` wait, on the device, for the work queued so far on every stream that
    /// may touch `segments`: their blocks' streams (allocation, and for free blocks the last
    /// user's), the streams their allocations were recorded on (`record_stream`), the streams
    /// of frees still waiting for events, and expandable segments' streams. One event recorded
    /// on each and waited for; no host wait.
    fn order_after_the_streams_of(
        &mut self,
        segments: &[SegmentId],
        copy_stream: StreamId,
    ) -> Result<(), DeviceError> {
        let mut streams: std::collections::BTreeSet<StreamId> =
            self.events.pending.keys().copied().collect();
        for &id in segments {
            if let Memory::Expandable(pages) = &self.segments.get(id).memory {
                streams.insert(pages.stream());
            }
            let mut cursor = Some(self.segments.head(id));
            while let Some(block) = cursor {
                let b = self.arena.get(block);
                streams.insert(b.stream);
                streams.extend(b.stream_uses.iter().copied());
                cursor = b.next;
            }
        }
        streams.remove(&copy_stream);
        for stream in streams {
            let event = self.device.record_event(stream)?;
            let waited = self.device.wait_event(copy_stream, event);
            self.device.release_event(event);
            waited?;
        }
        Ok(())
    }

    /// The live blocks of segment `id` that a backup copies now: those its awake memory holds.
    fn backup_ranges(&self, id: SegmentId) -> Vec<(usize, usize)> {
        let segment = self.segments.get(id);
        if !segment.memory.has_awake_memory() {
            return Vec::new();
        }
        segment.memory.backup_ranges(self.live_ranges(id))
    }

    /// The live blocks of segment `id` as (offset in the segment, length), adjacent ones
    /// merged. A freed block still waiting for other streams' events is not live: its contents
    /// are the program's no more.
    fn live_ranges(&self, id: SegmentId) -> Vec<(usize, usize)> {
        let head = self.segments.head(id);
        let base = self.arena.get(head).ptr;
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let mut cursor = Some(head);
        while let Some(block) = cursor {
            let b = self.arena.get(block);
            if b.allocated {
                let start = (b.ptr - base) as usize;
                match ranges.last_mut() {
                    Some((at, len)) if *at + *len == start => *len += b.size,
                    _ => ranges.push((start, b.size)),
                }
            }
            cursor = b.next;
        }
        ranges
    }

    /// Queues the copy of segment `id`'s live bytes into the pinned buffer, then an event after
    /// them (also with nothing to copy: the event follows the streams' work the copy stream
    /// waited for, after which the memory may go). A failure leaves the segment awake.
    fn queue_sleep(
        &mut self,
        copies: &mut SleepCopies,
        id: SegmentId,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let (Some(buffer), Some(stream)) = (copies.buffer, copies.stream) else {
            return Ok(());
        };
        let segment = self.segments.get(id);
        if !segment.memory.can_sleep() {
            report.skipped_bytes += self.mapped_size_from(self.segments.head(id));
            return Ok(());
        }
        if !segment.memory.has_awake_memory() {
            return Ok(());
        }
        let backup = Backup {
            buffer,
            offset: copies.next_offset,
            ranges: self.backup_ranges(id),
        };
        // Should this fail, copies may be left running: the end waits for them.
        copies.abandoned = true;
        self.segments
            .get(id)
            .memory
            .copy_out(&mut self.device, &backup, stream)?;
        let event = self.device.record_event(stream)?;
        copies.abandoned = false;
        copies.next_offset += backup.len();
        copies.pending.push_back(PendingSleep { id, event, backup });
        Ok(())
    }

    /// Puts to sleep the segments whose copies have completed, in order: those whose event
    /// says so when asked (no wait), or, `at_end`, all of them after one wait for the copy
    /// stream (also when a failure left copies running: nothing may unmap or reuse what they
    /// touch before they end). A failure leaves the segments not yet unmapped awake (their
    /// copies dropped).
    fn sleep_copied(
        &mut self,
        copies: &mut SleepCopies,
        report: &mut SleepReport,
        at_end: bool,
    ) -> Result<(), DeviceError> {
        let outcome = (|| {
            let running = !copies.pending.is_empty() || copies.abandoned;
            if at_end && let (Some(stream), true) = (copies.stream, running) {
                report.host_synchronizations += 1;
                copies.abandoned = false;
                self.device.synchronize_stream(stream)?;
            }
            while let Some(pending) = copies.pending.front() {
                if !at_end && !self.device.query_event(pending.event)? {
                    break;
                }
                let Some(pending) = copies.pending.pop_front() else {
                    break;
                };
                self.device.release_event(pending.event);
                self.put_to_sleep(pending.id, Some(pending.backup), report)?;
            }
            Ok(())
        })();
        if outcome.is_err() && !copies.pending.is_empty() {
            copies.abandoned = true;
            for pending in copies.pending.drain(..) {
                self.device.release_event(pending.event);
            }
        }
        outcome
    }

    /// Unmaps segment `id`'s memory and releases it, keeping `backup` (its copies completed;
    /// `None`: contents dropped), and counts it; a `cudaMalloc`'d segment cannot sleep and is
    /// counted as skipped. Its blocks leave their pools first (a free block still waiting for
    /// events is cached, or the events waited for, before). An expandable segment's failure
    /// part-way leaves the pages slept so far asleep, counted in `report`; the segment then
    /// counts as asleep, and a later sleep goes on with the pages still mapped.
    fn put_to_sleep(
        &mut self,
        id: SegmentId,
        backup: Option<Backup>,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let head = self.segments.head(id);
        let segment = self.segments.get(id);
        if !segment.memory.can_sleep() {
            report.skipped_bytes += self.mapped_size_from(head);
            return Ok(());
        }
        if !segment.memory.has_awake_memory() {
            return Ok(());
        }
        if !segment.asleep {
            self.settle_freed_blocks(id)?;
        }
        let segment = self.segments.get_mut(id);
        let (kind, was_asleep) = (segment.kind, segment.asleep);
        let slept = segment
            .memory
            .sleep(&mut self.device, backup, &mut self.source.leftovers);
        if slept.bytes > 0 {
            if !was_asleep {
                report.blocks += self.park(id);
            }
            report.segments += 1;
            report.bytes += slept.bytes;
            report.copied_bytes += slept.copied_bytes;
            if let Some(buffer) = slept.held {
                self.staging.hold(buffer);
            }
            let ptr = self.arena.get(head).ptr;
            self.ledger.slept(ptr, slept.bytes, kind);
        }
        slept.error.map_or(Ok(()), Err)
    }

    /// Makes the freed blocks of segment `id` still waiting for other streams' events
    /// available, so that they leave their pools with the rest when it sleeps: their events
    /// completed before the copy stream's (it waited for their streams), so asking finds them
    /// done; should one not be, the host waits for them all.
    fn settle_freed_blocks(&mut self, id: SegmentId) -> Result<(), DeviceError> {
        let waiting = |this: &Self| {
            let mut cursor = Some(this.segments.head(id));
            while let Some(block) = cursor {
                let b = this.arena.get(block);
                if !b.allocated && !b.is_available() {
                    return true;
                }
                cursor = b.next;
            }
            false
        };
        if !waiting(self) {
            return Ok(());
        }
        self.process_events()?;
        if waiting(self) {
            self.synchronize_and_free_events()?;
        }
        Ok(())
    }

    /// Wakes the memory of `tags`: creates physical memory again, maps it at the same
    /// addresses, grants access and copies back what was backed up. Segments awake are left as
    /// they are. A segment whose wake the guard refuses (past the memory fraction, or past
    /// `throw_on_cudamalloc_oom`'s limit) stays asleep and the call stops there, as a new
    /// segment would be refused: the limits bound what the allocator reserves.
    pub fn wake(&mut self, tags: Tags<'_>) -> Result<SleepReport, SleepError> {
        let mut copies = WakeCopies::default();
        let report = self.each_segment(
            tags,
            &mut copies,
            |_, _, _, _| Ok(()),
            |this, copies, segment, report| this.wake_segment(segment, copies, report),
            |this, copies, report| {
                let outcome = this.wait_for_wake_copies(copies, report);
                report.host_memory_pinned = report.copied_bytes > 0;
                Ok(outcome?)
            },
        )?;
        logging::woke(
            report.bytes,
            report.segments,
            report.blocks,
            report.copied_bytes,
            report.elapsed,
        );
        Ok(report)
    }

    /// One wait for every copy wake queued; then their pinned buffers are free for the next
    /// sleep (also after a failed wait: the next sleep waits for the device before it writes
    /// into them).
    fn wait_for_wake_copies(
        &mut self,
        copies: &mut WakeCopies,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        if copies.queued.is_empty() {
            return Ok(());
        }
        let waited = match self.staging.existing_stream() {
            Some(stream) => {
                report.host_synchronizations += 1;
                self.device.synchronize_stream(stream)
            }
            None => Ok(()),
        };
        for buffer in copies.queued.drain(..) {
            self.staging.let_go(buffer);
        }
        waited
    }

    fn wake_segment(
        &mut self,
        id: SegmentId,
        copies: &mut WakeCopies,
        report: &mut SleepReport,
    ) -> Result<(), Stop> {
        let segment = self.segments.get(id);
        if !segment.asleep {
            return Ok(());
        }
        let (kind, needed) = (segment.kind, segment.memory.sleeping_bytes());
        let reserved = self.ledger.reserved;
        match self.admit(needed, Announce::Yes)? {
            Ok(()) => {}
            Err(Refusal::OverMemoryFraction { allowed }) => {
                return Err(Stop::OverMemoryFraction {
                    needed,
                    reserved,
                    allowed,
                });
            }
            Err(Refusal::Rejected { limit }) => {
                return Err(Stop::PreemptivelyRejected {
                    needed,
                    reserved,
                    limit,
                });
            }
        }
        let stream = self.staging.existing_stream();
        let woken = self.segments.get_mut(id).memory.wake(
            &mut self.device,
            &mut self.source.leftovers,
            stream,
            &mut report.host_synchronizations,
        )?;
        for backup in woken.backups {
            report.copied_bytes += backup.len();
            copies.queued.push(backup.buffer);
        }
        report.blocks += self.unpark(id);
        report.segments += 1;
        report.bytes += woken.bytes;
        let ptr = self.arena.get(self.segments.head(id)).ptr;
        self.ledger.woke(ptr, woken.bytes, kind);
        Ok(())
    }

    /// Marks segment `id` asleep and takes its free blocks out of their pools (they keep their
    /// tie keys and ages); returns its live blocks.
    fn park(&mut self, id: SegmentId) -> usize {
        let mut live = 0;
        let mut cursor = Some(self.segments.head(id));
        while let Some(block) = cursor {
            let b = self.arena.get(block);
            if b.is_available() {
                let pool = self.pools.of_block_mut(b);
                let removed = if b.mapped {
                    pool.remove(block, b)
                } else {
                    pool.remove_unmapped(b)
                };
                debug_assert!(removed, "an available block is in its pool");
            } else {
                live += 1;
            }
            cursor = b.next;
        }
        self.segments.set_asleep(id, true);
        live
    }

    /// Marks segment `id` awake and puts its free blocks back in their pools, with the tie
    /// keys and ages they had; returns its live blocks.
    fn unpark(&mut self, id: SegmentId) -> usize {
        self.segments.set_asleep(id, false);
        let mut live = 0;
        let mut cursor = Some(self.segments.head(id));
        while let Some(block) = cursor {
            let b = self.arena.get_mut(block);
            cursor = b.next;
            if !b.is_available() {
                live += 1;
            } else if b.mapped {
                self.pools.get_mut(b.owner, b.pool).reinsert(block, b);
            } else {
                self.pools
                    .get_mut(b.owner, b.pool)
                    .insert_unmapped(block, b);
            }
        }
        live
    }

    /// The mapped bytes of the segment whose first block is `head`.
    fn mapped_size_from(&self, head: BlockId) -> usize {
        let mut size = 0;
        let mut cursor = Some(head);
        while let Some(id) = cursor {
            let b = self.arena.get(id);
            if b.mapped {
                size += b.size;
            }
            cursor = b.next;
        }
        size
    }
}

/// What a sleep with backup has queued: the pinned buffer it copies into, and the segments
/// whose copies are under way, in order.
#[derive(Default)]
struct SleepCopies {
    stream: Option<StreamId>,
    buffer: Option<PinnedHostBuffer>,
    /// Where the next segment's backup starts in `buffer`.
    next_offset: usize,
    pending: std::collections::VecDeque<PendingSleep>,
    /// Copies were queued for segments that a failure left awake: the end waits for them.
    abandoned: bool,
}

/// A segment whose live bytes are being copied; it is unmapped once `event` completes.
struct PendingSleep {
    id: SegmentId,
    event: EventHandle,
    backup: Backup,
}

/// What a wake has queued: the pinned buffers its copies read, freed after the wait.
#[derive(Default)]
struct WakeCopies {
    queued: Vec<PinnedHostBuffer>,
}
