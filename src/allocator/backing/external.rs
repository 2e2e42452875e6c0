//! External backing: segments "obtained from the pool's allocator", the memory of a private pool
//! made with an allocator of its own (`torch.cuda.MemPool(allocator=...)`: NCCL's pool over
//! `ncclMemAlloc`, symmetric memory's). PyTorch serves such a pool's segments with
//! `allocator->raw_alloc(size)` in place of `cudaMalloc` (`allocPrimitive`) and gives them back
//! with `allocator->raw_delete(ptr)` (`release_block`); blocks, splits, caching, statistics and
//! trace entries are those of any private pool. As `cudaMalloc`'d memory, it cannot sleep: its
//! memory and its addresses come and go together, and only its allocator knows how.
//!
//! The allocator itself is the pool's ([`ExternalAllocator`], kept in `PrivatePool`): it lives
//! as long as the pool, which is forgotten only once none of its segments is left.

use std::fmt;

use crate::device::{DeviceError, DevicePtr};
use crate::logging;

/// A private pool's own allocator: where its segments come from and go back to. Implemented by
/// the C ABI (over the C++ `CUDAAllocator` a `MemPool` was given) and by tests.
pub trait SegmentAllocator: Send {
    /// `size` bytes of device memory: `Ok(Some(ptr))`, `Ok(None)` when the allocator is out of
    /// memory (PyTorch's `raw_alloc` returned NULL), `Err(why)` when it failed otherwise (a C++
    /// exception), which the caller takes for out of memory too.
    fn allocate(&mut self, size: usize) -> Result<Option<DevicePtr>, String>;

    /// Gives back memory that [`allocate`](Self::allocate) gave; `Err(why)`: it refused, and the
    /// memory is still the pool's.
    fn deallocate(&mut self, ptr: DevicePtr) -> Result<(), String>;
}

/// A pool's allocator, as the pool keeps it.
pub(crate) struct ExternalAllocator(pub(crate) Box<dyn SegmentAllocator>);

impl fmt::Debug for ExternalAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ExternalAllocator")
    }
}

/// A new segment of `size` bytes from `allocator`; `None` when it is out of memory, or failed
/// (logged; PyTorch's `allocPrimitive` takes any NULL for `cudaErrorMemoryAllocation`).
pub(crate) fn obtain(allocator: &mut ExternalAllocator, size: usize) -> Option<DevicePtr> {
    match allocator.0.allocate(size) {
        Ok(Some(0)) | Ok(None) => None,
        Ok(Some(ptr)) => Some(ptr),
        Err(why) => {
            logging::pool_allocator_failed(size, &why);
            None
        }
    }
}

/// Gives the segment at `ptr` back to `allocator`; if it refuses, nothing changed (the segment
/// stays cached, as a `cudaFree` that fails leaves it).
pub(crate) fn release(
    allocator: &mut ExternalAllocator,
    ptr: DevicePtr,
) -> Result<(), DeviceError> {
    allocator
        .0
        .deallocate(ptr)
        .map_err(|message| DeviceError::Driver {
            call: "raw_delete",
            code: -1,
            message,
        })
}
