//! The segment table: every segment the allocator holds, with its first block, its owner, its
//! pool kind, the memory it owns ([`Memory`]) and whether it sleeps.
//!
//! A block names its segment ([`SegmentId`]); the segment's memory lives here and nowhere
//! else, so giving a segment back, putting it to sleep or waking it is one look-up, and sleep
//! and wake are a loop over one owner's segments ([`SegmentTable::of_owners`]).
//!
//! A sleeping segment's free blocks are out of their pools (the allocator takes them out at
//! sleep and puts them back at wake, with the same tie keys and ages), so that no search for
//! a free block has to ask whether it sleeps.

use super::backing::Memory;
use super::backing::expandable::ExpandableSegment;
use super::block::BlockId;
pub(crate) use super::block::SegmentId;
use super::owner::Owner;
use crate::policy::PoolKind;

/// One segment.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Whose pools its free blocks go to.
    pub(crate) owner: Owner,
    /// The pool kind of every block in it.
    pub(crate) kind: PoolKind,
    /// What it is made of, and the memory itself.
    pub(crate) memory: Memory,
    /// Its physical memory is given back, its addresses and blocks kept.
    pub(crate) asleep: bool,
}

/// Every segment; freed slots are reused, lowest first.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    segments: Vec<Option<Segment>>,
    /// The first block of each segment, by [`SegmentId`] (apart from the segments, so that
    /// keeping it current when a split or a merge changes it touches little memory).
    heads: Vec<BlockId>,
    /// Segments asleep now.
    sleeping: usize,
    /// PyTorch's allocation-order counter: segments made so far (and, under the block rule,
    /// blocks); the next one's `Block::segment_order` is this plus one.
    made: u64,
}

impl SegmentTable {
    /// Adds a segment whose first block is `head`.
    pub(crate) fn insert(&mut self, segment: Segment, head: BlockId) -> SegmentId {
        let index = match self.segments.iter().position(Option::is_none) {
            Some(free) => {
                self.segments[free] = Some(segment);
                self.heads[free] = head;
                free
            }
            None => {
                self.segments.push(Some(segment));
                self.heads.push(head);
                self.segments.len() - 1
            }
        };
        SegmentId(index as u32)
    }

    /// Removes a segment; its memory must have been given back (or left over).
    pub(crate) fn remove(&mut self, id: SegmentId) -> Segment {
        let segment = self.segments[id.0 as usize].take().expect("a live segment");
        debug_assert!(!segment.asleep, "a sleeping segment is never released");
        segment
    }

    #[inline(always)]
    pub(crate) fn get(&self, id: SegmentId) -> &Segment {
        self.segments[id.0 as usize]
            .as_ref()
            .expect("a live segment")
    }

    /// The segment `id`, if it is live.
    pub(crate) fn find(&self, id: SegmentId) -> Option<&Segment> {
        self.segments.get(id.0 as usize)?.as_ref()
    }

    #[inline(always)]
    pub(crate) fn get_mut(&mut self, id: SegmentId) -> &mut Segment {
        self.segments[id.0 as usize]
            .as_mut()
            .expect("a live segment")
    }

    #[inline(always)]
    pub(crate) fn head(&self, id: SegmentId) -> BlockId {
        self.heads[id.0 as usize]
    }

    /// The segment's first block is now `head` (a split or a merge at its start).
    #[inline(always)]
    pub(crate) fn set_head(&mut self, id: SegmentId, head: BlockId) {
        self.heads[id.0 as usize] = head;
    }

    /// The expandable segment's pages.
    pub(crate) fn expandable(&self, id: SegmentId) -> &ExpandableSegment {
        match &self.get(id).memory {
            Memory::Expandable(segment) => segment,
            _ => panic!("segment {} is not expandable", id.0),
        }
    }

    pub(crate) fn expandable_mut(&mut self, id: SegmentId) -> &mut ExpandableSegment {
        match &mut self.get_mut(id).memory {
            Memory::Expandable(segment) => segment,
            _ => panic!("segment {} is not expandable", id.0),
        }
    }

    /// Whether any segment sleeps (one load: the free path asks it first).
    #[inline(always)]
    pub(crate) fn any_asleep(&self) -> bool {
        self.sleeping != 0
    }

    /// Whether segment `id` sleeps.
    #[inline(always)]
    pub(crate) fn is_asleep(&self, id: SegmentId) -> bool {
        self.sleeping != 0 && self.get(id).asleep
    }

    /// Marks segment `id` asleep or awake.
    pub(crate) fn set_asleep(&mut self, id: SegmentId, asleep: bool) {
        let segment = self.get_mut(id);
        if segment.asleep == asleep {
            return;
        }
        segment.asleep = asleep;
        if asleep {
            self.sleeping += 1;
        } else {
            self.sleeping -= 1;
        }
    }

    /// Every live segment with its id, in table order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (SegmentId(i as u32), s)))
    }

    /// The segments whose owner `chosen` picks, in table order.
    pub(crate) fn of_owners(&self, chosen: impl Fn(Owner) -> bool) -> Vec<SegmentId> {
        self.iter()
            .filter(|(_, s)| chosen(s.owner))
            .map(|(id, _)| id)
            .collect()
    }

    /// Each live expandable segment's pages.
    pub(crate) fn expandable_segments(&self) -> impl Iterator<Item = &ExpandableSegment> {
        self.iter().filter_map(|(_, s)| match &s.memory {
            Memory::Expandable(segment) => Some(segment),
            _ => None,
        })
    }

    /// Bytes asleep now, over every segment.
    pub(crate) fn sleeping_bytes(&self) -> usize {
        self.iter().map(|(_, s)| s.memory.sleeping_bytes()).sum()
    }

    /// The next value of PyTorch's allocation-order counter.
    pub(crate) fn next_order(&mut self) -> u64 {
        self.made += 1;
        self.made
    }
}
