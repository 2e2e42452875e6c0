//! The pools of cached free blocks.
//!
//! Free blocks are ordered by (stream, size, address), like PyTorch's `BlockComparatorSize`, so
//! a best-fit search for a stream is one ordered lookup. Unmapped blocks of expandable segments
//! are kept apart, ordered by (stream, address).

use super::block::{Block, BlockId};
use crate::device::{DevicePtr, StreamId};
use crate::policy::PoolKind;
use std::collections::BTreeMap;
use std::ops::Bound;

/// The key a free block is ordered by.
pub type SizeKey = (StreamId, usize, DevicePtr);

/// One pool (small or large) of free blocks.
#[derive(Debug)]
pub struct BlockPool {
    pub kind: PoolKind,
    /// Free, mapped blocks: best fit is the first key at or after (stream, size, 0).
    blocks: BTreeMap<SizeKey, BlockId>,
    /// Unmapped address space of expandable segments.
    unmapped: BTreeMap<(StreamId, DevicePtr), BlockId>,
    /// How many times a free block was searched for (the clock of garbage collection).
    pub get_free_blocks_call_count: u64,
}

fn size_key(block: &Block) -> SizeKey {
    (block.stream, block.size, block.ptr)
}

impl BlockPool {
    pub fn new(kind: PoolKind) -> BlockPool {
        BlockPool {
            kind,
            blocks: BTreeMap::new(),
            unmapped: BTreeMap::new(),
            get_free_blocks_call_count: 0,
        }
    }

    /// `insert_into_blocks`: caches a free mapped block and starts its garbage-collection age.
    pub fn insert(&mut self, id: BlockId, block: &mut Block) {
        debug_assert!(block.mapped);
        block.gc_count_base = self.get_free_blocks_call_count;
        let previous = self.blocks.insert(size_key(block), id);
        debug_assert!(previous.is_none(), "block cached twice");
    }

    /// Removes a cached block; true if it was there.
    pub fn remove(&mut self, block: &Block) -> bool {
        self.blocks.remove(&size_key(block)).is_some()
    }

    pub fn insert_unmapped(&mut self, id: BlockId, block: &Block) {
        debug_assert!(!block.mapped);
        self.unmapped.insert((block.stream, block.ptr), id);
    }

    pub fn remove_unmapped(&mut self, block: &Block) -> bool {
        self.unmapped.remove(&(block.stream, block.ptr)).is_some()
    }

    /// The cached blocks of `stream` of at least `size` bytes, smallest first.
    pub fn fitting(
        &self,
        stream: StreamId,
        size: usize,
    ) -> impl Iterator<Item = (&SizeKey, &BlockId)> {
        self.blocks
            .range((stream, size, 0)..)
            .take_while(move |(key, _)| key.0 == stream)
    }

    /// The cached blocks of `stream` smaller than `size`, largest first.
    pub fn smaller_than(
        &self,
        stream: StreamId,
        size: usize,
    ) -> impl Iterator<Item = (&SizeKey, &BlockId)> {
        self.blocks
            .range((
                Bound::Included((stream, 0, 0)),
                Bound::Excluded((stream, size, 0)),
            ))
            .rev()
    }

    /// The unmapped blocks of `stream`, lowest address first.
    pub fn unmapped_of(&self, stream: StreamId) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped
            .range((stream, 0)..)
            .take_while(move |(key, _)| key.0 == stream)
            .map(|(_, id)| *id)
    }

    /// Every cached block, in (stream, size, address) order.
    pub fn cached(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.blocks.values().copied()
    }

    /// Every unmapped block, in (stream, address) order.
    pub fn unmapped_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped.values().copied()
    }

    pub fn cached_len(&self) -> usize {
        self.blocks.len()
    }

    pub fn unmapped_len(&self) -> usize {
        self.unmapped.len()
    }
}
