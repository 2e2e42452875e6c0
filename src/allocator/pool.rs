//! The pools of cached free blocks.
//!
//! PyTorch keeps free blocks in a `std::set` ordered by (stream, size, allocation-order counter,
//! address) (`BlockComparatorSizeCounterAddress`, PyTorch 2.12 and later; by address before:
//! see [`Block::tie_key`]); best fit is the first block at or after (stream, size, lowest). This pool keeps exactly that
//! order, but stored for speed: per stream, blocks of up to 2 MiB (every small-pool block, and
//! the smallest large ones) sit in exact size classes of 512 bytes, each a min-heap by tie key,
//! found through a two-level bitmap; larger blocks sit in an ordered map. A cache hit is then a
//! bitmap scan and a heap pop instead of tree searches.
//!
//! Unmapped blocks of expandable segments are kept apart, ordered by (stream, address).

use super::block::{Block, BlockId, TieKey};
use crate::device::{DevicePtr, StreamId};
use crate::policy::{K_MIN_BLOCK_SIZE, PoolKind};
use std::cell::Cell;
use std::collections::BTreeMap;

/// Blocks up to this size are kept in exact size classes.
const EXACT_LIMIT: usize = 2 << 20;
/// One class per multiple of 512 bytes up to the limit.
const EXACT_CLASSES: usize = EXACT_LIMIT / K_MIN_BLOCK_SIZE;
const BITMAP_WORDS: usize = EXACT_CLASSES / 64;

/// The class of the blocks of `size` bytes, or for a request of `size`, the first class that
/// can hold it (sizes are rounded up to a multiple of 512).
#[inline(always)]
fn class_of(size: usize) -> usize {
    size.div_ceil(K_MIN_BLOCK_SIZE).max(1) - 1
}

fn size_of_class(class: usize) -> usize {
    (class + 1) * K_MIN_BLOCK_SIZE
}

/// Which size classes hold blocks, with a summary word to skip empty stretches.
#[derive(Debug, Clone)]
struct ClassBitmap {
    summary: u64,
    words: [u64; BITMAP_WORDS],
}

const _: () = assert!(
    BITMAP_WORDS <= 64,
    "one summary word must cover every bitmap word"
);

impl ClassBitmap {
    fn new() -> ClassBitmap {
        ClassBitmap {
            summary: 0,
            words: [0; BITMAP_WORDS],
        }
    }

    #[inline(always)]
    fn set(&mut self, class: usize) {
        self.words[class / 64] |= 1 << (class % 64);
        self.summary |= 1 << (class / 64);
    }

    #[inline(always)]
    fn clear(&mut self, class: usize) {
        let word = &mut self.words[class / 64];
        *word &= !(1 << (class % 64));
        if *word == 0 {
            self.summary &= !(1 << (class / 64));
        }
    }

    /// The first occupied class at or after `class`.
    #[inline(always)]
    fn first_from(&self, class: usize) -> Option<usize> {
        if class >= EXACT_CLASSES {
            return None;
        }
        let w = class / 64;
        let bits = self.words[w] & (!0u64 << (class % 64));
        if bits != 0 {
            return Some(w * 64 + bits.trailing_zeros() as usize);
        }
        let later = if w + 1 >= 64 {
            0
        } else {
            self.summary & (!0u64 << (w + 1))
        };
        if later == 0 {
            return None;
        }
        let w = later.trailing_zeros() as usize;
        Some(w * 64 + self.words[w].trailing_zeros() as usize)
    }

    /// The last occupied class strictly before `class`.
    fn last_before(&self, class: usize) -> Option<usize> {
        let class = class.min(EXACT_CLASSES);
        if class == 0 {
            return None;
        }
        let last = class - 1;
        let w = last / 64;
        let bits = self.words[w] & (!0u64 >> (63 - last % 64));
        if bits != 0 {
            return Some(w * 64 + 63 - bits.leading_zeros() as usize);
        }
        let earlier = self.summary & ((1u64 << w) - 1);
        if earlier == 0 {
            return None;
        }
        let w = 63 - earlier.leading_zeros() as usize;
        Some(w * 64 + 63 - self.words[w].leading_zeros() as usize)
    }
}

