//! `cuMemAlloc` memory: real host memory, so tests can write and read through device pointers.

use std::alloc::Layout;
use std::ffi::c_void;

use crate::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CuResult, Driver, GRANULARITY, Outcome, call, put, sync,
};

/// `cudaMalloc` guarantees at least this alignment.
const SMALL_ALIGNMENT: u64 = 512;

pub struct Allocation {
    layout: Layout,
}

impl Driver {
    /// Succeeds when `[ptr, ptr + len)` is device memory the caller may touch: inside one live
    /// `cuMemAlloc` allocation, or inside mapped pages made accessible by `cuMemSetAccess`.
    fn check_device_range(&self, ptr: u64, len: u64) -> Outcome {
        let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((&start, allocation)) = self.allocations.range(..=ptr).next_back()
            && end <= start + allocation.layout.size() as u64
        {
            return Ok(());
        }
        self.check_accessible_mapping(ptr, len)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CuResult {
    call("cuMemAlloc_v2", |driver| {
        driver.require_primary_context()?;
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
        let alignment = if size as u64 >= GRANULARITY {
            GRANULARITY
        } else {
            SMALL_ALIGNMENT
        };
        let layout = Layout::from_size_align(size, alignment as usize)
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        driver.charge(size as u64)?;
        // SAFETY: `layout` has a non-zero size.
        let memory = unsafe { std::alloc::alloc(layout) };
        if memory.is_null() {
            driver.bytes_in_use -= size as u64;
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let address = memory as u64;
        driver.allocations.insert(address, Allocation { layout });
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
        driver.bytes_in_use -= allocation.layout.size() as u64;
        // SAFETY: `dptr` came from `std::alloc::alloc` with this very layout and is freed once,
        // since it was just removed from the table.
        unsafe { std::alloc::dealloc(dptr as *mut u8, allocation.layout) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    call("cuMemGetInfo_v2", |driver| {
        driver.require_primary_context()?;
        // SAFETY: out pointers from the caller, valid for writes by the driver API contract.
        unsafe {
            put(free, (driver.capacity - driver.bytes_in_use) as usize)?;
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
