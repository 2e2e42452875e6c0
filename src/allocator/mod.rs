//! The caching allocator: PyTorch's `DeviceCachingAllocator`, rule for rule, for one device.
//!
//! `DeviceAllocator<D>` is a plain struct over a [`Device`]: no globals, no FFI, no locking (the
//! caller wraps it in a lock). A test builds one on the simulated GPU in one line:
//! `DeviceAllocator::new(SimDevice::new(80 << 30), 0, Config::default())`.
//!
//! What a `malloc` walks through: round the size ([`policy::round_size`]), pick the pool, best
//! fit among that stream's cached blocks ([`policy::may_serve`]), split the block
//! ([`policy::should_split`]); on a miss, ask the device for a segment
//! ([`policy::allocation_size`]), and when the device is out of memory, release oversize cached
//! blocks and retry, then release every cached block and retry, then report PyTorch's
//! out-of-memory error. `free` is the mirror: the block goes back to its stream's pool and merges
//! with free neighbours, unless other streams used it, in which case it waits for events recorded
//! on them.
//!
//! During a CUDA graph capture, allocations on the capture's streams come from a private pool of
//! their own ([`private_pool`]), which keeps its memory for as long as a graph may replay into it.
//!
//! How the module is cut (each file's docs say more):
//! - the malloc path and the allocator's state here; `free.rs`, `events.rs` (frees waiting for
//!   other streams), `release.rs` (giving memory back) and `error.rs` beside it;
//! - `segments.rs`: the segment table, each segment with its owner (`owner.rs`), its memory
//!   (`backing/`: plain, expandable, VMM, each with obtain, release, sleep and wake) and its
//!   state (awake or asleep);
//! - `guard.rs` in front of every device allocation, `ledger.rs` behind every change of
//!   reserved bytes, `source.rs` holding the guard, the backing choice and the leftovers;
//! - `block.rs` and `pool.rs`: the blocks and the pools of free blocks; [`private_pool`],
//!   `expandable.rs`, `cross_stream.rs` and [`sleep`] for those features; [`history`] and
//!   [`stats`] for what PyTorch reports; `check.rs`, `import.rs` and `live.rs` for the
//!   self-check, replay's start state and the table of live allocations.

#![forbid(unsafe_code)]

pub(crate) mod backing;
pub(crate) mod block;
mod check;
pub mod checkpoint;
pub(crate) mod cross_stream;
mod error;
mod events;
pub(crate) mod expandable;
mod free;
mod free_memory;
mod guard;
pub mod history;
mod import;
pub mod ipc_handle;
mod ledger;
mod live;
pub(crate) mod owner;
pub(crate) mod pool;
pub mod private_pool;
mod release;
pub(crate) mod segments;
pub mod shareable;
pub mod sleep;
mod source;
mod staging;
pub mod stats;
pub mod tracker;
pub(crate) mod uncached;

pub use cross_stream::CrossStreamCounts;
pub use error::{AllocError, OutOfMemoryError, PointerError};
pub use source::ReserveClassLookup;

use crate::config::Config;
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind, TieRule};
use backing::{Memory, plain, vmm::VmmSegment};
use block::{Block, BlockArena, BlockId};
use cross_stream::CrossStream;
use events::StreamEvents;
use guard::{Announce, Refusal};
use history::{StackId, TraceAction};
use ledger::Ledger;
use owner::Owner;
use private_pool::{BlockPools, MempoolId};
use segments::{Segment, SegmentTable};
use source::Source;
use stats::DeviceStats;
use std::sync::Arc;

/// What the allocator knows about a live allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationInfo {
    pub ptr: DevicePtr,
    /// The block size (the request rounded).
    pub size: usize,
    pub requested_size: usize,
    pub stream: StreamId,
    pub pool: PoolKind,
    /// The private pool (CUDA graph capture) that served it; `None`: the ordinary pools.
    pub private_pool: Option<MempoolId>,
}

/// One live allocation to place in an imported segment (see [`DeviceAllocator::import_segment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportedBlock {
    pub offset: usize,
    pub size: usize,
    pub requested_size: usize,
}

/// The search for a cached block: PyTorch's `AllocParams`.
#[derive(Clone, Copy)]
struct Request {
    /// The rounded size.
    size: usize,
    stream: StreamId,
    pool: PoolKind,
    /// Whose pools serve it.
    owner: Owner,
    /// The segment size to ask the device for on a miss.
    alloc_size: usize,
}

