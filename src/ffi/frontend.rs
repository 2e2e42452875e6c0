//! What ferrocache's own `CUDAAllocator` object (python/ferrocache/frontend.cpp, built against
//! the running PyTorch at install time) asks beyond the pluggable allocator's hooks: the
//! allocation itself without PyTorch's second map of pointers, the private pools' calls,
//! `cacheInfo`, the statistics as PyTorch's `DeviceStats` holds them, and the live allocations
//! of a private pool for CUDA graph trees. The C++ only converts types and throws; every answer
//! is made here or in the core.

use std::ffi::{c_char, c_int, c_ulonglong, c_void};

use super::callbacks::ferrocache_oom_thrower;
use super::registry::{self, with_last_error};
use super::{cudaStream_t, device_address};
use crate::allocator::private_pool::PoolError;
use crate::allocator::stats::{DeviceStats, Stat, StatArray};
use crate::device::Device as _;

/// `CUDAAllocator::allocate` and `raw_alloc`: what `rust_malloc` does, for a caller outside
/// the library. Returns the pointer with `*error` set to NULL, or NULL with `*error` pointing
/// at the reason (valid until this thread's next ferrocache call) and `*thrower` at the
/// registered out-of-memory thrower when memory ran out (else NULL). Size 0 gives NULL with no
/// error.
///
/// # Safety
/// `error` and `thrower` are NULL or valid for one pointer write each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_frontend_malloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
    error: *mut *const c_char,
    thrower: *mut ferrocache_oom_thrower,
) -> *mut c_void {
    // SAFETY: the same contract, passed on.
    unsafe { super::entry::ferrocache_internal_malloc(size, device, stream, error, thrower) }
}

/// How the C++ side asks a capture's `std::function<bool(cudaStream_t)>` filter: 1 yes, 0 no,
/// -1 it threw (with what it said in `*error`).
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_filter_accepts =
    unsafe extern "C" fn(*const c_void, cudaStream_t, *mut *const c_char) -> c_int;
/// How the C++ side destroys the filter.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_filter_drop = unsafe extern "C" fn(*mut c_void);

/// `CUDAAllocator::beginAllocateToPool`: from now until `ferrocache_end_allocate_to_pool`,
/// allocations on `device` whose stream `filter` accepts come from the private pool
/// `(pool_first, pool_second)`. Takes ownership of `filter` (NULL: it could not be copied).
/// Returns NULL, or why the capture is refused (logged at ERROR), which the C++ side throws.
///
/// # Safety
/// `filter` is NULL or an object that `accepts` and `drop` work on, not used by the caller
/// afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_frontend_begin_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    filter: *mut c_void,
    accepts: ferrocache_filter_accepts,
    drop: ferrocache_filter_drop,
) -> *const c_char {
    // SAFETY: the same contract, passed on.
    unsafe {
        super::pools::ferrocache_internal_begin_allocate_to_pool(
            device,
            pool_first,
            pool_second,
            filter,
            accepts,
            drop,
        )
    }
}

/// `CUDAAllocator::cacheInfo` as PyTorch's allocator answers it (cuDNN sizes its benchmark
/// workspaces by it): `*largest` becomes the largest of itself and every cached block of
/// `device`, private pools included; a `*largest` of 0 starts from the device's free memory.
/// Returns 0, or -1 (last error set).
///
/// # Safety
/// `largest` is valid for one `size_t` read and write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_cache_info(device: c_int, largest: *mut usize) -> c_int {
    with_last_error("ferrocache_cache_info", -1, || {
        if largest.is_null() {
            return Err("ferrocache_cache_info: largest is NULL".to_string());
        }
        // SAFETY: non-NULL, and the caller promises it is valid for a read.
        let given = unsafe { largest.read() };
        let mut memory = registry::device(device)?.lock()?;
        let mut answer = given;
        if answer == 0 {
            let info = memory.allocator_mut().device_mut().mem_get_info();
            answer = info.map_err(|err| err.to_string())?.free;
        }
        answer = answer.max(memory.allocator().largest_cached_block());
        // SAFETY: as above, valid for a write.
        unsafe { largest.write(answer) };
        Ok(0)
    })
}

/// One of PyTorch's `Stat`s.
#[repr(C)]
#[derive(Clone, Copy, Default)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

/// PyTorch's `DeviceStats`, its `StatArray`s as [all, small pool, large pool], in its order.
#[repr(C)]
#[derive(Clone, Copy, Default)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_device_stats {
    pub allocation: [ferrocache_stat; 3],
    pub segment: [ferrocache_stat; 3],
    pub active: [ferrocache_stat; 3],
    pub inactive_split: [ferrocache_stat; 3],
    pub allocated_bytes: [ferrocache_stat; 3],
    pub reserved_bytes: [ferrocache_stat; 3],
    pub active_bytes: [ferrocache_stat; 3],
    pub inactive_split_bytes: [ferrocache_stat; 3],
    pub requested_bytes: [ferrocache_stat; 3],
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub oversize_allocations: ferrocache_stat,
    pub oversize_segments: ferrocache_stat,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub num_oom_rejections: i64,
    pub max_split_size: i64,
}

