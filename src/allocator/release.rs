//! Giving memory back: `empty_cache` (PyTorch's `release_cached_blocks`), the release of
//! oversize blocks after a failed device allocation (`release_available_cached_blocks`),
//! garbage collection under a memory fraction (`garbage_collect_cached_blocks`), and the
//! memory fraction itself. Sleeping segments are out of reach: their free blocks are in no
//! pool until they wake.

use super::backing::{Memory, plain};
use super::block::{Block, BlockId};
use super::owner::Owner;
use super::segments::SegmentId;
use super::{AllocError, DeviceAllocator, Request};
use crate::device::{Device, DeviceError, StreamId};
use crate::policy::{self, PoolKind};

impl<D: Device> DeviceAllocator<D> {
    // ----------------------------------------------------------------------------------------
    // giving memory back
    // ----------------------------------------------------------------------------------------

    /// `emptyCache`: waits for pending frees, then gives every wholly free segment (and every
    /// free page of expandable segments) back to the device, and the device's pooled events
    /// (PyTorch keeps its event pool; an emptied cache here holds nothing of the driver's).
    /// Private pools that a graph still holds keep all their memory.
    pub fn empty_cache(&mut self) -> Result<(), DeviceError> {
        self.empty_cache_for(None)
    }

    /// [`empty_cache`](Self::empty_cache) called with `current_stream` current, PyTorch's
    /// `getCurrentCUDAStream` of the device (`None`: unknown): whether a private pool that
    /// records makes it a capture context depends on it
    /// ([`empty_cache_in_capture_context`](Self::empty_cache_in_capture_context)).
    pub fn empty_cache_for(&mut self, current_stream: Option<StreamId>) -> Result<(), DeviceError> {
        let in_capture_context = self.empty_cache_in_capture_context(current_stream);
        self.release_cached_blocks(in_capture_context)?;
        self.device.destroy_idle_events()
    }

    /// `release_cached_blocks`. In a capture context (`in_capture_context`, PyTorch's
    /// `is_capture_context()`) only unreferenced private pools are released: the ordinary pools
    /// would need a synchronization, which a capture forbids. A private pool recording outside
    /// a capture (`use_mem_pool`) does not stop it.
    pub(super) fn release_cached_blocks(
        &mut self,
        in_capture_context: bool,
    ) -> Result<(), DeviceError> {
        if !in_capture_context {
            self.synchronize_and_free_events()?;
            self.source.leftovers.retry(&mut self.device)?;
            self.coalesce_across_streams()?;
            self.release_blocks(Owner::Ordinary, PoolKind::Large)?;
            self.release_blocks(Owner::Ordinary, PoolKind::Small)?;
            for tag in self.pools.tag_indices() {
                self.release_blocks(Owner::Tagged(tag), PoolKind::Large)?;
                self.release_blocks(Owner::Tagged(tag), PoolKind::Small)?;
            }
        }
        self.release_unreferenced_private_pools()
    }

    /// `release_blocks`: releases every unsplit cached segment of the block pool, and unmaps the
    /// free pages of its expandable segments.
    pub(super) fn release_blocks(
        &mut self,
        owner: Owner,
        pool: PoolKind,
    ) -> Result<(), DeviceError> {
        let mut whole = Vec::new();
        let mut to_unmap = Vec::new();
        for id in self.pools.get(owner, pool).cached() {
            // Sleeping memory is in no pool: it keeps its addresses until it wakes.
            let b = self.arena.get(id);
            if b.expandable {
                to_unmap.push(id);
            } else if !b.is_split() {
                whole.push(id);
            }
        }
        for id in whole {
            self.release_block(id)?;
        }
        for id in to_unmap {
            let segment = self.arena.get(id).segment;
            self.unmap_block(id)?;
            // As in PyTorch, a segment left with nothing mapped gives its address range back
            // at once, before the next block is unmapped.
            if let Some(empty) = self.wholly_unmapped_block(segment) {
                self.release_expandable_segment(empty)?;
            }
        }
        // A segment that had nothing mapped before this call (its first growth failed) keeps
        // its address range, as in PyTorch, and serves the next request of its stream.
        Ok(())
    }

    /// The one block of expandable segment `segment` when nothing of it is mapped.
    fn wholly_unmapped_block(&self, segment: SegmentId) -> Option<BlockId> {
        let Memory::Expandable(live) = &self.segments.find(segment)?.memory else {
            return None;
        };
        if live.mapped_bytes() != 0 {
            return None;
        }
        let head = self.segments.head(segment);
        debug_assert!(!self.arena.get(head).is_split() && !self.arena.get(head).mapped);
        Some(head)
    }

    /// `release_block`: gives a whole cached segment back to the device.
    fn release_block(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let (ptr, size, stream, pool, segment, owner) = {
            let b = self.arena.get(id);
            debug_assert!(!b.expandable && !b.is_split() && b.is_available());
            (b.ptr, b.size, b.stream, b.pool, b.segment, b.owner)
        };
        let pool_id = self.pools.id_of(owner);
        // The device first: if it refuses, the segment stays cached and nothing changes (but
        // its `segment_free` entry, written before, as PyTorch writes it before `cudaFree`).
        match &self.segments.get(segment).memory {
            Memory::Vmm(vmm) => {
                // `cudaFree` waits for the device; `cuMemUnmap` does not, and work queued on
                // the block's stream may still use the memory (as for expandable pages).
                self.device.synchronize_stream(stream)?;
                self.ledger.segment_releasing(ptr, size, stream, pool_id);
                vmm.release(&mut self.device, &mut self.source.leftovers)?;
            }
            Memory::Plain => {
                self.ledger.segment_releasing(ptr, size, stream, pool_id);
                plain::release(&mut self.device, ptr)?;
            }
            Memory::External => {
                // `cudaFree` waits for the device; another allocator's `raw_delete` may not
                // (`ncclMemFree` unmaps), and work queued on the block's stream may still use
                // the memory.
                self.device.synchronize_stream(stream)?;
                self.ledger.segment_releasing(ptr, size, stream, pool_id);
                self.release_to_pool_allocator(owner, ptr)?;
            }
            Memory::Expandable(_) => unreachable!("an expandable segment releases by pages"),
        }
        self.segments.remove(segment);
        let block = self.arena.remove(id);
        self.pools.of_block_mut(&block).remove(id, &block);
        self.count_segment_returned(block.owner);
        self.ledger.segment_released(ptr, size, pool, &self.config);
        Ok(())
    }

