//! Every driver call fails once (issue 16, item 1), through the C ABI on the fake libcuda.
//!
//! One fixed program — allocations of many sizes on 3 streams, `record_stream` with late events,
//! a memory fraction, an out-of-memory with its retries, `empty_cache`, then everything freed —
//! runs once to count the N driver calls it makes. Then it runs again, in a process of its own
//! each time, with call i failing, for every i: with one kind of error each, in rotation along
//! the calls (CI), or with each kind in turn (`FERROCACHE_FAULT_SWEEP=every-kind`, by hand): out
//! of memory, an invalid value, an invalid handle, "not permitted during capture", and a sticky
//! illegal address after which every call fails. After each run:
//! - the process exited normally and nothing panicked;
//! - the failure reached the caller: an operation's result or error differs from the clean
//!   run's, or an ERROR line was logged, or (out of memory) the allocator logged its retry;
//! - `ferrocache_check_invariants` holds;
//! - after a non-sticky error the next operations work, and once everything is freed and the
//!   cache emptied, the fake holds no device allocation, reservation, physical page, mapping or
//!   event;
//! - after a sticky error ferrocache logs it once and makes no further driver call (only the
//!   look-up of the error's text).
//!
//! The program comes in five parts, each swept on its own: with ordinary segments (it also
//! allocates once while a capture is under way without a pool), with `expandable_segments:True`,
//! with sleep and wake of VMM-backed segments (`FERROCACHE_SLEEP=1`, docs/sleep.md), the same
//! with expandable segments, whose pages sleep and wake, and CUDA
//! graph captures into a private pool shared by two graphs, made as PyTorch's
//! `CUDAGraph` makes them: its pool hooks with PyTorch's C++ types and its stream filter, which
//! asks the driver for the stream's capture (`tests/cpp/capture_hooks.cpp`).

mod cdylib;
mod support;

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_double, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::ptr;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cdylib::Ferrocache;
use support::{FakeCuda, fake_libcuda_dir, new_stream};

const MIB: usize = 1 << 20;
/// The fake GPU's memory: small enough for the program's out-of-memory.
const DEVICE_MEMORY: usize = 256 * MIB;
/// Set in a child process: which program it runs, and the failure to inject.
const CHILD: &str = "FERROCACHE_SWEEP_CHILD";
const FAIL_AT: &str = "FERROCACHE_SWEEP_FAIL_AT";
const FAIL_CODE: &str = "FERROCACHE_SWEEP_FAIL_CODE";
const FAIL_STICKY: &str = "FERROCACHE_SWEEP_FAIL_STICKY";
/// Set when the failure lasts for the process (a sticky error, a failed `cuInit`).
const FAIL_PERMANENT: &str = "FERROCACHE_SWEEP_FAIL_PERMANENT";
/// The compiled `tests/cpp/capture_hooks.cpp`, built once by the parent.
const CAPTURE_HOOKS: &str = "FERROCACHE_SWEEP_CAPTURE_HOOKS";
/// A child that runs longer than this is taken to hang.
const CHILD_TIMEOUT: Duration = Duration::from_secs(60);

/// A kind of error the driver gives, as the sweep injects it.
#[derive(Clone, Copy, Debug)]
struct Kind {
    name: &'static str,
    code: u32,
    sticky: bool,
}

const KINDS: [Kind; 5] = [
    Kind {
        name: "out of memory",
        code: 2,
        sticky: false,
    },
    Kind {
        name: "invalid value",
        code: 1,
        sticky: false,
    },
    Kind {
        name: "invalid handle",
        code: 400,
        sticky: false,
    },
    Kind {
        name: "not permitted during capture",
        code: 900,
        sticky: false,
    },
    Kind {
        name: "illegal address (sticky)",
        code: 700,
        sticky: true,
    },
];

// ------------------------------------------------------------------------------------------------
// The child: the program, through the C ABI
// ------------------------------------------------------------------------------------------------

/// The C ABI, as PyTorch's hooks and the Python package call it (`ferrocache_alloc` is
/// `rust_malloc` without the C++ throw).
struct Api {
    library: Ferrocache,
    /// `tests/cpp/capture_hooks.cpp` (PyTorch's `CUDAGraph` side of the pool hooks), when the
    /// parent built it.
    capture_hooks: Option<libloading::Library>,
}

impl Api {
    fn alloc(&self, size: usize, stream: u64) -> Result<*mut c_void, String> {
        let alloc: unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void =
            self.library.function("ferrocache_alloc");
        // SAFETY: plain values; the stream handle is only passed on.
        let ptr = unsafe { alloc(size, 0, ptr::without_provenance_mut(stream as usize)) };
        if ptr.is_null() {
            Err(self.last_error())
        } else {
            Ok(ptr)
        }
    }

