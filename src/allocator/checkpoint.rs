//! What PyTorch's CUDA graph trees ask of a private pool: which allocations in it are live
//! (`checkPoolLiveAllocations`), a checkpoint of its blocks (`getCheckpointState`) and the
//! return to that checkpoint (`setCheckpointPoolState`). And the pool options PyTorch sets one
//! at a time (`setUseOnOOM`, `setNoSplit`).
//!
//! A tree records a new branch after replaying part of a path. Replays change no allocator
//! state, so before recording, the pool is put back as it was when the branch point was
//! recorded: PyTorch's `setCheckpointPoolState` frees every block allocated in the pool now,
//! then carves each checkpointed segment into the same blocks again, at the same addresses (an
//! allocation of each block, split off the front as `alloc_found_block` does), and frees those
//! that were free at the checkpoint. The statistics and trace entries are those of these
//! allocations and frees, as in PyTorch; a restored block's requested size is its size.
//!
//! Unlike PyTorch, which checks as it goes and can stop half-way, a restore checks first that
//! every checkpointed segment is still there and would take the same shape once its blocks are
//! freed; otherwise nothing changes.

use super::block::{BlockId, TieKey};
use super::owner::PrivatePoolIndex;
use super::private_pool::{MempoolId, Owner, PoolName};
use super::{DeviceAllocator, PointerError, Request};
use crate::device::{Device, DevicePtr, StreamId};
use crate::policy::PoolKind;
use rustc_hash::FxHashMap;
use std::fmt;

/// A private pool's blocks, segment by segment, as PyTorch's `PrivatePoolState` keeps them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCheckpoint {
    id: MempoolId,
    device_index: i32,
    /// In the order PyTorch lists them (`get_private_pool_head_blocks`): segments whose first
    /// block is allocated, then those whose first block is cached, small pool before large.
    segments: Vec<SegmentState>,
}

/// PyTorch's `SegmentState`: a segment's blocks from its lowest address.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SegmentState {
    kind: PoolKind,
    blocks: Vec<BlockState>,
}

/// PyTorch's `BlockState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockState {
    ptr: DevicePtr,
    size: usize,
    stream: StreamId,
    allocated: bool,
    /// False for the unmapped address space of an expandable segment, which a restore leaves
    /// as it is.
    mapped: bool,
}

/// What a restore changed: PyTorch's `CheckpointDelta`, as addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointDelta {
    /// Every allocation of the pool that was live before the restore; all were freed (those
    /// the checkpoint has are allocated again and are in `allocated` too). Their tensors must
    /// lose their deleter.
    pub freed: Vec<DevicePtr>,
    /// The checkpoint's allocations, live again at their addresses: PyTorch gives them to
    /// the tensors of the path, or frees those it no longer needs.
    pub allocated: Vec<DevicePtr>,
}

/// Why a checkpoint could not be taken or restored. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointError {
    /// No private pool has this id.
    UnknownPool(MempoolId),
    /// Every reference to the pool was released (PyTorch's "freeable" pools).
    Unreferenced(MempoolId),
    /// A block of the pool waits for events of other streams.
    EventsPending { pool: MempoolId, ptr: DevicePtr },
    /// A checkpoint of another device's pool.
    OtherDevice { checkpoint: i32, device: i32 },
    /// A checkpointed segment is no longer in the pool.
    SegmentMissing { pool: MempoolId, ptr: DevicePtr },
    /// A checkpointed segment would not take the checkpoint's shape once its blocks are freed
    /// (it was split otherwise, pages were mapped or unmapped, or a block waits for streams).
    SegmentChanged { pool: MempoolId, ptr: DevicePtr },
    /// The allocator did not know a block the restore freed (a bug; the restore stopped).
    Pointer(PointerError),
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CheckpointError::UnknownPool(id) => {
                write!(f, "Could not find pool of id {}", PoolName(id))
            }
            CheckpointError::Unreferenced(id) => write!(
                f,
                "Not expected to checkpoint freeable graph: every reference to private pool {} \
                 was released",
                PoolName(id)
            ),
            CheckpointError::EventsPending { pool, ptr } => write!(
                f,
                "Events should have synchronized when checkpointing block: block {ptr:#x} of \
                 private pool {} waits for other streams",
                PoolName(pool)
            ),
            CheckpointError::OtherDevice { checkpoint, device } => write!(
                f,
                "the checkpoint is of a pool of device {checkpoint}, not of device {device}"
            ),
            CheckpointError::SegmentMissing { pool, ptr } => write!(
                f,
                "could not find segment {ptr:#x} of the checkpoint in private pool {}",
                PoolName(pool)
            ),
            CheckpointError::SegmentChanged { pool, ptr } => write!(
                f,
                "segment {ptr:#x} of private pool {} changed since the checkpoint and cannot \
                 take its blocks again",
                PoolName(pool)
            ),
            CheckpointError::Pointer(ref err) => write!(f, "restoring a checkpoint: {err}"),
        }
    }
}

