//! The allocator's self-check: every structural invariant, and the statistics recomputed from
//! the block table. A full walk: for tests and debugging.

use super::DeviceAllocator;
use super::backing::Memory;
use super::block::Block;
use super::owner::{Owner, PrivatePoolIndex};
use super::segments::SegmentId;
use super::stats::DeviceStats;
use crate::device::Device;
use crate::policy;
use rustc_hash::FxHashMap;

impl<D: Device> DeviceAllocator<D> {
    /// Checks every structural invariant and recomputes the current statistics from the block
    /// table; returns what is wrong. Costs a full walk: for tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut recomputed = DeviceStats::new(self.config.max_split_size);
        let mut cached_count = 0;
        let mut unmapped_count = 0;
        let mut mapped_expandable: FxHashMap<SegmentId, usize> = FxHashMap::default();
        let mut heads = 0;
        let mut private_segments: FxHashMap<PrivatePoolIndex, usize> = FxHashMap::default();
        // Where each cached block is filed: (private pool, pool kind).
        let mut filed = FxHashMap::default();
        for (owner, block_pool) in self.pools.all_with_owner() {
            for id in block_pool
                .cached()
                .into_iter()
                .chain(block_pool.unmapped_blocks())
            {
                filed.insert(id, (owner, block_pool.kind));
            }
        }
        for (id, head) in self.arena.iter() {
            if head.prev.is_some() {
                continue;
            }
            let pool = head.pool;
            heads += 1;
            let Some(segment) = self.segments.find(head.segment) else {
                return Err(format!(
                    "segment {:#x} is not in the segment table",
                    head.ptr
                ));
            };
            if self.segments.head(head.segment) != id
                || segment.owner != head.owner
                || segment.kind != pool
                || segment.memory.is_expandable() != head.expandable
            {
                return Err(format!(
                    "segment {:#x} disagrees with its entry in the segment table",
                    head.ptr
                ));
            }
            let asleep = segment.asleep;
            if let Owner::Private(owner) = head.owner {
                if !self.pools.is_live(owner) {
                    return Err(format!(
                        "segment {:#x} belongs to a private pool that no longer exists",
                        head.ptr
                    ));
                }
                *private_segments.entry(owner).or_default() += 1;
            }
            let mut end = head.ptr;
            let mut cursor = Some(id);
            let mut previous: Option<&Block> = None;
            let mut segment_size = 0;
            while let Some(c) = cursor {
                let b = self.arena.get(c);
                if b.ptr != end {
                    return Err(format!("block {:#x} does not follow {end:#x}", b.ptr));
                }
                if !b.ptr.is_multiple_of(512) || !b.size.is_multiple_of(512) || b.size == 0 {
                    return Err(format!(
                        "block {:#x} (size {}) is not 512-aligned",
                        b.ptr, b.size
                    ));
                }
                // Cross-stream reuse moves single blocks to other streams.
                if b.pool != pool
                    || (b.stream != head.stream && !self.config.opt_in.cross_stream)
                    || b.segment != head.segment
                    || b.expandable != head.expandable
                    || b.owner != head.owner
                {
                    return Err(format!("block {:#x} disagrees with its segment", b.ptr));
                }
                if let Some(p) = previous
                    && p.is_available()
                    && b.is_available()
                    && super::cross_stream::may_merge(p, b)
                {
                    return Err(format!(
                        "free blocks {:#x} and {:#x} are adjacent",
                        p.ptr, b.ptr
                    ));
                }
                if !b.expandable && !b.mapped {
                    return Err(format!("ordinary block {:#x} is unmapped", b.ptr));
                }
                if let Some(n) = b.next
                    && self.arena.get(n).prev != Some(c)
                {
                    return Err(format!("broken links after {:#x}", b.ptr));
                }
                let active = b.allocated || b.event_count > 0 || !b.stream_uses.is_empty();
                if b.allocated {
                    if self.allocated.get(&b.ptr) != Some(&c) {
                        return Err(format!("allocated block {:#x} not in the table", b.ptr));
                    }
                    recomputed.allocation.increase(pool, 1);
                    recomputed.allocated_bytes.increase(pool, b.size as u64);
                    if policy::is_oversize(b.size, &self.config) {
                        recomputed.oversize_allocations.increase(1);
                    }
                }
                if active {
                    recomputed.active.increase(pool, 1);
                    recomputed.active_bytes.increase(pool, b.size as u64);
                    recomputed
                        .requested_bytes
                        .increase(pool, b.requested_size as u64);
                }
                // A sleeping segment's free blocks are in no pool until it wakes.
                if b.is_available() && asleep && filed.contains_key(&c) {
                    return Err(format!(
                        "free block {:#x} of a sleeping segment is in a pool",
                        b.ptr
                    ));
                }
                if b.is_available() && !asleep && filed.get(&c) != Some(&(b.owner, b.pool)) {
                    return Err(format!(
                        "free block {:#x} is not filed in its own pool ({:?} {:?}) but in {:?}",
                        b.ptr,
                        b.owner,
                        b.pool,
                        filed.get(&c)
                    ));
                }
                if b.is_available() {
                    // The pools hold the free blocks of awake segments.
                    if b.mapped {
                        cached_count += usize::from(!asleep);
                        if !b.expandable && b.is_split() {
                            recomputed.inactive_split.increase(pool, 1);
                            recomputed
                                .inactive_split_bytes
                                .increase(pool, b.size as u64);
                        }
                    } else {
                        unmapped_count += usize::from(!asleep);
                    }
                }
                if b.mapped {
                    segment_size += b.size;
                    if b.expandable {
                        *mapped_expandable.entry(b.segment).or_default() += b.size;
                    }
                }
                end = b.end();
                previous = Some(b);
                cursor = b.next;
            }
            match &segment.memory {
                Memory::Plain | Memory::External | Memory::Vmm(_) => {
                    recomputed.segment.increase(pool, 1);
                    if !asleep {
                        recomputed
                            .reserved_bytes
                            .increase(pool, segment_size as u64);
                    }
                    if policy::is_oversize(segment_size, &self.config) {
                        recomputed.oversize_segments.increase(1);
                    }
                    if !segment.memory.can_sleep() && asleep {
                        return Err(format!("segment {:#x} sleeps, which it cannot", head.ptr));
                    }
                }
                Memory::Expandable(pages) => {
                    let e = head.segment.0;
                    if head.ptr != pages.base() || end != pages.base() + pages.size() as u64 {
                        return Err(format!("expandable segment {e} is not tiled by its blocks"));
                    }
                    if asleep != pages.is_asleep() {
                        return Err(format!(
                            "expandable segment {e}: asleep {asleep}, pages asleep {}",
                            pages.is_asleep()
                        ));
                    }
                    let mapped = mapped_expandable.get(&head.segment).copied().unwrap_or(0);
                    if pages.mapped_bytes() != mapped {
                        return Err(format!(
                            "expandable segment {e}: {} bytes mapped, blocks say {mapped}",
                            pages.mapped_bytes(),
                        ));
                    }
                    recomputed
                        .reserved_bytes
                        .increase(pool, (segment_size - pages.sleeping_bytes()) as u64);
                }
            }
        }
        let table: Vec<SegmentId> = self.segments.iter().map(|(id, _)| id).collect();
        if table.len() != heads {
            return Err(format!(
                "the segment table holds {} segments, the blocks {heads}",
                table.len()
            ));
        }
        let sleeping = self.segments.iter().filter(|(_, s)| s.asleep).count();
        if self.segments.any_asleep() != (sleeping > 0) {
            return Err(format!(
                "{sleeping} segments sleep, the table counts otherwise"
            ));
        }
        for (index, pool) in self.pools.private_pools() {
            let counted = private_segments.get(&index).copied().unwrap_or(0);
            if pool.segment_count != counted {
                return Err(format!(
                    "private pool {:?} counts {} segments, the blocks say {counted}",
                    pool.id, pool.segment_count
                ));
            }
        }
        for capture in &self.pools.captures {
            if !self.pools.is_live(capture.pool) || self.pools.private(capture.pool).use_count == 0
            {
                return Err(format!(
                    "the capture into {:?} records into a pool without references",
                    capture.id
                ));
            }
        }
        let pooled: usize = self.pools.all().map(|p| p.cached_len()).sum();
        let unmapped_pooled: usize = self.pools.all().map(|p| p.unmapped_len()).sum();
        if pooled != cached_count || unmapped_pooled != unmapped_count {
            return Err(format!(
                "pools hold {pooled} cached / {unmapped_pooled} unmapped blocks, the table {cached_count} / {unmapped_count}"
            ));
        }
        if self.allocated.len() as i64 != recomputed.allocation.all.current {
            return Err("allocation table and blocks disagree".into());
        }
        if self.ledger.stats.reserved_bytes.all.current as usize != self.ledger.reserved {
            return Err("reserved bytes and total_allocated_memory disagree".into());
        }
        let pairs = [
            (
                "allocation",
                &self.ledger.stats.allocation,
                &recomputed.allocation,
            ),
            ("segment", &self.ledger.stats.segment, &recomputed.segment),
            ("active", &self.ledger.stats.active, &recomputed.active),
            (
                "inactive_split",
                &self.ledger.stats.inactive_split,
                &recomputed.inactive_split,
            ),
            (
                "allocated_bytes",
                &self.ledger.stats.allocated_bytes,
                &recomputed.allocated_bytes,
            ),
            (
                "reserved_bytes",
                &self.ledger.stats.reserved_bytes,
                &recomputed.reserved_bytes,
            ),
            (
                "active_bytes",
                &self.ledger.stats.active_bytes,
                &recomputed.active_bytes,
            ),
            (
                "inactive_split_bytes",
                &self.ledger.stats.inactive_split_bytes,
                &recomputed.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &self.ledger.stats.requested_bytes,
                &recomputed.requested_bytes,
            ),
        ];
        for (name, kept, computed) in pairs {
            for (pool, a, b) in [
                ("all", &kept.all, &computed.all),
                ("small_pool", &kept.small_pool, &computed.small_pool),
                ("large_pool", &kept.large_pool, &computed.large_pool),
            ] {
                if a.current != b.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but the blocks say {}",
                        a.current, b.current
                    ));
                }
            }
        }
        let oversize_counters = if self.ledger.settings_replaced {
            // Counted by the max_split_size of each moment (PyTorch's rule): nothing to check.
            Vec::new()
        } else {
            vec![
                (
                    "oversize_allocations",
                    &self.ledger.stats.oversize_allocations,
                    &recomputed.oversize_allocations,
                ),
                (
                    "oversize_segments",
                    &self.ledger.stats.oversize_segments,
                    &recomputed.oversize_segments,
                ),
            ]
        };
        for (name, a, b) in oversize_counters {
            if a.current != b.current {
                return Err(format!(
                    "{name}.current is {} but the blocks say {}",
                    a.current, b.current
                ));
            }
        }
        Ok(())
    }
}
