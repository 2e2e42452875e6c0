//! Cross-stream reuse (opt-in, `FERROCACHE_CROSS_STREAM=1`): a request that finds nothing in
//! its own stream's cache may take a block cached on another stream.
//!
//! PyTorch caches per stream, so a program on several streams reserves about the sum of each
//! stream's peak. Here a miss on stream B may take stream A's best-fitting cached block: an
//! event is recorded on A (after every use of the block there, since the program freed it
//! before) and B is made to wait for it on the device (`cuStreamWaitEvent`), so B's work on the
//! memory runs after A's, with no host synchronization. The block then belongs to B, the rest
//! of it too when it is split: everything B does from now on runs after A's work so far.
//!
//! The rules, each in one function:
//! - [`DeviceAllocator::cross_stream_applies`]: only with the mode on, never during a CUDA
//!   graph capture (recording an event on a capturing stream would join the graph), and never
//!   for a private pool: its memory stays its own.
//! - [`DeviceAllocator::best_fit_on_other_streams`]: B's own blocks come first (this runs only
//!   after B's search missed); among the other streams' blocks, PyTorch's best fit (smallest
//!   size, then lowest address) under the same oversize rules (`policy::may_serve`). A block
//!   with pending `record_stream` events is not in any pool until they complete, so it
//!   qualifies only then.
//! - [`DeviceAllocator::move_to_stream`]: the one event wait per reuse.
//! - [`may_merge`]: free neighbours of different streams do not merge while the program runs
//!   (the merged block would hold memory that one of them has not waited for);
//!   [`DeviceAllocator::coalesce_across_streams`] merges them when the cache is emptied, after
//!   synchronizing the streams involved, so whole segments can still be released.
//! - With expandable segments, [`DeviceAllocator::grow_into_other_stream_segment`]: a free block
//!   at the end of another stream's mapped pages, grown into the unmapped pages after it, may
//!   serve B (one wait, for the free block's memory). Unmapped pages themselves hold nothing, so
//!   taking them needs no wait — but nor does it save memory over B growing its own segment,
//!   which is what happens when no free tail can be reused.

use super::block::{Block, BlockId};
use super::guard::Announce;
use super::private_pool::Owner;
use super::{AllocError, DeviceAllocator, Request};
use crate::device::{Device, DeviceError, StreamId};
use crate::logging;
use crate::policy;

/// What cross-stream reuse did, for the replayer, statistics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrossStreamCounts {
    /// Blocks taken from another stream's cache (whole, or merged from a run of neighbours).
    pub reuses: u64,
    /// Event waits those cost (one per block; one per stream for a run).
    pub waits: u64,
    /// Of those, blocks grown into another stream's expandable segment.
    pub segment_growths: u64,
    /// Takes abandoned because recording the event or the wait failed (the block stayed put).
    pub failed_waits: u64,
    /// Streams synchronized on the host to merge blocks of different streams when the cache
    /// was emptied.
    pub coalescing_synchronizations: u64,
}

/// Cross-stream reuse's state: what it did, and whether free neighbours of different streams
/// may merge now.
#[derive(Debug, Default)]
pub(crate) struct CrossStream {
    pub(crate) counts: CrossStreamCounts,
    /// Set while the cache is emptied, after the streams were synchronized: free neighbours of
    /// different streams may merge.
    pub(crate) merging: bool,
}

/// Whether two free neighbours may merge: the same state of mapping, and for mapped memory the
/// same stream (without the mode, every block of a segment has the segment's stream, so this
/// is PyTorch's rule). Unmapped pages hold nothing and merge regardless.
pub(super) fn may_merge(a: &Block, b: &Block) -> bool {
    a.mapped == b.mapped && (a.stream == b.stream || !a.mapped)
}

impl<D: Device> DeviceAllocator<D> {
    /// What cross-stream reuse did so far.
    pub fn cross_stream_counts(&self) -> CrossStreamCounts {
        self.cross_stream.counts
    }