    /// `rust_free`, PyTorch's free hook: errors are logged, not returned.
    fn rust_free(&self, ptr: *mut c_void, size: usize, stream: u64) {
        let free: unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void) =
            self.library.function("rust_free");
        // SAFETY: ferrocache checks the pointer against what it handed out.
        unsafe { free(ptr, size, 0, ptr::without_provenance_mut(stream as usize)) }
    }

    /// `rust_record_stream`, PyTorch's hook for `Tensor.record_stream`.
    fn record_stream(&self, ptr: *mut c_void, stream: u64) {
        let record: unsafe extern "C" fn(*mut c_void, *mut c_void) =
            self.library.function("rust_record_stream");
        // SAFETY: ferrocache checks the pointer; the stream is only passed on.
        unsafe { record(ptr, ptr::without_provenance_mut(stream as usize)) }
    }

    fn status(&self, name: &str, result: c_int) -> Result<(), String> {
        if result == 0 {
            Ok(())
        } else {
            Err(format!("{name}: {}", self.last_error()))
        }
    }

    fn set_memory_fraction(&self, fraction: f64) -> Result<(), String> {
        let set: unsafe extern "C" fn(c_double, c_int) -> c_int =
            self.library.function("ferrocache_set_memory_fraction");
        // SAFETY: plain values.
        self.status("set_memory_fraction", unsafe { set(fraction, 0) })
    }

    fn empty_cache(&self) -> Result<(), String> {
        let empty: unsafe extern "C" fn() -> c_int =
            self.library.function("ferrocache_empty_cache");
        // SAFETY: no arguments.
        self.status("empty_cache", unsafe { empty() })
    }

    /// `ferrocache_sleep` (NULL: every tag) or, with `wake`, `ferrocache_wake`.
    fn sleep_or_wake(&self, wake: bool, backup: bool) -> Result<(), String> {
        let text = if wake {
            let wake: unsafe extern "C" fn(*const c_char) -> *mut c_char =
                self.library.function("ferrocache_wake");
            // SAFETY: NULL names every tag.
            unsafe { wake(ptr::null()) }
        } else {
            let sleep: unsafe extern "C" fn(*const c_char, c_int) -> *mut c_char =
                self.library.function("ferrocache_sleep");
            // SAFETY: NULL names every tag.
            unsafe { sleep(ptr::null(), c_int::from(backup)) }
        };
        if text.is_null() {
            return Err(self.last_error());
        }
        let free: unsafe extern "C" fn(*mut c_char) =
            self.library.function("ferrocache_string_free");
        // SAFETY: a report ferrocache returned, freed once.
        unsafe { free(text) };
        Ok(())
    }

    fn check_invariants(&self) -> Result<(), String> {
        let check: unsafe extern "C" fn() -> c_int =
            self.library.function("ferrocache_check_invariants");
        // SAFETY: no arguments.
        self.status("check_invariants", unsafe { check() })
    }

    /// PyTorch's `CUDAGraph::capture_begin`: the begin hook, with a filter that accepts the
    /// streams whose capture has the id `*capture_id`.
    fn capture_begin(
        &self,
        pool: (u64, u64),
        capture_info: *mut c_void,
        capture_id: *const u64,
    ) -> Result<(), String> {
        type Begin = unsafe extern "C" fn(
            *mut c_void,
            c_int,
            u64,
            u64,
            *mut c_void,
            *const u64,
        ) -> *const c_char;
        let begin: Begin = self.capture_hook("capture_hooks_begin");
        let hook = self.library.address("rust_begin_allocate_to_pool");
        // SAFETY: the hook has the C++ type the helper casts it to; `capture_info` is the fake's
        // cuStreamGetCaptureInfo; `capture_id` outlives the capture (the program keeps it).
        let refused = unsafe { begin(hook, 0, pool.0, pool.1, capture_info, capture_id) };
        if refused.is_null() {
            Ok(())
        } else {
            // SAFETY: a NUL-terminated string, valid until this thread's next begin.
            Err(unsafe { CStr::from_ptr(refused) }
                .to_string_lossy()
                .into_owned())
        }
    }

    /// `capture_end` or `reset`: the end or the release hook (`hook`), which log what they refuse.
    fn pool_hook(&self, hook: &str, pool: (u64, u64)) {
        type Call = unsafe extern "C" fn(*mut c_void, c_int, u64, u64);
        let call: Call = self.capture_hook("capture_hooks_pool_call");
        // SAFETY: `hook` is one of the two hooks of type void(int, MempoolId_t).
        unsafe { call(self.library.address(hook), 0, pool.0, pool.1) }
    }

    /// The capture helper's export `name`; `T` must be its exact C signature.
    fn capture_hook<T: Copy>(&self, name: &str) -> T {
        let hooks = self
            .capture_hooks
            .as_ref()
            .expect("the capture hooks are loaded");
        // SAFETY: each caller names an export of tests/cpp/capture_hooks.cpp with its signature.
        *unsafe { hooks.get::<T>(name.as_bytes()) }.expect("the capture helper's export")
    }

    fn last_error(&self) -> String {
        self.library.last_error()
    }
}

/// The fake's sweep controls (tests/fake-cuda/driver/src/faults.rs).
struct Sweep {
    library: libloading::Library,
}

impl Sweep {
    fn open() -> Sweep {
        // SAFETY: in a child process libcuda.so is the fake (no initialisers); dlopen hands back
        // the library cudarc uses.
        let library = unsafe { libloading::Library::new("libcuda.so") }.expect("load the fake");
        Sweep { library }
    }

