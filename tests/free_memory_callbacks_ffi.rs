//! `ferrocache_set_free_memory_callbacks` through the real `libferrocache.so`, against the fake
//! libcuda: the function the C++ front end (python/ferrocache/frontend.cpp) registers so that
//! PyTorch's free-memory callbacks (libtorch_python's "cuda_ipc_collect", which frees the CUDA
//! IPC limbo's blocks) run when a search of the cache misses, as PyTorch's allocator runs them.
//! The callback here plays the limbo: it frees a block through the C ABI while the allocation
//! that called it is under way. Each scenario runs in a process of its own (the library keeps
//! its allocators and the registration).

mod cdylib;
mod support;

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use cdylib::Ferrocache;
use serde_json::Value;
use support::{in_own_process, in_own_process_stderr};

const MIB: usize = 1 << 20;
/// A large request served by a segment of exactly its size: nothing of it is left cached.
const WHOLE: usize = 12 * MIB;

type Callbacks = unsafe extern "C" fn(*mut *const c_char) -> c_int;
type SetFn = unsafe extern "C" fn(Option<Callbacks>) -> c_int;
type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type StatsFn = unsafe extern "C" fn(c_int) -> *mut c_char;
type StringFreeFn = unsafe extern "C" fn(*mut c_char);

/// `ferrocache_free`, for the callback.
static FREE: OnceLock<FreeFn> = OnceLock::new();
/// How many times the callback ran.
static CALLS: AtomicUsize = AtomicUsize::new(0);
/// The block waiting in the "limbo": the callback frees it (0: none).
static IN_LIMBO: AtomicUsize = AtomicUsize::new(0);
/// What the callback answers: 1 freed, 0 nothing, -1 failed.
static ANSWER: AtomicI32 = AtomicI32::new(1);

/// The limbo collected: frees the block waiting there, then answers [`ANSWER`].
unsafe extern "C" fn collect(error: *mut *const c_char) -> c_int {
    CALLS.fetch_add(1, Ordering::SeqCst);
    let waiting = IN_LIMBO.swap(0, Ordering::SeqCst);
    if waiting != 0 {
        let free = FREE.get().expect("set before any allocation");
        // SAFETY: a block ferrocache handed out and nobody else frees.
        let status = unsafe { free(ptr::with_exposed_provenance_mut(waiting)) };
        // A failure aborts the child (no unwinding out of a C function): the test fails.
        assert_eq!(status, 0);
    }
    let answer = ANSWER.load(Ordering::SeqCst);
    if answer < 0 {
        // SAFETY: the library passes a writable out pointer.
        unsafe { error.write(c"the limbo's reference counts could not be read".as_ptr()) };
    }
    answer
}

/// The library, with `collect` registered, answering `answer`.
struct Api {
    library: Ferrocache,
}

impl Api {
    fn registered(answer: c_int) -> Api {
        let library = Ferrocache::open();
        let _ = FREE.set(library.function("ferrocache_free"));
        ANSWER.store(answer, Ordering::SeqCst);
        let api = Api { library };
        assert_eq!(api.register(Some(collect)), 0);
        api
    }

    fn register(&self, callbacks: Option<Callbacks>) -> c_int {
        let set: SetFn = self
            .library
            .function("ferrocache_set_free_memory_callbacks");
        // SAFETY: `collect` stays callable for the life of the process and never unwinds.
        unsafe { set(callbacks) }
    }

    fn alloc(&self, size: usize) -> usize {
        let alloc: AllocFn = self.library.function("ferrocache_alloc");
        // SAFETY: plain values; the default stream.
        let block = unsafe { alloc(size, 0, ptr::null_mut()) };
        assert!(!block.is_null(), "{}", self.library.last_error());
        block.expose_provenance()
    }

    fn free(&self, block: usize) {
        let free: FreeFn = self.library.function("ferrocache_free");
        // SAFETY: a block ferrocache handed out.
        assert_eq!(unsafe { free(ptr::with_exposed_provenance_mut(block)) }, 0);
    }

