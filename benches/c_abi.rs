//! Host cost through the C ABI, as PyTorch calls it: `libferrocache.so` opened by path,
//! `rust_malloc` / `rust_free` / `rust_record_stream` called through function pointers, on the
//! fake libcuda (`tests/fake-cuda/driver`, built as the tests build it). Side by side in the same
//! process, so that ratios compare like with like: the core on the simulated device (no C ABI)
//! and glibc's `malloc` + `free` of 4 KiB.
//!
//! `cargo bench --bench c_abi` prints criterion's figures, then one table of medians and the
//! ratios the performance targets are stated in (see `docs/performance.md`). Each sample is
//! timed in chunks of 1,000 pairs and reports its median chunk, so that what the scheduler gives
//! to other processes on a shared machine does not count (see `common::median_chunk_time`).
//!
//! cudarc loads libcuda from the library search path the process started with, so `main` runs
//! this program again with the fake first on `LD_LIBRARY_PATH`.
//!
//! `FERROCACHE_BENCH_BASELINE=/path/to/libferrocache.so` (another build, e.g. of an older
//! commit) is measured in the same run: its C ABI pairs (`c_abi_baseline`, `*_baseline`) right
//! after this build's in each group, and the summary gives this build against it.

#[path = "../tests/cdylib/mod.rs"]
mod cdylib;
mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use common::median_chunk_time;
use criterion::{BenchmarkGroup, Criterion, measurement::WallTime};
use ferrocache::allocator::DeviceAllocator;
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use std::ffi::{c_int, c_void};
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SMALL: usize = 4 << 10;
const LARGE: usize = 64 << 20;

type Stream = *mut c_void;
type MallocFn = unsafe extern "C" fn(usize, c_int, Stream) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, Stream);
type RecordStreamFn = unsafe extern "C" fn(*mut c_void, Stream);
type ResetFn = unsafe extern "C" fn();
type LibcMallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
type LibcFreeFn = unsafe extern "C" fn(*mut c_void);

unsafe extern "C" {
    fn malloc(size: usize) -> *mut c_void;
    fn free(ptr: *mut c_void);
}

/// The functions PyTorch's `CUDAPluggableAllocator` is given, looked up as it looks them up.
#[derive(Clone, Copy)]
struct Abi {
    malloc: MallocFn,
    free: FreeFn,
    record_stream: RecordStreamFn,
    reset: ResetFn,
}

// SAFETY: plain function pointers into a library that stays loaded for the whole process (the
// `Library` is leaked), and the C ABI is thread-safe.
unsafe impl Send for Abi {}

/// The variable naming a baseline build of the library.
const BASELINE_VARIABLE: &str = "FERROCACHE_BENCH_BASELINE";

impl Abi {
    fn open() -> Abi {
        Abi::of(cdylib::Ferrocache::open())
    }

    /// The baseline build named by [`BASELINE_VARIABLE`], if any.
    fn baseline() -> Option<Abi> {
        let path = std::env::var_os(BASELINE_VARIABLE)?;
        Some(Abi::of(cdylib::Ferrocache::open_at(Path::new(&path))))
    }

    fn of(library: cdylib::Ferrocache) -> Abi {
        // Leaked: the functions are used until the process ends.
        let library = Box::leak(Box::new(library));
        Abi {
            malloc: library.function("rust_malloc"),
            free: library.function("rust_free"),
            record_stream: library.function("rust_record_stream"),
            reset: library.function("rust_reset"),
        }
    }

    fn alloc(&self, size: usize, stream: Stream) -> *mut c_void {
        // SAFETY: plain values; the stream is a handle from the fake (or 0). rust_malloc throws
        // only on failure, which the fake's 16 GiB rules out here.
        let ptr = unsafe { (self.malloc)(size, 0, stream) };
        assert!(!ptr.is_null(), "rust_malloc({size}) gave NULL");
        ptr
    }

