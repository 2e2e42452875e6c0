//! Blocks and the arena that owns them.
//!
//! A segment (one device allocation, or one expandable address range) is a chain of blocks that
//! tile it: `prev`/`next` link address neighbours. Links are arena indices, never pointers, so a
//! block can be freed, merged or moved between pools without any unsafe code.

use super::history::StackId;
use super::owner::Owner;
use crate::device::{DevicePtr, StreamId};
use crate::policy::PoolKind;

/// The index of a block in the [`BlockArena`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BlockId(pub u32);

/// The index of a segment in the segment table (`allocator/segments.rs`) (stable while the segment exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub(crate) struct SegmentId(pub(crate) u32);

/// How PyTorch orders cached blocks of the same stream and size: the lower allocation-order
/// counter first, then the lower address (`BlockComparatorSizeCounterAddress`, PyTorch 2.12
/// and later), so that best fit picks the same block in every process and rank whatever
/// addresses the driver gave. What the counter counts is the running PyTorch's
/// ([`TieRule`](crate::policy::TieRule)): segments from 2.13 on, blocks in 2.12; under 2.11
/// and older it stays 0 and the address alone decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct TieKey {
    pub segment_order: u64,
    pub ptr: DevicePtr,
}

impl TieKey {
    /// Below every block's key: where a search for a size starts.
    pub const MIN: TieKey = TieKey {
        segment_order: 0,
        ptr: 0,
    };
}

/// A piece of a segment: allocated, free (cached), or free but waiting for other streams.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// Device address of the first byte.
    pub ptr: DevicePtr,
    /// Size in bytes (a multiple of 512).
    pub size: usize,
    /// What the program asked for when it last got this block (kept after free, as PyTorch does).
    pub requested_size: usize,
    /// The stream the block belongs to; it is reused only for requests on this stream.
    pub stream: StreamId,
    /// The pool the block's segment belongs to.
    pub pool: PoolKind,
    /// Whose pools the segment's free blocks go to.
    pub owner: Owner,
    /// Handed out to the program.
    pub allocated: bool,
    /// Backed by physical memory. Always true outside expandable segments.
    pub mapped: bool,
    /// The block just below in the same segment.
    pub prev: Option<BlockId>,
    /// The block just above in the same segment.
    pub next: Option<BlockId>,
    /// Events recorded at free time that have not completed yet.
    pub event_count: u32,
    /// Other streams the program used the block on (`record_stream`).
    pub stream_uses: Vec<StreamId>,
    /// The pool's free-block search count when the block was cached (garbage collection age).
    pub gc_count_base: u64,
    /// The segment the block is part of (its memory, owner and state live there).
    pub segment: SegmentId,
    /// The segment is expandable (a copy of what the segment table says, for the hot path).
    pub expandable: bool,
    /// The stack of the allocation that last handed the block out (0: none recorded).
    pub stack_id: StackId,
    /// PyTorch's allocation-order counter for the block, counted per allocator from 1: under
    /// the segment rule taken when its segment was made and inherited by every block carved
    /// from it (see [`TieKey`]).
    pub segment_order: u64,
}

impl Block {
    pub(crate) fn new(ptr: DevicePtr, size: usize, stream: StreamId, pool: PoolKind) -> Block {
        Block {
            ptr,
            size,
            requested_size: 0,
            stream,
            pool,
            owner: Owner::Ordinary,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            event_count: 0,
            stream_uses: Vec::new(),
            gc_count_base: 0,
            segment: SegmentId::default(),
            expandable: false,
            stack_id: 0,
            segment_order: 0,
        }
    }

    /// A new free, mapped block at `ptr` in the same segment as `self` (same stream, pools,
    /// segment and segment order), not yet linked into the chain.
    pub(crate) fn sibling(&self, ptr: DevicePtr, size: usize) -> Block {
        Block {
            owner: self.owner,
            segment: self.segment,
            expandable: self.expandable,
            segment_order: self.segment_order,
            ..Block::new(ptr, size, self.stream, self.pool)
        }
    }

    /// Where the block sorts among cached blocks of its stream and size.
    #[inline]
    pub(crate) fn tie_key(&self) -> TieKey {
        TieKey {
            segment_order: self.segment_order,
            ptr: self.ptr,
        }
    }

    /// Part of a segment that holds other blocks too.
    pub(crate) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// Free and not waiting on any stream: may be merged or reused.
    pub(crate) fn is_available(&self) -> bool {
        !self.allocated && self.event_count == 0 && self.stream_uses.is_empty()
    }

    pub(crate) fn end(&self) -> DevicePtr {
        self.ptr + self.size as u64
    }
}

/// Puts `item` in the first free slot of `slots` (or a new one at the end); returns its index.
pub(crate) fn place_in_free_slot<T>(slots: &mut Vec<Option<T>>, item: T) -> usize {
    match slots.iter().position(Option::is_none) {
        Some(free) => {
            slots[free] = Some(item);
            free
        }
        None => {
            slots.push(Some(item));
            slots.len() - 1
        }
    }
}

/// Owns every block; freed slots are reused.
#[derive(Debug, Default)]
pub(crate) struct BlockArena {
    slots: Vec<Option<Block>>,
    vacant: Vec<u32>,
}

impl BlockArena {
    #[inline(always)]
    pub(crate) fn insert(&mut self, block: Block) -> BlockId {
        match self.vacant.pop() {
            Some(index) => {
                self.slots[index as usize] = Some(block);
                BlockId(index)
            }
            None => self.push(block),
        }
    }

    /// [`BlockArena::insert`] when no slot is vacant (out of line: it may grow the arena).
    #[inline(never)]
    fn push(&mut self, block: Block) -> BlockId {
        self.slots.push(Some(block));
        BlockId((self.slots.len() - 1) as u32)
    }

    /// Adds `block` to the chain just below `at` (it takes `at`'s place after `at.prev`).
    #[inline(always)]
    pub(crate) fn insert_before(&mut self, at: BlockId, mut block: Block) -> BlockId {
        let prev = self.get(at).prev;
        block.prev = prev;
        block.next = Some(at);
        let id = self.insert(block);
        if let Some(prev) = prev {
            self.get_mut(prev).next = Some(id);
        }
        self.get_mut(at).prev = Some(id);
        id
    }

    /// Adds `block` to the chain just above `at`.
    pub(crate) fn insert_after(&mut self, at: BlockId, mut block: Block) -> BlockId {
        block.prev = Some(at);
        block.next = self.get(at).next;
        let id = self.insert(block);
        if let Some(next) = self.get(id).next {
            self.get_mut(next).prev = Some(id);
        }
        self.get_mut(at).next = Some(id);
        id
    }

    #[inline(always)]
    pub(crate) fn remove(&mut self, id: BlockId) -> Block {
        let block = self.slots[id.0 as usize]
            .take()
            .expect("arena slot of a live block");
        self.vacant.push(id.0);
        block
    }

    /// Removes a block whose fields the caller no longer needs (cheaper than
    /// [`BlockArena::remove`], which moves it out).
    #[inline(always)]
    pub(crate) fn discard(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.0 as usize];
        assert!(slot.is_some(), "arena slot of a live block");
        *slot = None;
        self.vacant.push(id.0);
    }

    #[inline(always)]
    pub(crate) fn get(&self, id: BlockId) -> &Block {
        self.slots[id.0 as usize]
            .as_ref()
            .expect("arena slot of a live block")
    }

    #[inline(always)]
    pub(crate) fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id.0 as usize]
            .as_mut()
            .expect("arena slot of a live block")
    }

    /// Every live block with its id, in arena order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (BlockId(i as u32), b)))
    }
}
