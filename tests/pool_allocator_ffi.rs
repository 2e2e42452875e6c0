//! `ferrocache_create_pool_with_allocator` through the real `libferrocache.so` against the fake
//! libcuda: a private pool whose segments come from C functions on a context (what the C++
//! front end hands over for `torch.cuda.MemPool(allocator=...)`), given back through them, with
//! the context released once the pool is gone or refused. Each scenario runs in a process of
//! its own (see `support`).

mod cdylib;
mod support;

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use cdylib::Ferrocache;
use support::{FakeCuda, in_own_process};

const MIB: usize = 1 << 20;

type PoolFn = unsafe extern "C" fn(c_int, u64, u64) -> c_int;
type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type PoolAlloc = unsafe extern "C" fn(*mut c_void, usize, *mut *const c_char) -> *mut c_void;
type PoolFree = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *const c_char) -> c_int;
type PoolRelease = unsafe extern "C" fn(*mut c_void);
type CreateFn = unsafe extern "C" fn(
    c_int,
    u64,
    u64,
    *mut c_void,
    Option<PoolAlloc>,
    Option<PoolFree>,
    Option<PoolRelease>,
) -> c_int;

/// What the pool's allocator saw. It lives for the whole child process (leaked), so that the
/// test can read it after the release.
#[derive(Default)]
struct Seen {
    allocated: AtomicUsize,
    allocated_bytes: AtomicUsize,
    freed: AtomicUsize,
    released: AtomicUsize,
    /// Answer every alloc with NULL and this failure (`1`), or NULL and no failure (`2`).
    refuse: AtomicUsize,
}

unsafe extern "C" fn pool_alloc(
    context: *mut c_void,
    size: usize,
    error: *mut *const c_char,
) -> *mut c_void {
    // SAFETY: the context is the leaked `Seen` the test gave.
    let seen = unsafe { &*(context as *const Seen) };
    match seen.refuse.load(Ordering::SeqCst) {
        1 => {
            // SAFETY: `error` is valid for one write; the string is static.
            unsafe { *error = c"ncclMemAlloc failed".as_ptr() };
            return ptr::null_mut();
        }
        2 => return ptr::null_mut(),
        _ => {}
    }
    let fake = FakeCuda::open();
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> u32 = fake.function("cuMemAlloc_v2");
    let mut address = 0u64;
    // SAFETY: a valid out pointer; the test made the device's context current.
    if unsafe { alloc(&mut address, size) } != 0 {
        return ptr::null_mut();
    }
    seen.allocated.fetch_add(1, Ordering::SeqCst);
    seen.allocated_bytes.fetch_add(size, Ordering::SeqCst);
    ptr::without_provenance_mut(address as usize)
}

unsafe extern "C" fn pool_free(
    context: *mut c_void,
    memory: *mut c_void,
    _error: *mut *const c_char,
) -> c_int {
    // SAFETY: as in `pool_alloc`.
    let seen = unsafe { &*(context as *const Seen) };
    let fake = FakeCuda::open();
    let free: unsafe extern "C" fn(u64) -> u32 = fake.function("cuMemFree_v2");
    // SAFETY: memory `pool_alloc` gave.
    if unsafe { free(memory.addr() as u64) } != 0 {
        return -1;
    }
    seen.freed.fetch_add(1, Ordering::SeqCst);
    0
}

unsafe extern "C" fn pool_release(context: *mut c_void) {
    // SAFETY: as in `pool_alloc`.
    let seen = unsafe { &*(context as *const Seen) };
    seen.released.fetch_add(1, Ordering::SeqCst);
}

struct Api {
    library: Ferrocache,
}

impl Api {
    fn create(&self, pool: (u64, u64), seen: &'static Seen, with_alloc: bool) -> c_int {
        let create: CreateFn = self
            .library
            .function("ferrocache_create_pool_with_allocator");
        let context = ptr::from_ref(seen).cast_mut().cast::<c_void>();
        let alloc = with_alloc.then_some(pool_alloc as PoolAlloc);
        // SAFETY: the context outlives the library's use of it (leaked); the functions match.
        unsafe {
            create(
                0,
                pool.0,
                pool.1,
                context,
                alloc,
                Some(pool_free),
                Some(pool_release),
            )
        }
    }

    fn pool_call(&self, name: &str, pool: (u64, u64)) -> c_int {
        let call: PoolFn = self.library.function(name);
        // SAFETY: plain values.
        unsafe { call(0, pool.0, pool.1) }
    }

