//! The allocator's side of expandable segments (PyTorch's `expandable_segments:True`): the
//! blocks that tile each reserved range (mapped blocks in the free pool, unmapped ones in the
//! pool's unmapped set), finding room for a request, mapping pages into blocks, unmapping free
//! pages, releasing empty ranges. The pages themselves are the expandable backing's
//! ([`ExpandableSegment`], `allocator/backing/expandable.rs`).

use super::backing::Memory;
use super::backing::expandable::ExpandableSegment;
use super::block::BlockId;
use super::owner::Owner;
use super::segments::{Segment, SegmentId};
use super::{AllocError, DeviceAllocator, Request};
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind};

/// The allocator's side of expandable segments: finding room, mapping pages into blocks,
/// unmapping free pages, releasing empty ranges.
impl<D: Device> DeviceAllocator<D> {
    /// `try_allocate_expandable_block`: finds (or reserves) address space for the request in
    /// the stream's expandable segment and maps pages until a free block covers it.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let candidate = self.find_expandable_block(request)?;
        let fresh = self.arena.get(candidate);
        if !fresh.mapped && !fresh.is_split() && fresh.size < request.size {
            // A new segment's whole range cannot hold the request (larger than 9/8 of the
            // device, or than `expandable_segments_reserve`): as PyTorch does, the range goes
            // back at once and nothing is mapped.
            self.release_expandable_segment(candidate)?;
            return Ok(None);
        }
        self.grow_expandable_block(candidate, request)
    }

    /// Maps pages from `candidate` (a free or unmapped block that, with the free and unmapped
    /// space after it, holds the request) until one free block covers the request; takes it out
    /// of its pool. `Ok(None)` when the device is out of memory.
    ///
    /// The pages mapped take `candidate`'s stream, so that they merge with it into one block:
    /// with cross-stream reuse the unmapped space after it may carry another stream (that of
    /// the block unmapped there last, or of the segment), which would otherwise come back
    /// mapped as a block of that stream and be handed to the request.
    pub(super) fn grow_expandable_block(
        &mut self,
        mut candidate: BlockId,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let stream = self.arena.get(candidate).stream;
        if !self.arena.get(candidate).mapped {
            let size = self.arena.get(candidate).size.min(request.size);
            if !self.map_block(candidate, size, stream)? {
                return Ok(None);
            }
        }
        while self.arena.get(candidate).size < request.size {
            let remaining = request.size - self.arena.get(candidate).size;
            let next = self
                .arena
                .get(candidate)
                .next
                .expect("find_expandable_block checked the space after the candidate");
            let size = self.arena.get(next).size.min(remaining);
            if !self.map_block(next, size, stream)? {
                return Ok(None);
            }
            candidate = next;
        }
        let block = self.arena.get(candidate);
        self.pools.of_block_mut(block).remove(candidate, block);
        Ok(Some(candidate))
    }

    /// `find_expandable_block`: the lowest address where free and unmapped space together hold
    /// the request, in an existing segment of the stream, or else a newly reserved segment.
    pub(super) fn find_expandable_block(
        &mut self,
        request: &Request,
    ) -> Result<BlockId, AllocError> {
        let arena = &self.arena;
        // Mapped blocks join only if they will merge with the pages mapped for the request
        // (with cross-stream reuse, a neighbour may belong to another stream).
        let available = |id: Option<BlockId>| {
            id.filter(|&id| {
                let b = arena.get(id);
                b.is_available() && (!b.mapped || b.stream == request.stream)
            })
        };
        let has_room = |start: BlockId| {
            let mut bytes = 0;
            let mut cursor = Some(start);
            while bytes < request.size {
                match available(cursor) {
                    Some(id) => {
                        bytes += arena.get(id).size;
                        cursor = arena.get(id).next;
                    }
                    None => break,
                }
            }
            bytes >= request.size
        };
        let pool = self.pools.get(request.owner, request.pool);
        // A sleeping segment does not grow (its pages come back only at wake): its unmapped
        // space is in no pool until then, so the request looks further, or reserves a new
        // segment.
        for unmapped in pool.unmapped_of(request.stream) {
            // A free mapped block just before the unmapped space extends it downwards.
            let start = available(arena.get(unmapped).prev).unwrap_or(unmapped);
            if has_room(start) {
                return Ok(start);
            }
        }
        self.new_expandable_segment(request.stream, request.pool, request.owner)
    }

    /// Reserves the address range of a new expandable segment for `stream` in `pool` (of a
    /// private pool, or the ordinary one); returns its one block, unmapped, spanning the range.
    pub(super) fn new_expandable_segment(
        &mut self,
        stream: StreamId,
        pool: PoolKind,
        owner: Owner,
    ) -> Result<BlockId, AllocError> {
        let total = self.device.mem_get_info()?.total;
        let reserve_class = self.reserve_class_of(stream);
        let reserve = policy::expandable_segment_reserve(&self.config, total, &reserve_class);
        if !reserve_class.is_empty()
            && !reserve.class_known
            && self
                .source
                .warned_reserve_classes
                .insert(reserve_class.clone())
        {
            logging::warning(&policy::unknown_reserve_class_warning(&reserve_class));
        }
        let page_size = pool.expandable_page_size(&self.config);
        let segment =
            ExpandableSegment::reserve(&mut self.device, stream, page_size, reserve.bytes)?;
        let (base, size) = (segment.base(), segment.size());
        let segment = Segment {
            owner,
            kind: pool,
            memory: Memory::Expandable(segment),
            asleep: false,
        };
        let id = self.adopt_segment(base, size, stream, segment);
        let block = self.arena.get_mut(id);
        block.mapped = false;
        self.pools.get_mut(owner, pool).insert_unmapped(id, block);
        Ok(id)
    }

    /// An expandable block's address, size, stream, pool, private pool and segment.
    fn expandable_block(
        &self,
        id: BlockId,
    ) -> (DevicePtr, usize, StreamId, PoolKind, Owner, SegmentId) {
        let b = self.arena.get(id);
        debug_assert!(b.expandable, "a block of an expandable segment");
        (b.ptr, b.size, b.stream, b.pool, b.owner, b.segment)
    }

    /// `map_block`: maps pages under the first `size` bytes of an unmapped block; the mapped part
    /// becomes a free block of `stream` (merged with free neighbours), the rest stays unmapped.
    /// Unmapped pages hold nothing, so any stream may take them without waiting.
    /// `Ok(false)` when the device is out of memory.
    pub(super) fn map_block(
        &mut self,
        id: BlockId,
        size: usize,
        stream: StreamId,
    ) -> Result<bool, AllocError> {
        debug_assert!(!self.arena.get(id).mapped && size <= self.arena.get(id).size);
        let (ptr, block_size, _, pool, owner, segment_id) = self.expandable_block(id);
        let segment = self.segments.expandable_mut(segment_id);
        let range = match segment.map(&mut self.device, ptr, size, &mut self.source.leftovers) {
            Ok(range) => range,
            Err(DeviceError::OutOfMemory) => return Ok(false),
            Err(err) => return Err(err.into()),
        };
        debug_assert!(range.ptr == ptr && range.size >= size);
        self.pools
            .get_mut(owner, pool)
            .remove_unmapped(self.arena.get(id));
        self.arena.get_mut(id).mapped = true;
        if range.size < block_size {
            // The rest stays unmapped, with the stream it had.
            let mut rest = self.piece_of(id, ptr + range.size as u64, block_size - range.size);
            rest.mapped = false;
            self.arena.get_mut(id).size = range.size;
            let rest_id = self.arena.insert_after(id, rest);
            self.pools
                .get_mut(owner, pool)
                .insert_unmapped(rest_id, self.arena.get(rest_id));
        }
        self.arena.get_mut(id).stream = stream;
        let (prev, next) = (self.arena.get(id).prev, self.arena.get(id).next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools
            .get_mut(owner, pool)
            .insert(id, self.arena.get_mut(id));
        self.ledger.pages_mapped(
            range.ptr,
            range.size,
            stream,
            (pool, self.pools.id_of(owner)),
        );
        Ok(true)
    }

    /// `unmap_block`: unmaps the whole pages inside a free expandable block; partial pages at
    /// either end stay mapped as free blocks of their own.
    pub(super) fn unmap_block(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let (ptr, size, stream, pool, owner, segment_id) = self.expandable_block(id);
        let segment = self.segments.expandable_mut(segment_id);
        // With cross-stream reuse the free block may have served another stream last: unmapping
        // waits for that stream too.
        if stream != segment.stream() {
            self.device.synchronize_stream(stream)?;
        }
        let (range, failure) =
            segment.unmap(&mut self.device, ptr, size, &mut self.source.leftovers);
        if range.size == 0 {
            return failure.map_or(Ok(()), Err);
        }
        self.pools
            .get_mut(owner, pool)
            .remove(id, self.arena.get(id));
        // Partial pages at either end stay mapped, as free blocks of their own.
        let before = (range.ptr - ptr) as usize;
        let after = size - before - range.size;
        let mut pieces = Vec::with_capacity(2);
        if before > 0 {
            let piece = self.piece_of(id, ptr, before);
            pieces.push(self.insert_before(id, piece));
        }
        if after > 0 {
            let piece = self.piece_of(id, range.ptr + range.size as u64, after);
            pieces.push(self.arena.insert_after(id, piece));
        }
        for piece in pieces {
            self.pools
                .get_mut(owner, pool)
                .insert(piece, self.arena.get_mut(piece));
        }
        let block = self.arena.get_mut(id);
        block.ptr = range.ptr;
        block.size = range.size;
        block.mapped = false;
        let (prev, next) = (block.prev, block.next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools
            .get_mut(owner, pool)
            .insert_unmapped(id, self.arena.get(id));
        self.ledger.pages_unmapped(
            range.ptr,
            range.size,
            stream,
            (pool, self.pools.id_of(owner)),
        );
        failure.map_or(Ok(()), Err)
    }

    /// `release_expandable_segment`: gives back the address range of a segment with nothing
    /// mapped (its one block spans the whole range, unmapped). The segment leaves the books
    /// either way; a range the device refuses to free becomes a leftover, retried by every
    /// `empty_cache` as leftover pages are (it holds nothing, and no segment can use it).
    pub(super) fn release_expandable_segment(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let segment_id = self.arena.get(id).segment;
        debug_assert_eq!(
            self.arena.get(id).size,
            self.segments.expandable(segment_id).size()
        );
        let block = self.arena.remove(id);
        self.pools.of_block_mut(&block).remove_unmapped(&block);
        self.count_segment_returned(block.owner);
        let Memory::Expandable(segment) = self.segments.remove(segment_id).memory else {
            unreachable!("an expandable block's segment is expandable");
        };
        segment.release(&mut self.device).inspect_err(|_| {
            self.source.leftovers.push_range(super::backing::PageRange {
                ptr: segment.base(),
                size: segment.size(),
            });
        })
    }
}