    /// Whether a miss of `request` in its own stream's cache may look at other streams.
    fn cross_stream_applies(&self, request: &Request) -> bool {
        self.config.opt_in.cross_stream
            && self.pools.captures.is_empty()
            && request.owner == Owner::Ordinary
            && !self.segments.any_asleep()
    }

    /// The hook on a miss in the stream's own cache: a block taken from another stream, already
    /// ordered after that stream's work and owned by the request's stream, or `None`.
    pub(super) fn take_from_other_stream(
        &mut self,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        if !self.cross_stream_applies(request) {
            return Ok(None);
        }
        if let Some(id) = self.best_fit_on_other_streams(request) {
            let pool = self.pools.get_mut(Owner::Ordinary, request.pool);
            pool.remove(id, self.arena.get(id));
            if self.move_to_stream(id, request.stream) {
                // Its new stream's free neighbours join it, as a free would have merged them.
                self.absorb_free_neighbours(id);
                return Ok(Some(id));
            }
            // The block stays where it was; the request goes on to the device.
            let pool = self.pools.get_mut(Owner::Ordinary, request.pool);
            pool.insert(id, self.arena.get_mut(id));
            return Ok(None);
        }
        if let Some(id) = self.take_free_run(request) {
            return Ok(Some(id));
        }
        if self.config.expandable_segments {
            return self.grow_into_other_stream_segment(request);
        }
        Ok(None)
    }

    /// No single cached block fits, but adjacent free blocks of different streams together
    /// may (they do not merge while the program runs): the smallest such run that may serve is
    /// moved to the request's stream, one wait per stream it holds, and merged.
    fn take_free_run(&mut self, request: &Request) -> Option<BlockId> {
        let arena = &self.arena;
        let pool = self.pools.get(Owner::Ordinary, request.pool);
        let mut best: Option<(usize, Vec<BlockId>)> = None;
        for start in pool.cached() {
            let b = arena.get(start);
            let starts_run = b
                .prev
                .is_none_or(|p| !arena.get(p).is_available() || !arena.get(p).mapped);
            if !starts_run || (b.expandable && !self.config.expandable_segments) {
                continue;
            }
            let mut run = vec![start];
            let mut total = b.size;
            let mut cursor = b.next;
            while let Some(n) = cursor.filter(|&n| {
                let n = arena.get(n);
                n.is_available() && n.mapped
            }) {
                run.push(n);
                total += arena.get(n).size;
                cursor = arena.get(n).next;
            }
            let serves = total >= request.size
                && (b.expandable || policy::may_serve(total, request.size, &self.config));
            if run.len() > 1 && serves && best.as_ref().is_none_or(|(size, _)| total < *size) {
                best = Some((total, run));
            }
        }
        let (_, run) = best?;
        let mut streams: Vec<StreamId> = run
            .iter()
            .map(|&id| self.arena.get(id).stream)
            .filter(|&s| s != request.stream)
            .collect();
        streams.sort_unstable();
        streams.dedup();
        for &stream in &streams {
            if let Err(err) = self.order_after(request.stream, stream) {
                logging::device_error(
                    "cross-stream reuse: could not order the streams; the blocks stay cached",
                    &err,
                );
                self.cross_stream.counts.failed_waits += 1;
                return None;
            }
        }
        for &id in &run {
            let pool = self.pools.get_mut(Owner::Ordinary, request.pool);
            pool.remove(id, self.arena.get(id));
            let block = self.arena.get_mut(id);
            block.stream = request.stream;
            if id != run[0] {
                self.pools
                    .get_mut(Owner::Ordinary, request.pool)
                    .insert(id, block);
            }
        }
        self.cross_stream.counts.reuses += 1;
        self.cross_stream.counts.waits += streams.len() as u64;
        self.absorb_free_neighbours(run[0]);
        Some(run[0])
    }