fn c_stat(stat: &Stat) -> ferrocache_stat {
    ferrocache_stat {
        current: stat.current,
        peak: stat.peak,
        allocated: stat.allocated,
        freed: stat.freed,
    }
}

fn c_stats(array: &StatArray) -> [ferrocache_stat; 3] {
    [
        c_stat(&array.all),
        c_stat(&array.small_pool),
        c_stat(&array.large_pool),
    ]
}

fn c_device_stats(stats: &DeviceStats) -> ferrocache_device_stats {
    ferrocache_device_stats {
        allocation: c_stats(&stats.allocation),
        segment: c_stats(&stats.segment),
        active: c_stats(&stats.active),
        inactive_split: c_stats(&stats.inactive_split),
        allocated_bytes: c_stats(&stats.allocated_bytes),
        reserved_bytes: c_stats(&stats.reserved_bytes),
        active_bytes: c_stats(&stats.active_bytes),
        inactive_split_bytes: c_stats(&stats.inactive_split_bytes),
        requested_bytes: c_stats(&stats.requested_bytes),
        num_alloc_retries: stats.num_alloc_retries,
        num_ooms: stats.num_ooms,
        oversize_allocations: c_stat(&stats.oversize_allocations),
        oversize_segments: c_stat(&stats.oversize_segments),
        num_sync_all_streams: stats.num_sync_all_streams,
        num_device_alloc: stats.num_device_alloc,
        num_device_free: stats.num_device_free,
        num_oom_rejections: stats.num_oom_rejections,
        max_split_size: stats.max_split_size,
    }
}

/// `CUDAAllocator::getDeviceStats`: `device`'s statistics, what `torch.cuda.memory_stats`
/// reports, into `*out` (all zero for a device not used yet). Returns 0, or -1 (last error
/// set).
///
/// # Safety
/// `out` is valid for one `ferrocache_device_stats` write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_read_device_stats(
    device: c_int,
    out: *mut ferrocache_device_stats,
) -> c_int {
    with_last_error("ferrocache_read_device_stats", -1, || {
        if out.is_null() {
            return Err("ferrocache_read_device_stats: out is NULL".to_string());
        }
        let stats = match registry::if_used(device)? {
            Some(device) => c_device_stats(device.lock()?.allocator().stats()),
            None => c_device_stats(&DeviceStats::new(registry::config()?.max_split_size)),
        };
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { out.write(stats) };
        Ok(0)
    })
}

/// `CUDAAllocator::checkPoolLiveAllocations` (CUDA graph trees): 1 when the allocations live
/// in private pool `(pool_first, pool_second)` of `device` are exactly the `count` addresses at
/// `expected`, 0 when not, -1 for an unknown pool or device (last error set).
///
/// # Safety
/// `expected` is valid for `count` pointer reads (or `count` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_check_pool_live_allocations(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    expected: *const *mut c_void,
    count: usize,
) -> c_int {
    with_last_error("ferrocache_check_pool_live_allocations", -1, || {
        let expected: &[*mut c_void] = if count == 0 || expected.is_null() {
            &[]
        } else {
            // SAFETY: the caller promises `count` readable pointers at `expected`.
            unsafe { std::slice::from_raw_parts(expected, count) }
        };
        let id = (pool_first, pool_second);
        let live = registry::device(device)?
            .lock()?
            .allocator()
            .pool_live_allocations(id)
            .ok_or_else(|| PoolError::Unknown(id).to_string())?;
        let mut wanted: Vec<_> = expected.iter().map(|&ptr| device_address(ptr)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        Ok(c_int::from(wanted == live))
    })
}

/// Sets one of a private pool's options, keeping the other.
fn set_pool_option(
    device: c_int,
    id: (c_ulonglong, c_ulonglong),
    change: impl FnOnce(&mut (bool, bool)),
) -> Result<c_int, String> {
    let mut memory = registry::device(device)?.lock()?;
    let allocator = memory.allocator_mut();
    let mut options = allocator
        .pool_options(id)
        .ok_or_else(|| PoolError::Unknown(id).to_string())?;
    change(&mut options);
    let (use_on_oom, no_split) = options;
    allocator
        .set_pool_options(id, use_on_oom, no_split)
        .map(|()| 0)
        .map_err(|err| err.to_string())
}

/// `CUDAAllocator::setUseOnOOM`, as `torch.cuda.MemPool(use_on_oom=True)` calls it: with
/// `use_on_oom` non-zero, an allocation outside every private pool that would run out of memory
/// may take one of the pool's cached blocks. Returns 0, or -1 (last error set) when there is no
/// such pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_pool_use_on_oom(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    use_on_oom: c_int,
) -> c_int {
    with_last_error("ferrocache_set_pool_use_on_oom", -1, || {
        set_pool_option(device, (pool_first, pool_second), |options| {
            options.0 = use_on_oom != 0;
        })
    })
}

