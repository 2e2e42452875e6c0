//! The ledger: every change of the bytes held from the device goes through one of its six
//! entries, each of which updates, together, the reserved total (PyTorch's
//! `total_allocated_memory`), the statistics, the history (trace entries in PyTorch's
//! vocabulary) and the INFO log line, so that the counters the oracle compares cannot drift
//! apart:
//!
//! | entry | reserved | statistics | history | log |
//! |---|---|---|---|---|
//! | [`Ledger::segment_allocated`] | + | segment, reserved_bytes, oversize_segments, num_device_alloc | `segment_alloc` | yes |
//! | [`Ledger::segment_released`] | - | segment, reserved_bytes, oversize_segments, num_device_free | (`segment_free`, written by [`Ledger::segment_releasing`] just before) | yes |
//! | [`Ledger::pages_mapped`] | + | reserved_bytes, num_device_alloc | `segment_map` | yes |
//! | [`Ledger::pages_unmapped`] | - | reserved_bytes, num_device_free | `segment_unmap` | yes |
//! | [`Ledger::slept`] | - | reserved_bytes | none | yes |
//! | [`Ledger::woke`] | + | reserved_bytes | none | yes |
//!
//! A segment's `segment_free` entry is written before the device gives the memory back
//! ([`Ledger::segment_releasing`]), as PyTorch writes it before `cudaFree`: an allocator trace
//! tracker (NCCL's register hook) deregisters memory that is still there. Every entry names
//! the segment's pool (`MempoolId`), which trackers read ([`super::tracker`]).
//!
//! Sleep and wake write no trace entry: PyTorch's vocabulary has none for memory whose
//! addresses and blocks stay while its physical memory goes, and `segment_unmap` /
//! `segment_map` would tell the replayer and PyTorch's memory viewer that the blocks left.
//! They write an INFO line per segment, besides the summary line of each call.
//!
//! Expandable segments are PyTorch's exception to the segment statistics: their address range
//! comes and goes without a `segment` count, their pages count in `reserved_bytes` alone.

use super::history::{History, TraceAction};
use super::private_pool::MempoolId;
use super::stats::DeviceStats;
use crate::config::Config;
use crate::device::{DevicePtr, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind};

/// The reserved total with the statistics and the history that follow it.
#[derive(Debug)]
pub(crate) struct Ledger {
    /// Bytes held from the device (PyTorch's `total_allocated_memory`).
    pub(crate) reserved: usize,
    pub(crate) stats: DeviceStats,
    pub(crate) history: History,
    /// Whether the settings were replaced: the oversize counters then count by the
    /// `max_split_size` of each moment, as PyTorch's do, and no longer match the blocks by
    /// today's.
    pub(crate) settings_replaced: bool,
}

impl Ledger {
    pub(crate) fn new(max_split_size: usize) -> Ledger {
        Ledger {
            reserved: 0,
            stats: DeviceStats::new(max_split_size),
            history: History::default(),
            settings_replaced: false,
        }
    }

    /// A new segment of `size` bytes at `ptr` for `stream`, from the device, for `pool`.
    pub(crate) fn segment_allocated(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        (kind, pool): (PoolKind, MempoolId),
        config: &Config,
    ) {
        self.reserved += size;
        self.stats.segment.increase(kind, 1);
        self.stats.reserved_bytes.increase(kind, size as u64);
        if policy::is_oversize(size, config) {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.history
            .record_in_pool(TraceAction::SegmentAlloc, ptr, size, stream, || pool);
        logging::segment_allocated(ptr, size, stream);
    }

    /// The segment of `size` bytes at `ptr`, of `pool`, is about to go back to the device: its
    /// `segment_free` entry.
    pub(crate) fn segment_releasing(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        pool: MempoolId,
    ) {
        self.history
            .record_in_pool(TraceAction::SegmentFree, ptr, size, stream, || pool);
    }

    /// The segment of `size` bytes at `ptr` went back to the device.
    pub(crate) fn segment_released(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        kind: PoolKind,
        config: &Config,
    ) {
        self.reserved -= size;
        self.stats.num_device_free += 1;
        self.stats.segment.decrease(kind, 1);
        self.stats.reserved_bytes.decrease(kind, size as u64);
        if policy::is_oversize(size, config) {
            self.stats.oversize_segments.decrease_may_go_negative(1);
        }
        logging::segment_released(ptr, size);
    }

    /// Pages mapped into an expandable segment of `pool` for `stream`.
    pub(crate) fn pages_mapped(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        (kind, pool): (PoolKind, MempoolId),
    ) {
        self.reserved += size;
        self.stats.reserved_bytes.increase(kind, size as u64);
        self.stats.num_device_alloc += 1;
        self.history
            .record_in_pool(TraceAction::SegmentMap, ptr, size, stream, || pool);
        logging::pages_mapped(ptr, size, stream);
    }

    /// Pages unmapped from an expandable segment of `pool`.
    pub(crate) fn pages_unmapped(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
        (kind, pool): (PoolKind, MempoolId),
    ) {
        self.reserved -= size;
        self.stats.reserved_bytes.decrease(kind, size as u64);
        self.stats.num_device_free += 1;
        self.history
            .record_in_pool(TraceAction::SegmentUnmap, ptr, size, stream, || pool);
        logging::pages_unmapped(ptr, size);
    }

    /// `size` bytes of the segment at `ptr` went to sleep: given back, addresses kept.
    pub(crate) fn slept(&mut self, ptr: DevicePtr, size: usize, kind: PoolKind) {
        self.reserved -= size;
        self.stats.reserved_bytes.decrease(kind, size as u64);
        logging::segment_slept(ptr, size);
    }

    /// `size` bytes of the segment at `ptr` woke: taken again at the same addresses.
    pub(crate) fn woke(&mut self, ptr: DevicePtr, size: usize, kind: PoolKind) {
        self.reserved += size;
        self.stats.reserved_bytes.increase(kind, size as u64);
        logging::segment_woke(ptr, size);
    }
}
