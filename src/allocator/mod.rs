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

pub mod block;
mod check;
mod checkpoint;
pub mod cross_stream;
pub mod expandable;
pub mod history;
mod import;
mod live;
pub mod pool;
pub mod private_pool;
pub mod sleep;
pub mod stats;
pub(crate) mod uncached;

use crate::config::Config;
use crate::device::{Device, DeviceError, DevicePtr, EventHandle, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind, TieRule};
use block::{Backing, Block, BlockArena, BlockId, ExpandableId};
use cross_stream::CrossStreamCounts;
use expandable::{ExpandableSegment, LeftoverPage, PageRange};
use history::{History, StackId, TraceAction};
use private_pool::{BlockPools, Capture, MempoolId, Owner};
use rustc_hash::FxHashMap;
use stats::DeviceStats;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

/// PyTorch's out-of-memory error, with the figures its message quotes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemoryError {
    pub device: i32,
    /// What the program asked for.
    pub requested: usize,
    /// The segment size that could not be obtained (what PyTorch's message names).
    pub allocation_size: usize,
    pub device_free: usize,
    pub device_total: usize,
    /// The memory-fraction limit, when one is set.
    pub allowed: Option<usize>,
    pub allocated: usize,
    pub reserved: usize,
    /// The full message, starting `CUDA out of memory.`.
    pub message: String,
    /// `throw_on_cudamalloc_oom` refused the allocation before the device was asked. PyTorch
    /// then calls no out-of-memory observer (it has rejection observers instead, which no
    /// Python API reaches).
    pub preemptively_rejected: bool,
}

/// Why `malloc` failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// The device is out of memory even after releasing everything cached.
    OutOfMemory(Box<OutOfMemoryError>),
    /// The driver failed for another reason (PyTorch raises at once in that case too).
    Device(DeviceError),
    /// The caller asked for something impossible (a fraction outside [0, 1], ...).
    InvalidArgument(String),
    /// The stream filter of a capture failed, so it is unknown whether the allocation belongs
    /// to the capture's private pool; it is refused rather than risk handing a graph's memory
    /// to someone else.
    StreamFilter { pool: MempoolId, message: String },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(oom) => f.write_str(&oom.message),
            AllocError::Device(DeviceError::Unavailable(why) | DeviceError::Unusable(why)) => {
                f.write_str(why)
            }
            AllocError::Device(err) => write!(f, "CUDA error: {err}"),
            AllocError::InvalidArgument(why) => f.write_str(why),
            AllocError::StreamFilter { pool, message } => write!(
                f,
                "the stream filter of the CUDA graph capture into pool {} failed ({message}); \
                 the allocation is refused",
                private_pool::PoolName(*pool)
            ),
        }
    }
}

impl std::error::Error for AllocError {}

impl From<DeviceError> for AllocError {
    fn from(err: DeviceError) -> Self {
        AllocError::Device(err)
    }
}

/// Why an operation on a pointer was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PointerError {
    /// Not a pointer this allocator handed out, or one already freed.
    Unknown(DevicePtr),
}

impl fmt::Display for PointerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointerError::Unknown(ptr) => write!(
                f,
                "invalid device pointer: {ptr:#x} (never allocated by ferrocache, or already freed)"
            ),
        }
    }
}

impl std::error::Error for PointerError {}

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