impl std::error::Error for CheckpointError {}

impl PoolCheckpoint {
    /// The pool it is of.
    pub fn pool_id(&self) -> MempoolId {
        self.id
    }

    /// The addresses allocated at the checkpoint, in the order a restore gives them back.
    pub fn allocations(&self) -> Vec<DevicePtr> {
        self.segments
            .iter()
            .flat_map(|segment| &segment.blocks)
            .filter(|block| block.allocated)
            .map(|block| block.ptr)
            .collect()
    }
}

/// A segment once every allocation in it is freed: its runs of mapped and of unmapped memory,
/// as (address, size, mapped). Free neighbours merge, unless one is mapped and the other not.
fn shape_once_freed(
    blocks: impl Iterator<Item = (DevicePtr, usize, bool)>,
) -> Vec<(DevicePtr, usize, bool)> {
    let mut runs: Vec<(DevicePtr, usize, bool)> = Vec::new();
    for (ptr, size, mapped) in blocks {
        match runs.last_mut() {
            Some(last) if mapped && last.2 => last.1 += size,
            _ => runs.push((ptr, size, mapped)),
        }
    }
    runs
}

impl<D: Device> DeviceAllocator<D> {
    /// The addresses of the blocks handed out from private pool `id` and not freed yet, in
    /// address order; `None` for a pool this allocator does not know.
    pub fn pool_live_allocations(&self, id: MempoolId) -> Option<Vec<DevicePtr>> {
        let index = self.pools.find(id)?;
        let mut live: Vec<DevicePtr> = self
            .arena
            .iter()
            .filter(|(_, block)| block.allocated && block.owner == Owner::Private(index))
            .map(|(_, block)| block.ptr)
            .collect();
        live.sort_unstable();
        Some(live)
    }

    /// A private pool's options `(use_on_oom, no_split)`; `None` for an unknown pool.
    pub fn pool_options(&self, id: MempoolId) -> Option<(bool, bool)> {
        let pool = self.pools.private(self.pools.find(id)?);
        Some((pool.use_on_oom, pool.no_split))
    }

    /// PyTorch's `getCheckpointState`: every segment of private pool `id` with its blocks.
    /// Frees deferred during a capture get their events first; a block still waiting for
    /// other streams refuses the checkpoint, as does an unknown or unreferenced pool.
    pub fn checkpoint_pool(&mut self, id: MempoolId) -> Result<PoolCheckpoint, CheckpointError> {
        if self.pools.captures.is_empty() {
            self.insert_events_deferred_until_no_capture();
        }
        let index = self.referenced_pool(id)?;
        let mut segments = Vec::new();
        for head in self.pool_heads(index) {
            let mut blocks = Vec::new();
            let mut cursor = Some(head);
            while let Some(at) = cursor {
                let block = self.arena.get(at);
                if block.event_count > 0 || (!block.allocated && !block.stream_uses.is_empty()) {
                    return Err(CheckpointError::EventsPending {
                        pool: id,
                        ptr: block.ptr,
                    });
                }
                blocks.push(BlockState {
                    ptr: block.ptr,
                    size: block.size,
                    stream: block.stream,
                    allocated: block.allocated,
                    mapped: block.mapped,
                });
                cursor = block.next;
            }
            let kind = self.arena.get(head).pool;
            segments.push(SegmentState { kind, blocks });
        }
        Ok(PoolCheckpoint {
            id,
            device_index: self.device_index,
            segments,
        })
    }

    /// PyTorch's `setCheckpointPoolState`: frees every allocation of the checkpoint's pool,
    /// then carves each checkpointed segment into the checkpoint's blocks again, at the same
    /// addresses, and frees those that were free then. Segments made since stay, wholly free.
    /// Refused, with nothing changed, when the pool is unknown or unreferenced, or when a
    /// checkpointed segment is gone or would not take the same shape once freed.
    pub fn restore_pool_checkpoint(
        &mut self,
        checkpoint: &PoolCheckpoint,
    ) -> Result<CheckpointDelta, CheckpointError> {
        if checkpoint.device_index != self.device_index {
            return Err(CheckpointError::OtherDevice {
                checkpoint: checkpoint.device_index,
                device: self.device_index,
            });
        }
        let id = checkpoint.id;
        let index = self.referenced_pool(id)?;
        let heads = self.pool_heads(index);
        let segment_at: FxHashMap<DevicePtr, _> = heads
            .iter()
            .map(|&head| (self.arena.get(head).ptr, self.arena.get(head).segment))
            .collect();
        let mut restored = Vec::with_capacity(checkpoint.segments.len());
        for state in &checkpoint.segments {
            let ptr = state.blocks.first().map_or(0, |block| block.ptr);
            let segment = *segment_at
                .get(&ptr)
                .ok_or(CheckpointError::SegmentMissing { pool: id, ptr })?;
            let head = self.segments.head(segment);
            if !self.takes_shape_of(head, state) {
                return Err(CheckpointError::SegmentChanged { pool: id, ptr });
            }
            restored.push(segment);
        }

        let mut delta = CheckpointDelta::default();
        for head in heads {
            let mut cursor = Some(head);
            while let Some(at) = cursor {
                let block = self.arena.get(at);
                if block.allocated {
                    delta.freed.push(block.ptr);
                }
                cursor = block.next;
            }
        }
        for &ptr in &delta.freed {
            self.free(ptr).map_err(CheckpointError::Pointer)?;
        }
        for (state, segment) in checkpoint.segments.iter().zip(restored) {
            self.carve_as_checkpointed(self.segments.head(segment), state);
            for block in state.blocks.iter().filter(|block| block.mapped) {
                if block.allocated {
                    delta.allocated.push(block.ptr);
                } else {
                    self.free(block.ptr).map_err(CheckpointError::Pointer)?;
                }
            }
        }
        Ok(delta)
    }

