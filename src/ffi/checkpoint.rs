//! CUDA graph trees' checkpoints of a private pool, for ferrocache's own `CUDAAllocator` object
//! (python/ferrocache/frontend.cpp): `getCheckpointState` takes one, owned by the C++
//! `AllocatorState` that holds it; `setCheckpointPoolState` restores it and hands back which
//! allocations were freed and which are live again, in arrays owned here until the C++ side
//! has built PyTorch's `CheckpointDelta` from them. The rules are the core's
//! (`allocator/checkpoint.rs`).

use std::ffi::{c_int, c_ulonglong, c_void};
use std::ptr;

use super::device_pointer;
use super::guard::guarded;
use super::registry::{self, with_last_error};
use crate::allocator::checkpoint::PoolCheckpoint;

/// A private pool's checkpoint, opaque to C: made by `ferrocache_checkpoint_pool`, given back
/// with `ferrocache_checkpoint_free`.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_checkpoint {
    checkpoint: PoolCheckpoint,
}

/// What `ferrocache_restore_pool_checkpoint` changed (PyTorch's `CheckpointDelta`): the
/// addresses of the allocations it freed (their tensors must lose their deleter) and of the
/// checkpoint's allocations, live again (their `DataPtr`s get the front end's deleter). The
/// arrays are ferrocache's, valid until `ferrocache_checkpoint_delta_free`.
#[repr(C)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_checkpoint_delta {
    pub freed: *mut *mut c_void,
    pub freed_count: usize,
    pub allocated: *mut *mut c_void,
    pub allocated_count: usize,
}

/// An array of device addresses for C, owned by ferrocache: (pointer, count).
fn into_c_array(addresses: &[u64]) -> (*mut *mut c_void, usize) {
    let array: Box<[*mut c_void]> = addresses.iter().map(|&a| device_pointer(a)).collect();
    let count = array.len();
    (Box::into_raw(array).cast::<*mut c_void>(), count)
}

/// Gives back an array [`into_c_array`] made; NULL is nothing.
///
/// # Safety
/// `array` and `count` came from one call of [`into_c_array`] and are given back once.
unsafe fn free_c_array(array: *mut *mut c_void, count: usize) {
    if !array.is_null() {
        // SAFETY: the caller's promise: a boxed slice of `count` elements, leaked here.
        drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(array, count)) });
    }
}

/// `CUDAAllocator::getCheckpointState` (CUDA graph trees, after each recording): the blocks
/// of private pool `(pool_first, pool_second)` on `device`, segment by segment. Returns the
/// checkpoint, owned by the caller (`ferrocache_checkpoint_free`), or NULL (last error set)
/// for an unknown pool, one whose references were all released, or a block of it that waits
/// for other streams.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_checkpoint_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> *mut ferrocache_checkpoint {
    with_last_error("ferrocache_checkpoint_pool", ptr::null_mut(), || {
        let mut memory = registry::device(device)?.lock()?;
        let checkpoint = memory
            .allocator_mut()
            .checkpoint_pool((pool_first, pool_second))
            .map_err(|err| err.to_string())?;
        Ok(Box::into_raw(Box::new(ferrocache_checkpoint {
            checkpoint,
        })))
    })
}

/// Gives back a checkpoint; NULL is nothing.
///
/// # Safety
/// `checkpoint` is NULL or came from `ferrocache_checkpoint_pool` and is given back once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_checkpoint_free(checkpoint: *mut ferrocache_checkpoint) {
    guarded("ferrocache_checkpoint_free", (), || {
        if !checkpoint.is_null() {
            // SAFETY: the caller's promise: ours, from Box::into_raw, given back once.
            drop(unsafe { Box::from_raw(checkpoint) });
        }
    });
}

/// `CUDAAllocator::setCheckpointPoolState` (CUDA graph trees, before recording a new branch):
/// frees every allocation of the checkpoint's pool, then puts the checkpoint's blocks back at
/// their addresses, the checkpoint's allocations live again. Fills `*delta` (its arrays are
/// given back with `ferrocache_checkpoint_delta_free`) and returns 0; or returns -1 (last
/// error set, `*delta` empty, nothing changed) for another device's checkpoint, a pool gone
/// or unreferenced, or a checkpointed segment that is gone or was carved otherwise since.
///
/// # Safety
/// `checkpoint` came from `ferrocache_checkpoint_pool` and is not given back meanwhile;
/// `delta` is valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_restore_pool_checkpoint(
    device: c_int,
    checkpoint: *const ferrocache_checkpoint,
    delta: *mut ferrocache_checkpoint_delta,
) -> c_int {
    with_last_error("ferrocache_restore_pool_checkpoint", -1, || {
        if delta.is_null() {
            return Err("ferrocache_restore_pool_checkpoint: delta is NULL".to_string());
        }
        let empty = ferrocache_checkpoint_delta {
            freed: ptr::null_mut(),
            freed_count: 0,
            allocated: ptr::null_mut(),
            allocated_count: 0,
        };
        // SAFETY: the caller promises `delta` valid for a write; it is empty on every failure.
        unsafe { delta.write(empty) };
        // SAFETY: the caller promises a live checkpoint of ours (NULL is refused here).
        let Some(taken) = (unsafe { checkpoint.as_ref() }) else {
            return Err("ferrocache_restore_pool_checkpoint: checkpoint is NULL".to_string());
        };
        let changed = registry::device(device)?
            .lock()?
            .allocator_mut()
            .restore_pool_checkpoint(&taken.checkpoint)
            .map_err(|err| err.to_string())?;
        let (freed, freed_count) = into_c_array(&changed.freed);
        let (allocated, allocated_count) = into_c_array(&changed.allocated);
        // SAFETY: as above.
        unsafe {
            delta.write(ferrocache_checkpoint_delta {
                freed,
                freed_count,
                allocated,
                allocated_count,
            })
        };
        Ok(0)
    })
}

/// Gives back the arrays of a delta that `ferrocache_restore_pool_checkpoint` filled, and
/// empties it; NULL, or an empty delta, is nothing.
///
/// # Safety
/// `delta` is NULL or a delta filled by `ferrocache_restore_pool_checkpoint` (or emptied by
/// this function), its fields unchanged since.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_checkpoint_delta_free(delta: *mut ferrocache_checkpoint_delta) {
    guarded("ferrocache_checkpoint_delta_free", (), || {
        // SAFETY: the caller promises NULL or a delta of ours.
        let Some(delta) = (unsafe { delta.as_mut() }) else {
            return;
        };
        // SAFETY: both arrays came from into_c_array with these counts, given back once (the
        // fields are emptied below).
        unsafe {
            free_c_array(delta.freed, delta.freed_count);
            free_c_array(delta.allocated, delta.allocated_count);
        }
        delta.freed = ptr::null_mut();
        delta.freed_count = 0;
        delta.allocated = ptr::null_mut();
        delta.allocated_count = 0;
    });
}