    fn release(&self, ptr: *mut c_void, size: usize, stream: Stream) {
        // SAFETY: `ptr` came from `alloc` with this size and stream and is freed once.
        unsafe { (self.free)(ptr, size, 0, stream) }
    }

    /// One cache-hit pair, as PyTorch makes it.
    #[inline(always)]
    fn pair(&self, size: usize, stream: Stream) {
        let p = self.alloc(black_box(size), stream);
        self.release(black_box(p), size, stream);
    }

    /// `live` live blocks of `SMALL` bytes on `stream`, with one cached `SMALL` hole among them
    /// so that a `SMALL` request is a cache hit that neither splits nor merges.
    fn live_blocks(&self, live: usize, stream: Stream) -> LiveBlocks {
        let mut ptrs: Vec<*mut c_void> = (0..live + 2).map(|_| self.alloc(SMALL, stream)).collect();
        self.release(ptrs.remove(live / 2), SMALL, stream);
        LiveBlocks { ptrs, stream }
    }

    fn free_all(&self, blocks: LiveBlocks) {
        for p in blocks.ptrs {
            self.release(p, SMALL, blocks.stream);
        }
        // SAFETY: no arguments.
        unsafe { (self.reset)() };
    }
}

struct LiveBlocks {
    ptrs: Vec<*mut c_void>,
    stream: Stream,
}

// SAFETY: device addresses and a stream handle, never dereferenced here.
unsafe impl Send for LiveBlocks {}

/// The core on the simulated device with the same live blocks and hole as [`Abi::live_blocks`].
fn core_with_live_blocks(live: usize) -> DeviceAllocator<SimDevice> {
    let mut a = DeviceAllocator::new(SimDevice::new(1 << 40), 0, Config::default());
    let ptrs: Vec<u64> = (0..live + 2).map(|_| a.malloc(SMALL, 0).unwrap()).collect();
    a.free(ptrs[live / 2]).unwrap();
    a
}

fn bench_core(group: &mut BenchmarkGroup<'_, WallTime>, live: usize, size: usize) {
    let mut a = core_with_live_blocks(live);
    group.bench_function("core_sim", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                let p = a.malloc(black_box(size), 0).unwrap();
                a.free(black_box(p)).unwrap();
            })
        })
    });
}

fn bench_glibc(group: &mut BenchmarkGroup<'_, WallTime>) {
    // Through pointers, as the allocator is called, so neither call is inlined away.
    let (alloc, release): (LibcMallocFn, LibcFreeFn) = black_box((malloc, free));
    group.bench_function("glibc_4KiB", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                // SAFETY: a fresh allocation, freed once.
                unsafe { release(black_box(alloc(black_box(SMALL)))) }
            })
        })
    });
}

/// 4 KiB and 64 MiB cache-hit pairs with 1k, 10k and 100k live blocks, each next to the core's
/// own pair on the same population, to glibc and to the baseline's C ABI, if one is given.
fn cache_hit_pairs(c: &mut Criterion, abi: Abi, baseline: Option<Abi>) {
    for live in [1_000, 10_000, 100_000] {
        let blocks = abi.live_blocks(live, ptr::null_mut());
        let baseline_blocks = baseline.map(|b| (b, b.live_blocks(live, ptr::null_mut())));
        let mut group = c.benchmark_group(format!("cache_hit_4KiB/live_{live}"));
        group.bench_function("c_abi", |b| {
            b.iter_custom(|iters| median_chunk_time(iters, || abi.pair(SMALL, ptr::null_mut())))
        });
        if let Some(baseline) = baseline {
            group.bench_function("c_abi_baseline", |b| {
                b.iter_custom(|iters| {
                    median_chunk_time(iters, || baseline.pair(SMALL, ptr::null_mut()))
                })
            });
        }
        bench_core(&mut group, live, SMALL);
        bench_glibc(&mut group);
        group.finish();

        let mut group = c.benchmark_group(format!("cache_hit_64MiB/live_{live}"));
        abi.pair(LARGE, ptr::null_mut()); // the segment, cached from now on
        group.bench_function("c_abi", |b| {
            b.iter_custom(|iters| median_chunk_time(iters, || abi.pair(LARGE, ptr::null_mut())))
        });
        if let Some(baseline) = baseline {
            baseline.pair(LARGE, ptr::null_mut());
            group.bench_function("c_abi_baseline", |b| {
                b.iter_custom(|iters| {
                    median_chunk_time(iters, || baseline.pair(LARGE, ptr::null_mut()))
                })
            });
        }
        bench_core(&mut group, live, LARGE);
        group.finish();
        abi.free_all(blocks);
        if let Some((baseline, blocks)) = baseline_blocks {
            baseline.free_all(blocks);
        }
    }
}