    fn function<T: Copy>(&self, name: &str) -> T {
        // SAFETY: each caller names a fake export and gives its exact C signature.
        *unsafe { self.library.get::<T>(name.as_bytes()) }
            .unwrap_or_else(|e| panic!("the fake libcuda lacks {name}: {e}"))
    }

    /// The address of the fake's export `name`.
    fn address(&self, name: &str) -> *mut c_void {
        self.function(name)
    }

    fn arm(&self, fail_at: u64, code: u32, sticky: bool) {
        let arm: extern "C" fn(u64, u32, i32) = self.function("fake_cuda_sweep_arm");
        arm(fail_at, code, i32::from(sticky));
    }

    fn calls(&self) -> u64 {
        let calls: extern "C" fn() -> u64 = self.function("fake_cuda_sweep_calls");
        calls()
    }

    fn fired(&self) -> bool {
        let fired: extern "C" fn() -> i32 = self.function("fake_cuda_sweep_fired");
        fired() != 0
    }

    fn call_names(&self) -> Vec<String> {
        let name: unsafe extern "C" fn(u64, *mut c_char, usize) -> i64 =
            self.function("fake_cuda_sweep_call_name");
        (1..=self.calls())
            .map(|i| {
                let mut buffer = [0 as c_char; 64];
                // SAFETY: the buffer is a live local of the length given.
                let len = unsafe { name(i, buffer.as_mut_ptr(), buffer.len()) };
                assert!(len > 0, "call {i} has a name");
                // SAFETY: the fake NUL-terminated what it wrote.
                unsafe { CStr::from_ptr(buffer.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }
}

/// The program's state: the live allocations, and what each step gave.
struct Program {
    api: Api,
    sweep: Sweep,
    live: Vec<(*mut c_void, usize, u64)>,
    /// One line per step whose result the caller sees: `ok`, or the error the caller got.
    outcomes: Vec<String>,
    /// The driver calls each of those steps made: counted calls `(first, last]`.
    spans: Vec<(u64, u64)>,
    /// The capture ids the filters read, kept for as long as ferrocache may ask them.
    #[allow(
        clippy::vec_box,
        reason = "each id keeps its address while the Vec grows: the filters hold pointers to them"
    )]
    capture_ids: Vec<Box<u64>>,
    /// The driver calls PyTorch's side made itself (the capture id queries), not ferrocache.
    own_calls: Vec<u64>,
}

impl Program {
    /// Runs one step whose result the caller sees, and records it.
    fn step<T>(&mut self, what: &str, op: impl FnOnce(&Api) -> Result<T, String>) -> Option<T> {
        let before = self.sweep.calls();
        let result = op(&self.api);
        self.spans.push((before, self.sweep.calls()));
        match result {
            Ok(value) => {
                self.outcomes.push(format!("{what}: ok"));
                Some(value)
            }
            Err(why) => {
                self.outcomes.push(format!("{what}: {why}"));
                None
            }
        }
    }

    fn alloc(&mut self, size: usize, stream: u64) -> Option<*mut c_void> {
        let ptr = self.step(&format!("alloc {size} on {stream:#x}"), |api| {
            api.alloc(size, stream)
        });
        if let Some(ptr) = ptr {
            self.live.push((ptr, size, stream));
        }
        ptr
    }

    /// Frees the live allocations that `which` picks (by their index among the live ones).
    fn free_where(&mut self, which: impl Fn(usize) -> bool) {
        let live = std::mem::take(&mut self.live);
        for (i, (ptr, size, stream)) in live.into_iter().enumerate() {
            if which(i) {
                self.api.rust_free(ptr, size, stream);
            } else {
                self.live.push((ptr, size, stream));
            }
        }
    }

    fn free_all(&mut self) {
        self.free_where(|_| true);
    }

    fn free(&mut self, ptr: *mut c_void) {
        if let Some(i) = self.live.iter().position(|&(p, _, _)| p == ptr) {
            self.free_where(|j| j == i);
        }
    }

    /// `torch.cuda.graph` entering: a capture begins on `stream` (the fake's capture flag), its
    /// id is asked of the driver as PyTorch asks it, and the begin hook makes allocations on the
    /// stream come from `pool`. False (the capture undone) when PyTorch's capture_begin would
    /// have raised.
    fn capture_begin(&mut self, fake: &FakeCuda, pool: (u64, u64), stream: u64) -> bool {
        fake.set_capturing(stream, true);
        type Info = unsafe extern "C" fn(*mut c_void, *mut u32, *mut u64) -> u32;
        let info: Info = self.sweep.function("cuStreamGetCaptureInfo");
        let capture_info = self.sweep.address("cuStreamGetCaptureInfo");
        let before = self.sweep.calls();
        let id = self.step("the capture's id", |_| {
            let (mut status, mut id) = (0u32, 0u64);
            // SAFETY: valid out pointers; the stream handle is only passed on.
            match unsafe {
                info(
                    ptr::without_provenance_mut(stream as usize),
                    &mut status,
                    &mut id,
                )
            } {
                0 => Ok(id),
                code => Err(format!("cudaStreamGetCaptureInfo failed ({code})")),
            }
        });
        self.own_calls.extend(before + 1..=self.sweep.calls());
        let Some(id) = id else {
            fake.set_capturing(stream, false);
            return false;
        };
        self.capture_ids.push(Box::new(id));
        let id: *const u64 = &**self.capture_ids.last().expect("just pushed");
        let begun = self
            .step(&format!("capture_begin into pool {pool:?}"), |api| {
                api.capture_begin(pool, capture_info, id)
            })
            .is_some();
        if !begun {
            fake.set_capturing(stream, false);
        }
        begun
    }

    /// `torch.cuda.graph` leaving: the capture ends, then the end hook.
    fn capture_end(&mut self, fake: &FakeCuda, pool: (u64, u64), stream: u64) {
        fake.set_capturing(stream, false);
        self.pool_hook("rust_end_allocate_to_pool", pool);
    }

    /// A hook that returns nothing, as one step: `capture_end`'s or `reset`'s.
    fn pool_hook(&mut self, hook: &str, pool: (u64, u64)) {
        self.step(&format!("{hook} {pool:?}"), |api| {
            api.pool_hook(hook, pool);
            Ok(())
        });
    }
}

/// The program with ordinary segments: many sizes on 3 streams, record_stream with events that
/// complete late, a new segment during a capture, a memory fraction that refuses an
/// allocation, an allocation larger than the device (the retries, then out of memory),
/// empty_cache, and everything freed.
fn segments_program(program: &mut Program, fake: &FakeCuda, streams: [u64; 3]) {
    let sizes = [
        512,
        4096,
        100_000,
        MIB,
        MIB + 1,
        3 * MIB,
        12 * MIB,
        25 * MIB,
        60 * MIB,
    ];
    for (i, size) in sizes.into_iter().enumerate() {
        program.alloc(size, streams[i % 3]);
    }
    program.free_where(|i| i % 2 == 0);
    for (i, size) in sizes.into_iter().enumerate().take(6) {
        program.alloc(size, streams[(i + 1) % 3]);
    }

    // A block used on two other streams, whose events complete only after two queries.
    fake.set_event_delay(2);
    if let Some(shared) = program.alloc(3 * MIB, streams[0]) {
        program.api.record_stream(shared, streams[1]);
        program.api.record_stream(shared, streams[2]);
        let last = program.live.len() - 1;
        program.free_where(|i| i == last);
    }
    program.alloc(3 * MIB, streams[0]);
    program.alloc(512, streams[1]);
    fake.set_event_delay(0);

    // A new segment while a graph capture is under way on the stream: the malloc runs in the
    // relaxed capture mode.
    fake.set_capturing(streams[2], true);
    program.alloc(70 * MIB, streams[2]);
    fake.set_capturing(streams[2], false);

    // Half the memory allowed: 100 MiB more does not fit beside what is held.
    program.step("memory fraction 0.5", |api| api.set_memory_fraction(0.5));
    program.alloc(100 * MIB, streams[0]);
    program.step("memory fraction 1.0", |api| api.set_memory_fraction(1.0));

    // Larger than what is free on the device: released cache, retried, out of memory.
    program.alloc(200 * MIB, streams[2]);
    program.step("empty_cache", Api::empty_cache);
    program.alloc(20 * MIB, streams[1]);
    program.free_all();
    program.step("empty_cache", Api::empty_cache);
}

/// The program with `expandable_segments:True`: segments grow on two streams, shrink on
/// empty_cache and grow again; record_stream with late events; out of memory with retries.
fn expandable_program(program: &mut Program, fake: &FakeCuda, streams: [u64; 3]) {
    for (size, stream) in [
        (MIB, streams[0]),
        (30 * MIB, streams[0]),
        (70 * MIB, streams[0]),
        (4096, streams[0]),
        (30 * MIB, streams[1]),
        (100_000, streams[1]),
    ] {
        program.alloc(size, stream);
    }
    // Free the 30 and 70 MiB blocks of stream 0: empty_cache unmaps their pages.
    program.free_where(|i| i == 1 || i == 2);
    program.step("empty_cache", Api::empty_cache);
    program.alloc(50 * MIB, streams[0]);

    fake.set_event_delay(2);
    if let Some(shared) = program.alloc(10 * MIB, streams[1]) {
        program.api.record_stream(shared, streams[2]);
        let last = program.live.len() - 1;
        program.free_where(|i| i == last);
    }
    program.alloc(10 * MIB, streams[1]);
    fake.set_event_delay(0);

    // More than the device has left: retries, then out of memory.
    program.alloc(200 * MIB, streams[0]);
    program.free_all();
    program.step("empty_cache", Api::empty_cache);
}

/// The graphs' pool, as `torch.cuda.graph_pool_handle()` gives it.
const GRAPH_POOL: (u64, u64) = (1, 0);

/// CUDA graph captures into a private pool: a graph captured on stream 2 allocates from the
/// pool (small and large blocks, new segments made in the relaxed capture mode) while stream 0
/// keeps the ordinary pools, frees a block during its capture; a second graph shares the pool
/// (`pool=g1.pool()`) on stream 1 and runs out of memory; then both are reset: their tensors
/// freed, the pool released twice, the cache emptied.
fn capture_program(program: &mut Program, fake: &FakeCuda, streams: [u64; 3]) {
    program.alloc(MIB, streams[0]);
    program.alloc(4096, streams[2]);
    let mut graphs = 0;
    if program.capture_begin(fake, GRAPH_POOL, streams[2]) {
        graphs += 1;
        let freed = program.alloc(3 * MIB, streams[2]);
        program.alloc(4096, streams[2]);
        program.alloc(25 * MIB, streams[2]);
        program.alloc(4096, streams[0]);
        if let Some(freed) = freed {
            program.free(freed);
        }
        program.alloc(2 * MIB, streams[2]);
        program.capture_end(fake, GRAPH_POOL, streams[2]);
    }
    program.alloc(3 * MIB, streams[2]);
    if program.capture_begin(fake, GRAPH_POOL, streams[1]) {
        graphs += 1;
        program.alloc(3 * MIB, streams[1]);
        program.alloc(60 * MIB, streams[1]);
        // More than the device has left, during the capture: out of memory.
        program.alloc(200 * MIB, streams[1]);
        program.capture_end(fake, GRAPH_POOL, streams[1]);
    }
    program.free_all();
    for _ in 0..graphs {
        program.pool_hook("rust_release_pool", GRAPH_POOL);
    }
    program.step("empty_cache", Api::empty_cache);
}

/// The program with sleep-ability on (`FERROCACHE_SLEEP=1`): VMM-backed segments of both
/// pools on two streams, a sleep with backup, an allocation while asleep, a wake, a sleep
/// without backup and a wake, each called twice (the second is what a caller does after a
/// failure, and a no-op otherwise); out of memory with retries.
fn sleep_program(program: &mut Program, _fake: &FakeCuda, streams: [u64; 3]) {
    for (size, stream) in [
        (4096, streams[0]),
        (3 * MIB, streams[1]),
        (25 * MIB, streams[0]),
    ] {
        program.alloc(size, stream);
    }
    program.free_where(|i| i == 1);
    for (what, wake, backup) in [("sleep", false, true), ("sleep again", false, true)] {
        program.step(what, |api| api.sleep_or_wake(wake, backup));
    }
    program.alloc(MIB, streams[1]);
    for (what, wake, backup) in [
        ("wake", true, false),
        ("wake again", true, false),
        ("sleep without backup", false, false),
        ("sleep without backup again", false, false),
        ("wake", true, false),
        ("wake again", true, false),
    ] {
        program.step(what, |api| api.sleep_or_wake(wake, backup));
    }
    program.alloc(300 * MIB, streams[2]);
    program.free_all();
    program.step("empty_cache", Api::empty_cache);
}

/// The sweep's summary of one child run, printed on one line of stdout.
const SUMMARY: &str = "SWEEP-SUMMARY ";

/// Runs one program in this (child) process with the failure the environment names, checks
/// what it can, and prints the summary for the parent.
fn run_child(which: &str) {
    let env_number = |name: &str| -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let (fail_at, code, sticky, permanent) = (
        env_number(FAIL_AT),
        env_number(FAIL_CODE) as u32,
        env_number(FAIL_STICKY) != 0,
        env_number(FAIL_PERMANENT) != 0,
    );
    let api = Api {
        library: Ferrocache::open(),
        capture_hooks: std::env::var_os(CAPTURE_HOOKS).map(|path| {
            // SAFETY: the helper has no initialisers beyond the C++ runtime's.
            unsafe { libloading::Library::new(path) }.expect("load the capture hooks")
        }),
    };
    let fake = FakeCuda::open();
    let streams = [0, new_stream(), new_stream()];
    let mut program = Program {
        api,
        sweep: Sweep::open(),
        live: Vec::new(),
        outcomes: Vec::new(),
        spans: Vec::new(),
        capture_ids: Vec::new(),
        own_calls: Vec::new(),
    };

    program.sweep.arm(fail_at, code, sticky);
    match which {
        "segments" => segments_program(&mut program, &fake, streams),
        "expandable" => expandable_program(&mut program, &fake, streams),
        "capture" => capture_program(&mut program, &fake, streams),
        "sleep" | "sleep_expandable" => sleep_program(&mut program, &fake, streams),
        other => panic!("no program {other}"),
    }
    let calls = program.sweep.calls();
    let fired = program.sweep.fired();
    let names = program.sweep.call_names();

    if let Err(why) = program.api.check_invariants() {
        panic!("invariants broken after the program: {why}");
    }
    let mut after = Vec::new();
    if !(fired && permanent) {
        // The next operations work: one allocation of each pool on each stream.
        for stream in streams {
            for size in [4096, 3 * MIB, 30 * MIB] {
                let ptr = program
                    .api
                    .alloc(size, stream)
                    .unwrap_or_else(|why| panic!("alloc {size} after the failure: {why}"));
                program.api.rust_free(ptr, size, stream);
            }
        }
        program
            .api
            .empty_cache()
            .unwrap_or_else(|why| panic!("empty_cache after the failure: {why}"));
        if let Err(why) = program.api.check_invariants() {
            panic!("invariants broken at the end: {why}");
        }
        for counter in [
            "bytes_in_use",
            "live_allocations",
            "live_reservations",
            "live_physical",
            "live_mappings",
            "live_events",
        ] {
            after.push(format!("{counter}={}", fake.stat(counter)));
            assert_eq!(
                fake.stat(counter),
                0,
                "{counter} after everything was freed and the cache emptied"
            );
        }
    }
    let summary = serde_json::json!({
        "calls": calls,
        "fired": fired,
        "outcomes": program.outcomes,
        "spans": program.spans,
        "names": names,
        "own_calls": program.own_calls,
    });
    println!("{SUMMARY}{summary}");
}

// ------------------------------------------------------------------------------------------------
// The parent: count, then sweep
// ------------------------------------------------------------------------------------------------

/// What one child run showed.
struct RunResult {
    calls: u64,
    fired: bool,
    outcomes: Vec<String>,
    spans: Vec<(u64, u64)>,
    names: Vec<String>,
    /// Calls made by PyTorch's side itself (1-based), not by ferrocache.
    own_calls: Vec<u64>,
    stderr: String,
}

fn settings(which: &str) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("FAKE_LIBCUDA_TOTAL_MEM", DEVICE_MEMORY.to_string()),
        ("TORCH_CUDA_ALLOC_LOG_LEVEL", "INFO".to_string()),
    ];
    if which == "expandable" || which == "sleep_expandable" {
        env.push(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True".into()));
    }
    if which == "sleep" {
        env.push(("FERROCACHE_SLEEP", "1".into()));
    }
    env
}

/// `tests/cpp/capture_hooks.cpp`, built once per parent process.
fn capture_hooks() -> &'static Path {
    static HOOKS: OnceLock<PathBuf> = OnceLock::new();
    HOOKS.get_or_init(|| {
        support::compile_cpp(
            "tests/cpp/capture_hooks.cpp",
            "libcapture_hooks.so",
            &["-shared", "-fPIC"],
        )
    })
}

