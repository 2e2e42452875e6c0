//! Private pools: the memory of CUDA graph captures (and of `ferrocache.mem_pool()`), kept apart
//! from the ordinary pools for as long as a graph may replay into it.
//!
//! A graph bakes the addresses it used during capture into its kernels, so those addresses must
//! stay the graph's until the graph is gone. PyTorch's caching allocator therefore serves the
//! allocations of a capture from a private pool (`PrivatePool`) of its own segments, and this
//! module does the same, rule for rule (`beginAllocateToPool`, `endAllocateToPool`,
//! `releasePool` and the private-pool code of `CUDACachingAllocator.cpp`):
//!
//! - between [`DeviceAllocator::begin_allocate_to_pool`] and
//!   [`DeviceAllocator::end_allocate_to_pool`], an allocation whose stream the capture's filter
//!   accepts is served from that pool's blocks and segments only (`private_pool_for`, PyTorch's
//!   `get_pool`); a block freed in a pool goes back to that pool only;
//! - pools are reference-counted: a capture into an existing pool id (a shared
//!   `torch.cuda.graph_pool_handle()`) takes another reference and reuses the blocks earlier
//!   captures freed, with the ordinary stream rule (a block serves its own stream only);
//! - [`DeviceAllocator::release_pool`] drops a reference; once none is left and no block in the
//!   pool is live, `empty_cache` (and the out-of-memory retry that releases every cached block)
//!   gives the pool's segments back to the device and forgets the pool. A pool that is still
//!   referenced, or holds a live block, never loses memory.
//!
//! Departures from PyTorch, each refused where PyTorch would assert or corrupt memory:
//! - a capture into a pool whose references have all been released takes the pool back (PyTorch
//!   asserts);
//! - `release_pool` of an unknown pool, of a pool with no references, or of the last reference
//!   while a capture still records into the pool is refused (PyTorch asserts, or lets the pool
//!   be freed under the capture);
//! - the out-of-memory path never releases oversize cached blocks of a private pool (PyTorch's
//!   `release_available_cached_blocks` would `cudaFree` them although a graph of the pool may
//!   replay into them);
//! - an unreferenced pool keeps all its segments while any of its blocks is live (an output
//!   tensor of a reset graph); PyTorch already releases its wholly free ones.
//!
//! A pool made with an allocator of its own ([`DeviceAllocator::create_pool_with_allocator`],
//! `torch.cuda.MemPool(allocator=...)`: NCCL's pool, symmetric memory's) gets its segments from
//! that allocator and gives them back to it ([`external`]), as PyTorch's `allocPrimitive` and
//! `release_block` do; the guard and the ledger treat them as any segment (the memory fraction
//! applies, they count in reserved memory and `num_device_alloc`, `segment_alloc` and
//! `segment_free` carry the pool's id). As in PyTorch's `malloc`, expandable segments are never
//! active for such a pool (its segments are whole allocations, split by the rule for ordinary
//! large blocks), nor is ferrocache's sleep-ability (its memory is not ferrocache's to unmap);
//! cross-stream reuse never applies to any private pool. The allocator goes (its release) when
//! the pool is forgotten, once its last segment went back to it, as PyTorch's `PrivatePool`
//! drops its `shared_ptr`.

use super::backing::Memory;
pub use super::backing::external::SegmentAllocator;
use super::backing::external::{self, ExternalAllocator};
use super::block::{Block, BlockId};
pub use super::owner::{Owner, PrivatePoolIndex, TagIndex};
use super::pool::BlockPool;
use super::segments::Segment;
use super::{AllocError, DeviceAllocator, Request};
use crate::config::modelled::CaptureContextRule;
use crate::device::{Device, DeviceError, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind};
use rustc_hash::FxHashMap;
use std::fmt;

pub use crate::trace::{MempoolId, ORDINARY_POOL_ID};

/// Decides whether an allocation on a stream belongs to a capture: PyTorch's
/// `std::function<bool(cudaStream_t)>`. An `Err` (the filter itself failed) refuses the
/// allocation, since guessing could put it outside the capture's pool.
pub type StreamFilter = Box<dyn Fn(StreamId) -> Result<bool, String> + Send>;

