//! Private pools: CUDA graph captures (PyTorch's `set_begin_allocate_to_pool`,
//! `set_end_allocate_to_pool_fn` and `set_release_pool` hooks, through `src/pool_hooks.cpp`) and
//! `torch.cuda.MemPool` (`use_mem_pool`, its options, its own allocator and its destructor).

use std::ffi::{CStr, c_char, c_int, c_ulonglong, c_void};
use std::ptr;

use super::guard::{guarded, last_error_ptr, set_last_error};
use super::registry::{self, with_last_error};
use super::{cudaStream_t, stream_handle};
use crate::allocator::private_pool::{MempoolId, PoolError, SegmentAllocator, StreamFilter};
use crate::device::{DevicePtr, StreamId};
use crate::logging;

/// How `pool_hooks.cpp` asks a `std::function<bool(cudaStream_t)>`: 1 yes, 0 no, -1 it threw
/// (with what it said in `*error`).
type FilterAcceptsFn =
    unsafe extern "C" fn(*const c_void, cudaStream_t, *mut *const c_char) -> c_int;
/// How `pool_hooks.cpp` destroys the filter.
type FilterDropFn = unsafe extern "C" fn(*mut c_void);

/// A capture's stream filter: PyTorch's `std::function`, kept on the C++ heap and called
/// through `pool_hooks.cpp`. Destroyed when dropped.
struct CppStreamFilter {
    filter: *mut c_void,
    accepts: FilterAcceptsFn,
    drop: FilterDropFn,
}

// SAFETY: the allocator calls the filter only under its lock, one call at a time, from whichever
// thread allocates, as PyTorch's own allocator does; PyTorch's filter only asks the CUDA runtime
// about a stream's capture.
unsafe impl Send for CppStreamFilter {}

impl CppStreamFilter {
    fn accepts(&self, stream: StreamId) -> Result<bool, String> {
        let mut error: *const c_char = ptr::null();
        // SAFETY: `filter` is the live std::function pool_hooks.cpp gave us with `accepts`; the
        // stream handle is only passed on; `error` is valid for one write.
        let answer = unsafe { (self.accepts)(self.filter, stream_handle(stream), &mut error) };
        match answer {
            1 => Ok(true),
            0 => Ok(false),
            _ if error.is_null() => Err("it failed without saying why".to_string()),
            // SAFETY: on failure `error` points at a NUL-terminated string that stays valid
            // until this thread's next filter call.
            _ => Err(unsafe { CStr::from_ptr(error) }
                .to_string_lossy()
                .into_owned()),
        }
    }
}

impl Drop for CppStreamFilter {
    fn drop(&mut self) {
        // SAFETY: the filter was made by pool_hooks.cpp, with this `drop`, and is dropped once.
        unsafe { (self.drop)(self.filter) };
    }
}

fn pool_id(first: c_ulonglong, second: c_ulonglong) -> MempoolId {
    (first, second)
}

/// Runs `action` on `device`'s allocator (created on first use), its error as text.
fn on_device<T, E: ToString>(
    device: c_int,
    action: impl FnOnce(
        &mut crate::allocator::DeviceAllocator<crate::device::cuda::CudaDevice>,
    ) -> Result<T, E>,
) -> Result<T, String> {
    let mut memory = registry::device(device)?.lock()?;
    action(memory.allocator_mut()).map_err(|err| err.to_string())
}

fn begin_allocate_to_pool(
    device: c_int,
    id: MempoolId,
    filter: StreamFilter,
) -> Result<(), String> {
    on_device(device, |allocator| {
        allocator.begin_allocate_to_pool(id, filter)
    })
}

fn end_allocate_to_pool(device: c_int, id: MempoolId) -> Result<(), String> {
    on_device(device, |allocator| allocator.end_allocate_to_pool(id))
}

fn release_pool(device: c_int, id: MempoolId) -> Result<(), String> {
    on_device(device, |allocator| allocator.release_pool(id))
}