    /// The pool `id`, if it exists and holds a reference.
    fn referenced_pool(&self, id: MempoolId) -> Result<PrivatePoolIndex, CheckpointError> {
        let index = self
            .pools
            .find(id)
            .ok_or(CheckpointError::UnknownPool(id))?;
        if self.pools.private(index).use_count == 0 {
            return Err(CheckpointError::Unreferenced(id));
        }
        Ok(index)
    }

    /// The first block of each segment of pool `index`, in PyTorch's order: allocated first
    /// blocks (PyTorch's order there is a hash set's; address order here), then cached ones as
    /// the small pool and then the large pool order them, then unmapped ones.
    fn pool_heads(&self, index: PrivatePoolIndex) -> Vec<BlockId> {
        let mut heads: Vec<(u8, StreamId, usize, TieKey, BlockId)> = self
            .segments
            .of_owners(|owner| owner == Owner::Private(index))
            .into_iter()
            .map(|segment| {
                let head = self.segments.head(segment);
                let block = self.arena.get(head);
                let key = if block.allocated {
                    (
                        0,
                        0,
                        0,
                        TieKey {
                            segment_order: 0,
                            ptr: block.ptr,
                        },
                    )
                } else if !block.mapped {
                    (
                        3,
                        0,
                        0,
                        TieKey {
                            segment_order: 0,
                            ptr: block.ptr,
                        },
                    )
                } else {
                    let group = if block.pool == PoolKind::Small { 1 } else { 2 };
                    (group, block.stream, block.size, block.tie_key())
                };
                (key.0, key.1, key.2, key.3, head)
            })
            .collect();
        heads.sort_unstable();
        heads.into_iter().map(|(.., head)| head).collect()
    }

    /// Whether the segment starting at `head`, once its allocations are freed, is the
    /// checkpointed segment `state` once its allocations are freed; false too when a block
    /// would not go back to the pool at its free (it waits for other streams).
    fn takes_shape_of(&self, head: BlockId, state: &SegmentState) -> bool {
        let mut now = Vec::new();
        let mut cursor = Some(head);
        while let Some(at) = cursor {
            let block = self.arena.get(at);
            if block.event_count > 0 || !block.stream_uses.is_empty() {
                return false;
            }
            now.push((block.ptr, block.size, block.mapped));
            cursor = block.next;
        }
        self.arena.get(head).pool == state.kind
            && shape_once_freed(now.into_iter())
                == shape_once_freed(state.blocks.iter().map(|b| (b.ptr, b.size, b.mapped)))
    }

    /// Hands out each block of `state` again, from the wholly free segment at `head`: PyTorch's
    /// `alloc_found_block` of each one's size in turn, splitting off the front while space is
    /// left. Unmapped space is passed over.
    fn carve_as_checkpointed(&mut self, head: BlockId, state: &SegmentState) {
        let mut cursor = Some(head);
        for wanted in &state.blocks {
            let Some(at) = cursor else { return };
            let block = self.arena.get(at);
            if !wanted.mapped {
                cursor = block.next;
                continue;
            }
            debug_assert!(block.ptr == wanted.ptr && block.size >= wanted.size);
            let (owner, kind, split) = (block.owner, block.pool, block.size > wanted.size);
            self.pools.get_mut(owner, kind).remove(at, block);
            let request = Request {
                size: wanted.size,
                stream: wanted.stream,
                pool: kind,
                owner,
                alloc_size: wanted.size,
            };
            let ptr = self.alloc_found_block(at, &request, wanted.size, split);
            cursor = self
                .allocated
                .get(&ptr)
                .and_then(|&handed_out| self.arena.get(handed_out).next);
        }
    }
}
