//! Caching turned off (`torch.cuda.memory.caching_allocator_enable(False)`): PyTorch's
//! `uncached_allocate` and `uncached_delete`. Each allocation goes to the driver at its exact
//! size and back at its free, outside the cache and its statistics.
//!
//! [`DeviceMemory`] is what a device's caller talks to: the caching allocator, and beside it the
//! allocations made while caching was off, found again by address in one hash look-up. A free
//! looks there only while some are live, so with caching on it costs one length test.

use rustc_hash::FxHashMap;

use super::history::StackId;
use super::{AllocError, AllocationInfo, DeviceAllocator, PointerError};
use crate::device::{Device, DevicePtr, StreamId};
use crate::policy;

/// One device's memory: the caching allocator, or the driver itself while caching is off.
pub struct DeviceMemory<D: Device> {
    caching: DeviceAllocator<D>,
    /// Whether new allocations are cached (PyTorch's `isEnabled`).
    enabled: bool,
    /// The live allocations made while caching was off: size and stream, by address.
    uncached: FxHashMap<DevicePtr, (usize, StreamId)>,
}

/// Who asks for an allocation, as the trace entries record it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    /// The caller's stack id (0: none).
    pub stack: StackId,
    /// The tag the allocation is made under (`ferrocache.region`).
    pub tag: Option<u32>,
}

impl<D: Device> DeviceMemory<D> {
    /// `caching` with caching on or off.
    pub fn new(caching: DeviceAllocator<D>, enabled: bool) -> DeviceMemory<D> {
        DeviceMemory {
            caching,
            enabled,
            uncached: FxHashMap::default(),
        }
    }

    /// The caching allocator, for everything but allocation and free.
    pub fn allocator(&self) -> &DeviceAllocator<D> {
        &self.caching
    }

    pub fn allocator_mut(&mut self) -> &mut DeviceAllocator<D> {
        &mut self.caching
    }

    /// Whether `ptr` is a live allocation made while caching was off.
    pub fn is_uncached(&self, ptr: DevicePtr) -> bool {
        !self.uncached.is_empty() && self.uncached.contains_key(&ptr)
    }

    /// PyTorch's `enable`: allocations made from now on are cached or not; those made while
    /// caching was off still go back to the driver at their free.
    pub fn set_caching_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
    }

    /// Allocates `size` bytes for `stream`: from the cache, or from the driver at the exact size
    /// while caching is off.
    #[inline(always)]
    pub fn malloc(
        &mut self,
        size: usize,
        stream: StreamId,
        caller: Caller,
    ) -> Result<DevicePtr, AllocError> {
        if !self.enabled {
            return self.malloc_uncached(size, stream);
        }
        self.caching
            .malloc_tagged_with_stack(size, stream, caller.tag, caller.stack)
    }

    /// The rest of a [`malloc`](Self::malloc) that returned
    /// [`AllocError::RunFreeMemoryCallbacks`], once the caller ran them (see
    /// [`DeviceAllocator::malloc_after_free_memory_callbacks`]); caching turned off meanwhile
    /// sends it to the driver.
    pub fn malloc_after_free_memory_callbacks(
        &mut self,
        size: usize,
        stream: StreamId,
        caller: Caller,
        freed: bool,
    ) -> Result<DevicePtr, AllocError> {
        if !self.enabled {
            return self.malloc_uncached(size, stream);
        }
        let previous = self.caching.ledger.history.set_current_stack(caller.stack);
        let result = self
            .caching
            .malloc_after_free_memory_callbacks(size, stream, caller.tag, freed);
        self.caching.ledger.history.set_current_stack(previous);
        result
    }

    /// Frees `ptr`, wherever it came from; [`PointerError::Unknown`] for a pointer not handed
    /// out here (nothing changes). A driver that refuses an uncached free is an error too.
    #[inline(always)]
    pub fn free(
        &mut self,
        ptr: DevicePtr,
        stack: StackId,
    ) -> Result<AllocationInfo, UncachedFreeError> {
        if !self.uncached.is_empty()
            && let Some((size, stream)) = self.uncached.remove(&ptr)
        {
            return self.free_uncached(ptr, size, stream);
        }
        self.caching
            .free_with_stack(ptr, stack)
            .map_err(UncachedFreeError::Pointer)
    }

    /// [`free`](Self::free) while no allocation made with caching off is live (the usual case);
    /// `None` otherwise, and then `free` is the one to ask. Its result is the caching
    /// allocator's alone, with no room for the driver's refusal of an uncached free, so that a
    /// caller that matches on it at once keeps it in registers: `free`'s, merged with the
    /// out-of-line uncached path's, goes through memory.
    #[inline(always)]
    pub fn free_cached(
        &mut self,
        ptr: DevicePtr,
        stack: StackId,
    ) -> Option<Result<AllocationInfo, PointerError>> {
        if !self.uncached.is_empty() {
            return None;
        }
        Some(self.caching.free_with_stack(ptr, stack))
    }

    #[cold]
    #[inline(never)]
    fn malloc_uncached(&mut self, size: usize, stream: StreamId) -> Result<DevicePtr, AllocError> {
        let ptr = self.caching.device_mut().malloc(size, stream)?;
        self.uncached.insert(ptr, (size, stream));
        Ok(ptr)
    }

    #[cold]
    #[inline(never)]
    fn free_uncached(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        stream: StreamId,
    ) -> Result<AllocationInfo, UncachedFreeError> {
        self.caching
            .device_mut()
            .free(ptr)
            .map_err(|err| UncachedFreeError::Device(AllocError::Device(err)))?;
        Ok(AllocationInfo {
            ptr,
            size,
            requested_size: size,
            stream,
            pool: policy::pool_for(size),
            private_pool: None,
        })
    }
}