/// For `rust_begin_allocate_to_pool` in `pool_hooks.cpp` only (not exported): PyTorch's
/// `beginAllocateToPool`. From now until the end hook, allocations on `device` whose stream
/// `filter` accepts come from the private pool `(pool_first, pool_second)`. Takes ownership of
/// `filter` (NULL: the C++ side could not copy it), asked through `accepts` and destroyed
/// through `drop`. Returns NULL, or why the capture is refused (logged at ERROR; this thread's
/// last error), which the C++ side throws: a capture ferrocache cannot serve from its own pool
/// must not start.
///
/// # Safety
/// `filter` is NULL or an object that `accepts` and `drop` work on, not used by the caller
/// afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_internal_begin_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    filter: *mut c_void,
    accepts: FilterAcceptsFn,
    drop: FilterDropFn,
) -> *const c_char {
    // Owned from the first line, so that it is destroyed on every path, a panic included.
    let filter = (!filter.is_null()).then_some(CppStreamFilter {
        filter,
        accepts,
        drop,
    });
    let id = pool_id(pool_first, pool_second);
    let outcome = guarded("rust_begin_allocate_to_pool", Err(()), || {
        registry::read_once();
        let result = match filter {
            Some(filter) => {
                begin_allocate_to_pool(device, id, Box::new(move |stream| filter.accepts(stream)))
            }
            None => Err(
                "the capture's stream filter could not be copied (out of host memory)".to_string(),
            ),
        };
        result.map_err(|why| {
            logging::call_refused("rust_begin_allocate_to_pool", &why);
            set_last_error(&why);
        })
    });
    match outcome {
        Ok(()) => ptr::null(),
        Err(()) => last_error_ptr(),
    }
}

/// For `rust_end_allocate_to_pool` in `pool_hooks.cpp` only (not exported): PyTorch's
/// `endAllocateToPool`. A pool no capture records into is logged at ERROR; nothing changes.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_internal_end_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) {
    guarded("rust_end_allocate_to_pool", (), || {
        registry::read_once();
        if let Err(why) = end_allocate_to_pool(device, pool_id(pool_first, pool_second)) {
            logging::call_refused("rust_end_allocate_to_pool", &why);
        }
    });
}

/// For `rust_release_pool` in `pool_hooks.cpp` only (not exported): PyTorch's `releasePool`
/// (`g.reset()`, or a graph's deletion). An unknown pool, or one with no reference left, is
/// logged at ERROR; nothing changes.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_internal_release_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) {
    guarded("rust_release_pool", (), || {
        registry::read_once();
        if let Err(why) = release_pool(device, pool_id(pool_first, pool_second)) {
            logging::call_refused("rust_release_pool", &why);
        }
    });
}

/// PyTorch's `_cuda_beginAllocateCurrentThreadToPool` (what `torch.cuda.use_mem_pool` calls):
/// allocations this thread makes on `device` come from the private pool `(pool_first,
/// pool_second)` (created, or given one more reference) until
/// `ferrocache_end_allocate_to_pool`. Returns 0, or -1 (last error set) when a capture already
/// records into that pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_begin_allocate_current_thread_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error(
        "ferrocache_begin_allocate_current_thread_to_pool",
        -1,
        || {
            let thread = std::thread::current().id();
            let filter: StreamFilter = Box::new(move |_| Ok(std::thread::current().id() == thread));
            begin_allocate_to_pool(device, pool_id(pool_first, pool_second), filter).map(|()| 0)
        },
    )
}

/// PyTorch's `_cuda_endAllocateToPool`: allocations stop going to the pool; it keeps its
/// memory and references. Returns 0, or -1 (last error set) when nothing records into it.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_end_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_end_allocate_to_pool", -1, || {
        end_allocate_to_pool(device, pool_id(pool_first, pool_second)).map(|()| 0)
    })
}

/// PyTorch's `_cuda_releasePool`: drops one reference to the pool. Once none is left and no
/// block in it is live, `empty_cache` gives its memory back to the driver. Returns 0, or -1
/// (last error set) for an unknown pool, one without references, or the last reference of a
/// pool that something still records into.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_release_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_release_pool", -1, || {
        release_pool(device, pool_id(pool_first, pool_second)).map(|()| 0)
    })
}