/// Runs the program `which` in a child process with call `fail_at` failing (0: none).
fn run_once(
    test: &str,
    which: &str,
    fail_at: u64,
    kind: Kind,
    permanent: bool,
) -> Result<RunResult, String> {
    let mut child = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, which)
        .env("LD_LIBRARY_PATH", fake_libcuda_dir())
        .envs(settings(which))
        .env(FAIL_AT, fail_at.to_string())
        .env(FAIL_CODE, kind.code.to_string())
        .env(FAIL_STICKY, u8::from(kind.sticky).to_string())
        .env(FAIL_PERMANENT, u8::from(permanent).to_string())
        .env(CAPTURE_HOOKS, capture_hooks())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the test binary again");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait for the child").is_some() {
            break;
        }
        if start.elapsed() > CHILD_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("hung: still running after {CHILD_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let output = child.wait_with_output().expect("the child's output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let tail = |text: &str| -> String {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(25)..].join("\n")
    };
    if !output.status.success() || !stdout.contains("1 passed") {
        return Err(format!(
            "the child failed ({}):\n{}\n{}",
            output.status,
            tail(&stdout),
            tail(&stderr)
        ));
    }
    if stderr.contains("panicked") {
        return Err(format!("something panicked:\n{}", tail(&stderr)));
    }
    let line = stdout
        .lines()
        // libtest writes the test's name on the same line, before the output.
        .find_map(|l| l.split_once(SUMMARY).map(|(_, summary)| summary))
        .ok_or("no summary line")?;
    let summary: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let strings = |key: &str| -> Vec<String> {
        summary[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok(RunResult {
        calls: summary["calls"].as_u64().unwrap_or(0),
        fired: summary["fired"].as_bool().unwrap_or(false),
        outcomes: strings("outcomes"),
        spans: summary["spans"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|span| (span[0].as_u64().unwrap_or(0), span[1].as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default(),
        names: strings("names"),
        own_calls: summary["own_calls"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default(),
        stderr,
    })
}

fn count_lines(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

/// What is wrong with a run that failed call `fail_at` with `kind`, judged against the clean
/// run; `None` when it is all as it must be.
fn judge(
    clean: &RunResult,
    run: &RunResult,
    fail_at: u64,
    call: &str,
    kind: Kind,
) -> Option<String> {
    if !run.fired {
        return Some("the call to fail was never made (the program is not deterministic)".into());
    }
    if call == "cuStreamIsCapturing" && kind.code == 900 {
        // A capture error is the driver's way of saying "a capture is under way": ferrocache
        // answers it by relaxing the thread's capture mode around the malloc, not as a failure;
        // or, where it asked whether the caller is in a capture context (PyTorch's
        // is_capture_context: the last out-of-memory retry, during this program's capture),
        // by acting as in a capture, which the clean run did too: the same outcomes and the
        // same next call.
        let relaxed = run.names.get(fail_at as usize).map(String::as_str)
            == Some("cuThreadExchangeStreamCaptureMode");
        let acted_as_in_a_capture = run.outcomes == clean.outcomes
            && run.names.get(fail_at as usize) == clean.names.get(fail_at as usize);
        return (!relaxed && !acted_as_in_a_capture).then(|| {
            "a capture error from cuStreamIsCapturing did not relax the capture mode".into()
        });
    }
    // The step that made the failed call returned an error: the caller knows. (An injected
    // out-of-memory inside an allocation that runs out of memory anyway changes nothing else.)
    let failed_step = run
        .spans
        .iter()
        .position(|&(first, last)| first < fail_at && fail_at <= last);
    let step_failed = failed_step.is_some_and(|i| !run.outcomes[i].ends_with(": ok"));
    let errors = count_lines(&run.stderr, "[ERROR]");
    let reached_the_caller = step_failed
        || run.outcomes != clean.outcomes
        || errors > count_lines(&clean.stderr, "[ERROR]")
        || count_lines(&run.stderr, "failed; releasing")
            > count_lines(&clean.stderr, "failed; releasing");
    if !reached_the_caller {
        return Some("the failure reached nobody: same results, no ERROR line, no retry".into());
    }
    if kind.sticky {
        return judge_sticky(run, fail_at, call);
    }
    None
}

/// A sticky error: ferrocache says once that CUDA is unusable and makes no driver call after it
/// (but the look-up of the error's text). When the failed call was PyTorch's (a capture's id, or
/// the stream filter, which asks `cuStreamGetCaptureInfo`), ferrocache learns of the error at its
/// own next call, which fails; before that it may ask a filter again, which fails again.
fn judge_sticky(run: &RunResult, fail_at: u64, call: &str) -> Option<String> {
    const FILTER_CALL: &str = "cuStreamGetCaptureInfo";
    let ferrocache_calls: Vec<&str> = (fail_at + 1..=run.calls)
        .filter(|i| !run.own_calls.contains(i))
        .map(|i| run.names[i as usize - 1].as_str())
        .collect();
    let pytorchs_call = call == FILTER_CALL;
    let mut after = ferrocache_calls.as_slice();
    if pytorchs_call {
        let first_own = after.iter().position(|&name| name != FILTER_CALL);
        after = first_own.map_or(&[], |i| &after[i + 1..]);
    }
    if after.iter().any(|&name| name != "cuGetErrorString") {
        return Some(format!(
            "{} driver calls after a sticky error: {after:?}",
            after.len()
        ));
    }
    let said = count_lines(&run.stderr, "is unusable in this process");
    let learned = !pytorchs_call || ferrocache_calls.iter().any(|&name| name != FILTER_CALL);
    (said != usize::from(learned)).then(|| {
        format!(
            "a sticky error must be reported once as leaving the device unusable (once \
             ferrocache made a call of its own after it); it was {said} times"
        )
    })
}

/// Set to `every-kind`: every call fails with each of the [`KINDS`] in turn (5 runs a call), as
/// by hand (`FERROCACHE_FAULT_SWEEP=every-kind cargo test --release --test fault_sweep`).
/// Unset, as in CI: every call fails once, the kinds taken in rotation along the calls, so that
/// each kind still fails a fifth of the calls, in a fifth of the time.
const SWEEP_MODE: &str = "FERROCACHE_FAULT_SWEEP";

fn every_kind_at_every_call() -> bool {
    std::env::var(SWEEP_MODE).as_deref() == Ok("every-kind")
}

/// The runs of a sweep of `n` calls: (call index, kind).
fn sweep_jobs(n: u64, every_kind: bool) -> Vec<(u64, Kind)> {
    if every_kind {
        (1..=n)
            .flat_map(|i| KINDS.iter().map(move |&k| (i, k)))
            .collect()
    } else {
        (1..=n)
            .map(|i| (i, KINDS[(i as usize - 1) % KINDS.len()]))
            .collect()
    }
}

/// Counts the program's calls, fails each one (with each kind of error, or with one kind each,
/// see [`SWEEP_MODE`]), and reports.
fn sweep(test: &str, which: &str) {
    let clean_kind = Kind {
        name: "none",
        code: 0,
        sticky: false,
    };
    let clean = run_once(test, which, 0, clean_kind, false).unwrap_or_else(|why| {
        panic!("the {which} program fails without any injected failure: {why}")
    });
    assert!(
        clean
            .outcomes
            .iter()
            .any(|o| o.contains("CUDA out of memory")),
        "the program's out-of-memory step did not run out of memory: {:?}",
        clean.outcomes
    );
    let n = clean.calls;
    assert!(n >= 20, "only {n} driver calls");
    eprintln!("the {which} program, without failures:");
    for outcome in &clean.outcomes {
        eprintln!("  {outcome}");
    }

    let jobs = sweep_jobs(n, every_kind_at_every_call());
    let next = Mutex::new(0usize);
    let failures = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    let job = {
                        let mut next = next.lock().unwrap();
                        let job = jobs.get(*next).copied();
                        *next += 1;
                        job
                    };
                    let Some((i, kind)) = job else { break };
                    let call = clean.names[i as usize - 1].as_str();
                    let permanent = kind.sticky || call == "cuInit";
                    let verdict = match run_once(test, which, i, kind, permanent) {
                        Ok(run) => judge(&clean, &run, i, call, kind),
                        Err(why) => Some(why),
                    };
                    if let Some(why) = verdict {
                        failures.lock().unwrap().push(format!(
                            "call {i} ({call}) failing with {}: {why}",
                            kind.name
                        ));
                    }
                }
            });
        }
    });

    // The report: N, the runs, and the calls by function with the kinds each was failed with.
    let mut by_function: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (i, name) in clean.names.iter().enumerate() {
        by_function.entry(name).or_default().push(i as u64 + 1);
    }
    let kinds: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
    eprintln!(
        "fault sweep, {which} program: N = {n} driver calls, {} runs ({}: {})",
        jobs.len(),
        if every_kind_at_every_call() {
            "every kind at every call"
        } else {
            "one kind a call, in rotation"
        },
        kinds.join(", ")
    );
    for (function, indices) in &by_function {
        eprintln!("  {function}: {} call(s), at {indices:?}", indices.len());
    }
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} runs went wrong:\n{}",
        failures.len(),
        jobs.len(),
        failures.join("\n")
    );
    eprintln!("  all {} runs clean", jobs.len());
}