/// One private pool: PyTorch's `PrivatePool`.
#[derive(Debug)]
pub(crate) struct PrivatePool {
    pub id: MempoolId,
    /// Graphs (and `mem_pool` contexts) that hold the pool: PyTorch's `use_count`.
    pub use_count: u32,
    /// Segments (ordinary ones and expandable address ranges) the pool holds from the device.
    /// PyTorch counts device allocations (`cudaMalloc_count`); counting segments gives the same
    /// answer to the one question asked of it, whether the pool still holds any memory.
    pub segment_count: usize,
    /// `torch.cuda.MemPool(use_on_oom=True)`: an allocation outside every private pool that
    /// would run out of memory may take one of this pool's cached blocks (PyTorch's
    /// `use_on_oom_pools`).
    pub use_on_oom: bool,
    /// `torch.cuda.MemPool(no_split=True)`: the pool's blocks are handed out whole, never split
    /// (PyTorch's `no_split_pools`).
    pub no_split: bool,
    /// `torch.cuda.MemPool(allocator=...)`: where the pool's segments come from, in place of
    /// the device (PyTorch's `PrivatePool::allocator()`); `None`: the device.
    pub(crate) allocator: Option<ExternalAllocator>,
    /// The pool's free blocks, small and large.
    blocks: [BlockPool; 2],
}

/// What a test or the C ABI may read about a private pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrivatePoolInfo {
    pub id: MempoolId,
    pub use_count: u32,
    pub segment_count: usize,
    /// Whether a capture is recording into the pool now.
    pub recording: bool,
}

/// Every pool of free blocks: the ordinary small and large pools, and those of each private
/// pool.
#[derive(Debug)]
pub(crate) struct BlockPools {
    /// Indexed by [`kind_index`]: small, large.
    ordinary: [BlockPool; 2],
    /// Private pools by index; `None` marks a slot whose pool was forgotten.
    private: Vec<Option<PrivatePool>>,
    by_id: FxHashMap<MempoolId, PrivatePoolIndex>,
    /// Each tag's small and large pools, with the tag's id; never forgotten (a tag is a name
    /// the program chose, a handful per process).
    tagged: Vec<(u32, [BlockPool; 2])>,
    /// Captures under way, each with its pool and stream filter (allocations on an accepted
    /// stream go to that pool).
    pub(super) captures: Vec<Capture>,
}

/// The slot of a pool kind in a pair of block pools.
pub(super) fn kind_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

fn block_pool_pair() -> [BlockPool; 2] {
    [
        BlockPool::new(PoolKind::Small),
        BlockPool::new(PoolKind::Large),
    ]
}

impl Default for BlockPools {
    fn default() -> BlockPools {
        BlockPools {
            ordinary: block_pool_pair(),
            private: Vec::new(),
            by_id: FxHashMap::default(),
            tagged: Vec::new(),
            captures: Vec::new(),
        }
    }
}