/// A thread that allocates on its own stream when told to.
struct Worker {
    orders: Sender<Order>,
    thread: Option<JoinHandle<()>>,
}

struct Order {
    pairs: u64,
    /// Shared by the workers of one run, so that they start together.
    start: Arc<Barrier>,
    /// When this worker started and finished its pairs. Workers time themselves: the thread
    /// that gives the orders may be descheduled at any moment on a busy machine.
    report: Sender<(Instant, Instant)>,
}

impl Worker {
    fn spawn(abi: Abi, stream: u64, live: usize) -> Worker {
        let (orders, inbox): (Sender<Order>, Receiver<Order>) = channel();
        let thread = std::thread::spawn(move || {
            let stream: Stream = ptr::without_provenance_mut(stream as usize);
            let blocks = abi.live_blocks(live, stream);
            for order in inbox {
                order.start.wait();
                let began = Instant::now();
                for _ in 0..order.pairs {
                    abi.pair(SMALL, stream);
                }
                let _ = order.report.send((began, Instant::now()));
            }
            for p in blocks.ptrs {
                abi.release(p, SMALL, stream);
            }
        });
        Worker {
            orders,
            thread: Some(thread),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        let (closed, _) = channel();
        drop(std::mem::replace(&mut self.orders, closed));
        if let Some(thread) = self.thread.take() {
            thread.join().expect("a worker thread panicked");
        }
    }
}

/// Pairs each worker makes per timed round.
const ROUND: u64 = 10_000;

/// The time for every one of `workers` to make `pairs` pairs, started together, in rounds of
/// [`ROUND`] pairs each: the median round's time from the first start to the last finish, per
/// pair, times `pairs` (the median for the reason [`median_chunk_time`] gives).
fn run_together(workers: &[&Worker], pairs: u64) -> Duration {
    let mut per_pair = Vec::new();
    let mut remaining = pairs;
    while remaining > 0 {
        let round = remaining.min(ROUND);
        remaining -= round;
        per_pair.push(one_round(workers, round).as_secs_f64() / round as f64);
    }
    per_pair.sort_by(f64::total_cmp);
    Duration::from_secs_f64(per_pair[per_pair.len() / 2] * pairs as f64)
}

/// One round: each worker makes `pairs` pairs; from the first start to the last finish.
fn one_round(workers: &[&Worker], pairs: u64) -> Duration {
    let start = Arc::new(Barrier::new(workers.len()));
    let (report, reports) = channel();
    for worker in workers {
        let order = Order {
            pairs,
            start: start.clone(),
            report: report.clone(),
        };
        worker.orders.send(order).expect("the worker is running");
    }
    drop(report);
    let times: Vec<(Instant, Instant)> = reports.iter().collect();
    assert_eq!(times.len(), workers.len(), "a worker stopped");
    let first_start = times
        .iter()
        .map(|t| t.0)
        .min()
        .expect("at least one worker");
    let last_finish = times
        .iter()
        .map(|t| t.1)
        .max()
        .expect("at least one worker");
    last_finish - first_start
}

/// Two threads, each on its own stream with 2,500 live blocks: the time per pair that each
/// thread sees, next to one thread alone on the same allocator; the baseline's the same way.
fn two_streams(c: &mut Criterion, [first, second]: &[Worker; 2], baseline: Option<&[Worker; 2]>) {
    let mut group = c.benchmark_group("streams_live_2500_each");
    group.bench_function("one_thread", |b| {
        b.iter_custom(|pairs| run_together(&[first], pairs))
    });
    group.bench_function("two_threads", |b| {
        b.iter_custom(|pairs| run_together(&[first, second], pairs))
    });
    if let Some([first, second]) = baseline {
        group.bench_function("one_thread_baseline", |b| {
            b.iter_custom(|pairs| run_together(&[first], pairs))
        });
        group.bench_function("two_threads_baseline", |b| {
            b.iter_custom(|pairs| run_together(&[first, second], pairs))
        });
    }
    group.finish();
}

/// `Tensor.record_stream` on a second stream before each free: the free records an event on
/// that stream (`cuEventRecord`), the next allocation finds it completed (`cuEventQuery`), so
/// this pair includes the fake driver's cost. With 10k live blocks, next to a plain pair.
fn record_stream_pair(c: &mut Criterion, abi: Abi) {
    let other: Stream = ptr::without_provenance_mut(support::new_stream() as usize);
    let blocks = abi.live_blocks(10_000, ptr::null_mut());
    let mut group = c.benchmark_group("record_stream/live_10000");
    group.bench_function("plain_pair", |b| {
        b.iter_custom(|iters| median_chunk_time(iters, || abi.pair(SMALL, ptr::null_mut())))
    });
    group.bench_function("record_stream_pair", |b| {
        b.iter_custom(|iters| {
            median_chunk_time(iters, || {
                let p = abi.alloc(black_box(SMALL), ptr::null_mut());
                // SAFETY: a live allocation; the stream is the fake's.
                unsafe { (abi.record_stream)(p, other) };
                abi.release(p, SMALL, ptr::null_mut());
            })
        })
    });
    group.finish();
    abi.free_all(blocks);
}

// ------------------------------------------------------------------------------------------------
// The summary: medians and ratios from this run
// ------------------------------------------------------------------------------------------------

fn criterion_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR lies in the target directory")
        .join("criterion")
}