fn sweep_or_child(test: &str, which: &str) {
    if std::env::var(CHILD).as_deref() == Ok(which) {
        run_child(which);
    } else {
        sweep(test, which);
    }
}

#[test]
fn every_driver_call_of_the_segments_program_fails_once() {
    sweep_or_child(
        "every_driver_call_of_the_segments_program_fails_once",
        "segments",
    );
}

#[test]
fn every_driver_call_of_the_capture_program_fails_once() {
    sweep_or_child(
        "every_driver_call_of_the_capture_program_fails_once",
        "capture",
    );
}

#[test]
fn every_driver_call_of_the_expandable_program_fails_once() {
    sweep_or_child(
        "every_driver_call_of_the_expandable_program_fails_once",
        "expandable",
    );
}

#[test]
fn every_driver_call_of_the_sleep_program_fails_once() {
    sweep_or_child("every_driver_call_of_the_sleep_program_fails_once", "sleep");
}

/// The sleep program with expandable segments: their pages sleep and wake.
#[test]
fn every_driver_call_of_the_expandable_sleep_program_fails_once() {
    sweep_or_child(
        "every_driver_call_of_the_expandable_sleep_program_fails_once",
        "sleep_expandable",
    );
}

/// The runs that went wrong before their fixes, by call index: each must still be that call
/// (else the program changed and the list needs the new indices) and must now be clean.
const FIXED: [(&str, u64, &str, usize); 13] = [
    // A failure while opening the device was kept for the life of the process.
    ("segments", 1, "cuDriverGetVersion", 0),
    ("segments", 9, "cuDevicePrimaryCtxRetain", 1),
    // Any failed capture query was read as "maybe capturing" and went unreported.
    ("segments", 11, "cuStreamIsCapturing", 2),
    // A sticky error was logged again by every later call.
    ("segments", 12, "cuMemAlloc_v2", 4),
    // empty_cache left pooled events alive; destroying them may fail too.
    ("segments", 81, "cuEventDestroy_v2", 2),
    // During a capture: a capture error from the query on a capturing stream, and a sticky
    // error inside the relaxed capture mode, which was logged again when leaving it.
    ("segments", 55, "cuStreamIsCapturing", 3),
    ("segments", 57, "cuMemAlloc_v2", 4),
    ("segments", 58, "cuThreadExchangeStreamCaptureMode", 4),
    // A page whose release failed was forgotten, its memory lost.
    ("expandable", 77, "cuMemRelease", 1),
    ("expandable", 76, "cuCtxGetCurrent", 0),
    ("expandable", 143, "cuMemRelease", 3),
    // An injected out-of-memory inside the out-of-memory step is that step's error.
    ("expandable", 129, "cuMemCreate", 0),
    // After a sticky error, allocations still asked the capture's stream filter (PyTorch's
    // code, which asks CUDA), and a cache hit still succeeded.
    ("capture", 18, "cuCtxGetCurrent", 4),
];