/// The caching allocator of one device.
pub struct DeviceAllocator<D: Device> {
    device: D,
    device_index: i32,
    config: Config,
    arena: BlockArena,
    /// The cached free blocks: the ordinary small and large pools and those of private pools.
    pools: BlockPools,
    /// Captures under way, each with its pool and stream filter.
    captures: Vec<Capture>,
    /// Freed blocks whose events are still to be recorded, by the next `process_events` or
    /// `synchronize_and_free_events`: blocks freed during a capture with uses on other streams
    /// (event calls are illegal during a capture), and blocks for whose streams the device would
    /// neither record an event nor synchronize.
    events_to_record: Vec<BlockId>,
    /// Streams a block was used on (`record_stream`) while a capture was under way.
    capture_stream_uses: FxHashMap<BlockId, Vec<StreamId>>,
    /// Blocks handed out to the program, by address.
    allocated: live::LiveTable,
    /// Per stream, events recorded when a block used on it was freed, oldest first.
    pending_events: BTreeMap<StreamId, VecDeque<(EventHandle, BlockId)>>,
    pending_event_count: usize,
    stats: DeviceStats,
    /// Bytes held from the device (PyTorch's `total_allocated_memory`).
    total_allocated_memory: usize,
    /// The memory-fraction limit, once `set_memory_fraction` was called.
    allowed_memory_maximum: Option<usize>,
    /// Live expandable segments; `None` marks a released slot.
    expandable_segments: Vec<Option<ExpandableSegment>>,
    /// Pages whose unmap or release the device refused; retried by `release_cached_blocks`.
    leftover_pages: Vec<LeftoverPage>,
    /// Address ranges of released expandable segments whose free the device refused; retried
    /// by `release_cached_blocks`, after the leftover pages.
    leftover_ranges: Vec<PageRange>,
    history: History,
    /// What cross-stream reuse (opt-in) did.
    cross_stream: CrossStreamCounts,
    /// Set while the cache is emptied, after the streams were synchronized: free neighbours of
    /// different streams may merge.
    merging_across_streams: bool,
    /// PyTorch's allocation-order counter: segments made so far (and, under the block rule,
    /// blocks); the next one's [`Block::segment_order`] is this plus one.
    blocks_made: u64,
    /// The device's total memory, asked once (the preemptive-rejection limit).
    device_total: Option<usize>,
    /// Set when `throw_on_cudamalloc_oom` refused a device allocation during the current
    /// `malloc` (PyTorch's `AllocParams` flag): the malloc then fails with the rejection.
    preemptively_rejected: bool,
    /// Where the reserve class of a stream comes from (PyTorch's C++ API, through the C ABI);
    /// `None`: every stream is untagged.
    reserve_classes: Option<ReserveClassLookup>,
    /// The reserve classes warned of as having no entry in
    /// `expandable_segments_reserve_by_class` (PyTorch warns once per class).
    warned_reserve_classes: HashSet<String>,
    /// New ordinary segments are VMM-backed, so that they can sleep (see [`sleep`]).
    sleepable: bool,
    /// VMM-backed segments; `None` marks a released slot.
    vmm_segments: Vec<Option<sleep::VmmSegment>>,
    /// Segments asleep now (VMM-backed, or expandable with a page asleep).
    sleeping_segments: usize,
    /// Whether [`replace_config`](Self::replace_config) was called: the oversize counters then
    /// count by the `max_split_size` of each moment, as PyTorch's do, and no longer match the
    /// blocks by today's.
    settings_replaced: bool,
}

/// Answers the reserve class PyTorch's C++ API gave a stream (empty: none).
pub type ReserveClassLookup = Box<dyn Fn(StreamId) -> String + Send>;

