//! Host cost of sleep and wake through the C ABI on the fake libcuda (`tests/fake-cuda/driver`,
//! built with optimisations), as `ferrocache.sleep` / `ferrocache.wake` call them: the figures
//! `benches/sleep.rs` gives for the core on the simulated GPU, with the driver calls of a real
//! process (`cuCtxSynchronize`, then per segment `cuMemUnmap` + `cuMemRelease` to sleep and
//! `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` to wake) made into the fake.
//!
//! `cargo bench --bench sleep_fake`
//!
//! - `sleep_wake_fake/{1,10}GiB`: a sleep and a wake without backup (the copies are the device's
//!   bandwidth, measured by `scripts/gpu-check` on a GPU) of 1 GiB and 10 GiB held as live
//!   2 MiB blocks from `rust_malloc`, ten to each 20 MiB segment, with `FERROCACHE_SLEEP=1`.
//! - `sleep_wake_fake_backup/1GiB`: the same 1 GiB slept with a backup, half of each segment
//!   live (the other half freed): on the fake a copy is a `memcpy` of host memory, so this
//!   measures what ferrocache adds around the copies and how many bytes it moves, not the bus.
//! - `SLEEP_FAKE_EXPANDABLE=1 cargo bench --bench sleep_fake`: the same cases with
//!   `expandable_segments:True` (groups named `..._expandable`): the blocks lie in expandable
//!   segments' 20 MiB pages, which sleep and wake page by page.
//!
//! `main` runs this program again with the fake first on `LD_LIBRARY_PATH`
//! (`support::rerun_benchmark_on_the_fake_libcuda`).

#[path = "../tests/cdylib/mod.rs"]
mod cdylib;
#[path = "../tests/support/mod.rs"]
mod support;

use criterion::{BenchmarkId, Criterion};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// A large-pool request: PyTorch serves it from a 20 MiB segment, split ten ways.
const BLOCK: usize = 2 * MIB;

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type EmptyCacheFn = unsafe extern "C" fn() -> c_int;
type SleepFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_char;
type WakeFn = unsafe extern "C" fn(*const c_char) -> *mut c_char;
type StringFreeFn = unsafe extern "C" fn(*mut c_char);

struct Abi {
    malloc: MallocFn,
    free: FreeFn,
    empty_cache: EmptyCacheFn,
    sleep: SleepFn,
    wake: WakeFn,
    string_free: StringFreeFn,
}

impl Abi {
    fn open() -> Abi {
        // Leaked: the functions are used until the process ends.
        let library = Box::leak(Box::new(cdylib::Ferrocache::open()));
        Abi {
            malloc: library.function("rust_malloc"),
            free: library.function("rust_free"),
            empty_cache: library.function("ferrocache_empty_cache"),
            sleep: library.function("ferrocache_sleep"),
            wake: library.function("ferrocache_wake"),
            string_free: library.function("ferrocache_string_free"),
        }
    }

    /// The report's text, freed; a NULL answer (an error) stops the benchmark.
    fn answered(&self, report: *mut c_char, what: &str) {
        assert!(!report.is_null(), "{what} failed");
        // SAFETY: a non-NULL answer is a NUL-terminated string from ferrocache, freed once here.
        unsafe {
            let _ = CStr::from_ptr(report);
            (self.string_free)(report);
        }
    }

    fn sleep_and_wake(&self, backup: bool) {
        // SAFETY: NULL tags means all memory; the functions are ferrocache's exports.
        let slept = unsafe { (self.sleep)(ptr::null(), c_int::from(backup)) };
        self.answered(slept, "ferrocache_sleep");
        // SAFETY: as above.
        let woke = unsafe { (self.wake)(ptr::null()) };
        self.answered(woke, "ferrocache_wake");
    }
}

/// Set to 1: the cases run with `expandable_segments:True`.
const EXPANDABLE_VARIABLE: &str = "SLEEP_FAKE_EXPANDABLE";

fn main() {
    let expandable = std::env::var(EXPANDABLE_VARIABLE).is_ok_and(|v| v == "1");
    let mut env = vec![
        ("FERROCACHE_SLEEP", "1".to_string()),
        ("FAKE_LIBCUDA_TOTAL_MEM", (16 * GIB).to_string()),
    ];
    if expandable {
        env.push((
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True".to_string(),
        ));
    }
    support::rerun_benchmark_on_the_fake_libcuda(&env);
    let suffix = if expandable { "_expandable" } else { "" };
    let abi = Abi::open();
    let mut criterion = Criterion::default().configure_from_args();
    backup_case(&abi, &mut criterion, suffix);
    let mut group = criterion.benchmark_group(format!("sleep_wake_fake{suffix}"));
    group.sample_size(20);
    let mut held = 0;
    for gib in [1, 10] {
        // Blocks stay live across the cases: the 10 GiB case adds 9 GiB to the first one's.
        while held < gib * GIB {
            // SAFETY: a plain allocation on the default stream of device 0.
            let block = unsafe { (abi.malloc)(BLOCK, 0, ptr::null_mut()) };
            assert!(
                !block.is_null(),
                "rust_malloc of 2 MiB failed with {held} bytes held"
            );
            held += BLOCK;
        }
        group.bench_function(BenchmarkId::from_parameter(format!("{gib}GiB")), |b| {
            b.iter(|| abi.sleep_and_wake(false))
        });
    }
    group.finish();
    criterion.final_summary();
}

/// 1 GiB of segments, every other 2 MiB block freed, slept with a backup and woken; the
/// blocks are freed afterwards and the cache emptied, so that the other cases start afresh.
fn backup_case(abi: &Abi, criterion: &mut Criterion, suffix: &str) {
    let blocks: Vec<*mut c_void> = (0..GIB / BLOCK)
        .map(|_| {
            // SAFETY: a plain allocation on the default stream of device 0.
            let block = unsafe { (abi.malloc)(BLOCK, 0, ptr::null_mut()) };
            assert!(!block.is_null(), "rust_malloc of 2 MiB failed");
            block
        })
        .collect();
    for &block in blocks.iter().step_by(2) {
        // SAFETY: a block from rust_malloc, freed once.
        unsafe { (abi.free)(block, BLOCK, 0, ptr::null_mut()) };
    }
    let mut group = criterion.benchmark_group(format!("sleep_wake_fake_backup{suffix}"));
    group.sample_size(10);
    group.bench_function(BenchmarkId::from_parameter("1GiB"), |b| {
        b.iter(|| abi.sleep_and_wake(true))
    });
    group.finish();
    for &block in blocks.iter().skip(1).step_by(2) {
        // SAFETY: as above.
        unsafe { (abi.free)(block, BLOCK, 0, ptr::null_mut()) };
    }
    // SAFETY: no arguments.
    let emptied = unsafe { (abi.empty_cache)() };
    assert_eq!(emptied, 0, "ferrocache_empty_cache failed");
}