/// The cached blocks of one stream in one pool.
#[derive(Debug)]
struct StreamBlocks {
    stream: StreamId,
    /// Per exact class, a binary min-heap of (tie key, block). A fixed-size array, so that an
    /// index below `EXACT_CLASSES` needs no bounds check.
    classes: Box<[Vec<(TieKey, BlockId)>; EXACT_CLASSES]>,
    occupied: ClassBitmap,
    /// Blocks above `EXACT_LIMIT`, by (size, tie key).
    larger: BTreeMap<(usize, TieKey), BlockId>,
}

impl StreamBlocks {
    /// Out of line, and the classes made on the heap: an array of them built on the stack
    /// first (`Box::new([...])`) gave every caller a 96 KiB frame to probe, page by page, on
    /// each call.
    #[inline(never)]
    fn new(stream: StreamId) -> StreamBlocks {
        let classes: Box<[Vec<(TieKey, BlockId)>]> = vec![Vec::new(); EXACT_CLASSES].into();
        StreamBlocks {
            stream,
            classes: classes.try_into().expect("EXACT_CLASSES classes were made"),
            occupied: ClassBitmap::new(),
            larger: BTreeMap::new(),
        }
    }

    /// The blocks of one class, lowest tie key first.
    fn class_sorted(&self, class: usize) -> Vec<(TieKey, BlockId)> {
        let mut blocks = self.classes[class].clone();
        blocks.sort_unstable();
        blocks
    }
}

/// Where each cached block sits in its class heap (indexed by block id), so any block can be
/// removed when it merges with a neighbour.
#[derive(Debug, Default)]
struct HeapSlots(Vec<u32>);

impl HeapSlots {
    #[inline(always)]
    fn set(&mut self, id: BlockId, slot: usize) {
        let i = id.0 as usize;
        if i >= self.0.len() {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = slot as u32;
    }

    #[inline(always)]
    fn get(&self, id: BlockId) -> usize {
        self.0[id.0 as usize] as usize
    }
}

/// Adds a block of up to `EXACT_LIMIT` bytes to its class's heap in `blocks`.
#[inline(always)]
fn push_into_class(blocks: &mut StreamBlocks, slots: &mut HeapSlots, id: BlockId, block: &Block) {
    let class = class_of(block.size);
    let heap = &mut blocks.classes[class];
    let slot = heap.len();
    heap.push((block.tie_key(), id));
    if slot == 0 {
        // The usual case on a cache hit: the class was empty.
        slots.set(id, 0);
    } else {
        sift_up(heap, slots, slot);
    }
    blocks.occupied.set(class);
}

/// Restores the heap property upwards from `slot`.
fn sift_up(heap: &mut [(TieKey, BlockId)], slots: &mut HeapSlots, mut slot: usize) {
    while slot > 0 {
        let parent = (slot - 1) / 2;
        if heap[parent].0 <= heap[slot].0 {
            break;
        }
        heap.swap(parent, slot);
        slots.set(heap[slot].1, slot);
        slot = parent;
    }
    slots.set(heap[slot].1, slot);
}

/// Restores the heap property downwards from `slot`.
fn sift_down(heap: &mut [(TieKey, BlockId)], slots: &mut HeapSlots, mut slot: usize) {
    loop {
        let left = 2 * slot + 1;
        if left >= heap.len() {
            break;
        }
        let right = left + 1;
        let child = if right < heap.len() && heap[right].0 < heap[left].0 {
            right
        } else {
            left
        };
        if heap[slot].0 <= heap[child].0 {
            break;
        }
        heap.swap(slot, child);
        slots.set(heap[slot].1, slot);
        slot = child;
    }
    slots.set(heap[slot].1, slot);
}

/// One pool (small or large) of free blocks.
#[derive(Debug)]
pub(crate) struct BlockPool {
    pub kind: PoolKind,
    /// Per stream, sorted by stream (PyTorch orders by stream first).
    streams: Vec<StreamBlocks>,
    /// Where the stream looked up last sits in `streams`. A program allocates on one stream
    /// many times in a row, and with several streams the binary search is a chain of dependent
    /// loads that everything after it waits for (~10 ns of a cache hit with three streams).
    /// Checked before use, so it is never stale.
    last_stream: Cell<usize>,
    heap_slots: HeapSlots,
    cached: usize,
    /// Unmapped address space of expandable segments.
    unmapped: BTreeMap<(StreamId, DevicePtr), BlockId>,
    /// How many times a free block was searched for (the clock of garbage collection).
    pub get_free_blocks_call_count: u64,
}

impl BlockPool {
    pub(crate) fn new(kind: PoolKind) -> BlockPool {
        BlockPool {
            kind,
            streams: Vec::new(),
            last_stream: Cell::new(0),
            heap_slots: HeapSlots::default(),
            cached: 0,
            unmapped: BTreeMap::new(),
            get_free_blocks_call_count: 0,
        }
    }