    /// `release_available_cached_blocks`: after a failed device allocation, releases the
    /// smallest oversize cached block that covers the request, or else oversize blocks from the
    /// largest down until enough is released. Only when `max_split_size` is set, and never in
    /// a private pool: a request for one comes from a capture, so the pool is referenced and a
    /// graph may replay into its free blocks (PyTorch releases them; see [`private_pool`]).
    pub(super) fn release_available_cached_blocks(
        &mut self,
        request: &Request,
    ) -> Result<bool, DeviceError> {
        let max_split_size = self.config.max_split_size;
        if max_split_size == usize::MAX || request.owner != Owner::Ordinary {
            return Ok(false);
        }
        let wanted = request.size.max(max_split_size);
        let pool = self.pools.get(Owner::Ordinary, request.pool);
        let arena = &self.arena;
        // Only whole segments go back to the device. PyTorch never caches a split block this
        // large (requests below max_split_size never get one, larger ones never split it), but
        // a replay's imported start state can hold one (a segment laid out under another
        // setting): it is passed over like an expandable one.
        let releasable = |id: BlockId| {
            let b = arena.get(id);
            !b.expandable && !b.is_split()
        };
        let covering = pool
            .best_fit(request.stream, wanted)
            .filter(|&id| releasable(id));
        if let Some(id) = covering {
            self.release_block(id)?;
            return Ok(true);
        }
        // No single block is large enough: release oversize blocks, largest first. As in
        // PyTorch, each is released as it is chosen, even when all of them together turn out
        // too small (the caller then releases everything anyway).
        let mut to_release = Vec::new();
        let mut released = 0;
        for (size, id) in pool.smaller_than(request.stream, wanted) {
            if released >= wanted || size < max_split_size {
                break;
            }
            if releasable(id) {
                to_release.push(id);
                released += size;
            }
        }
        for id in to_release {
            self.release_block(id)?;
        }
        Ok(released >= wanted)
    }

    /// `garbage_collect_cached_blocks`: with a memory fraction and a threshold set, releases
    /// unsplit large cached segments, oldest (least recently reused) first, until reserved
    /// memory is back under the threshold.
    pub(super) fn garbage_collect_cached_blocks(&mut self) -> Result<(), DeviceError> {
        let Some(allowed) = self.source.guard.allowed_memory_maximum else {
            return Ok(());
        };
        let gc_threshold = (self.config.garbage_collection_threshold * allowed as f64) as usize;
        if self.ledger.reserved <= gc_threshold {
            return Ok(());
        }
        let target = self.ledger.reserved - gc_threshold;
        let large = self.pools.get(Owner::Ordinary, PoolKind::Large);
        let clock = large.get_free_blocks_call_count;
        let age = |b: &Block| clock - b.gc_count_base;
        let freeable = |b: &Block| !b.is_split() && !b.expandable;
        let mut total_age: u64 = 0;
        let mut freeable_count: u64 = 0;
        for id in large.cached() {
            let b = self.arena.get(id);
            if freeable(b) {
                total_age += age(b);
                freeable_count += 1;
            }
        }
        let mut reclaimed = 0;
        while reclaimed < target && freeable_count > 0 {
            let age_threshold = total_age as f64 / freeable_count as f64;
            // Release every block at least as old as the average, not only up to the target,
            // so collection does not run again at once.
            let victims: Vec<BlockId> = self
                .pools
                .get(Owner::Ordinary, PoolKind::Large)
                .cached()
                .into_iter()
                .filter(|&id| {
                    let b = self.arena.get(id);
                    freeable(b) && age(b) as f64 >= age_threshold
                })
                .collect();
            if victims.is_empty() {
                break;
            }
            for id in victims {
                let b = self.arena.get(id);
                reclaimed += b.size;
                total_age -= age(b);
                freeable_count -= 1;
                self.release_block(id)?;
            }
        }
        Ok(())
    }

    /// `setMemoryFraction`: limits what this allocator holds to `fraction` of the device.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidArgument(format!(
                "invalid fraction: {fraction}. Please set within (0, 1)."
            )));
        }
        let info = self.device.mem_get_info()?;
        self.source.guard.allowed_memory_maximum =
            policy::memory_fraction_limit(fraction, info.total);
        Ok(())
    }

    /// `getMemoryFraction`: the limit `set_memory_fraction` set, as a share of the device's
    /// memory (1 when none was set), computed from the limit in bytes as PyTorch does.
    pub fn memory_fraction(&mut self) -> Result<f64, AllocError> {
        let Some(limit) = self.source.guard.allowed_memory_maximum else {
            return Ok(1.0);
        };
        Ok(limit as f64 / self.device_total()? as f64)
    }
}