impl BlockPools {
    /// The block pool of `kind` in the private pool `owner`, or the ordinary one for `None`.
    #[inline]
    pub(crate) fn get(&self, owner: Owner, kind: PoolKind) -> &BlockPool {
        match owner {
            Owner::Ordinary => &self.ordinary[kind_index(kind)],
            Owner::Private(index) => &self.private(index).blocks[kind_index(kind)],
            Owner::Tagged(index) => &self.tagged[index.0 as usize].1[kind_index(kind)],
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, owner: Owner, kind: PoolKind) -> &mut BlockPool {
        match owner {
            Owner::Ordinary => &mut self.ordinary[kind_index(kind)],
            Owner::Private(index) => &mut self.private_mut(index).blocks[kind_index(kind)],
            Owner::Tagged(index) => &mut self.tagged[index.0 as usize].1[kind_index(kind)],
        }
    }

    /// The block pool a block belongs to.
    #[inline]
    pub(crate) fn of_block_mut(&mut self, block: &Block) -> &mut BlockPool {
        self.get_mut(block.owner, block.pool)
    }

    pub(crate) fn private(&self, index: PrivatePoolIndex) -> &PrivatePool {
        self.private[index.0 as usize]
            .as_ref()
            .expect("a live private pool")
    }

    pub(crate) fn private_mut(&mut self, index: PrivatePoolIndex) -> &mut PrivatePool {
        self.private[index.0 as usize]
            .as_mut()
            .expect("a live private pool")
    }

    /// Whether `index` names a live private pool.
    pub(crate) fn is_live(&self, index: PrivatePoolIndex) -> bool {
        self.private
            .get(index.0 as usize)
            .is_some_and(Option::is_some)
    }

    pub(crate) fn find(&self, id: MempoolId) -> Option<PrivatePoolIndex> {
        self.by_id.get(&id).copied()
    }

    /// A new private pool with one reference, its segments from `allocator` (`None`: the
    /// device).
    fn create(&mut self, id: MempoolId, allocator: Option<ExternalAllocator>) -> PrivatePoolIndex {
        let pool = PrivatePool {
            id,
            use_count: 1,
            segment_count: 0,
            use_on_oom: false,
            no_split: false,
            allocator,
            blocks: block_pool_pair(),
        };
        let index = super::block::place_in_free_slot(&mut self.private, pool);
        let index = PrivatePoolIndex(index as u32);
        self.by_id.insert(id, index);
        index
    }

    /// Forgets a private pool that holds no memory.
    fn forget(&mut self, index: PrivatePoolIndex) {
        let pool = self.private[index.0 as usize]
            .take()
            .expect("a live private pool");
        debug_assert_eq!(pool.segment_count, 0);
        self.by_id.remove(&pool.id);
    }

    /// The live private pools.
    pub(crate) fn private_pools(&self) -> impl Iterator<Item = (PrivatePoolIndex, &PrivatePool)> {
        self.private
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (PrivatePoolIndex(i as u32), p)))
    }

    /// The pools of tag `tag`, made on first use.
    pub(crate) fn tag_index(&mut self, tag: u32) -> TagIndex {
        let index = match self.tagged.iter().position(|(t, _)| *t == tag) {
            Some(index) => index,
            None => {
                self.tagged.push((tag, block_pool_pair()));
                self.tagged.len() - 1
            }
        };
        TagIndex(index as u32)
    }

    /// The tag whose pools sit at `index`.
    pub(crate) fn tag_of(&self, index: TagIndex) -> u32 {
        self.tagged[index.0 as usize].0
    }

    /// Every tag with pools, by index.
    pub(crate) fn tag_indices(&self) -> impl Iterator<Item = TagIndex> + use<> {
        (0..self.tagged.len() as u32).map(TagIndex)
    }

    /// Every block pool with its owner, ordinary first.
    pub(crate) fn all_with_owner(&self) -> impl Iterator<Item = (Owner, &BlockPool)> {
        let private = self
            .private_pools()
            .flat_map(|(index, pool)| pool.blocks.iter().map(move |b| (Owner::Private(index), b)));
        let tagged = self
            .tagged
            .iter()
            .enumerate()
            .flat_map(|(index, (_, pair))| {
                pair.iter()
                    .map(move |b| (Owner::Tagged(TagIndex(index as u32)), b))
            });
        self.ordinary
            .iter()
            .map(|b| (Owner::Ordinary, b))
            .chain(private)
            .chain(tagged)
    }

    /// Every block pool, ordinary first.
    pub(crate) fn all(&self) -> impl Iterator<Item = &BlockPool> {
        self.ordinary.iter().chain(
            self.private
                .iter()
                .flatten()
                .flat_map(|pool| pool.blocks.iter())
                .chain(self.tagged.iter().flat_map(|(_, pair)| pair.iter())),
        )
    }
}

/// A capture under way: PyTorch's `captures_underway` entry.
pub(super) struct Capture {
    pub(super) id: MempoolId,
    pub(super) pool: PrivatePoolIndex,
    pub(super) filter: StreamFilter,
}

impl std::fmt::Debug for Capture {
    /// The filter is a closure: only the ids show.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("id", &self.id)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

/// Why a pool operation was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// `begin_allocate_to_pool` for a pool a capture already records into.
    AlreadyRecording(MempoolId),
    /// `end_allocate_to_pool` for a pool no capture records into.
    NotRecording(MempoolId),
    /// No such private pool.
    Unknown(MempoolId),
    /// `release_pool` of a pool that holds no references.
    NotReferenced(MempoolId),
    /// `release_pool` of the last reference while a capture still records into the pool.
    StillRecording(MempoolId),
    /// `(0, 0)`, which names the ordinary pools, used as a private pool's id.
    OrdinaryId,
    /// An allocator given for a pool that already exists.
    AllocatorOfExistingPool(MempoolId),
}

/// A pool id as PyTorch prints a `MempoolId_t` from Python: `(1, 0)`.
pub struct PoolName(pub MempoolId);