    /// PyTorch's best fit over the other streams' cached blocks: the smallest that may serve,
    /// lowest address among equals.
    fn best_fit_on_other_streams(&self, request: &Request) -> Option<BlockId> {
        let pool = self.pools.get(Owner::Ordinary, request.pool);
        let arena = &self.arena;
        let mut best: Option<(usize, u64, BlockId)> = None;
        for stream in pool.streams().filter(|&s| s != request.stream) {
            // Blocks of expandable segments serve only while the setting is on (as in
            // `get_free_block`).
            let Some(id) = pool
                .fitting(stream, request.size)
                .find(|&id| self.config.expandable_segments || !arena.get(id).expandable)
            else {
                continue;
            };
            let b = arena.get(id);
            // The oversize rules grow stricter with the block's size, so a stream whose best
            // fit fails them has nothing that passes.
            if !b.expandable && !policy::may_serve(b.size, request.size, &self.config) {
                continue;
            }
            if best.is_none_or(|(size, ptr, _)| (b.size, b.ptr) < (size, ptr)) {
                best = Some((b.size, b.ptr, id));
            }
        }
        best.map(|(_, _, id)| id)
    }

    /// Orders `stream` after everything queued so far on the block's stream (one event record
    /// there, one device-side wait on `stream`), then gives the block to `stream`. `false`, with
    /// the block unchanged, when the device refused either call.
    fn move_to_stream(&mut self, id: BlockId, stream: StreamId) -> bool {
        let (ptr, size, from) = {
            let b = self.arena.get(id);
            (b.ptr, b.size, b.stream)
        };
        if let Err(err) = self.order_after(stream, from) {
            logging::device_error(
                "cross-stream reuse: could not order the streams; the block stays cached",
                &err,
            );
            self.cross_stream.counts.failed_waits += 1;
            return false;
        }
        self.arena.get_mut(id).stream = stream;
        self.cross_stream.counts.reuses += 1;
        self.cross_stream.counts.waits += 1;
        logging::cross_stream_reuse(ptr, size, from, stream);
        true
    }

    /// `cuEventRecord` on `earlier`, `cuStreamWaitEvent` on `later`: later's work from now on
    /// runs after earlier's work so far.
    fn order_after(&mut self, later: StreamId, earlier: StreamId) -> Result<(), DeviceError> {
        let event = self.device.record_event(earlier)?;
        let waited = self.device.wait_event(later, event);
        // The wait keeps the record it saw, so the event can go back to the pool at once.
        self.device.release_event(event);
        waited
    }

    /// With expandable segments: a free block of another stream, at the end of its segment's
    /// mapped pages, grown into the unmapped pages after it until it holds the request. The
    /// lowest address where that fits.
    fn grow_into_other_stream_segment(
        &mut self,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        // Pages mapped for another stream's segment are a device allocation like any other.
        // A refusal is not announced here: the request's own device allocation comes next and
        // gives the answer (counted once, as PyTorch counts its one `alloc_block`).
        if self.admit(request.alloc_size, Announce::Quietly)?.is_err() {
            return Ok(None);
        }
        let arena = &self.arena;
        let pool = self.pools.get(Owner::Ordinary, request.pool);
        let start = pool
            .unmapped_blocks()
            .filter(|&id| arena.get(id).stream != request.stream)
            .filter_map(|unmapped| {
                let u = arena.get(unmapped);
                // Only a free tail saves memory; unmapped pages alone B maps in its own segment.
                let tail = u.prev.filter(|&p| {
                    let p = arena.get(p);
                    p.is_available() && p.mapped && p.stream == u.stream
                })?;
                let room = arena.get(tail).size + u.size;
                (room >= request.size).then_some(tail)
            })
            .min_by_key(|&tail| arena.get(tail).ptr);
        let Some(tail) = start else { return Ok(None) };
        let Some(id) = self.grow_expandable_block(tail, request)? else {
            return Ok(None);
        };
        if self.move_to_stream(id, request.stream) {
            self.absorb_free_neighbours(id);
            self.cross_stream.counts.segment_growths += 1;
            return Ok(Some(id));
        }
        let block = self.arena.get_mut(id);
        self.pools
            .get_mut(Owner::Ordinary, request.pool)
            .insert(id, block);
        Ok(None)
    }