    fn stat(&self, key: &str) -> i64 {
        let stats: StatsFn = self.library.function("ferrocache_memory_stats");
        let string_free: StringFreeFn = self.library.function("ferrocache_string_free");
        // SAFETY: a plain value.
        let text = unsafe { stats(0) };
        assert!(!text.is_null(), "{}", self.library.last_error());
        // SAFETY: a NUL-terminated string from the library, freed right after.
        let json = unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above, not used after.
        unsafe { string_free(text) };
        let stats: Value = serde_json::from_str(&json).expect("the statistics are JSON");
        stats[key].as_i64().expect("a number")
    }
}

/// A block allocated, then put in the "limbo" (the program let go; a receiver still holds it).
fn one_block_in_limbo(api: &Api) -> usize {
    let block = api.alloc(WHOLE);
    IN_LIMBO.store(block, Ordering::SeqCst);
    block
}

#[test]
fn the_callbacks_run_once_per_miss_and_never_on_a_hit() {
    in_own_process(
        "the_callbacks_run_once_per_miss_and_never_on_a_hit",
        &[],
        || {
            let api = Api::registered(0);
            let first = api.alloc(WHOLE);
            assert_eq!(CALLS.load(Ordering::SeqCst), 1, "a miss");
            api.free(first);
            assert_eq!(api.alloc(WHOLE), first, "a hit");
            assert_eq!(CALLS.load(Ordering::SeqCst), 1, "not run on a hit");
            api.alloc(WHOLE);
            assert_eq!(CALLS.load(Ordering::SeqCst), 2, "the next miss");
        },
    );
}

#[test]
fn a_block_the_callbacks_free_is_found_by_the_second_search_at_its_address() {
    in_own_process(
        "a_block_the_callbacks_free_is_found_by_the_second_search_at_its_address",
        &[],
        || {
            let api = Api::registered(1);
            let waiting = one_block_in_limbo(&api);
            // The callback frees through the C ABI while this allocation is under way.
            assert_eq!(api.alloc(WHOLE), waiting);
            assert_eq!(
                IN_LIMBO.load(Ordering::SeqCst),
                0,
                "the limbo was collected"
            );
            assert_eq!(api.stat("segment.all.current"), 1, "no new segment");
            assert_eq!(api.stat("num_device_alloc"), 1);
        },
    );
}

#[test]
fn callbacks_that_say_they_freed_nothing_give_no_second_search() {
    in_own_process(
        "callbacks_that_say_they_freed_nothing_give_no_second_search",
        &[],
        || {
            // It frees, but says it did not: as PyTorch's `&&`, the cache is not searched again.
            let api = Api::registered(0);
            let waiting = one_block_in_limbo(&api);
            assert_ne!(api.alloc(WHOLE), waiting);
            assert_eq!(api.stat("segment.all.current"), 2, "a new segment");
            assert_eq!(
                api.alloc(WHOLE),
                waiting,
                "the freed block was cached, and the next request takes it"
            );
        },
    );
}

#[test]
fn a_failing_callback_is_logged_and_what_it_freed_is_found() {
    let stderr = in_own_process_stderr(
        "a_failing_callback_is_logged_and_what_it_freed_is_found",
        &[],
        || {
            let api = Api::registered(-1);
            let waiting = one_block_in_limbo(&api);
            assert_eq!(api.alloc(WHOLE), waiting, "nothing is lost");
            assert_eq!(api.stat("segment.all.current"), 1);
        },
    );
    if let Some(stderr) = stderr {
        assert!(
            stderr.contains(
                "the free-memory callbacks on a cache miss of 12582912 bytes (device 0) failed: \
                 the limbo's reference counts could not be read; the cache is searched again"
            ),
            "{stderr}"
        );
    }
}

#[test]
fn callbacks_withdrawn_run_no_more() {
    in_own_process("callbacks_withdrawn_run_no_more", &[], || {
        let api = Api::registered(1);
        api.alloc(WHOLE);
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        assert_eq!(api.register(None), 0);
        let waiting = one_block_in_limbo(&api);
        assert_ne!(
            api.alloc(WHOLE),
            waiting,
            "a miss served by the device, as before"
        );
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        assert_eq!(IN_LIMBO.load(Ordering::SeqCst), waiting, "still waiting");
    });
}