impl<D: Device> DeviceAllocator<D> {
    /// An allocator for device number `device_index`, with nothing reserved yet.
    pub fn new(device: D, device_index: i32, config: Config) -> DeviceAllocator<D> {
        let mut allocator = DeviceAllocator {
            device,
            device_index,
            stats: DeviceStats::new(config.max_split_size),
            arena: BlockArena::default(),
            pools: BlockPools::default(),
            captures: Vec::new(),
            events_to_record: Vec::new(),
            capture_stream_uses: FxHashMap::default(),
            allocated: live::LiveTable::default(),
            pending_events: BTreeMap::new(),
            pending_event_count: 0,
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            expandable_segments: Vec::new(),
            leftover_pages: Vec::new(),
            leftover_ranges: Vec::new(),
            history: History::default(),
            cross_stream: CrossStreamCounts::default(),
            merging_across_streams: false,
            blocks_made: 0,
            device_total: None,
            preemptively_rejected: false,
            reserve_classes: None,
            warned_reserve_classes: HashSet::new(),
            sleepable: false,
            vmm_segments: Vec::new(),
            sleeping_segments: 0,
            settings_replaced: false,
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
        self.settings_replaced = true;
    }

    /// Tells the allocator where to ask for the reserve class of a stream
    /// (`expandable_segments_reserve_by_class`); without it every stream is untagged.
    pub fn set_reserve_class_lookup(&mut self, lookup: ReserveClassLookup) {
        self.reserve_classes = Some(lookup);
    }

    /// The reserve class of `stream`; empty when it has none.
    pub(crate) fn reserve_class_of(&self, stream: StreamId) -> String {
        self.reserve_classes
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
        &self.stats
    }

    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Bytes held from the device.
    pub fn reserved_bytes(&self) -> usize {
        self.total_allocated_memory
    }

    /// The memory-fraction limit in bytes, when set.
    pub fn allowed_memory_maximum(&self) -> Option<usize> {
        self.allowed_memory_maximum
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
        let owner = if self.captures.is_empty() {
            // Event queries are illegal during a capture, so completed frees wait until after.
            if self.pending_event_count > 0 || !self.events_to_record.is_empty() {
                self.process_events()?;
            }
            match tag {
                None => Owner::Ordinary,
                Some(tag) => self.tagged_owner(tag),
            }
        } else {
            self.private_pool_for(stream)?
        };
        let rounded = policy::round_size(size, &self.config);
        let pool = policy::pool_for(rounded);
        let request = Request {
            size: rounded,
            stream,
            pool,
            owner,
            alloc_size: policy::allocation_size(rounded, &self.config),
        };
        let mut request = request;
        let id = match self.get_free_block(&request) {
            Some(id) => id,
            None => match self.take_from_other_stream(&request)? {
                Some(id) => id,
                None => self.allocate_new_block(&mut request, size)?,
            },
        };
        let split = !self.never_splits(request.owner)
            && policy::should_split(self.arena.get(id).size, rounded, pool, &self.config);
        Ok(self.alloc_found_block(id, &request, size, split))
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
        let previous = self.history.set_current_stack(stack);
        let result = self.malloc(size, stream);
        self.history.set_current_stack(previous);
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
        let previous = self.history.set_current_stack(stack);
        let result = self.malloc_tagged(size, stream, tag);
        self.history.set_current_stack(previous);
        result
    }

    /// Sets the metadata (`torch.cuda.memory._set_memory_metadata`) that the trace entries
    /// recorded from now on carry; returns the previous one, to put back after the call.
    #[inline(always)]
    pub fn set_user_metadata(&mut self, metadata: Option<Arc<str>>) -> Option<Arc<str>> {
        self.history.set_current_metadata(metadata)
    }

    /// [`free_returning_info`](Self::free_returning_info) on behalf of the caller's stack
    /// `stack`: the `free_requested` and `free_completed` entries it records carry it.
    #[inline(always)]
    pub fn free_with_stack(
        &mut self,
        ptr: DevicePtr,
        stack: StackId,
    ) -> Result<AllocationInfo, PointerError> {
        let previous = self.history.set_current_stack(stack);
        let result = self.free_returning_info(ptr);
        self.history.set_current_stack(previous);
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
        self.preemptively_rejected = false;
        if self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0 {
            self.garbage_collect_cached_blocks()?;
        }
        if let Some(id) = self.alloc_block(request, false)? {
            return Ok(id);
        }
        if self.preemptively_rejected {
            return Err(self.preemptive_rejection(request, orig_size));
        }
        logging::alloc_retry(request.alloc_size, "releasing oversize cached blocks");
        if self.release_available_cached_blocks(request)?
            && let Some(id) = self.alloc_block(request, false)?
        {
            return Ok(id);
        }
        // Releasing everything synchronizes, which a capture forbids.
        if self.captures.is_empty() {
            logging::alloc_retry(request.alloc_size, "releasing all cached blocks");
            self.release_cached_blocks()?;
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
        if self.preemptively_rejected {
            return Err(self.preemptive_rejection(request, orig_size));
        }
        Err(self.out_of_memory(request, orig_size))
    }

    /// `get_free_block`: the best-fitting cached block of the request's stream, if one may serve.
    #[inline(always)]
    fn get_free_block(&mut self, request: &Request) -> Option<BlockId> {
        let pool = self.pools.get_mut(request.owner, request.pool);
        if self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0 {
            pool.get_free_blocks_call_count += 1;
        }
        let arena = &self.arena;
        let mut id = pool.best_fit(request.stream, request.size)?;
        if arena.get(id).asleep {
            // A sleeping segment's free blocks wait for its wake: the next fit serves.
            id = pool
                .fitting(request.stream, request.size)
                .find(|&id| !arena.get(id).asleep)?;
        }
        if arena.get(id).backing.is_expandable() {
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
                    if !arena.get(id).backing.is_expandable()
                        || arena.get(next).asleep
                        || growable(next) >= growable(id)
                    {
                        break;
                    }
                    id = next;
                }
            } else {
                // Expandable segments were switched off: serve only from ordinary segments.
                id = successors.find(|&id| {
                    let b = arena.get(id);
                    !b.backing.is_expandable() && !b.asleep
                })?;
            }
        }
        let block = arena.get(id);
        // PyTorch applies the oversize rules to expandable blocks too, though they always split
        // (which grows reserved memory without bound, pytorch#123548); the opt-in
        // FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT leaves them out.
        let exempt = block.backing.is_expandable() && self.config.expandable_ignore_max_split;
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
            (b.is_split(), b.backing.is_expandable(), b.ptr, b.size)
        };
        let id = if split {
            // The allocated part is a new block at the front; the original becomes the rest.
            let front = self.piece_of(id, block_ptr, request.size);
            let front_id = self.arena.insert_before(id, front);
            let rest = self.arena.get_mut(id);
            rest.ptr += request.size as u64;
            rest.size -= request.size;
            let rest_size = rest.size;
            self.pools.get_mut(request.owner, pool).insert(id, rest);
            if !expandable {
                if already_split {
                    // An inactive split block shrinks by the allocated size.
                    self.stats
                        .inactive_split_bytes
                        .decrease(pool, request.size as u64);
                } else {
                    // A new inactive split block: the rest of a previously whole segment.
                    self.stats
                        .inactive_split_bytes
                        .increase(pool, rest_size as u64);
                    self.stats.inactive_split.increase(pool, 1);
                }
            }
            self.stats.num_splits += 1;
            logging::block_split(block_ptr, request.size, rest_size);
            front_id
        } else {
            if already_split && !expandable {
                // An inactive split block becomes active.
                self.stats
                    .inactive_split_bytes
                    .decrease(pool, block_size as u64);
                self.stats.inactive_split.decrease(pool, 1);
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
        block.stack_id = self.history.current_stack();
        let (ptr, size, pool, stream) = (block.ptr, block.size, block.pool, block.stream);
        self.allocated.insert(ptr, id);
        let stats = &mut self.stats;
        stats.allocation.increase(pool, 1);
        stats.allocated_bytes.increase(pool, size as u64);
        stats.active.increase(pool, 1);
        stats.active_bytes.increase(pool, size as u64);
        stats.requested_bytes.increase(pool, requested_size as u64);
        if policy::is_oversize(size, &self.config) {
            stats.oversize_allocations.increase(1);
        }
        self.history
            .record(TraceAction::Alloc, ptr, requested_size, stream);
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
            self.stats.num_alloc_retries += 1;
        }
        let size = request.alloc_size;
        if self.memory_fraction_refuses(size).is_some() {
            return Ok(None);
        }
        if self.config.throw_on_cudamalloc_oom && self.rejects_preemptively(size)? {
            return Ok(None);
        }
        if self.config.expandable_segments {
            return self.try_allocate_expandable_block(request);
        }
        let (ptr, backing) = if self.sleepable {
            match self.new_vmm_segment(size)? {
                Some(made) => made,
                None => return Ok(None),
            }
        } else {
            match self.device.malloc(size, request.stream) {
                Ok(ptr) => (ptr, Backing::Plain),
                Err(DeviceError::OutOfMemory) => return Ok(None),
                Err(err) => return Err(err.into()),
            }
        };
        let id = self.adopt_segment(ptr, size, request.stream, request.pool);
        let block = self.arena.get_mut(id);
        block.owner = request.owner;
        block.backing = backing;
        self.count_segment_taken(request.owner);
        Ok(Some(id))
    }