    /// When the cache is emptied (no capture under way): merges free neighbours of different
    /// streams, after synchronizing those streams on the host, so whole segments can be
    /// released. Without the mode there is nothing to merge.
    pub(super) fn coalesce_across_streams(&mut self) -> Result<(), DeviceError> {
        if !self.config.opt_in.cross_stream {
            return Ok(());
        }
        for kind in [policy::PoolKind::Large, policy::PoolKind::Small] {
            loop {
                let arena = &self.arena;
                let pair = self
                    .pools
                    .get(Owner::Ordinary, kind)
                    .cached()
                    .into_iter()
                    .find_map(|id| {
                        let b = arena.get(id);
                        let n = b.next?;
                        let next = arena.get(n);
                        (b.mapped && next.mapped && next.is_available() && next.stream != b.stream)
                            .then_some((id, b.stream, next.stream))
                    });
                let Some((id, _, _)) = pair else {
                    break;
                };
                // The host waits for every stream of the free run the merge will absorb: none
                // has work left on any of its blocks.
                for s in self.streams_of_free_run(id) {
                    self.device.synchronize_stream(s)?;
                    self.cross_stream.counts.coalescing_synchronizations += 1;
                }
                let pool = self.pools.get_mut(Owner::Ordinary, kind);
                pool.remove(id, self.arena.get(id));
                self.cross_stream.merging = true;
                self.absorb_free_neighbours(id);
                self.cross_stream.merging = false;
                let block = self.arena.get_mut(id);
                self.pools.get_mut(Owner::Ordinary, kind).insert(id, block);
            }
        }
        Ok(())
    }

    /// The streams of the free mapped blocks adjacent to `id` (itself included), each once.
    fn streams_of_free_run(&self, id: BlockId) -> Vec<StreamId> {
        let free = |n: &Option<BlockId>| {
            n.filter(|&n| {
                let b = self.arena.get(n);
                b.is_available() && b.mapped
            })
        };
        let mut first = id;
        while let Some(p) = free(&self.arena.get(first).prev) {
            first = p;
        }
        let mut streams = Vec::new();
        let mut cursor = Some(first);
        while let Some(c) = cursor {
            streams.push(self.arena.get(c).stream);
            cursor = free(&self.arena.get(c).next);
        }
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Merges a free block that is out of its pool (just moved to another stream, or being
    /// coalesced) with the free neighbours it may merge with, keeping the inactive-split
    /// statistics: each merge turns two inactive split blocks into one, or into a whole
    /// segment.
    /// Repeats until nothing merges: a neighbour of another stream, once absorbed, may bring
    /// a free block of this one next to it.
    fn absorb_free_neighbours(&mut self, id: BlockId) {
        let mut merged_any = true;
        while merged_any {
            merged_any = false;
            for side in [Side::Below, Side::Above] {
                if self.absorb_neighbour(id, side) {
                    merged_any = true;
                }
            }
        }
    }

    /// Merges the neighbour on `side` into `id` if it may; keeps the statistics.
    fn absorb_neighbour(&mut self, id: BlockId, side: Side) -> bool {
        let candidate = match side {
            Side::Below => self.arena.get(id).prev,
            Side::Above => self.arena.get(id).next,
        };
        {
            if self.try_merge_blocks(id, candidate) == 0 {
                return false;
            }
            let b = self.arena.get(id);
            // Expandable segments are left out of the inactive-split statistics.
            if !b.expandable {
                let (whole, size, kind) = (!b.is_split(), b.size as u64, b.pool);
                self.ledger
                    .stats
                    .inactive_split
                    .decrease(kind, 1 + u64::from(whole));
                if whole {
                    self.ledger.stats.inactive_split_bytes.decrease(kind, size);
                }
            }
        }
        true
    }
}

/// Which neighbour of a block.
#[derive(Clone, Copy)]
enum Side {
    Below,
    Above,
}