impl fmt::Display for PoolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0.0, self.0.1)
    }
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            PoolError::AlreadyRecording(id) => write!(
                f,
                "beginAllocateToPool: already recording to mempool_id {}",
                PoolName(id)
            ),
            PoolError::NotRecording(id) => write!(
                f,
                "endAllocateToPool: not currently recording to mempool_id {}",
                PoolName(id)
            ),
            PoolError::Unknown(id) => write!(f, "no private pool has mempool_id {}", PoolName(id)),
            PoolError::NotReferenced(id) => write!(
                f,
                "releasePool: mempool_id {} holds no references to release",
                PoolName(id)
            ),
            PoolError::StillRecording(id) => write!(
                f,
                "releasePool: a capture still records into mempool_id {}; end it first",
                PoolName(id)
            ),
            PoolError::OrdinaryId => f.write_str(
                "mempool_id (0, 0) names the ordinary pools and cannot be a private pool's",
            ),
            PoolError::AllocatorOfExistingPool(id) => write!(
                f,
                "createOrIncrefPool: mempool_id {} exists; a pool's own allocator is given when \
                 the pool is made",
                PoolName(id)
            ),
        }
    }
}

impl std::error::Error for PoolError {}

impl<D: Device> DeviceAllocator<D> {
    /// PyTorch's `create_or_incref_pool`: a new pool with one reference, or one more reference
    /// to an existing one (which revives a pool whose references were all released).
    pub fn create_or_incref_pool(&mut self, id: MempoolId) -> Result<PrivatePoolIndex, PoolError> {
        if id == ORDINARY_POOL_ID {
            return Err(PoolError::OrdinaryId);
        }
        Ok(match self.pools.find(id) {
            Some(index) => {
                self.pools.private_mut(index).use_count += 1;
                index
            }
            None => self.pools.create(id, None),
        })
    }

    /// PyTorch's `create_or_incref_pool` with an allocator (`torch.cuda.MemPool(allocator=...)`):
    /// a new pool with one reference whose segments come from `allocator` and go back to it.
    /// An existing id is refused (PyTorch asserts: a pool's allocator is given when it is
    /// made), and so is `(0, 0)`; `allocator` is then dropped.
    pub fn create_pool_with_allocator(
        &mut self,
        id: MempoolId,
        allocator: Box<dyn SegmentAllocator>,
    ) -> Result<PrivatePoolIndex, PoolError> {
        if id == ORDINARY_POOL_ID {
            return Err(PoolError::OrdinaryId);
        }
        if self.pools.find(id).is_some() {
            return Err(PoolError::AllocatorOfExistingPool(id));
        }
        Ok(self.pools.create(id, Some(ExternalAllocator(allocator))))
    }

    /// Whether the segments of `owner` come from a pool's own allocator.
    pub(super) fn has_own_allocator(&self, owner: Owner) -> bool {
        owner
            .private()
            .is_some_and(|index| self.pools.private(index).allocator.is_some())
    }

    /// `alloc_block` for a pool with its own allocator (PyTorch's `allocPrimitive`): a new
    /// segment from the allocator, `None` when it has no memory (the caller's out-of-memory
    /// path follows, as for a failed `cudaMalloc`).
    pub(super) fn alloc_segment_from_pool_allocator(
        &mut self,
        request: &Request,
    ) -> Option<BlockId> {
        let index = request.owner.private()?;
        let allocator = self.pools.private_mut(index).allocator.as_mut()?;
        let size = request.alloc_size;
        let ptr = external::obtain(allocator, size)?;
        let segment = Segment {
            owner: request.owner,
            kind: request.pool,
            memory: Memory::External,
            asleep: false,
        };
        Some(self.adopt_segment(ptr, size, request.stream, segment))
    }

    /// Gives the segment at `ptr` back to the allocator of the private pool `owner`.
    pub(super) fn release_to_pool_allocator(
        &mut self,
        owner: Owner,
        ptr: crate::device::DevicePtr,
    ) -> Result<(), DeviceError> {
        let allocator = owner
            .private()
            .and_then(|index| self.pools.private_mut(index).allocator.as_mut())
            .expect("a segment of a pool's own allocator belongs to that pool");
        external::release(allocator, ptr)
    }