    /// PyTorch's memory fraction (`alloc_block`: `set_fraction && total_allocated_memory + size >
    /// allowed_memory_maximum`): whether reserving `size` more bytes from the device would take
    /// the memory held past the limit of `set_per_process_memory_fraction`: that limit if so.
    pub(super) fn memory_fraction_refuses(&self, size: usize) -> Option<usize> {
        self.allowed_memory_maximum
            .filter(|&allowed| self.total_allocated_memory + size > allowed)
    }

    /// `throw_on_cudamalloc_oom`: whether a device allocation of `size` would take the memory
    /// held past the limit of [`policy::preemptive_rejection_limit`]; if so it is counted
    /// (`num_oom_rejections`), logged with PyTorch's warning and remembered for `malloc`.
    fn rejects_preemptively(&mut self, size: usize) -> Result<bool, AllocError> {
        let device_total = self.device_total()?;
        let Some(limit) = policy::preemptive_rejection_limit(&self.config, device_total) else {
            return Ok(false);
        };
        if self.total_allocated_memory + size <= limit {
            return Ok(false);
        }
        self.stats.num_oom_rejections += 1;
        self.preemptively_rejected = true;
        logging::warning(&policy::preemptive_rejection_warning(
            size,
            self.total_allocated_memory,
            limit,
            self.config.per_process_memory_fraction.unwrap_or(1.0),
            device_total,
        ));
        Ok(true)
    }