#[test]
fn the_runs_that_went_wrong_before_stay_fixed() {
    const TEST: &str = "the_runs_that_went_wrong_before_stay_fixed";
    if let Ok(which) = std::env::var(CHILD) {
        run_child(&which);
        return;
    }
    for which in ["segments", "expandable", "capture"] {
        let clean_kind = Kind {
            name: "none",
            code: 0,
            sticky: false,
        };
        let clean = run_once(TEST, which, 0, clean_kind, false)
            .unwrap_or_else(|why| panic!("the clean {which} run: {why}"));
        for &(program, index, call, kind) in FIXED.iter().filter(|f| f.0 == which) {
            let near: Vec<usize> = (0..clean.names.len())
                .filter(|&i| clean.names[i] == call)
                .map(|i| i + 1)
                .collect();
            assert_eq!(
                clean.names[index as usize - 1],
                call,
                "call {index} of the {program} program ({call} is now call {near:?})"
            );
            let kind = KINDS[kind];
            let run = run_once(TEST, which, index, kind, kind.sticky || call == "cuInit")
                .unwrap_or_else(|why| panic!("call {index} ({call}) with {}: {why}", kind.name));
            if let Some(why) = judge(&clean, &run, index, call, kind) {
                panic!("call {index} ({call}) with {}: {why}", kind.name);
            }
        }
    }
}
