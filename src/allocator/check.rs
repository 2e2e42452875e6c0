//! The allocator's self-check: every structural invariant, and the statistics recomputed from
//! the block table. A full walk: for tests and debugging.

use super::DeviceAllocator;
use super::block::{Backing, Block};
use super::private_pool::{Owner, PrivatePoolIndex};
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
        let mut mapped_expandable = vec![0usize; self.expandable_segments.len()];
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
                    || b.backing != head.backing
                    || b.owner != head.owner
                    || b.asleep != head.asleep
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
                if !b.backing.is_expandable() && !b.mapped {
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
                if b.is_available() && filed.get(&c) != Some(&(b.owner, b.pool)) {
                    return Err(format!(
                        "free block {:#x} is not filed in its own pool ({:?} {:?}) but in {:?}",
                        b.ptr,
                        b.owner,
                        b.pool,
                        filed.get(&c)
                    ));
                }
                if b.is_available() {
                    if b.mapped {
                        cached_count += 1;
                        if !b.backing.is_expandable() && b.is_split() {
                            recomputed.inactive_split.increase(pool, 1);
                            recomputed
                                .inactive_split_bytes
                                .increase(pool, b.size as u64);
                        }
                    } else {
                        unmapped_count += 1;
                    }
                }
                if b.mapped {
                    segment_size += b.size;
                    if let Backing::Expandable(e) = b.backing {
                        mapped_expandable[e as usize] += b.size;
                    }
                }
                end = b.end();
                previous = Some(b);
                cursor = b.next;
            }
            match head.backing.expandable() {
                None => {
                    recomputed.segment.increase(pool, 1);
                    if !head.asleep {
                        recomputed
                            .reserved_bytes
                            .increase(pool, segment_size as u64);
                    }
                    if policy::is_oversize(segment_size, &self.config) {
                        recomputed.oversize_segments.increase(1);
                    }
                }
                Some(e) => {
                    let segment = self.segment(e);
                    if head.ptr != segment.base() || end != segment.base() + segment.size() as u64 {
                        return Err(format!("expandable segment {e} is not tiled by its blocks"));
                    }
                    if head.asleep != segment.is_asleep() {
                        return Err(format!(
                            "expandable segment {e}: blocks asleep {}, pages asleep {}",
                            head.asleep,
                            segment.is_asleep()
                        ));
                    }
                    recomputed
                        .reserved_bytes
                        .increase(pool, (segment_size - segment.sleeping_bytes()) as u64);
                }
            }
        }
        for (e, segment) in self.expandable_segments.iter().enumerate() {
            if let Some(segment) = segment
                && segment.mapped_bytes() != mapped_expandable[e]
            {
                return Err(format!(
                    "expandable segment {e}: {} bytes mapped, blocks say {}",
                    segment.mapped_bytes(),
                    mapped_expandable[e]
                ));
            }
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
        for capture in &self.captures {
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
        if self.stats.reserved_bytes.all.current as usize != self.total_allocated_memory {
            return Err("reserved bytes and total_allocated_memory disagree".into());
        }
        let pairs = [
            ("allocation", &self.stats.allocation, &recomputed.allocation),
            ("segment", &self.stats.segment, &recomputed.segment),
            ("active", &self.stats.active, &recomputed.active),
            (
                "inactive_split",
                &self.stats.inactive_split,
                &recomputed.inactive_split,
            ),
            (
                "allocated_bytes",
                &self.stats.allocated_bytes,
                &recomputed.allocated_bytes,
            ),
            (
                "reserved_bytes",
                &self.stats.reserved_bytes,
                &recomputed.reserved_bytes,
            ),
            (
                "active_bytes",
                &self.stats.active_bytes,
                &recomputed.active_bytes,
            ),
            (
                "inactive_split_bytes",
                &self.stats.inactive_split_bytes,
                &recomputed.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &self.stats.requested_bytes,
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
        let oversize_counters = if self.settings_replaced {
            // Counted by the max_split_size of each moment (PyTorch's rule): nothing to check.
            Vec::new()
        } else {
            vec![
                (
                    "oversize_allocations",
                    &self.stats.oversize_allocations,
                    &recomputed.oversize_allocations,
                ),
                (
                    "oversize_segments",
                    &self.stats.oversize_segments,
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