/// Why [`DeviceMemory::free`] refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UncachedFreeError {
    /// Not a pointer handed out here; nothing changed.
    Pointer(PointerError),
    /// An allocation made while caching was off, which the driver would not take back (it is
    /// forgotten, as PyTorch's `uncached_delete` forgets it when `cudaFree` throws).
    Device(AllocError),
}

impl std::fmt::Display for UncachedFreeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UncachedFreeError::Pointer(err) => err.fmt(f),
            UncachedFreeError::Device(err) => write!(f, "while caching is disabled: {err}"),
        }
    }
}

impl std::error::Error for UncachedFreeError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::device::sim::SimDevice;

    fn memory() -> DeviceMemory<SimDevice> {
        let allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, Config::default());
        DeviceMemory::new(allocator, true)
    }

    #[test]
    fn with_caching_off_allocations_go_to_the_driver_and_back_outside_the_statistics() {
        let mut memory = memory();
        let cached = memory.malloc(1000, 0, Caller::default()).unwrap();
        memory.set_caching_enabled(false);
        let raw = memory.malloc(1000, 7, Caller::default()).unwrap();
        assert_eq!(
            memory.allocator().stats().num_device_alloc,
            1,
            "one segment"
        );
        assert_eq!(memory.allocator().live_allocations(), 1);
        memory.set_caching_enabled(true);
        // Freed after caching came back: still to the driver.
        let info = memory.free(raw, 0).unwrap();
        assert_eq!((info.ptr, info.size, info.stream), (raw, 1000, 7));
        assert!(memory.free(raw, 0).is_err(), "a second free is refused");
        memory.free(cached, 0).unwrap();
        assert_eq!(memory.allocator().live_allocations(), 0);
    }

    #[test]
    fn an_unknown_pointer_is_refused_and_changes_nothing() {
        let mut memory = memory();
        memory.set_caching_enabled(false);
        let raw = memory.malloc(4096, 0, Caller::default()).unwrap();
        assert_eq!(
            memory.free(raw + 1, 0),
            Err(UncachedFreeError::Pointer(PointerError::Unknown(raw + 1)))
        );
        assert!(memory.free(raw, 0).is_ok());
    }
}