/// The caching allocator of one device. Its state, grouped by what owns it.
pub struct DeviceAllocator<D: Device> {
    device: D,
    device_index: i32,
    config: Config,
    /// Every block; links between blocks are arena indices.
    arena: BlockArena,
    /// The cached free blocks: the ordinary small and large pools and those of private pools
    /// and tags.
    pools: BlockPools,
    /// Every segment with the memory it owns ([`segments`]).
    segments: SegmentTable,
    /// Where new segments come from: the guard, the backing for new segments, leftovers.
    source: Source,
    /// The reserved total, the statistics and the history ([`ledger`]).
    ledger: Ledger,
    /// Frees waiting for other streams ([`events`]).
    events: StreamEvents,
    /// Blocks handed out to the program, by address.
    allocated: live::LiveTable,
    /// Cross-stream reuse (opt-in): what it did, and its merging state.
    cross_stream: CrossStream,
    /// Sleep's pinned host buffers and copy stream ([`staging`]).
    staging: staging::HostStaging,
}

impl<D: Device> DeviceAllocator<D> {
    /// An allocator for device number `device_index`, with nothing reserved yet.
    pub fn new(device: D, device_index: i32, config: Config) -> DeviceAllocator<D> {
        let mut allocator = DeviceAllocator {
            device,
            device_index,
            arena: BlockArena::default(),
            pools: BlockPools::default(),
            segments: SegmentTable::default(),
            source: Source::default(),
            ledger: Ledger::new(config.max_split_size),
            events: StreamEvents::default(),
            allocated: live::LiveTable::default(),
            cross_stream: CrossStream::default(),
            staging: staging::HostStaging::default(),
            config,
        };
        if let Some(fraction) = allocator.config.per_process_memory_fraction
            && let Err(err) = allocator.set_memory_fraction(fraction)
        {
            logging::device_error("could not apply per_process_memory_fraction", &err);
        }
        allocator
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Replaces the settings, as `torch.cuda.memory._set_allocator_settings` does for PyTorch's
    /// allocator: each decision from the next one on reads the new values (PyTorch reads its
    /// settings at each decision). What PyTorch took from the settings once, when the device's
    /// allocator was made, stays: the memory-fraction limit that `per_process_memory_fraction`
    /// set and the `max_split_size` statistic.
    pub fn replace_config(&mut self, config: Config) {
        self.config = config;
        self.ledger.settings_replaced = true;
    }

    /// Tells the allocator where to ask for the reserve class of a stream
    /// (`expandable_segments_reserve_by_class`); without it every stream is untagged.
    pub fn set_reserve_class_lookup(&mut self, lookup: ReserveClassLookup) {
        self.source.reserve_classes = Some(lookup);
    }

    /// The reserve class of `stream`; empty when it has none.
    pub(crate) fn reserve_class_of(&self, stream: StreamId) -> String {
        self.source
            .reserve_classes
            .as_ref()
            .map_or_else(String::new, |lookup| lookup(stream))
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    pub fn device_index(&self) -> i32 {
        self.device_index
    }

    pub fn stats(&self) -> &DeviceStats {
        &self.ledger.stats
    }

    pub fn reset_peak_stats(&mut self) {
        self.ledger.stats.reset_peaks();
    }

    pub fn reset_accumulated_stats(&mut self) {
        self.ledger.stats.reset_accumulated();
    }

    /// Bytes held from the device.
    pub fn reserved_bytes(&self) -> usize {
        self.ledger.reserved
    }

    /// The memory-fraction limit in bytes, when set.
    pub fn allowed_memory_maximum(&self) -> Option<usize> {
        self.source.guard.allowed_memory_maximum
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.allocated.len()
    }

    /// What the allocator knows about the live allocation at `ptr`.
    pub fn allocation_info(&self, ptr: DevicePtr) -> Option<AllocationInfo> {
        let id = *self.allocated.get(&ptr)?;
        Some(self.info_of(ptr, id))
    }

    /// What block `id`, handed out at `ptr`, records.
    fn info_of(&self, ptr: DevicePtr, id: BlockId) -> AllocationInfo {
        let b = self.arena.get(id);
        AllocationInfo {
            ptr,
            size: b.size,
            requested_size: b.requested_size,
            stream: b.stream,
            pool: b.pool,
            private_pool: b.owner.private().map(|index| self.pools.private(index).id),
        }
    }

    // ----------------------------------------------------------------------------------------
    // malloc
    // ----------------------------------------------------------------------------------------

    /// Allocates `size` bytes (0 is served as 512) for use on `stream`.
    #[inline(always)]
    pub fn malloc(&mut self, size: usize, stream: StreamId) -> Result<DevicePtr, AllocError> {
        self.malloc_tagged(size, stream, None)
    }

    /// [`malloc`](Self::malloc) under tag `tag` (`ferrocache.region`): outside a capture, the
    /// allocation comes from the tag's own pools, whose segments are VMM-backed and never
    /// shared with another tag, so that the tag can sleep alone. A capture's private pool
    /// still takes the allocations on its streams (a graph's memory stays the graph's).
    #[inline(always)]
    pub fn malloc_tagged(
        &mut self,
        size: usize,
        stream: StreamId,
        tag: Option<u32>,
    ) -> Result<DevicePtr, AllocError> {
        let owner = if self.pools.captures.is_empty() {
            // Event queries are illegal during a capture, so completed frees wait until after.
            if self.events.pending_count > 0 || !self.events.to_record.is_empty() {
                self.process_events()?;
            }
            match tag {
                None => Owner::Ordinary,
                Some(tag) => self.tagged_owner(tag),
            }
        } else {
            self.owner_while_pools_record(stream)?
        };
        let mut request = self.request_for(size, stream, owner);
        let (rounded, pool) = (request.size, request.pool);
        let id = match self.get_free_block(&request) {
            Some(id) => id,
            // Where PyTorch runs its free-memory callbacks: the caller runs them, unlocked, then
            // calls `malloc_after_free_memory_callbacks` ([`free_memory`]).
            None if self.source.free_memory_callbacks => {
                return Err(AllocError::RunFreeMemoryCallbacks);
            }
            None => match self.take_from_other_stream(&request)? {
                Some(id) => id,
                None => self.allocate_new_block(&mut request, size)?,
            },
        };
        let split = self.should_split(request.owner, self.arena.get(id).size, rounded, pool);
        Ok(self.alloc_found_block(id, &request, size, split))
    }

    /// The request for `size` bytes on `stream` for `owner`: PyTorch's rounding, pool and
    /// allocation size (`round_size`, `get_pool`, `get_allocation_size`).
    #[inline(always)]
    fn request_for(&self, size: usize, stream: StreamId, owner: Owner) -> Request {
        let rounded = policy::round_size(size, &self.config);
        Request {
            size: rounded,
            stream,
            pool: policy::pool_for(rounded),
            owner,
            alloc_size: policy::allocation_size(rounded, &self.config),
        }
    }

    /// [`malloc`](Self::malloc) on behalf of the caller's stack `stack` (an id the caller hands
    /// out; 0: none): the block keeps it for snapshots, and every trace entry the allocation
    /// records (`segment_alloc`, `alloc`, `oom`) carries it.
    #[inline(always)]
    pub fn malloc_with_stack(
        &mut self,
        size: usize,
        stream: StreamId,
        stack: StackId,
    ) -> Result<DevicePtr, AllocError> {
        let previous = self.ledger.history.set_current_stack(stack);
        let result = self.malloc(size, stream);
        self.ledger.history.set_current_stack(previous);
        result
    }

    /// [`malloc_with_stack`](Self::malloc_with_stack) under tag `tag` (see
    /// [`malloc_tagged`](Self::malloc_tagged)).
    #[inline(always)]
    pub fn malloc_tagged_with_stack(
        &mut self,
        size: usize,
        stream: StreamId,
        tag: Option<u32>,
        stack: StackId,
    ) -> Result<DevicePtr, AllocError> {
        // Usually no stack is given (0, as outside any call): two stores fewer on every call.
        if stack == self.ledger.history.current_stack() {
            return self.malloc_tagged(size, stream, tag);
        }
        let previous = self.ledger.history.set_current_stack(stack);
        let result = self.malloc_tagged(size, stream, tag);
        self.ledger.history.set_current_stack(previous);
        result
    }

    /// Sets the metadata (`torch.cuda.memory._set_memory_metadata`) that the trace entries
    /// recorded from now on carry; returns the previous one, to put back after the call.
    #[inline(always)]
    pub fn set_user_metadata(&mut self, metadata: Option<Arc<str>>) -> Option<Arc<str>> {
        self.ledger.history.set_current_metadata(metadata)
    }

    /// [`free_returning_info`](Self::free_returning_info) on behalf of the caller's stack
    /// `stack`: the `free_requested` and `free_completed` entries it records carry it.
    #[inline(always)]
    pub fn free_with_stack(
        &mut self,
        ptr: DevicePtr,
        stack: StackId,
    ) -> Result<AllocationInfo, PointerError> {
        // As in `malloc_tagged_with_stack`: nothing to set when the stack is already current.
        if stack == self.ledger.history.current_stack() {
            return self.free_returning_info(ptr);
        }
        let previous = self.ledger.history.set_current_stack(stack);
        let result = self.free_returning_info(ptr);
        self.ledger.history.set_current_stack(previous);
        result
    }

    /// The miss path of `malloc`: garbage collection, then the device, with PyTorch's two
    /// retries, then the out-of-memory error. A preemptive rejection (`throw_on_cudamalloc_oom`)
    /// of the first try fails at once, with no retry.
    /// A block taken from a `use_on_oom` private pool makes `request` that pool's.
    fn allocate_new_block(
        &mut self,
        request: &mut Request,
        orig_size: usize,
    ) -> Result<BlockId, AllocError> {
        self.source.guard.preemptively_rejected = false;
        if self.source.guard.allowed_memory_maximum.is_some()
            && self.config.garbage_collection_threshold > 0.0
        {
            self.garbage_collect_cached_blocks()?;
        }
        if let Some(id) = self.alloc_block(request, false)? {
            return Ok(id);
        }
        if self.source.guard.preemptively_rejected {
            return Err(self.preemptive_rejection(request, orig_size));
        }
        logging::alloc_retry(request.alloc_size, "releasing oversize cached blocks");
        if self.release_available_cached_blocks(request)?
            && let Some(id) = self.alloc_block(request, false)?
        {
            return Ok(id);
        }
        // Releasing everything synchronizes, which a capture forbids (a recording pool outside
        // one may reclaim: `is_capture_context`).
        if !self.is_capture_context(request.stream) {
            logging::alloc_retry(request.alloc_size, "releasing all cached blocks");
            self.release_cached_blocks(false)?;
            if let Some(id) = self.alloc_block(request, true)? {
                return Ok(id);
            }
        }
        if request.owner == Owner::Ordinary
            && let Some((pool, id)) = self.free_block_of_use_on_oom_pools(request)
        {
            request.owner = Owner::Private(pool);
            return Ok(id);
        }
        if self.source.guard.preemptively_rejected {
            return Err(self.preemptive_rejection(request, orig_size));
        }
        Err(self.out_of_memory(request, orig_size))
    }

    /// `get_free_block`: the best-fitting cached block of the request's stream, if one may serve.
    #[inline(always)]
    fn get_free_block(&mut self, request: &Request) -> Option<BlockId> {
        let pool = self.pools.get_mut(request.owner, request.pool);
        if self.source.guard.allowed_memory_maximum.is_some()
            && self.config.garbage_collection_threshold > 0.0
        {
            pool.get_free_blocks_call_count += 1;
        }
        let arena = &self.arena;
        // A sleeping segment's free blocks are in no pool: whatever is found here is awake.
        let mut id = pool.best_fit(request.stream, request.size)?;
        if arena.get(id).expandable {
            let mut successors = pool.fitting(request.stream, request.size).skip(1);
            if self.config.expandable_segments {
                // Best fit by what a block can grow to: its size plus the unmapped space after
                // it.
                let growable = |id: BlockId| {
                    let b = arena.get(id);
                    b.size
                        + b.next
                            .map(|n| arena.get(n))
                            .filter(|n| !n.mapped)
                            .map_or(0, |n| n.size)
                };
                for next in successors {
                    if !arena.get(id).expandable || growable(next) >= growable(id) {
                        break;
                    }
                    id = next;
                }
            } else {
                // Expandable segments were switched off: serve only from ordinary segments.
                id = successors.find(|&id| !arena.get(id).expandable)?;
            }
        }
        let block = arena.get(id);
        // PyTorch applies the oversize rules to expandable blocks too, though they always split
        // (which grows reserved memory without bound, pytorch#123548); the opt-in
        // FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT leaves them out.
        let exempt = block.expandable && self.config.opt_in.expandable_ignore_max_split;
        if !exempt && !policy::may_serve(block.size, request.size, &self.config) {
            return None;
        }
        pool.remove(id, block);
        Some(id)
    }

    /// `alloc_found_block`: hands out the block, splitting off the rest when `split`.
    #[inline(always)]
    fn alloc_found_block(
        &mut self,
        id: BlockId,
        request: &Request,
        orig_size: usize,
        split: bool,
    ) -> DevicePtr {
        let pool = request.pool;
        let (already_split, expandable, block_ptr, block_size) = {
            let b = self.arena.get(id);
            (b.is_split(), b.expandable, b.ptr, b.size)
        };
        let id = if split {
            // The allocated part is a new block at the front; the original becomes the rest.
            let front = self.piece_of(id, block_ptr, request.size);
            let front_id = self.insert_before(id, front);
            let rest = self.arena.get_mut(id);
            rest.ptr += request.size as u64;
            rest.size -= request.size;
            let rest_size = rest.size;
            self.pools.get_mut(request.owner, pool).insert(id, rest);
            if !expandable {
                if already_split {
                    // An inactive split block shrinks by the allocated size.
                    self.ledger
                        .stats
                        .inactive_split_bytes
                        .decrease(pool, request.size as u64);
                } else {
                    // A new inactive split block: the rest of a previously whole segment.
                    self.ledger
                        .stats
                        .inactive_split_bytes
                        .increase(pool, rest_size as u64);
                    self.ledger.stats.inactive_split.increase(pool, 1);
                }
            }
            self.ledger.stats.num_splits += 1;
            logging::block_split(block_ptr, request.size, rest_size);
            front_id
        } else {
            if already_split && !expandable {
                // An inactive split block becomes active.
                self.ledger
                    .stats
                    .inactive_split_bytes
                    .decrease(pool, block_size as u64);
                self.ledger.stats.inactive_split.decrease(pool, 1);
            }
            id
        };

        let ptr = self.hand_out(id, orig_size);
        let size = self.arena.get(id).size;
        logging::block_allocated(ptr, size, request.stream);
        ptr
    }

    /// Marks a block allocated to the program, with its statistics and trace entry.
    #[inline(always)]
    fn hand_out(&mut self, id: BlockId, requested_size: usize) -> DevicePtr {
        let block = self.arena.get_mut(id);
        block.allocated = true;
        block.requested_size = requested_size;
        block.stack_id = self.ledger.history.current_stack();
        let (ptr, size, pool, stream, owner) =
            (block.ptr, block.size, block.pool, block.stream, block.owner);
        self.allocated.insert(ptr, id);
        let stats = &mut self.ledger.stats;
        stats.allocation.increase(pool, 1);
        stats.allocated_bytes.increase(pool, size as u64);
        stats.active.increase(pool, 1);
        stats.active_bytes.increase(pool, size as u64);
        stats.requested_bytes.increase(pool, requested_size as u64);
        if policy::is_oversize(size, &self.config) {
            stats.oversize_allocations.increase(1);
        }
        let pools = &self.pools;
        self.ledger
            .history
            .record_in_pool(TraceAction::Alloc, ptr, requested_size, stream, || {
                pools.id_of(owner)
            });
        ptr
    }

    /// `alloc_block`: a new segment (or newly mapped pages) for the request. `Ok(None)` when the
    /// device is out of memory or the memory fraction forbids it; `Err` on other device failures.
    fn alloc_block(
        &mut self,
        request: &Request,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.ledger.stats.num_alloc_retries += 1;
        }
        let size = request.alloc_size;
        if self.admit(size, Announce::Yes)?.is_err() {
            return Ok(None);
        }
        if self.has_own_allocator(request.owner) {
            return Ok(self.alloc_segment_from_pool_allocator(request));
        }
        if self.config.expandable_segments {
            return self.try_allocate_expandable_block(request);
        }
        let (ptr, memory) = if self.source.sleepable {
            match VmmSegment::obtain(&mut self.device, size, &mut self.source.leftovers)? {
                Some(segment) => (segment.base(), Memory::Vmm(segment)),
                None => return Ok(None),
            }
        } else {
            match plain::obtain(&mut self.device, size, request.stream)? {
                Some(ptr) => (ptr, Memory::Plain),
                None => return Ok(None),
            }
        };
        let segment = Segment {
            owner: request.owner,
            kind: request.pool,
            memory,
            asleep: false,
        };
        Ok(Some(self.adopt_segment(ptr, size, request.stream, segment)))
    }

    /// The guard in front of every device allocation ([`guard`]): whether `size` more bytes
    /// may be taken from the device now.
    pub(super) fn admit(
        &mut self,
        size: usize,
        announce: Announce,
    ) -> Result<Result<(), Refusal>, DeviceError> {
        let reserved = self.ledger.reserved;
        self.source.guard.admit(
            &mut self.device,
            &self.config,
            &mut self.ledger.stats,
            reserved,
            size,
            announce,
        )
    }

    /// The device's total memory, asked of the device once.
    fn device_total(&mut self) -> Result<usize, DeviceError> {
        self.source.guard.device_total(&mut self.device)
    }

    /// Records a fresh segment of `size` bytes at `ptr` (its memory obtained) as one
    /// free-to-carve block (not yet in the pool).
    pub(super) fn adopt_segment(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        segment: Segment,
    ) -> BlockId {
        let (owner, kind) = (segment.owner, segment.kind);
        let mut block = Block::new(ptr, size, stream, kind);
        block.owner = owner;
        block.expandable = segment.memory.is_expandable();
        block.segment_order = self.order_of_new_segment();
        let id = self.arena.insert(block);
        self.arena.get_mut(id).segment = self.segments.insert(segment, id);
        self.count_segment_taken(owner);
        if !self.arena.get(id).expandable {
            let pool = (kind, self.pools.id_of(owner));
            self.ledger
                .segment_allocated(ptr, size, stream, pool, &self.config);
        }
        id
    }

    /// The [`Block::segment_order`] of a segment made now: PyTorch's allocation-order counter,
    /// taken when backing memory is obtained (0 for everything under the address rule).
    fn order_of_new_segment(&mut self) -> u64 {
        match self.config.modelled.tie_rule {
            TieRule::Address => 0,
            TieRule::BlockOrder | TieRule::SegmentOrder => self.segments.next_order(),
        }
    }

    /// Adds `block` to its segment's chain just below `at`, keeping the segment's first block
    /// current.
    #[inline(always)]
    pub(super) fn insert_before(&mut self, at: BlockId, block: Block) -> BlockId {
        let segment = block.segment;
        let id = self.arena.insert_before(at, block);
        if self.arena.get(id).prev.is_none() {
            self.segments.set_head(segment, id);
        }
        id
    }

    /// A new free piece of the segment of block `of`, at `ptr` (a front split off for a
    /// request, or what mapping or unmapping pages leaves), with the order PyTorch gives its
    /// new `Block` there: the segment's under the segment rule, a fresh one under the block
    /// rule (see [`TieRule`]).
    pub(super) fn piece_of(&mut self, of: BlockId, ptr: DevicePtr, size: usize) -> Block {
        let mut piece = self.arena.get(of).sibling(ptr, size);
        if self.config.modelled.tie_rule == TieRule::BlockOrder {
            piece.segment_order = self.segments.next_order();
        }
        piece
    }

    // ----------------------------------------------------------------------------------------
    // inspection
    // ----------------------------------------------------------------------------------------

    /// `getBaseAllocation`: the start and size of the segment holding the allocation at `ptr`.
    pub fn base_allocation(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize), PointerError> {
        let mut id = *self.allocated.get(&ptr).ok_or(PointerError::Unknown(ptr))?;
        while let Some(prev) = self.arena.get(id).prev {
            id = prev;
        }
        let base = self.arena.get(id).ptr;
        let mut size = 0;
        let mut cursor = Some(id);
        while let Some(c) = cursor {
            size += self.arena.get(c).size;
            cursor = self.arena.get(c).next;
        }
        Ok((base, size))
    }

    /// Each live expandable segment's reserved range and page size: (base, size, page size).
    pub fn expandable_segment_ranges(&self) -> Vec<(DevicePtr, usize, usize)> {
        self.segments
            .expandable_segments()
            .map(|s| (s.base(), s.size(), s.page_size()))
            .collect()
    }

    /// The largest cached block, private pools included (PyTorch's `cacheInfo`).
    pub fn largest_cached_block(&self) -> usize {
        self.pools
            .all()
            .flat_map(|p| p.cached())
            .map(|id| self.arena.get(id).size)
            .max()
            .unwrap_or(0)
    }

    /// `_record_memory_history`: starts (or stops and clears) recording trace entries.
    pub fn record_history(&mut self, enabled: bool, max_entries: usize) {
        self.ledger.history.set_recording(enabled, max_entries);
    }

    pub fn is_recording_history(&self) -> bool {
        self.ledger.history.is_recording()
    }
}
