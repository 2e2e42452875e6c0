//! Private pools: CUDA graph captures (PyTorch's `set_begin_allocate_to_pool`,
//! `set_end_allocate_to_pool_fn` and `set_release_pool` hooks, through `src/pool_hooks.cpp`) and
//! `torch.cuda.MemPool` (`use_mem_pool`, its options and its destructor).

use std::ffi::{CStr, c_char, c_int, c_ulonglong, c_void};
use std::ptr;

use super::guard::{guarded, last_error_ptr, set_last_error};
use super::registry::{self, with_last_error};
use super::{cudaStream_t, stream_handle};
use crate::allocator::private_pool::{MempoolId, PoolError, StreamFilter};
use crate::device::StreamId;
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