    /// PyTorch's `setUseOnOOM` and `setNoSplit`, which `torch.cuda.MemPool(use_on_oom=...,
    /// no_split=...)` calls once it made the pool: the options last as long as the pool.
    pub fn set_pool_options(
        &mut self,
        id: MempoolId,
        use_on_oom: bool,
        no_split: bool,
    ) -> Result<(), PoolError> {
        let index = self.pools.find(id).ok_or(PoolError::Unknown(id))?;
        let pool = self.pools.private_mut(index);
        pool.use_on_oom = use_on_oom;
        pool.no_split = no_split;
        Ok(())
    }

    /// The last resort of an allocation outside every private pool that would run out of
    /// memory (PyTorch's loop over `use_on_oom_pools`): the cached block of a `use_on_oom` pool
    /// that `get_free_block` would pick for it, with the pool; the first pool that has one.
    pub(super) fn free_block_of_use_on_oom_pools(
        &mut self,
        request: &Request,
    ) -> Option<(PrivatePoolIndex, BlockId)> {
        let candidates: Vec<PrivatePoolIndex> = self
            .pools
            .private_pools()
            .filter(|(_, pool)| pool.use_on_oom)
            .map(|(index, _)| index)
            .collect();
        candidates.into_iter().find_map(|index| {
            let in_pool = Request {
                owner: Owner::Private(index),
                ..*request
            };
            Some((index, self.get_free_block(&in_pool)?))
        })
    }

    /// PyTorch's `should_split` for a block of `owner` of `block_size` serving `rounded_size`:
    /// never in a `no_split` pool; in a pool with its own allocator, expandable segments are
    /// not active (the rule of ordinary large blocks).
    #[inline(always)]
    pub(super) fn should_split(
        &self,
        owner: Owner,
        block_size: usize,
        rounded_size: usize,
        kind: PoolKind,
    ) -> bool {
        let expandable_segments_active = match owner.private() {
            None => self.config.expandable_segments,
            Some(index) => {
                let pool = self.pools.private(index);
                if pool.no_split {
                    return false;
                }
                self.config.expandable_segments && pool.allocator.is_none()
            }
        };
        policy::should_split_in(
            block_size,
            rounded_size,
            kind,
            expandable_segments_active,
            &self.config,
        )
    }

    /// `beginAllocateToPool`: from now until [`end_allocate_to_pool`](Self::end_allocate_to_pool),
    /// allocations on streams that `filter` accepts are served from pool `id` (created, or
    /// given one more reference).
    pub fn begin_allocate_to_pool(
        &mut self,
        id: MempoolId,
        filter: StreamFilter,
    ) -> Result<(), PoolError> {
        if self.pools.captures.iter().any(|c| c.id == id) {
            return Err(PoolError::AlreadyRecording(id));
        }
        let pool = self.create_or_incref_pool(id)?;
        self.pools.captures.push(Capture { id, pool, filter });
        logging::capture_begins(id, self.pools.private(pool).use_count);
        Ok(())
    }

    /// `endAllocateToPool`: allocations stop going to pool `id`; the pool keeps its memory and
    /// its references.
    pub fn end_allocate_to_pool(&mut self, id: MempoolId) -> Result<(), PoolError> {
        let position = self
            .pools
            .captures
            .iter()
            .position(|c| c.id == id)
            .ok_or(PoolError::NotRecording(id))?;
        // The filter belongs to the caller's capture and is dropped here, at its end.
        self.pools.captures.remove(position);
        logging::capture_ends(id);
        Ok(())
    }

    /// `releasePool`: a graph using pool `id` is gone. Once no reference is left, the pool's
    /// wholly free segments go back to the device on the next `empty_cache`.
    pub fn release_pool(&mut self, id: MempoolId) -> Result<(), PoolError> {
        let index = self.pools.find(id).ok_or(PoolError::Unknown(id))?;
        let recording = self.pools.captures.iter().any(|c| c.pool == index);
        let pool = self.pools.private_mut(index);
        match pool.use_count {
            0 => return Err(PoolError::NotReferenced(id)),
            1 if recording => return Err(PoolError::StillRecording(id)),
            _ => pool.use_count -= 1,
        }
        logging::pool_released(id, pool.use_count);
        Ok(())
    }

    /// PyTorch's `getPoolUseCount`: the references pool `id` holds, `None` for no such pool.
    pub fn pool_use_count(&self, id: MempoolId) -> Option<u32> {
        self.pools
            .find(id)
            .map(|index| self.pools.private(index).use_count)
    }

