//! `cuMemAlloc` memory: real host memory, so tests can write and read through device pointers.
//! It is carved from the device's arena of the block of device addresses (`address_space.rs`),
//! so the same calls give the same addresses in any process; its pages are opened when it is
//! allocated and given back, inaccessible again, when it is freed.

use std::ffi::{c_int, c_void};

use crate::address_space::{open_pages, page_size, put_back_inaccessible};
use crate::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CuResult, Driver, GRANULARITY, Outcome, call, call_log, put, sync,
};

/// `cudaMalloc` guarantees at least this alignment.
const SMALL_ALIGNMENT: u64 = 512;

pub struct Allocation {
    size: u64,
    /// The device whose context made it.
    pub device: i32,
}

impl Driver {
    /// Succeeds when `[ptr, ptr + len)` is device memory the caller may touch: inside one live
    /// `cuMemAlloc` allocation, or inside mapped pages made accessible by `cuMemSetAccess`.
    fn check_device_range(&self, ptr: u64, len: u64) -> Outcome {
        let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((&start, allocation)) = self.allocations.range(..=ptr).next_back()
            && end <= start + allocation.size
        {
            return Ok(());
        }
        self.check_accessible_mapping(ptr, len)
    }

    /// The device that owns the device memory at `ptr`, or None for any other address.
    fn device_of_pointer(&self, ptr: u64) -> Option<i32> {
        if let Some((&start, allocation)) = self.allocations.range(..=ptr).next_back()
            && ptr < start + allocation.size
        {
            return Some(allocation.device);
        }
        self.mapped_device(ptr)
    }

    /// Takes `size` bytes of `device`'s arena, lowest address first, and opens their pages.
    fn place_allocation(&mut self, device: i32, size: u64) -> Option<u64> {
        let alignment = if size >= GRANULARITY {
            GRANULARITY
        } else {
            SMALL_ALIGNMENT
        };
        let arena = self
            .address_space
            .as_mut()?
            .allocations
            .get_mut(usize::try_from(device).ok()?)?;
        let Some(address) = arena.place(size, alignment) else {
            // Not the device's memory but the fake's address range ran out: say so, since a
            // real GPU would have served the request.
            eprintln!(
                "fake-cuda: cuMemAlloc of {size} bytes: the device's address range ({} bytes) is \
                 too fragmented",
                arena.size()
            );
            return None;
        };
        let page = page_size();
        let first_page = address / page * page;
        let end_page = (address + size).next_multiple_of(page);
        if !open_pages(first_page, end_page - first_page) {
            arena.release(address, size);
            return None;
        }
        Some(address)
    }

    /// Gives back the arena space of a removed allocation, and the host memory of the pages that
    /// no other live allocation shares (small allocations may share a page).
    fn release_allocation(&mut self, address: u64, allocation: &Allocation) {
        let end = address + allocation.size;
        let page = page_size();
        let mut first_page = address / page * page;
        let mut end_page = end.next_multiple_of(page);
        if let Some((&before, other)) = self.allocations.range(..address).next_back()
            && before + other.size > first_page
        {
            first_page += page;
        }
        if let Some((&after, _)) = self.allocations.range(end..).next()
            && after < end_page
        {
            end_page -= page;
        }
        if first_page < end_page && !put_back_inaccessible(first_page, end_page - first_page) {
            eprintln!("fake-cuda: cuMemFree could not give pages back at {first_page:#x}");
        }
        if let Some(arena) = self
            .address_space
            .as_mut()
            .and_then(|space| space.allocations.get_mut(allocation.device as usize))
        {
            arena.release(address, allocation.size);
        }
    }

    /// Where `address` lies in `device`'s arena (what the call log writes).
    fn arena_offset(&self, device: i32, address: u64) -> u64 {
        self.address_space
            .as_ref()
            .and_then(|space| space.allocations.get(device as usize))
            .map_or(address, |arena| arena.offset(address))
    }
}

