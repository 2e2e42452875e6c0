//! Host cost of sleep and wake on the simulated GPU, and what sleep-ability costs when it is on
//! and never used (`docs/sleep.md`).
//!
//! `cargo bench --bench sleep`
//!
//! - `sleep_wake/{1,10}GiB`: a sleep and a wake, without backup (the copies are the device's
//!   bandwidth, not the allocator's cost), of 1 GiB and 10 GiB held as live 2 MiB blocks, ten
//!   to each 20 MiB segment (PyTorch's segment size for them).
//! - `sleep_wake_backup/{vmm,expandable}/1GiB`: 1 GiB of 2 MiB blocks, every other one freed
//!   again, slept with a backup and woken, in VMM-backed segments and in expandable ones: the
//!   live half is copied (on the simulated GPU a copy is a `memcpy` of its page contents).
//! - `new_segment/{plain,sleepable}`: a miss that makes a 20 MiB segment and its release (one
//!   `cudaMalloc` and `cudaFree` against reserve, create, map, set access and their undo).
//! - `cache_hit/{plain,sleepable}`: a cache hit, which makes no device call either way.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ferrocache::allocator::DeviceAllocator;
use ferrocache::allocator::sleep::Tags;
use ferrocache::config::Config;
use ferrocache::device::Device;
use ferrocache::device::sim::SimDevice;
use std::hint::black_box;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const SEGMENT: usize = 20 * MIB;
/// A large-pool request: PyTorch serves it from a 20 MiB segment, split ten ways.
const BLOCK: usize = 2 * MIB;

fn allocator(sleepable: bool) -> DeviceAllocator<SimDevice> {
    let mut a = DeviceAllocator::new(SimDevice::new(64 * GIB), 0, Config::default());
    a.set_sleepable(sleepable);
    a.device_mut().set_complete_immediately(true);
    a.device_mut().set_record_waits(false);
    a
}

/// `total` bytes of live 2 MiB blocks.
fn holding(total: usize) -> DeviceAllocator<SimDevice> {
    let mut a = allocator(true);
    for _ in 0..total / BLOCK {
        a.malloc(BLOCK, 0).unwrap();
    }
    a
}

fn sleep_wake(c: &mut Criterion) {
    let mut group = c.benchmark_group("sleep_wake");
    group.sample_size(10);
    for gib in [1, 10] {
        let mut a = holding(gib * GIB);
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{gib}GiB")),
            &gib,
            |b, _| {
                b.iter(|| {
                    black_box(a.sleep(Tags::All, false).unwrap());
                    black_box(a.wake(Tags::All).unwrap());
                })
            },
        );
    }
    group.finish();
}

/// 1 GiB of 2 MiB blocks, every other one freed: half of it live, each block written once.
fn half_live(expandable: bool) -> DeviceAllocator<SimDevice> {
    let config = Config {
        expandable_segments: expandable,
        ..Config::default()
    };
    let mut a = DeviceAllocator::new(SimDevice::new(64 * GIB), 0, config);
    a.set_sleepable(true);
    a.device_mut().set_complete_immediately(true);
    a.device_mut().set_record_waits(false);
    let blocks: Vec<u64> = (0..GIB / BLOCK)
        .map(|_| a.malloc(BLOCK, 0).unwrap())
        .collect();
    let bytes = vec![7u8; BLOCK];
    for (i, &block) in blocks.iter().enumerate() {
        if i % 2 == 0 {
            a.free(block).unwrap();
        } else {
            a.device_mut().copy_from_host(block, &bytes).unwrap();
        }
    }
    a
}

fn sleep_wake_backup(c: &mut Criterion) {
    let mut group = c.benchmark_group("sleep_wake_backup");
    group.sample_size(10);
    for (name, expandable) in [("vmm", false), ("expandable", true)] {
        let mut a = half_live(expandable);
        group.bench_function(BenchmarkId::new(name, "1GiB"), |b| {
            b.iter(|| {
                black_box(a.sleep(Tags::All, true).unwrap());
                black_box(a.wake(Tags::All).unwrap());
            })
        });
    }
    group.finish();
}

fn new_segment(c: &mut Criterion) {
    let mut group = c.benchmark_group("new_segment");
    for (name, sleepable) in [("plain", false), ("sleepable", true)] {
        let mut a = allocator(sleepable);
        group.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(SEGMENT), 0).unwrap();
                a.free(p).unwrap();
                a.empty_cache().unwrap();
            })
        });
    }
    group.finish();
}

fn cache_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("cache_hit");
    for (name, sleepable) in [("plain", false), ("sleepable", true)] {
        let mut a = allocator(sleepable);
        let keep: Vec<u64> = (0..1000).map(|_| a.malloc(4096, 0).unwrap()).collect();
        a.free(keep[500]).unwrap();
        group.bench_function(name, |b| {
            b.iter(|| {
                let p = a.malloc(black_box(4096), 0).unwrap();
                a.free(black_box(p)).unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    sleep_wake,
    sleep_wake_backup,
    new_segment,
    cache_hit
);
criterion_main!(benches);