    /// Every private pool that exists, in no particular order.
    pub fn private_pools(&self) -> Vec<PrivatePoolInfo> {
        self.pools
            .private_pools()
            .map(|(index, pool)| PrivatePoolInfo {
                id: pool.id,
                use_count: pool.use_count,
                segment_count: pool.segment_count,
                recording: self.pools.captures.iter().any(|c| c.pool == index),
            })
            .collect()
    }

    /// Whether a capture is under way (PyTorch's `!captures_underway.empty()`).
    pub fn capture_underway(&self) -> bool {
        !self.pools.captures.is_empty()
    }

    /// PyTorch's `is_capture_context()` for a caller whose current stream is `stream`: whether
    /// the allocator must act as during a CUDA graph capture (no event queries or
    /// synchronization, no release of the ordinary pools, frees used on other streams
    /// deferred). A private pool records, and, from PyTorch 2.13 on, `stream` is capturing:
    /// inside `torch.cuda.use_mem_pool` outside any graph capture it is not. Costs nothing while
    /// no pool records.
    #[inline(always)]
    pub fn is_capture_context(&mut self, stream: StreamId) -> bool {
        !self.pools.captures.is_empty() && self.any_capturing([stream])
    }

    /// While a private pool records: whether one of `streams` counts as capturing under the
    /// modelled PyTorch's rule. A device that cannot say counts as capturing, which never
    /// issues a call a capture forbids.
    #[cold]
    pub(super) fn any_capturing(&mut self, streams: impl IntoIterator<Item = StreamId>) -> bool {
        debug_assert!(!self.pools.captures.is_empty());
        match self.config.modelled.capture_context {
            CaptureContextRule::AnyPoolRecording => true,
            CaptureContextRule::CurrentStreamCapturing => streams.into_iter().any(|stream| {
                self.device
                    .stream_is_capturing(stream)
                    .unwrap_or_else(|err| {
                        logging::device_error(
                            "could not ask whether a stream captures; acting as in a capture",
                            &err,
                        );
                        true
                    })
            }),
        }
    }

    /// [`is_capture_context`](Self::is_capture_context) for `empty_cache`, which PyTorch asks of
    /// the caller's current stream (`getCurrentCUDAStream`): asked of `current_stream` when the
    /// caller says it (ferrocache's front end does). A caller that does not (the plain C ABI)
    /// gets the rule before PyTorch 2.13: any recording pool counts as a capture, so that
    /// `empty_cache` never synchronizes under a capture it cannot see.
    pub fn empty_cache_in_capture_context(&mut self, current_stream: Option<StreamId>) -> bool {
        match current_stream {
            Some(stream) => self.is_capture_context(stream),
            None => !self.pools.captures.is_empty(),
        }
    }

    /// The owner of an allocation on `stream` while a private pool records, after PyTorch's
    /// start of `malloc`: completed events are processed unless the caller is in a capture
    /// context ([`is_capture_context`](Self::is_capture_context); the driver is asked only when
    /// events wait), then the first capture whose filter accepts `stream` takes it.
    #[cold]
    pub(super) fn owner_while_pools_record(
        &mut self,
        stream: StreamId,
    ) -> Result<Owner, AllocError> {
        if (self.events.pending_count > 0 || !self.events.to_record.is_empty())
            && !self.is_capture_context(stream)
        {
            self.process_events()?;
        }
        self.private_pool_for(stream)
    }

    /// PyTorch's `get_pool`, the private half: the pool of the first capture whose filter
    /// accepts `stream`, or `None` for the ordinary pools.
    #[inline]
    pub(super) fn private_pool_for(&self, stream: StreamId) -> Result<Owner, AllocError> {
        for capture in &self.pools.captures {
            match (capture.filter)(stream) {
                Ok(true) => return Ok(Owner::Private(capture.pool)),
                Ok(false) => {}
                Err(message) => {
                    return Err(AllocError::StreamFilter {
                        pool: capture.id,
                        message,
                    });
                }
            }
        }
        Ok(Owner::Ordinary)
    }

    /// The id a block's memory is reported under (`segment_pool_id`).
    pub(super) fn pool_id_of(&self, block: &Block) -> MempoolId {
        block
            .owner
            .private()
            .map_or(ORDINARY_POOL_ID, |index| self.pools.private(index).id)
    }