/// PyTorch's `createOrIncrefPool` (what `torch.cuda.MemPool()` calls): creates the private
/// pool with one reference, or gives an existing one another. Returns 0, or -1 (last error set)
/// when the device is unusable or the id is `(0, 0)` (the ordinary pools').
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_create_or_incref_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_create_or_incref_pool", -1, || {
        let id = pool_id(pool_first, pool_second);
        on_device(device, |allocator| allocator.create_or_incref_pool(id)).map(|_| 0)
    })
}

/// PyTorch's `setUseOnOOM` and `setNoSplit`, as `torch.cuda.MemPool(use_on_oom=...,
/// no_split=...)` calls them: with `use_on_oom` non-zero, an allocation outside every private
/// pool that would run out of memory may take one of the pool's cached blocks; with `no_split`
/// non-zero, the pool's blocks are handed out whole. Returns 0, or -1 (last error set) when
/// there is no such pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_pool_options(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    use_on_oom: c_int,
    no_split: c_int,
) -> c_int {
    with_last_error("ferrocache_set_pool_options", -1, || {
        let id = pool_id(pool_first, pool_second);
        on_device(device, |allocator| {
            allocator.set_pool_options(id, use_on_oom != 0, no_split != 0)
        })
        .map(|()| 0)
    })
}

/// PyTorch's `emptyCache(mempool_id)`, as `torch.cuda.MemPool`'s destructor calls it: the
/// private pool's cached memory goes back to the device once nothing refers to the pool and
/// none of its blocks is live. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_empty_pool_cache(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_empty_pool_cache", -1, || {
        let Some(created) = registry::created(device) else {
            return Ok(0);
        };
        let mut memory = created.lock()?;
        let result = memory
            .allocator_mut()
            .empty_pool_cache(pool_id(pool_first, pool_second));
        result.map(|()| 0).map_err(|err| err.to_string())
    })
}

/// PyTorch's `getPoolUseCount`: the references the private pool holds. Returns -1 (last error
/// set) when there is no such pool (never created, or gone after `empty_cache`).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_pool_use_count(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_pool_use_count", -1, || {
        let id = pool_id(pool_first, pool_second);
        let count = registry::device(device)?
            .lock()?
            .allocator()
            .pool_use_count(id);
        count
            .map(|count| c_int::try_from(count).unwrap_or(c_int::MAX))
            .ok_or_else(|| PoolError::Unknown(id).to_string())
    })
}

/// Asks a pool's own allocator (the C++ `CUDAAllocator` a `torch.cuda.MemPool` was given) for
/// `size` bytes: the memory, or NULL with `*error` NULL when it has none (`raw_alloc` returned
/// NULL), or NULL with why in `*error` when it threw (valid until the thread's next call).
type PoolAllocFn = unsafe extern "C" fn(*mut c_void, usize, *mut *const c_char) -> *mut c_void;
/// Gives memory back to a pool's own allocator (`raw_delete`): 0, or -1 with why in `*error`
/// when it threw (the memory is then still the pool's).
type PoolFreeFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *const c_char) -> c_int;
/// Lets go of a pool's own allocator once the pool is gone (drops the C++ `shared_ptr`).
type PoolReleaseFn = unsafe extern "C" fn(*mut c_void);

/// A [`PoolAllocFn`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_pool_alloc = Option<PoolAllocFn>;
/// A [`PoolFreeFn`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_pool_free = Option<PoolFreeFn>;
/// A [`PoolReleaseFn`] or NULL (nothing to release), as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_pool_release = Option<PoolReleaseFn>;

/// A pool's own allocator, on the C++ heap and called through the front end. Released when
/// dropped: when the pool is forgotten, or at once when it cannot be made.
struct CppPoolAllocator {
    context: *mut c_void,
    alloc: PoolAllocFn,
    free: PoolFreeFn,
    release: ferrocache_pool_release,
}

