//! A private pool's checkpoint through the C ABI, as ferrocache's allocator object for PyTorch
//! (python/ferrocache/frontend.cpp) calls it for `getCheckpointState` and
//! `setCheckpointPoolState`: through the real `libferrocache.so` on the fake libcuda, each
//! scenario in a process of its own.

mod cdylib;
mod support;

use std::ffi::{c_int, c_void};
use std::ptr;

use cdylib::Ferrocache;
use support::in_own_process;

/// `struct ferrocache_checkpoint_delta` of the header.
#[repr(C)]
struct Delta {
    freed: *mut *mut c_void,
    freed_count: usize,
    allocated: *mut *mut c_void,
    allocated_count: usize,
}

impl Delta {
    fn empty() -> Delta {
        Delta {
            freed: ptr::null_mut(),
            freed_count: 0,
            allocated: ptr::null_mut(),
            allocated_count: 0,
        }
    }

    fn addresses(array: *mut *mut c_void, count: usize) -> Vec<usize> {
        if count == 0 {
            return Vec::new();
        }
        // SAFETY: ferrocache filled `count` pointers at `array`, valid until the delta is freed.
        let pointers = unsafe { std::slice::from_raw_parts(array, count) };
        pointers.iter().map(|p| p.addr()).collect()
    }
}

type PoolFn = unsafe extern "C" fn(c_int, u64, u64) -> c_int;
type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type CheckpointFn = unsafe extern "C" fn(c_int, u64, u64) -> *mut c_void;
type CheckpointFreeFn = unsafe extern "C" fn(*mut c_void);
type RestoreFn = unsafe extern "C" fn(c_int, *const c_void, *mut Delta) -> c_int;
type DeltaFreeFn = unsafe extern "C" fn(*mut Delta);

const POOL: (u64, u64) = (0, 77);

struct Api {
    library: Ferrocache,
}

impl Api {
    fn alloc(&self, size: usize) -> *mut c_void {
        let alloc: AllocFn = self.library.function("ferrocache_alloc");
        // SAFETY: plain values; stream 0 is the legacy default stream.
        let ptr = unsafe { alloc(size, 0, ptr::null_mut()) };
        assert!(!ptr.is_null(), "{}", self.library.last_error());
        ptr
    }

    fn free(&self, ptr: *mut c_void) -> c_int {
        let free: FreeFn = self.library.function("ferrocache_free");
        // SAFETY: ferrocache checks the pointer against what it handed out.
        unsafe { free(ptr) }
    }

    /// Runs `body` with this thread's allocations going to the pool (`use_mem_pool`).
    fn in_pool<R>(&self, body: impl FnOnce() -> R) -> R {
        let begin: PoolFn = self
            .library
            .function("ferrocache_begin_allocate_current_thread_to_pool");
        let end: PoolFn = self.library.function("ferrocache_end_allocate_to_pool");
        // SAFETY: plain values.
        assert_eq!(unsafe { begin(0, POOL.0, POOL.1) }, 0);
        let result = body();
        // SAFETY: plain values.
        assert_eq!(unsafe { end(0, POOL.0, POOL.1) }, 0);
        result
    }

    fn checkpoint(&self, pool: (u64, u64)) -> *mut c_void {
        let checkpoint: CheckpointFn = self.library.function("ferrocache_checkpoint_pool");
        // SAFETY: plain values.
        unsafe { checkpoint(0, pool.0, pool.1) }
    }

    fn checkpoint_free(&self, checkpoint: *mut c_void) {
        let free: CheckpointFreeFn = self.library.function("ferrocache_checkpoint_free");
        // SAFETY: NULL or a checkpoint of ferrocache_checkpoint_pool, given back once.
        unsafe { free(checkpoint) }
    }

    fn restore(&self, device: c_int, checkpoint: *const c_void, delta: &mut Delta) -> c_int {
        let restore: RestoreFn = self.library.function("ferrocache_restore_pool_checkpoint");
        // SAFETY: NULL or a live checkpoint; `delta` is valid for a write.
        unsafe { restore(device, checkpoint, delta) }
    }

