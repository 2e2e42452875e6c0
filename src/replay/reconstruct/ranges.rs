//! Segments (or mapped ranges of expandable segments) by address, as the backward walk and the
//! forward pass see them, and the size rules they are read with.

use crate::config::Config;
use crate::policy::{self, K_LARGE_BUFFER, K_SMALL_BUFFER, PoolKind};
use crate::replay::workload::SegmentRef;
use std::collections::BTreeMap;

/// `round_size` under the recorded settings; absurd sizes (hostile input) stay as they are
/// instead of overflowing.
pub(super) fn rounded(size: u64, config: &Config) -> u64 {
    const SANE: u64 = 1 << 56;
    if size > SANE {
        return size;
    }
    policy::round_size(size as usize, config) as u64
}

/// The pool of a segment known only by its size: small segments are always 2 MiB, large ones
/// never are; expandable large pages are 20 MiB.
pub(super) fn pool_of_segment(size: u64, expandable: bool) -> PoolKind {
    let small = if expandable {
        !size.is_multiple_of(K_LARGE_BUFFER as u64)
    } else {
        size == K_SMALL_BUFFER as u64
    };
    if small {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Range {
    pub(super) size: u64,
    pub(super) stream: u64,
    pub(super) pool: PoolKind,
    pub(super) expandable: bool,
    /// Which segment it is, in the forward pass (`None` for expandable ranges and in the
    /// backward walk).
    pub(super) owner: Option<SegmentRef>,
}

/// Segments (or mapped ranges) by start address.
#[derive(Default)]
pub(super) struct Ranges(pub(super) BTreeMap<u64, Range>);

impl Ranges {
    pub(super) fn containing(&self, addr: u64) -> Option<(u64, Range)> {
        let (&start, &range) = self.0.range(..=addr).next_back()?;
        (addr - start < range.size).then_some((start, range))
    }

    pub(super) fn overlaps(&self, addr: u64, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else {
            return true;
        };
        self.containing(addr).is_some() || self.0.range(addr..end).next().is_some()
    }

    pub(super) fn insert(&mut self, addr: u64, range: Range) -> bool {
        if range.size == 0 || self.overlaps(addr, range.size) {
            return false;
        }
        self.0.insert(addr, range);
        true
    }

    pub(super) fn remove_exact(&mut self, addr: u64) -> bool {
        self.0.remove(&addr).is_some()
    }

    /// Takes `[addr, addr + size)` out of the range that holds it.
    pub(super) fn remove_range(&mut self, addr: u64, size: u64) -> bool {
        let Some((start, range)) = self.containing(addr) else {
            return false;
        };
        let (Some(cut_end), Some(end)) = (addr.checked_add(size), start.checked_add(range.size))
        else {
            return false;
        };
        if cut_end > end {
            return false;
        }
        self.0.remove(&start);
        if start < addr {
            self.0.insert(
                start,
                Range {
                    size: addr - start,
                    ..range
                },
            );
        }
        if cut_end < end {
            self.0.insert(
                cut_end,
                Range {
                    size: end - cut_end,
                    ..range
                },
            );
        }
        true
    }

    /// Adds a mapped range, merging it with adjacent mapped ranges of the same stream.
    pub(super) fn add_mapped(&mut self, addr: u64, size: u64, stream: u64) -> bool {
        if size == 0 || self.overlaps(addr, size) {
            return false;
        }
        let mut start = addr;
        let mut merged = Range {
            size,
            stream,
            pool: pool_of_segment(size, true),
            expandable: true,
            owner: None,
        };
        let joins = |r: &Range| r.expandable && r.stream == stream;
        if let Some((&prev_start, &prev)) = self.0.range(..addr).next_back()
            && joins(&prev)
            && prev_start.checked_add(prev.size) == Some(addr)
        {
            self.0.remove(&prev_start);
            start = prev_start;
            merged.size += prev.size;
            merged.pool = prev.pool;
        }
        if let Some(&next) = self.0.get(&(addr + size))
            && joins(&next)
        {
            self.0.remove(&(addr + size));
            merged.size = merged.size.saturating_add(next.size);
            merged.pool = next.pool;
        }
        self.0.insert(start, merged);
        true
    }
}
