//! The table of live allocations: device address -> block.
//!
//! Every cache hit inserts one entry and every free removes one, so this table is on the hot
//! path twice per allocation. `std`'s `HashMap` (hashbrown) costs ~85 instructions for an
//! insert there (it first probes for an existing key, then for a free slot, with group
//! metadata) and ~45 for a removal. The allocator needs far less: keys are distinct device
//! addresses, 512-byte aligned, inserted only when absent. So: open addressing with linear
//! probing, at most half full, and backward-shift deletion (no tombstones, so probes stay
//! short however many allocations come and go); about 15 instructions an insert and 25 a
//! removal. `tests` checks it against `HashMap` on random operations.

use super::block::BlockId;
use crate::device::DevicePtr;

/// Marks an empty slot. Address 0 is never a device allocation's, but a table must not
/// depend on that: it is kept apart, in `zero`.
const EMPTY: DevicePtr = 0;
/// Slots when the first entry arrives.
const INITIAL_SLOTS: usize = 64;

#[derive(Debug, Clone)]
pub(crate) struct LiveTable {
    /// `keys.len()` is a power of two (or 0 before the first insert).
    keys: Vec<DevicePtr>,
    values: Vec<BlockId>,
    /// Entries in `keys` (not counting `zero`).
    len: usize,
    /// `64 - log2(keys.len())`: the hash's top bits index the table.
    shift: u32,
    zero: Option<BlockId>,
}

impl Default for LiveTable {
    fn default() -> LiveTable {
        LiveTable {
            keys: Vec::new(),
            values: Vec::new(),
            len: 0,
            shift: 64,
            zero: None,
        }
    }
}

impl LiveTable {
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// The slot where a probe for `ptr` starts: Fibonacci hashing of the address above its
    /// 512-byte alignment.
    #[inline(always)]
    fn home(&self, ptr: DevicePtr) -> usize {
        ((ptr >> 9).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.keys.len().wrapping_sub(1)
    }

    /// The slot holding `ptr`, if any.
    #[inline(always)]
    fn find(&self, ptr: DevicePtr) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut slot = self.home(ptr);
        loop {
            match self.keys[slot] {
                key if key == ptr => return Some(slot),
                EMPTY => return None,
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, ptr: &DevicePtr) -> Option<&BlockId> {
        if *ptr == EMPTY {
            return self.zero.as_ref();
        }
        self.find(*ptr).map(|slot| &self.values[slot])
    }

    /// Records `ptr -> id`; returns the block `ptr` mapped to before, if any.
    #[inline(always)]
    pub(crate) fn insert(&mut self, ptr: DevicePtr, id: BlockId) -> Option<BlockId> {
        if ptr == EMPTY {
            return self.zero.replace(id);
        }
        if 2 * (self.len + 1) > self.keys.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut slot = self.home(ptr);
        loop {
            match self.keys[slot] {
                EMPTY => {
                    self.keys[slot] = ptr;
                    self.values[slot] = id;
                    self.len += 1;
                    return None;
                }
                key if key == ptr => return Some(std::mem::replace(&mut self.values[slot], id)),
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// Removes `ptr`; returns the block it mapped to, if any.
    #[inline(always)]
    pub(crate) fn remove(&mut self, ptr: &DevicePtr) -> Option<BlockId> {
        if *ptr == EMPTY {
            return self.zero.take();
        }
        let mut hole = self.find(*ptr)?;
        let id = self.values[hole];
        // Backward shift: entries after the hole whose probe started at or before it move
        // into it, so that every entry stays reachable from its home slot.
        let mask = self.mask();
        let mut next = (hole + 1) & mask;
        while self.keys[next] != EMPTY {
            let home = self.home(self.keys[next]);
            // `next` may fill the hole when its home is not strictly inside (hole, next].
            if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(hole) & mask) {
                self.keys[hole] = self.keys[next];
                self.values[hole] = self.values[next];
                hole = next;
            }
            next = (next + 1) & mask;
        }
        self.keys[hole] = EMPTY;
        self.len -= 1;
        Some(id)
    }

    /// Doubles the slots (out of line: it happens O(log n) times).
    #[inline(never)]
    fn grow(&mut self) {
        let slots = (self.keys.len() * 2).max(INITIAL_SLOTS);
        let keys = std::mem::replace(&mut self.keys, vec![EMPTY; slots]);
        let values = std::mem::replace(&mut self.values, vec![BlockId(0); slots]);
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        for (key, value) in keys.into_iter().zip(values) {
            if key != EMPTY {
                self.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn address_zero_is_an_ordinary_key() {
        let mut table = LiveTable::default();
        assert_eq!(table.insert(0, BlockId(7)), None);
        assert_eq!(table.insert(512, BlockId(8)), None);
        assert_eq!(table.get(&0), Some(&BlockId(7)));
        assert_eq!(table.len(), 2);
        assert_eq!(table.remove(&0), Some(BlockId(7)));
        assert_eq!(table.get(&0), None);
        assert_eq!(table.get(&512), Some(&BlockId(8)));
        assert_eq!(table.len(), 1);
    }

    proptest! {
        /// Any sequence of inserts and removals answers as `HashMap` does, with addresses
        /// crowded together (colliding probes, removals inside clusters) and far apart.
        #[test]
        fn agrees_with_a_hash_map(
            ops in prop::collection::vec((0u8..3, 0u64..600, 0u32..1000), 1..2000)
        ) {
            let mut table = LiveTable::default();
            let mut model: HashMap<DevicePtr, BlockId> = HashMap::new();
            for (op, slot, value) in ops {
                // Mostly 512-byte neighbours, some far away, some unaligned.
                let ptr = match slot % 3 {
                    0 => 0x7f00_0000_0000 + slot * 512,
                    1 => slot << 30,
                    _ => slot * 8,
                };
                match op {
                    0 => prop_assert_eq!(table.insert(ptr, BlockId(value)), model.insert(ptr, BlockId(value))),
                    1 => prop_assert_eq!(table.remove(&ptr), model.remove(&ptr)),
                    _ => prop_assert_eq!(table.get(&ptr), model.get(&ptr)),
                }
                prop_assert_eq!(table.len(), model.len());
            }
            for (ptr, id) in &model {
                prop_assert_eq!(table.get(ptr), Some(id));
            }
        }
    }
}
