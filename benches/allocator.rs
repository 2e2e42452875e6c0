//! Host cost of the allocator's hot paths, on the simulated GPU (no device call happens on a
//! cache hit, so this is the allocator's own cost).
//!
//! `cargo bench --bench allocator`

mod common;

use common::median_chunk_time;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ferrocache::allocator::DeviceAllocator;
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use ferrocache::lock::SpinNapMutex;
use std::hint::black_box;

const BLOCK: usize = 4096;

/// An allocator with `live` allocations of 4 KiB and one cached 4 KiB hole between two of
/// them, so a 4 KiB request is a cache hit that neither splits nor merges.
fn with_live_blocks(live: usize) -> DeviceAllocator<SimDevice> {
    let mut a = DeviceAllocator::new(SimDevice::new(1 << 40), 0, Config::default());
    let ptrs: Vec<u64> = (0..live + 2).map(|_| a.malloc(BLOCK, 0).unwrap()).collect();
    a.free(ptrs[live / 2]).unwrap();
    a
}

fn cache_hit_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cache_hit_malloc_free");
    for live in [1_000, 10_000, 100_000] {
        let mut a = with_live_blocks(live);
        group.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                let p = a.malloc(black_box(BLOCK), 0).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
    }
    group.finish();
}

/// The same for large-pool blocks (8 MiB), which sit in the pool's ordered map.
fn large_cache_hit_pair(c: &mut Criterion) {
    const LARGE: usize = 8 << 20;
    let mut group = c.benchmark_group("large_cache_hit_malloc_free");
    for live in [1_000, 10_000] {
        let mut a = DeviceAllocator::new(SimDevice::new(1 << 50), 0, Config::default());
        let ptrs: Vec<u64> = (0..live + 2).map(|_| a.malloc(LARGE, 0).unwrap()).collect();
        a.free(ptrs[live / 2]).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                let p = a.malloc(black_box(LARGE), 0).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
    }
    group.finish();
}

fn split_merge_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("split_merge_malloc_free");
    for live in [1_000, 10_000, 100_000] {
        let mut a = with_live_blocks(live);
        // A fresh segment with a large free rest: every request splits it, every free merges.
        let keep = a.malloc(BLOCK, 7).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                let p = a.malloc(black_box(BLOCK), 7).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
        a.free(keep).unwrap();
    }
    group.finish();
}

/// The cache-hit pair with the lock taken around each call, as the C ABI takes it: the lock
/// ferrocache uses (`lock::SpinNapMutex`, released by a plain store) next to parking_lot's
/// mutex (released by an atomic read-modify-write), with 10,000 live blocks.
fn locked_cache_hit_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("locked_cache_hit_malloc_free/10000");
    let spin_nap = SpinNapMutex::new(with_live_blocks(10_000));
    group.bench_function("spin_nap", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                let p = spin_nap
                    .lock()
                    .unwrap()
                    .malloc(black_box(BLOCK), 0)
                    .unwrap();
                spin_nap.lock().unwrap().free(black_box(p)).unwrap();
            })
        })
    });
    let parking = parking_lot::Mutex::new(with_live_blocks(10_000));
    group.bench_function("parking_lot", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                let p = parking.lock().malloc(black_box(BLOCK), 0).unwrap();
                parking.lock().free(black_box(p)).unwrap();
            })
        })
    });
    let mut unlocked = with_live_blocks(10_000);
    group.bench_function("no_lock", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                let p = unlocked.malloc(black_box(BLOCK), 0).unwrap();
                unlocked.free(black_box(p)).unwrap();
            })
        })
    });
    group.finish();
}

/// A cache hit while a CUDA graph capture is under way, side by side with none: the capture's
/// stream filter is asked on every allocation (PyTorch's `get_pool`).
fn capture_cache_hit_pair(c: &mut Criterion) {
    const CAPTURE: u64 = 0x5000;
    let mut group = c.benchmark_group("capture_cache_hit_malloc_free");
    let cases = [
        ("no_capture", None),
        ("capture_on_another_stream", Some(CAPTURE)),
        ("into_the_capture_pool", Some(0)),
    ];
    for (name, capture_stream) in cases {
        let mut a = with_live_blocks(1_000);
        if let Some(stream) = capture_stream {
            a.begin_allocate_to_pool((1, 0), Box::new(move |s| Ok(s == stream)))
                .unwrap();
            // The same state in the pool: a cached 4 KiB hole between two live blocks.
            let held: Vec<u64> = (0..3).map(|_| a.malloc(BLOCK, 0).unwrap()).collect();
            a.free(held[1]).unwrap();
        }
        group.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(BLOCK), 0).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
    }
    group.finish();
}

/// Cross-stream reuse (FERROCACHE_CROSS_STREAM=1): a malloc on stream 1 that takes the block
/// cached on stream 0 (one event record, one wait, one event release), then the same back,
/// against the same-stream hit on the same allocator; each iteration is two malloc/free pairs.
fn cross_stream_hit_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("cross_stream_hit_malloc_free_x2");
    let config = Config {
        cross_stream: true,
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(1 << 40), 0, config);
    a.device_mut().set_record_waits(false);
    // Two 2 MiB small-pool segments filled exactly, then one hole: the only cached block, so
    // every malloc below misses its own stream's cache and takes the other stream's.
    let ptrs: Vec<u64> = (0..1_024).map(|_| a.malloc(BLOCK, 0).unwrap()).collect();
    a.free(ptrs[512]).unwrap();
    // The same-stream case runs on stream 0 first, where the hole is.
    group.bench_function("same_stream", |b| {
        b.iter(|| {
            for stream in [0, 0] {
                let p = a.malloc(black_box(BLOCK), stream).unwrap();
                a.free(black_box(p)).unwrap();
            }
        })
    });
    group.bench_function("cross_stream", |b| {
        b.iter(|| {
            for stream in [1, 0] {
                let p = a.malloc(black_box(BLOCK), stream).unwrap();
                a.free(black_box(p)).unwrap();
            }
        })
    });
    assert!(
        a.cross_stream_counts().reuses > 0,
        "the cross-stream case took blocks"
    );
    group.finish();
}

criterion_group!(
    benches,
    cross_stream_hit_pair,
    cache_hit_pair,
    large_cache_hit_pair,
    split_merge_pair,
    locked_cache_hit_pair,
    capture_cache_hit_pair
);
criterion_main!(benches);
