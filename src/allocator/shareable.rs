//! What CUDA IPC shares of an allocation (PyTorch's `shareIpcHandle`): the device memory that
//! holds it and where it lies in it. A plain segment is shared whole, by its base (the driver
//! hands out a memory handle for the base of a `cuMemAlloc` allocation only); an expandable or
//! VMM-backed segment by the physical pages under the allocation.
//!
//! Whether the receiver is done with the memory is PyTorch's business: the sender's storage
//! keeps the block allocated until the receivers' reference count falls to zero
//! (`torch/csrc/CudaIPCTypes.h`), so nothing here changes the block.

use std::fmt;

use super::backing::Memory;
use super::uncached::DeviceMemory;
use super::{DeviceAllocator, PointerError};
use crate::device::{Device, DevicePtr, PhysicalHandle};

/// The memory to share for one allocation, and the allocation's offset in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shareable {
    /// A `cuMemAlloc` allocation, shared by its base.
    Plain { base: DevicePtr, offset: usize },
    /// Physical pages of `page_size` bytes each, mapped in this order from the first page's
    /// address on.
    Pages {
        page_size: usize,
        handles: Vec<PhysicalHandle>,
        offset: usize,
    },
}

/// Why an allocation cannot be shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareError {
    Pointer(PointerError),
    /// Its memory sleeps: there is nothing to map in another process until it wakes.
    Asleep(DevicePtr),
}

impl fmt::Display for ShareError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShareError::Pointer(err) => err.fmt(f),
            ShareError::Asleep(ptr) => write!(
                f,
                "the allocation at {ptr:#x} sleeps (ferrocache.sleep): wake it before sharing it \
                 with another process"
            ),
        }
    }
}

impl std::error::Error for ShareError {}

impl<D: Device> DeviceAllocator<D> {
    /// What to share for the allocation that starts at `ptr` (PyTorch's `shareIpcHandle` takes
    /// an allocated block's start too).
    pub fn shareable(&self, ptr: DevicePtr) -> Result<Shareable, ShareError> {
        let id = *self
            .allocated
            .get(&ptr)
            .ok_or(ShareError::Pointer(PointerError::Unknown(ptr)))?;
        let block = self.arena.get(id);
        let segment = self.segments.get(block.segment);
        match &segment.memory {
            // As PyTorch's `shareIpcHandle`: memory from a pool's own allocator is shared as a
            // `cudaMalloc`'d segment is (its allocator decides whether the driver can).
            Memory::Plain | Memory::External => {
                let base = self.arena.get(self.segments.head(block.segment)).ptr;
                Ok(Shareable::Plain {
                    base,
                    offset: (ptr - base) as usize,
                })
            }
            Memory::Expandable(pages) => {
                let (first, handles) = pages
                    .pages_under(block.ptr, block.size)
                    .ok_or(ShareError::Asleep(ptr))?;
                Ok(Shareable::Pages {
                    page_size: pages.page_size(),
                    handles,
                    offset: (ptr - first) as usize,
                })
            }
            Memory::Vmm(vmm) => {
                let (handle, size) = vmm.physical().ok_or(ShareError::Asleep(ptr))?;
                Ok(Shareable::Pages {
                    page_size: size,
                    handles: vec![handle],
                    offset: (ptr - vmm.base()) as usize,
                })
            }
        }
    }
}

impl<D: Device> DeviceMemory<D> {
    /// [`DeviceAllocator::shareable`], allocations made while caching was off included (each
    /// its own `cuMemAlloc`).
    pub fn shareable(&self, ptr: DevicePtr) -> Result<Shareable, ShareError> {
        if self.is_uncached(ptr) {
            return Ok(Shareable::Plain {
                base: ptr,
                offset: 0,
            });
        }
        self.allocator().shareable(ptr)
    }
}