    #[inline(always)]
    fn stream_index(&self, stream: StreamId) -> Result<usize, usize> {
        let last = self.last_stream.get();
        if self.streams.get(last).is_some_and(|s| s.stream == stream) {
            return Ok(last);
        }
        self.search_stream(stream)
    }

    /// [`BlockPool::stream_index`] when the stream is not the one looked up last.
    #[inline(never)]
    fn search_stream(&self, stream: StreamId) -> Result<usize, usize> {
        let found = self.streams.binary_search_by_key(&stream, |s| s.stream);
        if let Ok(index) = found {
            self.last_stream.set(index);
        }
        found
    }

    fn stream_blocks(&self, stream: StreamId) -> Option<&StreamBlocks> {
        self.stream_index(stream).ok().map(|i| &self.streams[i])
    }

    /// `insert_into_blocks`: caches a free mapped block and starts its garbage-collection age.
    #[inline(always)]
    pub(crate) fn insert(&mut self, id: BlockId, block: &mut Block) {
        debug_assert!(block.mapped);
        block.gc_count_base = self.get_free_blocks_call_count;
        // The usual case, inlined into every cache hit: a block of an exact class of a stream
        // already here. The rest (a new stream, a block above the classes) is out of line.
        if block.size <= EXACT_LIMIT
            && let Ok(index) = self.stream_index(block.stream)
        {
            push_into_class(&mut self.streams[index], &mut self.heap_slots, id, block);
            self.cached += 1;
        } else {
            self.insert_uncommon(id, block);
        }
    }

    /// [`BlockPool::insert`] of a block that was cached before and keeps its
    /// garbage-collection age (a sleeping segment's free block, back at wake).
    pub(crate) fn reinsert(&mut self, id: BlockId, block: &mut Block) {
        let age = block.gc_count_base;
        self.insert(id, block);
        block.gc_count_base = age;
    }

    /// [`BlockPool::insert`] of a block above the classes, or of a stream new to this pool.
    #[inline(never)]
    fn insert_uncommon(&mut self, id: BlockId, block: &Block) {
        let index = match self.stream_index(block.stream) {
            Ok(i) => i,
            Err(i) => {
                self.streams.insert(i, StreamBlocks::new(block.stream));
                i
            }
        };
        let blocks = &mut self.streams[index];
        if block.size <= EXACT_LIMIT {
            push_into_class(blocks, &mut self.heap_slots, id, block);
        } else {
            let previous = blocks.larger.insert((block.size, block.tie_key()), id);
            debug_assert!(previous.is_none(), "block cached twice");
        }
        self.cached += 1;
    }

    /// Removes a cached block; true if it was there.
    #[inline(always)]
    pub(crate) fn remove(&mut self, id: BlockId, block: &Block) -> bool {
        if block.size > EXACT_LIMIT {
            return self.remove_larger(block);
        }
        let Ok(index) = self.stream_index(block.stream) else {
            return false;
        };
        let blocks = &mut self.streams[index];
        let class = class_of(block.size);
        let heap = &mut blocks.classes[class];
        let slot = self.heap_slots.get(id);
        if heap.get(slot).is_none_or(|e| e.1 != id) {
            return false;
        }
        let last = heap.len() - 1;
        if slot == last {
            // The usual case on a cache hit: the class holds this block alone.
            heap.pop();
        } else {
            heap.swap(slot, last);
            heap.pop();
            sift_down(heap, &mut self.heap_slots, slot);
            sift_up(heap, &mut self.heap_slots, slot);
        }
        if heap.is_empty() {
            blocks.occupied.clear(class);
        }
        self.cached -= 1;
        true
    }

    /// [`BlockPool::remove`] of a block above the classes.
    #[inline(never)]
    fn remove_larger(&mut self, block: &Block) -> bool {
        let Ok(index) = self.stream_index(block.stream) else {
            return false;
        };
        let removed = self.streams[index]
            .larger
            .remove(&(block.size, block.tie_key()))
            .is_some();
        if removed {
            self.cached -= 1;
        }
        removed
    }