// SAFETY: the core calls the allocator under the device's lock, one call at a time, from
// whichever thread allocates or empties the cache, as PyTorch's allocator calls `raw_alloc` and
// `raw_delete`; a `CUDAAllocator` serves any thread.
unsafe impl Send for CppPoolAllocator {}

/// What the C++ side said in `*error`, or `fallback` when it said nothing.
///
/// # Safety
/// `error` is NULL or a NUL-terminated string.
unsafe fn said(error: *const c_char, fallback: &str) -> String {
    if error.is_null() {
        return fallback.to_string();
    }
    // SAFETY: non-NULL, so a NUL-terminated string by the contract.
    unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned()
}

impl SegmentAllocator for CppPoolAllocator {
    fn allocate(&mut self, size: usize) -> Result<Option<DevicePtr>, String> {
        let mut error: *const c_char = ptr::null();
        // SAFETY: `context` is the live object the front end gave with `alloc`; `error` is valid
        // for one write.
        let memory = unsafe { (self.alloc)(self.context, size, &mut error) };
        if !memory.is_null() {
            return Ok(Some(memory as DevicePtr));
        }
        if error.is_null() {
            return Ok(None);
        }
        // SAFETY: set by the callee: a NUL-terminated string, valid until its next call.
        Err(unsafe { said(error, "") })
    }

    fn deallocate(&mut self, ptr: DevicePtr) -> Result<(), String> {
        let mut error: *const c_char = ptr::null();
        // SAFETY: as in `allocate`; `ptr` came from `alloc` on this context.
        let status = unsafe { (self.free)(self.context, ptr as *mut c_void, &mut error) };
        if status == 0 {
            return Ok(());
        }
        // SAFETY: set by the callee, or NULL.
        Err(unsafe { said(error, "it failed without saying why") })
    }
}

impl Drop for CppPoolAllocator {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: the context was given with this `release`, and is released once.
            unsafe { release(self.context) };
        }
    }
}

/// PyTorch's `createOrIncrefPool` with an allocator (`torch.cuda.MemPool(allocator=...)`, as
/// NCCL's pool and symmetric memory make it): creates the private pool `(pool_first,
/// pool_second)` on `device` with one reference; its segments come from `alloc_fn` and go back
/// through `free_fn` (in place of the device's `cudaMalloc` and `cudaFree`), as PyTorch's do;
/// when `alloc_fn` has no memory, or failed, the allocation takes the out-of-memory path. Takes
/// ownership of `context`: `release_fn(context)` is called once the pool is gone (its last
/// segment given back), or before returning when the pool is refused. Returns 0, or -1 (last
/// error set) when the pool exists already (a pool's allocator is given when it is made), the id
/// is `(0, 0)`, `alloc_fn` or `free_fn` is NULL, or the device is unusable.
///
/// # Safety
/// `context` is what the three functions work on, callable from any thread, and not used by
/// the caller afterwards; `release_fn` may be NULL (nothing to release).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_create_pool_with_allocator(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    context: *mut c_void,
    alloc_fn: ferrocache_pool_alloc,
    free_fn: ferrocache_pool_free,
    release_fn: ferrocache_pool_release,
) -> c_int {
    // Owned from the first line, so that it is released on every path, a panic included.
    let allocator = match (alloc_fn, free_fn) {
        (Some(alloc), Some(free)) => Ok(CppPoolAllocator {
            context,
            alloc,
            free,
            release: release_fn,
        }),
        _ => {
            if let Some(release) = release_fn {
                // SAFETY: the context was given with this `release`; it is not kept.
                unsafe { release(context) };
            }
            Err("the pool's allocator needs both an alloc and a free function".to_string())
        }
    };
    with_last_error("ferrocache_create_pool_with_allocator", -1, || {
        let allocator = Box::new(allocator?);
        let id = pool_id(pool_first, pool_second);
        on_device(device, |memory| {
            memory.create_pool_with_allocator(id, allocator)
        })
        .map(|_| 0)
    })
}