    fn alloc(&self, size: usize) -> *mut c_void {
        let alloc: AllocFn = self.library.function("ferrocache_alloc");
        // SAFETY: plain values; the default stream.
        unsafe { alloc(size, 0, ptr::null_mut()) }
    }

    fn free(&self, memory: *mut c_void) -> c_int {
        let free: FreeFn = self.library.function("ferrocache_free");
        // SAFETY: ferrocache checks the pointer against what it handed out.
        unsafe { free(memory) }
    }
}

fn leaked() -> &'static Seen {
    Box::leak(Box::default())
}

fn last_error(library: &Ferrocache) -> String {
    let error: unsafe extern "C" fn() -> *const c_char = library.function("ferrocache_last_error");
    // SAFETY: never NULL, valid until the thread's next call.
    unsafe { CStr::from_ptr(error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn a_pool_with_its_own_allocator_gets_its_segments_from_it_and_releases_it_when_gone() {
    in_own_process(
        "a_pool_with_its_own_allocator_gets_its_segments_from_it_and_releases_it_when_gone",
        &[],
        || {
            let api = Api {
                library: Ferrocache::open(),
            };
            // As the CUDA runtime does on PyTorch's threads: the allocator's cuMemAlloc runs in
            // the device's context.
            FakeCuda::open().make_current(0);
            let seen = leaked();
            let pool = (0, 7);
            assert_eq!(api.create(pool, seen, true), 0);
            assert_eq!(
                api.pool_call("ferrocache_begin_allocate_current_thread_to_pool", pool),
                0
            );
            let inside = api.alloc(MIB);
            assert!(!inside.is_null(), "{}", last_error(&api.library));
            assert_eq!(seen.allocated.load(Ordering::SeqCst), 1);
            assert_eq!(seen.allocated_bytes.load(Ordering::SeqCst), 2 * MIB);
            assert_eq!(api.pool_call("ferrocache_end_allocate_to_pool", pool), 0);
            assert_eq!(api.pool_call("ferrocache_release_pool", pool), 0);
            let outside = api.alloc(MIB);
            assert_eq!(
                seen.allocated.load(Ordering::SeqCst),
                1,
                "not from the pool's"
            );
            assert_eq!(api.free(inside), 0);
            assert_eq!(api.free(outside), 0);
            // MemPool's destructor: its reference goes, then the pool's cache.
            assert_eq!(api.pool_call("ferrocache_release_pool", pool), 0);
            assert_eq!(api.pool_call("ferrocache_empty_pool_cache", pool), 0);
            assert_eq!(seen.freed.load(Ordering::SeqCst), 1);
            assert_eq!(seen.released.load(Ordering::SeqCst), 1);
            assert_eq!(api.pool_call("ferrocache_pool_use_count", pool), -1);
        },
    );
}

#[test]
fn an_allocator_that_fails_is_out_of_memory_and_a_refused_pool_releases_its_context() {
    in_own_process(
        "an_allocator_that_fails_is_out_of_memory_and_a_refused_pool_releases_its_context",
        &[],
        || {
            let api = Api {
                library: Ferrocache::open(),
            };
            let seen = leaked();
            let pool = (0, 8);
            assert_eq!(api.create(pool, seen, true), 0);
            assert_eq!(
                api.pool_call("ferrocache_begin_allocate_current_thread_to_pool", pool),
                0
            );
            for refusal in [1, 2] {
                seen.refuse.store(refusal, Ordering::SeqCst);
                assert!(api.alloc(MIB).is_null());
                let error = last_error(&api.library);
                assert!(error.starts_with("CUDA out of memory."), "{error}");
            }
            assert_eq!(api.pool_call("ferrocache_end_allocate_to_pool", pool), 0);

            // An allocator for a pool that exists, or without its alloc function: refused, and
            // the context released at once.
            let again = leaked();
            assert_eq!(api.create(pool, again, true), -1);
            assert!(
                last_error(&api.library).contains("exists"),
                "{}",
                last_error(&api.library)
            );
            assert_eq!(again.released.load(Ordering::SeqCst), 1);
            let without = leaked();
            assert_eq!(api.create((0, 9), without, false), -1);
            assert_eq!(without.released.load(Ordering::SeqCst), 1);
            assert_eq!(
                seen.released.load(Ordering::SeqCst),
                0,
                "the pool still lives"
            );
        },
    );
}