/// `CUDAAllocator::setNoSplit`, as `torch.cuda.MemPool(no_split=True)` calls it: the pool's
/// blocks are handed out whole. Returns 0, or -1 (last error set) when there is no such pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_pool_no_split(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_set_pool_no_split", -1, || {
        set_pool_option(device, (pool_first, pool_second), |options| {
            options.1 = true;
        })
    })
}

/// `CUDAAllocator::isHistoryEnabled`: 1 while allocator events are recorded
/// (`ferrocache_record_history`), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_history_enabled() -> c_int {
    with_last_error("ferrocache_history_enabled", 0, || {
        Ok(c_int::from(registry::process_wide().history.is_some()))
    })
}

/// One segment of a snapshot, as PyTorch's `SegmentInfo` holds it (without its blocks).
#[repr(C)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_segment_info {
    pub device: c_int,
    pub address: u64,
    pub total_size: u64,
    pub requested_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub stream: u64,
    pub is_large: c_int,
    pub is_expandable: c_int,
    pub pool_first: c_ulonglong,
    pub pool_second: c_ulonglong,
    /// The order in which the segment was made (PyTorch's `registration_counter`).
    pub registration_counter: u64,
}

/// One block of a snapshot's segment, as PyTorch's `BlockInfo` holds it.
#[repr(C)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_block_info {
    pub size: u64,
    pub requested_size: u64,
    pub allocated: c_int,
    pub active: c_int,
}

/// Receives a segment; the blocks that follow, up to the next segment, are its own.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_segment_visitor =
    Option<unsafe extern "C" fn(context: *mut c_void, segment: *const ferrocache_segment_info)>;
/// Receives a block of the segment last given.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_block_visitor =
    Option<unsafe extern "C" fn(context: *mut c_void, block: *const ferrocache_block_info)>;

/// `CUDAAllocator::snapshot` from C++ (what PyTorch's NCCL process groups and the profiler
/// ask): every segment of every device in use, in device then address order, each followed by
/// its blocks, given to `segment` and `block` with `context`. With a pool id other than
/// `(0, 0)`, only that private pool's segments. The trace entries are not given (ferrocache's
/// history reaches Python through `ferrocache_snapshot`). No allocator lock is held while the
/// visitors run. Returns 0, or -1 (last error set).
///
/// # Safety
/// `segment` and `block` are callable with `context`, and never unwind.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_snapshot_segments(
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    context: *mut c_void,
    segment: ferrocache_segment_visitor,
    block: ferrocache_block_visitor,
) -> c_int {
    with_last_error("ferrocache_snapshot_segments", -1, || {
        let (Some(segment), Some(block)) = (segment, block) else {
            return Err("ferrocache_snapshot_segments: a visitor is NULL".to_string());
        };
        let mut segments = Vec::new();
        for device in registry::created_devices() {
            segments.extend(device.lock()?.allocator().segments());
        }
        segments.sort_by_key(|s| (s.device, s.address));
        let only = (pool_first, pool_second);
        for taken in segments
            .iter()
            .filter(|s| only == (0, 0) || s.segment_pool_id == only)
        {
            let info = ferrocache_segment_info {
                device: taken.device,
                address: taken.address,
                total_size: taken.total_size,
                requested_size: taken.requested_size,
                allocated_size: taken.allocated_size,
                active_size: taken.active_size,
                stream: taken.stream,
                is_large: c_int::from(taken.segment_type == "large"),
                is_expandable: c_int::from(taken.is_expandable),
                pool_first: taken.segment_pool_id.0,
                pool_second: taken.segment_pool_id.1,
                registration_counter: taken.registration_counter,
            };
            // SAFETY: the caller promises the visitor is callable with `context`; `info` lives
            // across the call.
            unsafe { segment(context, &info) };
            for taken in &taken.blocks {
                let info = ferrocache_block_info {
                    size: taken.size,
                    requested_size: taken.requested_size,
                    allocated: c_int::from(taken.state == "active_allocated"),
                    active: c_int::from(taken.state.starts_with("active")),
                };
                // SAFETY: as above.
                unsafe { block(context, &info) };
            }
        }
        Ok(0)
    })
}