    /// The streams that have (or had) cached blocks in this pool, in order.
    pub(crate) fn streams(&self) -> impl Iterator<Item = StreamId> + '_ {
        self.streams.iter().map(|s| s.stream)
    }

    /// Best fit: the smallest cached block of `stream` of at least `size` bytes, lowest tie key
    /// first among equals (the first block of [`BlockPool::fitting`]).
    #[inline(always)]
    pub(crate) fn best_fit(&self, stream: StreamId, size: usize) -> Option<BlockId> {
        let blocks = self.stream_blocks(stream)?;
        if size <= EXACT_LIMIT
            && let Some(class) = blocks.occupied.first_from(class_of(size))
        {
            return Some(blocks.classes[class][0].1);
        }
        blocks
            .larger
            .range((size, TieKey::MIN)..)
            .next()
            .map(|(_, &id)| id)
    }

    /// The cached blocks of `stream` of at least `size` bytes, in (size, tie key) order.
    pub(crate) fn fitting(&self, stream: StreamId, size: usize) -> Fitting<'_> {
        Fitting {
            blocks: self.stream_blocks(stream),
            size,
            next_class: if size <= EXACT_LIMIT {
                class_of(size)
            } else {
                EXACT_CLASSES
            },
            buffer: Vec::new(),
            larger: None,
        }
    }

    /// The cached blocks of `stream` smaller than `size`, largest first (size, block).
    pub(crate) fn smaller_than(&self, stream: StreamId, size: usize) -> Vec<(usize, BlockId)> {
        let Some(blocks) = self.stream_blocks(stream) else {
            return Vec::new();
        };
        let mut out: Vec<(usize, BlockId)> = blocks
            .larger
            .range(..(size, TieKey::MIN))
            .rev()
            .map(|(&(s, _), &id)| (s, id))
            .collect();
        let mut class = if size > EXACT_LIMIT {
            EXACT_CLASSES
        } else {
            class_of(size)
        };
        while let Some(c) = blocks.occupied.last_before(class) {
            out.extend(
                blocks
                    .class_sorted(c)
                    .into_iter()
                    .rev()
                    .map(|(_, id)| (size_of_class(c), id)),
            );
            class = c;
        }
        out
    }

    /// Every cached block, in (stream, size, tie key) order.
    pub(crate) fn cached(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.cached);
        for blocks in &self.streams {
            let mut class = 0;
            while let Some(c) = blocks.occupied.first_from(class) {
                out.extend(blocks.class_sorted(c).into_iter().map(|(_, id)| id));
                class = c + 1;
            }
            out.extend(blocks.larger.values().copied());
        }
        out
    }

    pub(crate) fn cached_len(&self) -> usize {
        self.cached
    }

    pub(crate) fn insert_unmapped(&mut self, id: BlockId, block: &Block) {
        debug_assert!(!block.mapped);
        self.unmapped.insert((block.stream, block.ptr), id);
    }

    pub(crate) fn remove_unmapped(&mut self, block: &Block) -> bool {
        self.unmapped.remove(&(block.stream, block.ptr)).is_some()
    }

    /// The unmapped blocks of `stream`, lowest address first.
    pub(crate) fn unmapped_of(&self, stream: StreamId) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped
            .range((stream, 0)..)
            .take_while(move |(key, _)| key.0 == stream)
            .map(|(_, id)| *id)
    }

    /// Every unmapped block, in (stream, address) order.
    pub(crate) fn unmapped_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped.values().copied()
    }

    pub(crate) fn unmapped_len(&self) -> usize {
        self.unmapped.len()
    }
}

/// The iterator of [`BlockPool::fitting`]: exact classes from the request's up, each in
/// tie-key order, then the larger blocks.
pub(crate) struct Fitting<'a> {
    blocks: Option<&'a StreamBlocks>,
    size: usize,
    next_class: usize,
    /// The current class's blocks, highest tie key first (popped from the end).
    buffer: Vec<(TieKey, BlockId)>,
    larger: Option<std::collections::btree_map::Range<'a, (usize, TieKey), BlockId>>,
}

