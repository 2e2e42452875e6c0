//! PyTorch's allocator statistics (`torch.cuda.memory_stats()`), kept the way
//! `DeviceCachingAllocator` keeps them, plus the split and merge counts that people tuning
//! fragmentation look for.

use crate::policy::PoolKind;
use serde::Serialize;

/// One statistic: its current value, its peak, and how much was ever added and removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        self.current += amount as i64;
        // A branch, not a store on every call: the peak rarely moves, and every store is
        // drained before the next lock is taken.
        if self.current > self.peak {
            self.peak = self.current;
        }
        self.allocated += amount as i64;
    }

    /// `decrease` where PyTorch's own count can go below zero: the oversize counters, which
    /// PyTorch decreases by the `max_split_size_mb` in effect at the free, so that a smaller one
    /// set at run time (`_set_allocator_settings`) uncounts blocks it never counted.
    #[inline]
    pub fn decrease_may_go_negative(&mut self, amount: u64) {
        self.current -= amount as i64;
        self.freed += amount as i64;
    }

    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        self.decrease_may_go_negative(amount);
        debug_assert!(self.current >= 0, "negative statistic (logic error)");
    }

    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A statistic kept for all pools together and for the small and the large pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl StatArray {
    #[inline]
    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    /// Adds to the aggregate and to `pool`'s statistic.
    #[inline]
    pub fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }

    /// Removes from the aggregate and from `pool`'s statistic.
    #[inline]
    pub fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }

    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    fn for_each_mut(&mut self, mut f: impl FnMut(&mut Stat)) {
        f(&mut self.all);
        f(&mut self.small_pool);
        f(&mut self.large_pool);
    }

    fn entries(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }
}

/// Everything `torch.cuda.memory_stats()` reports for one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Allocations handed out (blocks in use by the program).
    pub allocation: StatArray,
    /// Segments held from the device.
    pub segment: StatArray,
    /// Blocks in use, or freed but waiting for other streams' work.
    pub active: StatArray,
    /// Free blocks that are part of a split segment (so the segment cannot be released).
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    /// Bytes the program asked for (before rounding).
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// Requests refused before any `cudaMalloc` under `throw_on_cudamalloc_oom` (PyTorch 2.15);
    /// ferrocache ignores that setting, so this stays 0, under PyTorch's key.
    pub num_oom_rejections: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    /// `max_split_size` in bytes; -1 when unlimited (as PyTorch reports it).
    pub max_split_size: i64,
    /// Blocks split to serve a request (ferrocache's own).
    pub num_splits: i64,
    /// Free blocks merged with a free neighbour (ferrocache's own).
    pub num_merges: i64,
}

impl DeviceStats {
    pub fn new(max_split_size: usize) -> DeviceStats {
        DeviceStats {
            max_split_size: if max_split_size == usize::MAX {
                -1
            } else {
                max_split_size as i64
            },
            ..DeviceStats::default()
        }
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// `reset_accumulated_memory_stats`: zero every `allocated`/`freed` and every counter.
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            array.for_each_mut(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_oom_rejections = 0;
        self.num_splits = 0;
        self.num_merges = 0;
    }

    /// `reset_peak_memory_stats`: every peak becomes the current value.
    pub fn reset_peaks(&mut self) {
        for array in self.arrays_mut() {
            array.for_each_mut(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// The statistics under `torch.cuda.memory_stats()`'s flat keys
    /// (`allocated_bytes.all.current`, `num_ooms`, ...), sorted by key as PyTorch sorts them.
    pub fn to_flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        let mut push_stat = |prefix: String, stat: &Stat| {
            out.push((format!("{prefix}.current"), stat.current));
            out.push((format!("{prefix}.peak"), stat.peak));
            out.push((format!("{prefix}.allocated"), stat.allocated));
            out.push((format!("{prefix}.freed"), stat.freed));
        };
        for (name, array) in self.arrays() {
            for (pool, stat) in array.entries() {
                push_stat(format!("{name}.{pool}"), stat);
            }
        }
        push_stat("oversize_allocations".into(), &self.oversize_allocations);
        push_stat("oversize_segments".into(), &self.oversize_segments);
        out.extend([
            ("num_alloc_retries".to_string(), self.num_alloc_retries),
            ("num_ooms".to_string(), self.num_ooms),
            (
                "num_sync_all_streams".to_string(),
                self.num_sync_all_streams,
            ),
            ("num_device_alloc".to_string(), self.num_device_alloc),
            ("num_device_free".to_string(), self.num_device_free),
            ("num_oom_rejections".to_string(), self.num_oom_rejections),
            ("max_split_size".to_string(), self.max_split_size),
            ("num_splits".to_string(), self.num_splits),
            ("num_merges".to_string(), self.num_merges),
        ]);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The flat statistics as one JSON object.
    pub fn to_json(&self) -> String {
        let map: serde_json::Map<String, serde_json::Value> = self
            .to_flat()
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::from(v)))
            .collect();
        serde_json::Value::Object(map).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        assert_eq!(
            s,
            Stat {
                current: 3,
                peak: 15,
                allocated: 15,
                freed: 12
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 3);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed, s.current), (0, 0, 3));
    }

    #[test]
    fn flat_keys_are_pytorchs() {
        let stats = DeviceStats::new(usize::MAX);
        let flat = stats.to_flat();
        let keys: Vec<&str> = flat.iter().map(|(k, _)| k.as_str()).collect();
        // 9 arrays x 3 pools x 4 metrics + 2 oversize x 4 + 9 counters.
        assert_eq!(keys.len(), 9 * 3 * 4 + 8 + 9);
        for key in [
            "allocated_bytes.all.current",
            "reserved_bytes.large_pool.peak",
            "active.small_pool.allocated",
            "inactive_split_bytes.all.freed",
            "requested_bytes.small_pool.current",
            "oversize_allocations.peak",
            "oversize_segments.current",
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "num_oom_rejections",
            "max_split_size",
            "num_splits",
            "num_merges",
        ] {
            assert!(keys.contains(&key), "{key} missing");
        }
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        assert!(flat.contains(&("max_split_size".to_string(), -1)));
    }
}