const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const MEMORY_TYPE_DEVICE: u32 = 2;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CuResult {
    call("cuMemAlloc_v2", |driver| {
        let device = driver.require_primary_context()?;
        if dptr.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // The real driver refuses a plain cudaMalloc while a capture is under way, unless the
        // thread has relaxed its capture mode.
        if driver.any_stream_capturing()
            && sync::thread_capture_mode() != sync::CAPTURE_MODE_RELAXED
        {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let size = size as u64;
        let charged = driver.charge(device, size);
        let placed = match charged {
            Ok(()) => driver.place_allocation(device, size),
            Err(_) => None,
        };
        let Some(address) = placed else {
            if charged.is_ok() {
                driver.uncharge(device, size);
            }
            call_log::alloc(size, None);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        call_log::alloc(size, Some(driver.arena_offset(device, address)));
        driver
            .allocations
            .insert(address, Allocation { size, device });
        // SAFETY: `dptr` was checked non-NULL; the caller promises it is writable.
        unsafe { put(dptr, address) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    call("cuMemFree_v2", |driver| {
        driver.require_primary_context()?;
        let allocation = driver
            .allocations
            .remove(&dptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        driver.uncharge(allocation.device, allocation.size);
        call_log::free(
            allocation.size,
            driver.arena_offset(allocation.device, dptr),
        );
        driver.release_allocation(dptr, &allocation);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    call("cuMemGetInfo_v2", |driver| {
        let device = driver.require_primary_context()?;
        let free_bytes = driver.free_bytes(device);
        // SAFETY: out pointers from the caller, valid for writes by the driver API contract.
        unsafe {
            put(free, free_bytes as usize)?;
            put(total, driver.capacity as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dptr: u64, value: u8, count: usize) -> CuResult {
    call("cuMemsetD8_v2", |driver| {
        driver.require_primary_context()?;
        driver.check_device_range(dptr, count as u64)?;
        // SAFETY: the range was just checked to be live, writable device (= host) memory.
        unsafe { std::ptr::write_bytes(dptr as *mut u8, value, count) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, count: usize) -> CuResult {
    call("cuMemcpyHtoD_v2", |driver| {
        driver.require_primary_context()?;
        driver.check_device_range(dst, count as u64)?;
        if src.is_null() && count > 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `dst` was checked to be live device memory; the caller promises `count`
        // readable bytes at `src`. `copy` tolerates overlap.
        unsafe { std::ptr::copy(src.cast::<u8>(), dst as *mut u8, count) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, count: usize) -> CuResult {
    call("cuMemcpyDtoH_v2", |driver| {
        driver.require_primary_context()?;
        driver.check_device_range(src, count as u64)?;
        if dst.is_null() && count > 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: `src` was checked to be live device memory; the caller promises `count`
        // writable bytes at `dst`. `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst.cast::<u8>(), count) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, count: usize) -> CuResult {
    call("cuMemcpyDtoD_v2", |driver| {
        driver.require_primary_context()?;
        driver.check_device_range(dst, count as u64)?;
        driver.check_device_range(src, count as u64)?;
        // SAFETY: both ranges were just checked to be live device (= host) memory; `copy`
        // tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
        Ok(())
    })
}

/// The unified-addressing copy: either side may be host or device memory. A side that lies in
/// device memory must lie wholly in one live allocation or accessible mapping.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpy(dst: u64, src: u64, count: usize) -> CuResult {
    call("cuMemcpy", |driver| {
        driver.require_primary_context()?;
        for side in [dst, src] {
            if side == 0 && count > 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if driver.device_of_pointer(side).is_some() {
                driver.check_device_range(side, count as u64)?;
            }
        }
        // SAFETY: device sides were checked above; host sides are the caller's promise, as
        // with the real driver. `copy` tolerates overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
        Ok(())
    })
}

/// Answers the memory type and the device ordinal of device memory; any other address is
/// `CUDA_ERROR_INVALID_VALUE`, as the driver answers for memory it does not know.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: u64,
) -> CuResult {
    call("cuPointerGetAttribute", |driver| {
        let device = driver
            .device_of_pointer(ptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match attribute {
            // SAFETY: the caller provides room for the attribute's type, as the API requires.
            POINTER_ATTRIBUTE_MEMORY_TYPE => unsafe { put(data.cast::<u32>(), MEMORY_TYPE_DEVICE) },
            // SAFETY: as above.
            POINTER_ATTRIBUTE_DEVICE_ORDINAL => unsafe { put(data.cast::<c_int>(), device) },
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}