    fn delta_free(&self, delta: *mut Delta) {
        let free: DeltaFreeFn = self.library.function("ferrocache_checkpoint_delta_free");
        // SAFETY: NULL or a delta ferrocache filled, unchanged since.
        unsafe { free(delta) }
    }
}

#[test]
fn a_restore_through_the_c_abi_hands_back_the_freed_and_the_live_again_addresses() {
    in_own_process(
        "a_restore_through_the_c_abi_hands_back_the_freed_and_the_live_again_addresses",
        &[],
        || {
            let api = Api {
                library: Ferrocache::open(),
            };
            let (kept, hole, also_kept) = api.in_pool(|| {
                let kept = api.alloc(4096);
                let hole = api.alloc(8192);
                let also_kept = api.alloc(3 << 20);
                assert_eq!(api.free(hole), 0);
                (kept, hole, also_kept)
            });
            let checkpoint = api.checkpoint(POOL);
            assert!(!checkpoint.is_null(), "{}", api.library.last_error());
            let later = api.in_pool(|| api.alloc(8192));
            assert_eq!(later, hole, "the pool reuses the hole");

            let mut delta = Delta::empty();
            assert_eq!(
                api.restore(0, checkpoint, &mut delta),
                0,
                "{}",
                api.library.last_error()
            );
            let mut freed = Delta::addresses(delta.freed, delta.freed_count);
            freed.sort_unstable();
            let mut expected = vec![kept.addr(), later.addr(), also_kept.addr()];
            expected.sort_unstable();
            assert_eq!(freed, expected);
            let allocated = Delta::addresses(delta.allocated, delta.allocated_count);
            assert_eq!(allocated.len(), 2);
            assert!(allocated.contains(&kept.addr()) && allocated.contains(&also_kept.addr()));
            api.delta_free(&mut delta);
            assert!(delta.freed.is_null() && delta.allocated.is_null());
            assert_eq!(delta.freed_count + delta.allocated_count, 0);
            api.delta_free(&mut delta); // an emptied delta is nothing
            api.delta_free(ptr::null_mut());

            // The live-again blocks are freed as any allocation; the restore freed `later`.
            assert_eq!(api.free(kept), 0);
            assert_eq!(api.free(also_kept), 0);
            assert_eq!(api.free(later), -1, "freed by the restore");
            api.checkpoint_free(checkpoint);
            api.checkpoint_free(ptr::null_mut());
        },
    );
}

#[test]
fn checkpoints_of_unknown_pools_and_restores_without_a_checkpoint_are_errors() {
    in_own_process(
        "checkpoints_of_unknown_pools_and_restores_without_a_checkpoint_are_errors",
        &[("FAKE_LIBCUDA_DEVICE_COUNT", "2")],
        || {
            let api = Api {
                library: Ferrocache::open(),
            };
            assert!(api.checkpoint((7, 7)).is_null());
            assert_eq!(api.library.last_error(), "Could not find pool of id (7, 7)");
            let mut delta = Delta::empty();
            delta.freed_count = 99; // emptied on failure
            assert_eq!(api.restore(0, ptr::null(), &mut delta), -1);
            assert!(api.library.last_error().contains("checkpoint is NULL"));
            assert_eq!(delta.freed_count, 0);

            // A checkpoint of device 0's pool is not device 1's.
            api.in_pool(|| api.alloc(512));
            let checkpoint = api.checkpoint(POOL);
            assert!(!checkpoint.is_null(), "{}", api.library.last_error());
            assert_eq!(api.restore(1, checkpoint, &mut delta), -1);
            assert!(
                api.library.last_error().contains("not of device 1"),
                "{}",
                api.library.last_error()
            );
            api.checkpoint_free(checkpoint);
        },
    );
}