    /// A new segment (or expandable address range) now belongs to `owner`.
    pub(super) fn count_segment_taken(&mut self, owner: Owner) {
        if let Owner::Private(index) = owner {
            self.pools.private_mut(index).segment_count += 1;
        }
    }

    /// A segment of `owner` went back to the device.
    pub(super) fn count_segment_returned(&mut self, owner: Owner) {
        if let Owner::Private(index) = owner {
            self.pools.private_mut(index).segment_count -= 1;
        }
    }

    /// The free bytes cached in private pools, which PyTorch's out-of-memory message counts as
    /// allocated ("with ... allocated in private pools (e.g., CUDA Graphs)").
    pub(super) fn private_pool_cached_bytes(&self) -> usize {
        self.pools
            .private_pools()
            .flat_map(|(_, pool)| pool.blocks.iter())
            .flat_map(BlockPool::cached)
            .map(|id| self.arena.get(id).size)
            .sum()
    }

    /// The private-pool part of `release_cached_blocks`: every pool without references and
    /// without a live block gives its segments back to the device, and is then forgotten. Any
    /// other pool keeps everything.
    pub(super) fn release_unreferenced_private_pools(&mut self) -> Result<(), DeviceError> {
        if self.pools.private_pools().next().is_none() {
            return Ok(());
        }
        let holding_live_blocks = self.private_pools_with_live_blocks();
        self.release_unreferenced_pools_among(|_| true, &holding_live_blocks)
    }

    /// PyTorch's `emptyCache(mempool_id)`, which `torch.cuda.MemPool`'s destructor calls after
    /// it dropped its reference: if nothing refers to pool `id` any more, its wholly free
    /// cached segments go back to the device, as PyTorch's do, even while another of its
    /// blocks is live (nothing can allocate from the pool again; the live block's segment
    /// returns at an `empty_cache` after it is freed). The ordinary pools and the other private
    /// pools keep theirs. An unknown or referenced pool is nothing to do.
    pub fn empty_pool_cache(&mut self, id: MempoolId) -> Result<(), DeviceError> {
        self.release_unreferenced_pools_among(|pool| pool.id == id, &[])
    }

    /// Releases the cached memory of the unreferenced private pools that `chosen` picks, except
    /// those in `holding_live_blocks`.
    fn release_unreferenced_pools_among(
        &mut self,
        chosen: impl Fn(&PrivatePool) -> bool,
        holding_live_blocks: &[PrivatePoolIndex],
    ) -> Result<(), DeviceError> {
        let unreferenced: Vec<PrivatePoolIndex> = self
            .pools
            .private_pools()
            .filter(|(index, pool)| {
                chosen(pool) && pool.use_count == 0 && !holding_live_blocks.contains(index)
            })
            .map(|(index, _)| index)
            .collect();
        for index in unreferenced {
            self.release_blocks(Owner::Private(index), PoolKind::Small)?;
            self.release_blocks(Owner::Private(index), PoolKind::Large)?;
            // Nobody can allocate from a pool nothing refers to: an expandable range of it with
            // nothing mapped (its first growth failed) goes back too, which the ordinary pools
            // keep for the next request of the stream.
            for kind in [PoolKind::Small, PoolKind::Large] {
                let unmapped: Vec<BlockId> = self
                    .pools
                    .get(Owner::Private(index), kind)
                    .unmapped_blocks()
                    .filter(|&id| !self.arena.get(id).is_split())
                    .collect();
                for id in unmapped {
                    self.release_expandable_segment(id)?;
                }
            }
            if self.pools.private(index).segment_count == 0 {
                let id = self.pools.private(index).id;
                self.pools.forget(index);
                logging::pool_forgotten(id);
            }
        }
        Ok(())
    }

    /// The private pools holding a block that is allocated, or freed but waiting for other
    /// streams. A full walk: only `empty_cache` and the out-of-memory path ask.
    fn private_pools_with_live_blocks(&self) -> Vec<PrivatePoolIndex> {
        let mut pools: Vec<PrivatePoolIndex> = self
            .arena
            .iter()
            .filter(|(_, b)| b.mapped && !b.is_available())
            .filter_map(|(_, b)| b.owner.private())
            .collect();
        pools.sort_unstable();
        pools.dedup();
        pools
    }
}
