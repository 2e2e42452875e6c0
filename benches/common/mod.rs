//! What the benchmarks share: timing that leaves out what the scheduler gives to other work.

use std::time::{Duration, Instant};

/// Pairs per timed chunk.
const CHUNK: u64 = 1_000;

/// Runs `pair` `iters` times in chunks of [`CHUNK`] and returns the median chunk's time per
/// pair, times `iters` (for criterion's `iter_custom`). The machines these run on are shared
/// with other work, and a chunk the scheduler interrupts (a few in a hundred) would otherwise
/// count that work as ours; the median chunk is one nobody interrupted. Figures that are
/// compared are all taken this way, so that ratios compare like with like.
pub fn median_chunk_time(iters: u64, mut pair: impl FnMut()) -> Duration {
    if iters == 0 {
        return Duration::ZERO;
    }
    let mut per_pair = Vec::with_capacity(iters.div_ceil(CHUNK) as usize);
    let mut remaining = iters;
    while remaining > 0 {
        let pairs = remaining.min(CHUNK);
        remaining -= pairs;
        let began = Instant::now();
        for _ in 0..pairs {
            pair();
        }
        per_pair.push(began.elapsed().as_secs_f64() / pairs as f64);
    }
    per_pair.sort_by(f64::total_cmp);
    Duration::from_secs_f64(per_pair[per_pair.len() / 2] * iters as f64)
}