/// The median of benchmark `group/function` from this run, in ns, if it ran.
fn median_ns(group: &str, function: &str) -> Option<f64> {
    let path = criterion_dir()
        .join(group.replace('/', "_"))
        .join(function)
        .join("new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let estimates: serde_json::Value = serde_json::from_str(&text).ok()?;
    estimates["median"]["point_estimate"].as_f64()
}

/// A ratio next to its target, for the summary.
fn against(ratio: f64, target: f64) -> String {
    let verdict = if ratio <= target { "met" } else { "MISSED" };
    format!("{ratio:.2} (target <= {target}: {verdict})")
}

/// One line per comparison the targets of issue 13 are stated in (see `docs/performance.md`);
/// comparisons whose benchmarks did not run in this process (filtered out) are left out.
fn print_summary(started: std::time::SystemTime) {
    let fresh = |group: &str, function: &str| {
        let path = criterion_dir()
            .join(group.replace('/', "_"))
            .join(function)
            .join("new/estimates.json");
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok()?;
        (modified >= started).then(|| median_ns(group, function))?
    };
    let mut lines = Vec::new();
    let mut c_abi_10k = None;
    for live in [1_000, 10_000, 100_000] {
        let small = format!("cache_hit_4KiB/live_{live}");
        let (abi, core, glibc) = (
            fresh(&small, "c_abi"),
            fresh(&small, "core_sim"),
            fresh(&small, "glibc_4KiB"),
        );
        if let (Some(abi), Some(core), Some(glibc)) = (abi, core, glibc) {
            lines.push(format!(
                "4 KiB, {live:>6} live: C ABI {abi:5.1} ns, core {core:5.1} ns, glibc {glibc:5.1} ns"
            ));
            if let Some(baseline) = fresh(&small, "c_abi_baseline") {
                lines.push(format!(
                    "    baseline C ABI {baseline:5.1} ns: this/baseline {:.2}, baseline/glibc {:.2}",
                    abi / baseline,
                    baseline / glibc
                ));
            }
            if live == 10_000 {
                c_abi_10k = Some(abi);
                lines.push(format!("    C ABI/core  {}", against(abi / core, 1.2)));
                lines.push(format!("    C ABI/glibc {}", against(abi / glibc, 2.0)));
            } else {
                lines.push(format!(
                    "    C ABI/core {:.2}, C ABI/glibc {:.2}",
                    abi / core,
                    abi / glibc
                ));
            }
            if live == 100_000
                && let Some(at_10k) = c_abi_10k
            {
                lines.push(format!(
                    "    C ABI at 100k / C ABI at 10k {}",
                    against(abi / at_10k, 1.5)
                ));
            }
        }
        let large = format!("cache_hit_64MiB/live_{live}");
        if let (Some(abi), Some(core)) = (fresh(&large, "c_abi"), fresh(&large, "core_sim")) {
            lines.push(format!(
                "64 MiB, {live:>5} live: C ABI {abi:5.1} ns, core {core:5.1} ns; C ABI/core {:.2}",
                abi / core
            ));
            if let Some(baseline) = fresh(&large, "c_abi_baseline") {
                lines.push(format!(
                    "    baseline C ABI {baseline:5.1} ns: this/baseline {:.2}",
                    abi / baseline
                ));
            }
        }
    }
    let streams = "streams_live_2500_each";
    if let (Some(one), Some(two)) = (fresh(streams, "one_thread"), fresh(streams, "two_threads")) {
        lines.push(format!(
            "2 streams, 2,500 live each: one thread {one:5.1} ns/pair, two threads {two:5.1} ns/pair each"
        ));
        lines.push(format!("    two/one {}", against(two / one, 2.5)));
    }
    if let (Some(one), Some(two)) = (
        fresh(streams, "one_thread_baseline"),
        fresh(streams, "two_threads_baseline"),
    ) {
        lines.push(format!(
            "    baseline: one thread {one:5.1} ns/pair, two threads {two:5.1} ns/pair each; two/one {:.2}",
            two / one
        ));
    }
    let record = "record_stream/live_10000";
    if let (Some(plain), Some(recorded)) = (
        fresh(record, "plain_pair"),
        fresh(record, "record_stream_pair"),
    ) {
        lines.push(format!(
            "record_stream pair, 10,000 live: {recorded:5.1} ns (plain pair {plain:5.1} ns)"
        ));
    }
    if !lines.is_empty() {
        println!("\nhost cost, medians of this run:");
        for line in lines {
            println!("  {line}");
        }
    }
}

// The fake libcuda of a measuring run is built with optimisations: the record_stream pair calls
// it four times (`cuCtxGetCurrent` and `cuEventRecord` on free, `cuCtxGetCurrent` and
// `cuEventQuery` on the next malloc), and the debug build would make its own cost most of that
// figure. Cache hits never call it.
fn main() {
    support::rerun_benchmark_on_the_fake_libcuda(&[]);
    let started = std::time::SystemTime::now();
    let abi = Abi::open();
    let baseline = Abi::baseline();
    // Started first, as PyTorch's threads are: glibc's malloc skips its locks only while a
    // process has a single thread, which no PyTorch process has.
    let workers = [
        Worker::spawn(abi, support::new_stream(), 2_500),
        Worker::spawn(abi, support::new_stream(), 2_500),
    ];
    let baseline_workers = baseline.map(|baseline| {
        [
            Worker::spawn(baseline, support::new_stream(), 2_500),
            Worker::spawn(baseline, support::new_stream(), 2_500),
        ]
    });
    let mut criterion = Criterion::default()
        .output_directory(&criterion_dir())
        .configure_from_args();
    cache_hit_pairs(&mut criterion, abi, baseline);
    two_streams(&mut criterion, &workers, baseline_workers.as_ref());
    record_stream_pair(&mut criterion, abi);
    criterion.final_summary();
    print_summary(started);
}