    /// The device's total memory, asked of the device once.
    fn device_total(&mut self) -> Result<usize, DeviceError> {
        if let Some(total) = self.device_total {
            return Ok(total);
        }
        let total = self.device.mem_get_info()?.total;
        self.device_total = Some(total);
        Ok(total)
    }

    /// Records a fresh device allocation as one free-to-carve block (not yet in the pool).
    fn adopt_segment(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        pool: PoolKind,
    ) -> BlockId {
        self.total_allocated_memory += size;
        let mut block = Block::new(ptr, size, stream, pool);
        block.segment_order = self.order_of_new_segment();
        let id = self.arena.insert(block);
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, size as u64);
        if policy::is_oversize(size, &self.config) {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.history
            .record(TraceAction::SegmentAlloc, ptr, size, stream);
        logging::segment_allocated(ptr, size, stream);
        id
    }

    /// The [`Block::segment_order`] of a segment made now: PyTorch's allocation-order counter,
    /// taken when backing memory is obtained (0 for everything under the address rule).
    fn order_of_new_segment(&mut self) -> u64 {
        match self.config.tie_rule {
            TieRule::Address => 0,
            TieRule::BlockOrder | TieRule::SegmentOrder => {
                self.blocks_made += 1;
                self.blocks_made
            }
        }
    }

    /// A new free piece of the segment of block `of`, at `ptr` (a front split off for a
    /// request, or what mapping or unmapping pages leaves), with the order PyTorch gives its
    /// new `Block` there: the segment's under the segment rule, a fresh one under the block
    /// rule (see [`TieRule`]).
    pub(super) fn piece_of(&mut self, of: BlockId, ptr: DevicePtr, size: usize) -> Block {
        let mut piece = self.arena.get(of).sibling(ptr, size);
        if self.config.tie_rule == TieRule::BlockOrder {
            self.blocks_made += 1;
            piece.segment_order = self.blocks_made;
        }
        piece
    }