impl Iterator for Fitting<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        let blocks = self.blocks?;
        if let Some((_, id)) = self.buffer.pop() {
            return Some(id);
        }
        if let Some(class) = blocks.occupied.first_from(self.next_class) {
            self.next_class = class + 1;
            self.buffer = blocks.class_sorted(class);
            self.buffer.reverse();
            return self.buffer.pop().map(|(_, id)| id);
        }
        self.next_class = EXACT_CLASSES;
        let size = self.size;
        let larger = self
            .larger
            .get_or_insert_with(|| blocks.larger.range((size, TieKey::MIN)..));
        larger.next().map(|(_, &id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn block(ptr: u64, size: usize, stream: StreamId) -> Block {
        Block::new(ptr, size, stream, PoolKind::Small)
    }

    #[test]
    fn bitmap_finds_neighbouring_classes() {
        let mut b = ClassBitmap::new();
        assert_eq!(b.first_from(0), None);
        for c in [3, 64, 200, 4095] {
            b.set(c);
        }
        assert_eq!(b.first_from(0), Some(3));
        assert_eq!(b.first_from(4), Some(64));
        assert_eq!(b.first_from(65), Some(200));
        assert_eq!(b.first_from(201), Some(4095));
        assert_eq!(b.last_before(4095), Some(200));
        assert_eq!(b.last_before(64), Some(3));
        assert_eq!(b.last_before(3), None);
        assert_eq!(b.last_before(5000), Some(4095));
        b.clear(64);
        assert_eq!(b.first_from(4), Some(200));
        assert_eq!(b.last_before(200), Some(3));
    }

    /// The pool must order exactly like PyTorch's set: (stream, size, address).
    #[test]
    fn order_is_stream_size_address() {
        let mut pool = BlockPool::new(PoolKind::Small);
        let mut blocks = [
            block(0x9000, 1024, 1),
            block(0x1000, 1024, 1),
            block(0x5000, 512, 1),
            block(0x7000, 3 * MIB, 1),
            block(0x2000, 2 * MIB, 1),
            block(0x3000, 512, 0),
        ];
        for (i, b) in blocks.iter_mut().enumerate() {
            pool.insert(BlockId(i as u32), b);
        }
        assert_eq!(pool.cached_len(), 6);
        assert_eq!(pool.best_fit(1, 600), Some(BlockId(1)));
        assert_eq!(pool.best_fit(1, 512), Some(BlockId(2)));
        assert_eq!(pool.best_fit(1, 2 * MIB + 512), Some(BlockId(3)));
        assert_eq!(pool.best_fit(1, 4 * MIB), None);
        assert_eq!(pool.best_fit(2, 512), None);
        let fitting: Vec<u32> = pool.fitting(1, 1024).map(|id| id.0).collect();
        assert_eq!(fitting, vec![1, 0, 4, 3]);
        let smaller: Vec<u32> = pool
            .smaller_than(1, 3 * MIB)
            .iter()
            .map(|b| b.1.0)
            .collect();
        assert_eq!(smaller, vec![4, 0, 1, 2]);
        let all: Vec<u32> = pool.cached().iter().map(|id| id.0).collect();
        assert_eq!(all, vec![5, 2, 1, 0, 4, 3]);
        assert!(pool.remove(BlockId(1), &blocks[1]));
        assert!(!pool.remove(BlockId(1), &blocks[1]));
        assert_eq!(pool.best_fit(1, 600), Some(BlockId(0)));
        assert!(pool.remove(BlockId(3), &blocks[3]));
        assert_eq!(pool.best_fit(1, 2 * MIB + 512), None);
        assert_eq!(pool.cached_len(), 4);
    }

    /// Equal blocks of different segments: the segment made first wins, whatever the
    /// addresses; within one segment the lower address wins (PyTorch >= 2.13).
    #[test]
    fn ties_go_to_the_older_segment_then_the_lower_address() {
        let mut pool = BlockPool::new(PoolKind::Small);
        let mut older_high = block(0x9_0000, 128 << 10, 0);
        older_high.segment_order = 1;
        let mut newer_low = block(0x1_0000, 128 << 10, 0);
        newer_low.segment_order = 2;
        let mut older_higher_still = block(0xa_0000, 128 << 10, 0);
        older_higher_still.segment_order = 1;
        let mut big_newer = block(0x2_0000, 4 * MIB, 0);
        big_newer.segment_order = 3;
        let mut big_older = block(0x8_0000, 4 * MIB, 0);
        big_older.segment_order = 1;
        for (i, b) in [
            &mut older_high,
            &mut newer_low,
            &mut older_higher_still,
            &mut big_newer,
            &mut big_older,
        ]
        .into_iter()
        .enumerate()
        {
            pool.insert(BlockId(i as u32), b);
        }
        let fitting: Vec<u32> = pool.fitting(0, 1).map(|id| id.0).collect();
        assert_eq!(fitting, vec![0, 2, 1, 4, 3]);
        assert_eq!(pool.best_fit(0, 2 * MIB + 1), Some(BlockId(4)));
    }

    #[test]
    fn heaps_give_the_lowest_address_after_any_removal() {
        let mut pool = BlockPool::new(PoolKind::Small);
        let mut blocks: Vec<Block> = (0..50u64)
            .map(|i| block(0x10_0000 + ((i * 37) % 50) * 0x1000, 4096, 0))
            .collect();
        for (i, b) in blocks.iter_mut().enumerate() {
            pool.insert(BlockId(i as u32), b);
        }
        let mut live: Vec<usize> = (0..50).collect();
        // Remove in a scrambled order; the best fit is always the lowest remaining address.
        for step in 0..50 {
            let lowest = *live.iter().min_by_key(|&&i| blocks[i].ptr).unwrap();
            assert_eq!(pool.best_fit(0, 4096), Some(BlockId(lowest as u32)));
            let victim = live.remove((step * 7) % live.len());
            assert!(pool.remove(BlockId(victim as u32), &blocks[victim]));
        }
        assert_eq!(pool.best_fit(0, 4096), None);
    }

    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #![proptest_config(crate::test_properties::config(256))]

        /// The pool answers every query exactly as an ordered set of (stream, size, segment
        /// order, address) would: PyTorch's `std::set` with `BlockComparatorSizeCounterAddress`.
        #[test]
        fn agrees_with_an_ordered_set(
            ops in prop::collection::vec((0u8..4, 0u64..3, 1usize..12_000, 0usize..400), 1..300)
        ) {
            let mut pool = BlockPool::new(PoolKind::Large);
            let mut model: BTreeSet<(StreamId, usize, TieKey, u32)> = BTreeSet::new();
            let mut blocks: Vec<Block> = Vec::new();
            for (kind, stream, units, pick) in ops {
                // Sizes from 512 bytes to ~6 MiB, so both the classes and the map are used.
                let size = units * 512;
                match kind {
                    0 | 1 => {
                        let id = blocks.len() as u32;
                        let mut b = block(0x1_0000_0000 + (pick as u64) * 0x100_0000 + id as u64 * 512, size, stream);
                        // A few segments, made in an order unrelated to their addresses.
                        b.segment_order = (pick as u64 * 7) % 5;
                        pool.insert(BlockId(id), &mut b);
                        model.insert((b.stream, b.size, b.tie_key(), id));
                        blocks.push(b);
                    }
                    2 => {
                        if let Some(&entry) = model.iter().nth(pick % model.len().max(1)) {
                            let id = entry.3;
                            prop_assert!(pool.remove(BlockId(id), &blocks[id as usize]));
                            model.remove(&entry);
                        }
                    }
                    _ => {
                        let expected: Vec<u32> = model
                            .range((stream, size, TieKey::MIN, 0)..)
                            .take_while(|e| e.0 == stream)
                            .map(|e| e.3)
                            .collect();
                        prop_assert_eq!(pool.best_fit(stream, size).map(|b| b.0), expected.first().copied());
                        let fitting: Vec<u32> = pool.fitting(stream, size).map(|b| b.0).collect();
                        prop_assert_eq!(fitting, expected);
                        let smaller: Vec<u32> = model
                            .range((stream, 0, TieKey::MIN, 0)..(stream, size, TieKey::MIN, 0))
                            .rev()
                            .map(|e| e.3)
                            .collect();
                        let got: Vec<u32> = pool.smaller_than(stream, size).iter().map(|b| b.1.0).collect();
                        prop_assert_eq!(got, smaller);
                    }
                }
                prop_assert_eq!(pool.cached_len(), model.len());
            }
            let all: Vec<u32> = pool.cached().iter().map(|b| b.0).collect();
            prop_assert_eq!(all, model.iter().map(|e| e.3).collect::<Vec<_>>());
        }
    }
}
