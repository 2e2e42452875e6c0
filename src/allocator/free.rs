//! `free`: the block goes back to its stream's pool and merges with free neighbours
//! (PyTorch's `free`, `free_block`, `try_merge_blocks`), unless other streams used it, in which
//! case it waits for events recorded on them ([`super::events`]). A block of a sleeping
//! segment merges as usual but stays out of the pools until its segment wakes.

use super::block::BlockId;
use super::history::TraceAction;
use super::private_pool::ORDINARY_POOL_ID;
use super::{AllocationInfo, DeviceAllocator, PointerError, cross_stream, stats};
use crate::device::{Device, DevicePtr};
use crate::logging;
use crate::policy::{self, PoolKind};

impl<D: Device> DeviceAllocator<D> {
    // ----------------------------------------------------------------------------------------
    // free
    // ----------------------------------------------------------------------------------------

    /// Frees an allocation. The block is cached for its stream at once, or, if the program used
    /// it on other streams, once the work queued on them by now has completed.
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), PointerError> {
        self.free_returning_info(ptr).map(drop)
    }

    /// [`DeviceAllocator::free`], returning what the allocation had recorded, so that a caller
    /// can check what it was told about the pointer without a second look-up. A pointer this
    /// allocator did not hand out changes nothing.
    #[inline(always)]
    pub fn free_returning_info(&mut self, ptr: DevicePtr) -> Result<AllocationInfo, PointerError> {
        let id = self
            .allocated
            .remove(&ptr)
            .ok_or(PointerError::Unknown(ptr))?;
        let block = self.arena.get_mut(id);
        block.allocated = false;
        let waits_for_streams = !block.stream_uses.is_empty();
        let info = AllocationInfo {
            ptr,
            size: block.size,
            requested_size: block.requested_size,
            stream: block.stream,
            pool: block.pool,
            private_pool: block
                .owner
                .private()
                .map(|index| self.pools.private(index).id),
        };
        let (pool, size) = (info.pool, info.size);
        self.ledger.stats.allocation.decrease(pool, 1);
        self.ledger
            .stats
            .allocated_bytes
            .decrease(pool, size as u64);
        if policy::is_oversize(size, &self.config) {
            self.ledger
                .stats
                .oversize_allocations
                .decrease_may_go_negative(1);
        }
        self.ledger.history.record_in_pool(
            TraceAction::FreeRequested,
            ptr,
            info.requested_size,
            info.stream,
            || info.private_pool.unwrap_or(ORDINARY_POOL_ID),
        );
        if !waits_for_streams {
            logging::block_freed(ptr);
            self.free_block(id);
        } else if !self.pools.captures.is_empty() {
            // Recording and querying events is illegal during a capture: wait until it ends.
            self.events.to_record.push(id);
        } else {
            // Freed outside a capture, the block waits for every stream it was used on, as in
            // PyTorch, those of a capture included.
            if !self.events.capture_stream_uses.is_empty() {
                self.events.capture_stream_uses.remove(&id);
            }
            self.insert_events(id);
        }
        Ok(info)
    }

    /// `free_block`: returns an available block to its pool, merged with free neighbours.
    #[inline(always)]
    pub(super) fn free_block(&mut self, id: BlockId) {
        let b = self.arena.get(id);
        debug_assert!(b.is_available());
        let (ptr, original_size, requested, stream, pool, expandable) = (
            b.ptr,
            b.size,
            b.requested_size,
            b.stream,
            b.pool,
            b.expandable,
        );
        let (prev, next, owner) = (b.prev, b.next, b.owner);
        let pools = &self.pools;
        self.ledger.history.record_in_pool(
            TraceAction::FreeCompleted,
            ptr,
            requested,
            stream,
            || pools.id_of(owner),
        );
        let mut inactive_split_blocks: i64 = 0;
        let mut inactive_split_bytes: i64 = 0;
        for candidate in [prev, next].into_iter().flatten() {
            let subsumed = self.merge_if_available(id, candidate);
            if subsumed > 0 {
                inactive_split_blocks -= 1;
                inactive_split_bytes -= subsumed as i64;
            }
        }
        let block = self.arena.get_mut(id);
        if block.is_split() {
            inactive_split_blocks += 1;
            inactive_split_bytes += block.size as i64;
        }
        let merged_size = block.size;
        let (owner, segment) = (block.owner, block.segment);
        let blocks = self.pools.get_mut(owner, pool);
        if !self.segments.is_asleep(segment) {
            blocks.insert(id, block);
        } else {
            // Its segment sleeps: the block joins its pool at wake, aged from now.
            block.gc_count_base = blocks.get_free_blocks_call_count;
        }
        if merged_size != original_size {
            logging::new_free_block(merged_size);
        }
        let stats = &mut self.ledger.stats;
        // Expandable segments can always give free pages back, so PyTorch leaves them out of
        // the inactive-split statistics.
        if !expandable {
            apply_signed(&mut stats.inactive_split, pool, inactive_split_blocks);
            apply_signed(&mut stats.inactive_split_bytes, pool, inactive_split_bytes);
        }
        stats.active.decrease(pool, 1);
        stats.active_bytes.decrease(pool, original_size as u64);
        stats.requested_bytes.decrease(pool, requested as u64);
    }

    /// `try_merge_blocks`: absorbs `candidate` into `dst` if it is an available block in the same
    /// state of mapping. Returns the bytes absorbed (0 = no merge).
    #[inline(always)]
    pub(super) fn try_merge_blocks(&mut self, dst: BlockId, candidate: Option<BlockId>) -> usize {
        match candidate {
            Some(src) => self.merge_if_available(dst, src),
            None => 0,
        }
    }

    /// [`try_merge_blocks`](Self::try_merge_blocks) of `dst`'s neighbour `src`.
    #[inline(always)]
    fn merge_if_available(&mut self, dst: BlockId, src: BlockId) -> usize {
        let s = self.arena.get(src);
        if !s.is_available() {
            return 0;
        }
        let d = self.arena.get(dst);
        let allowed =
            cross_stream::may_merge(s, d) || (self.cross_stream.merging && s.mapped == d.mapped);
        if !allowed {
            return 0;
        }
        let (src_ptr, src_size, src_prev, src_next, src_mapped, segment) =
            (s.ptr, s.size, s.prev, s.next, s.mapped, s.segment);
        // A sleeping segment's free blocks are in no pool.
        if !self.segments.is_asleep(segment) {
            let pool = self.pools.of_block_mut(s);
            let removed = if src_mapped {
                pool.remove(src, s)
            } else {
                pool.remove_unmapped(s)
            };
            debug_assert!(removed, "an available block is in its pool");
        }
        self.arena.discard(src);
        let dst_block = self.arena.get_mut(dst);
        dst_block.size += src_size;
        let merged_ptr = if src_next == Some(dst) {
            src_ptr
        } else {
            dst_block.ptr
        };
        if src_next == Some(dst) {
            // [src dst]
            dst_block.ptr = src_ptr;
            dst_block.prev = src_prev;
            match src_prev {
                Some(p) => self.arena.get_mut(p).next = Some(dst),
                None => self.segments.set_head(segment, dst),
            }
        } else {
            // [dst src]
            dst_block.next = src_next;
            if let Some(n) = src_next {
                self.arena.get_mut(n).prev = Some(dst);
            }
        }
        self.ledger.stats.num_merges += 1;
        if src_mapped {
            logging::block_merged(merged_ptr);
        }
        src_size
    }
}

/// Applies a signed change to a statistic.
#[inline]
fn apply_signed(stat: &mut stats::StatArray, pool: PoolKind, change: i64) {
    if change > 0 {
        stat.increase(pool, change as u64);
    } else if change < 0 {
        stat.decrease(pool, (-change) as u64);
    }
}