    /// The error of an allocation that `throw_on_cudamalloc_oom` refused, with PyTorch's
    /// message (which names what the program asked for). PyTorch counts it in
    /// `num_oom_rejections`, not `num_ooms`, and records no `oom` trace entry.
    fn preemptive_rejection(&mut self, request: &Request, orig_size: usize) -> AllocError {
        let info = self
            .device
            .mem_get_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: 0 });
        let message = policy::preemptive_rejection_message(orig_size);
        self.out_of_memory_error(request, orig_size, info, message)
    }

    /// The out-of-memory error, in PyTorch's words and figures.
    fn out_of_memory(&mut self, request: &Request, orig_size: usize) -> AllocError {
        let info = self
            .device
            .mem_get_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: 0 });
        self.stats.num_ooms += 1;
        self.history.record(
            TraceAction::Oom,
            info.free as u64,
            request.size,
            request.stream,
        );
        let allocated = self.stats.allocated_bytes.all.current as usize;
        let reserved = self.stats.reserved_bytes.all.current as usize;
        // PyTorch counts the free blocks cached in private pools as allocated: they are the
        // graphs' memory, which no other allocation can use.
        let in_private_pools = self.private_pool_cached_bytes();
        let reserve_class = self.reserve_class_of(request.stream);
        let reserve = policy::expandable_segment_reserve(&self.config, info.total, &reserve_class);
        // Asked of NVML under the lock, as PyTorch does; only its first call in the process
        // (loading and starting NVML) takes long.
        let processes = self.device.compute_processes();
        let message = policy::out_of_memory_message(
            &policy::OomFigures {
                alloc_size: request.alloc_size,
                device: self.device_index,
                device_total: info.total,
                device_free: info.free,
                allowed: self.allowed_memory_maximum,
                allocated: allocated + in_private_pools,
                in_private_pools,
                reserved,
                expandable_segments: self.config.expandable_segments,
                configured_reserve: reserve.configured.then_some(reserve.bytes),
                reserve_class,
                processes,
                own_pid: std::process::id(),
            },
            self.config.oom_wording,
        );
        self.out_of_memory_error(request, orig_size, info, message)
    }

    /// An out-of-memory error with `message`, logged, and the figures it is about.
    fn out_of_memory_error(
        &self,
        request: &Request,
        orig_size: usize,
        info: crate::device::MemInfo,
        message: String,
    ) -> AllocError {
        logging::out_of_memory(&message);
        AllocError::OutOfMemory(Box::new(OutOfMemoryError {
            device: self.device_index,
            requested: orig_size,
            allocation_size: request.alloc_size,
            device_free: info.free,
            device_total: info.total,
            allowed: self.allowed_memory_maximum,
            allocated: self.stats.allocated_bytes.all.current as usize,
            reserved: self.stats.reserved_bytes.all.current as usize,
            message,
            preemptively_rejected: self.preemptively_rejected,
        }))
    }

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
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size as u64);
        if policy::is_oversize(size, &self.config) {
            self.stats.oversize_allocations.decrease_may_go_negative(1);
        }
        self.history.record(
            TraceAction::FreeRequested,
            ptr,
            info.requested_size,
            info.stream,
        );
        if !waits_for_streams {
            logging::block_freed(ptr);
            self.free_block(id);
        } else if !self.captures.is_empty() {
            // Recording and querying events is illegal during a capture: wait until it ends.
            self.events_to_record.push(id);
        } else {
            // Freed outside a capture, the block waits for every stream it was used on, as in
            // PyTorch, those of a capture included.
            if !self.capture_stream_uses.is_empty() {
                self.capture_stream_uses.remove(&id);
            }
            self.insert_events(id);
        }
        Ok(info)
    }

    /// `free_block`: returns an available block to its pool, merged with free neighbours.
    #[inline(always)]
    fn free_block(&mut self, id: BlockId) {
        let b = self.arena.get(id);
        debug_assert!(b.is_available());
        let (ptr, original_size, requested, stream, pool, expandable) = (
            b.ptr,
            b.size,
            b.requested_size,
            b.stream,
            b.pool,
            b.backing.is_expandable(),
        );
        let (prev, next) = (b.prev, b.next);
        self.history
            .record(TraceAction::FreeCompleted, ptr, requested, stream);
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
        let owner = block.owner;
        self.pools.get_mut(owner, pool).insert(id, block);
        if merged_size != original_size {
            logging::new_free_block(merged_size);
        }
        let stats = &mut self.stats;
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
    fn try_merge_blocks(&mut self, dst: BlockId, candidate: Option<BlockId>) -> usize {
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
            cross_stream::may_merge(s, d) || (self.merging_across_streams && s.mapped == d.mapped);
        if !allowed {
            return 0;
        }
        let (src_ptr, src_size, src_prev, src_next, src_mapped) =
            (s.ptr, s.size, s.prev, s.next, s.mapped);
        let pool = self.pools.of_block_mut(s);
        let removed = if src_mapped {
            pool.remove(src, s)
        } else {
            pool.remove_unmapped(s)
        };
        debug_assert!(removed, "an available block is in its pool");
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
            if let Some(p) = src_prev {
                self.arena.get_mut(p).next = Some(dst);
            }
        } else {
            // [dst src]
            dst_block.next = src_next;
            if let Some(n) = src_next {
                self.arena.get_mut(n).prev = Some(dst);
            }
        }
        self.stats.num_merges += 1;
        if src_mapped {
            logging::block_merged(merged_ptr);
        }
        src_size
    }

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
        if !self.captures.is_empty() {
            // Only a use that a capture alone made is dropped when the capture's deferred free
            // is processed: one made outside it too still needs its event.
            if !used_before {
                self.note_capture_stream_use(id, stream);
            }
        } else if let Some(during_capture) = self.capture_stream_uses.get_mut(&id) {
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
                    self.pending_events
                        .entry(stream)
                        .or_default()
                        .push_back((event, id));
                    self.pending_event_count += 1;
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
            self.events_to_record.push(id);
        } else if block.event_count == 0 {
            self.free_block(id);
        }
    }

    /// `process_events`: caches the freed blocks whose streams have all finished with them.
    fn process_events(&mut self) -> Result<(), DeviceError> {
        self.insert_events_deferred_until_no_capture();
        let mut completed = Vec::new();
        let mut outcome = Ok(());
        'streams: for queue in self.pending_events.values_mut() {
            while let Some(&(event, id)) = queue.front() {
                match self.device.query_event(event) {
                    Ok(true) => {
                        queue.pop_front();
                        self.device.release_event(event);
                        self.pending_event_count -= 1;
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
        self.pending_events.retain(|_, q| !q.is_empty());
        for id in completed {
            self.event_completed(id);
        }
        outcome
    }

    /// One of the block's events completed: the block is cached once none is left, unless
    /// events of other streams are still to be recorded.
    fn event_completed(&mut self, id: BlockId) {
        let block = self.arena.get_mut(id);
        block.event_count -= 1;
        if block.is_available() {
            self.free_block(id);
        }
    }

    /// `synchronize_and_free_events`: waits for every pending event and caches its block.
    fn synchronize_and_free_events(&mut self) -> Result<(), DeviceError> {
        self.stats.num_sync_all_streams += 1;
        self.insert_events_deferred_until_no_capture();
        let streams: Vec<StreamId> = self.pending_events.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, id)) =
                self.pending_events.get(&stream).and_then(VecDeque::front)
            {
                self.device.synchronize_event(event)?;
                if let Some(queue) = self.pending_events.get_mut(&stream) {
                    queue.pop_front();
                }
                self.device.release_event(event);
                self.pending_event_count -= 1;
                self.event_completed(id);
            }
            self.pending_events.remove(&stream);
        }
        Ok(())
    }

    // ----------------------------------------------------------------------------------------
    // giving memory back
    // ----------------------------------------------------------------------------------------

    /// `emptyCache`: waits for pending frees, then gives every wholly free segment (and every
    /// free page of expandable segments) back to the device, and the device's pooled events
    /// (PyTorch keeps its event pool; an emptied cache here holds nothing of the driver's).
    /// Private pools that a graph still holds keep all their memory.
    pub fn empty_cache(&mut self) -> Result<(), DeviceError> {
        self.release_cached_blocks()?;
        self.device.destroy_idle_events()
    }

    /// `release_cached_blocks`. During a capture only unreferenced private pools are released:
    /// the ordinary pools would need a synchronization, which a capture forbids.
    fn release_cached_blocks(&mut self) -> Result<(), DeviceError> {
        if self.captures.is_empty() {
            self.synchronize_and_free_events()?;
            self.release_leftovers()?;
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
    fn release_blocks(&mut self, owner: Owner, pool: PoolKind) -> Result<(), DeviceError> {
        let mut whole = Vec::new();
        let mut to_unmap = Vec::new();
        for id in self.pools.get(owner, pool).cached() {
            let b = self.arena.get(id);
            if b.asleep {
                // Sleeping memory keeps its addresses until it wakes.
                continue;
            }
            if b.backing.is_expandable() {
                to_unmap.push(id);
            } else if !b.is_split() {
                whole.push(id);
            }
        }
        for id in whole {
            self.release_block(id)?;
        }
        for id in to_unmap {
            let segment_id = self.arena.get(id).backing.expandable();
            self.unmap_block(id)?;
            // As in PyTorch, a segment left with nothing mapped gives its address range back
            // at once, before the next block is unmapped.
            if let Some(empty) = segment_id.and_then(|s| self.wholly_unmapped_block(owner, pool, s))
            {
                self.release_expandable_segment(empty)?;
            }
        }
        // A segment that had nothing mapped before this call (its first growth failed) keeps
        // its address range, as in PyTorch, and serves the next request of its stream.
        Ok(())
    }

    /// The one block of expandable segment `segment` (of block pool `owner`/`pool`) when nothing
    /// of it is mapped.
    fn wholly_unmapped_block(
        &self,
        owner: Owner,
        pool: PoolKind,
        segment: ExpandableId,
    ) -> Option<BlockId> {
        let live = self.expandable_segments.get(segment as usize)?.as_ref()?;
        if live.mapped_bytes() != 0 {
            return None;
        }
        self.pools.get(owner, pool).unmapped_blocks().find(|&id| {
            let b = self.arena.get(id);
            b.backing == Backing::Expandable(segment) && !b.is_split()
        })
    }

    /// `release_block`: gives a whole cached segment back to the device.
    fn release_block(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let (ptr, size, stream, pool) = {
            let b = self.arena.get(id);
            debug_assert!(!b.backing.is_expandable() && !b.is_split() && b.is_available());
            debug_assert!(!b.asleep);
            (b.ptr, b.size, b.stream, b.pool)
        };
        // The device first: if it refuses, the segment stays cached and nothing changes.
        match self.arena.get(id).backing {
            Backing::Vmm(vmm) => {
                // `cudaFree` waits for the device; `cuMemUnmap` does not, and work queued on
                // the block's stream may still use the memory (as for expandable pages).
                self.device.synchronize_stream(stream)?;
                self.release_vmm_segment(vmm)?
            }
            _ => self.device.free(ptr)?,
        }
        let block = self.arena.remove(id);
        self.pools.of_block_mut(&block).remove(id, &block);
        self.count_segment_returned(block.owner);
        self.total_allocated_memory -= size;
        self.stats.num_device_free += 1;
        self.stats.segment.decrease(pool, 1);
        self.stats.reserved_bytes.decrease(pool, size as u64);
        if policy::is_oversize(size, &self.config) {
            self.stats.oversize_segments.decrease_may_go_negative(1);
        }
        self.history
            .record(TraceAction::SegmentFree, ptr, size, stream);
        logging::segment_released(ptr, size);
        Ok(())
    }

    /// `release_available_cached_blocks`: after a failed device allocation, releases the
    /// smallest oversize cached block that covers the request, or else oversize blocks from the
    /// largest down until enough is released. Only when `max_split_size` is set, and never in
    /// a private pool: a request for one comes from a capture, so the pool is referenced and a
    /// graph may replay into its free blocks (PyTorch releases them; see [`private_pool`]).
    fn release_available_cached_blocks(&mut self, request: &Request) -> Result<bool, DeviceError> {
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
            !b.backing.is_expandable() && !b.is_split() && !b.asleep
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
    fn garbage_collect_cached_blocks(&mut self) -> Result<(), DeviceError> {
        let Some(allowed) = self.allowed_memory_maximum else {
            return Ok(());
        };
        let gc_threshold = (self.config.garbage_collection_threshold * allowed as f64) as usize;
        if self.total_allocated_memory <= gc_threshold {
            return Ok(());
        }
        let target = self.total_allocated_memory - gc_threshold;
        let large = self.pools.get(Owner::Ordinary, PoolKind::Large);
        let clock = large.get_free_blocks_call_count;
        let age = |b: &Block| clock - b.gc_count_base;
        let freeable = |b: &Block| !b.is_split() && !b.backing.is_expandable() && !b.asleep;
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
        self.allowed_memory_maximum = policy::memory_fraction_limit(fraction, info.total);
        Ok(())
    }

    /// `getMemoryFraction`: the limit `set_memory_fraction` set, as a share of the device's
    /// memory (1 when none was set), computed from the limit in bytes as PyTorch does.
    pub fn memory_fraction(&mut self) -> Result<f64, AllocError> {
        let Some(limit) = self.allowed_memory_maximum else {
            return Ok(1.0);
        };
        Ok(limit as f64 / self.device_total()? as f64)
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
        self.expandable_segments
            .iter()
            .flatten()
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
        self.history.set_recording(enabled, max_entries);
    }

    pub fn is_recording_history(&self) -> bool {
        self.history.is_recording()
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
