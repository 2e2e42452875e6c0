//! `cuMemAlloc` memory: real host memory, so tests can write and read through device pointers.
//! It is carved from the device's arena of the block of device addresses (`address_space.rs`),
//! so the same calls give the same addresses in any process; its pages are opened when it is
//! allocated and given back, inaccessible again, when it is freed.

use std::ffi::{c_int, c_void};

use crate::address_space::{open_pages, page_size, put_back_inaccessible};
use crate::sync::Node;
use crate::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CuResult, Driver, GRANULARITY, Outcome,
    call, call_log, put,
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
    pub fn check_device_range(&self, ptr: u64, len: u64) -> Outcome {
        let end = ptr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((&start, allocation)) = self.allocations.range(..=ptr).next_back()
            && end <= start + allocation.size
        {
            return Ok(());
        }
        self.check_accessible_mapping(ptr, len)
    }

    /// Whether `ptr` lies in device address space (live memory, reserved ranges mapped or not,
    /// freed memory): a copy checks such a side, rather than take it for host memory.
    pub fn is_device_address(&self, ptr: u64) -> bool {
        self.device_of_pointer(ptr).is_some()
            || self
                .address_space
                .as_ref()
                .is_some_and(|space| space.contains(ptr))
    }

    /// The device that owns the device memory at `ptr`, or None for any other address.
    pub fn device_of_pointer(&self, ptr: u64) -> Option<i32> {
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
const POINTER_ATTRIBUTE_DEVICE_POINTER: c_int = 3;
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
        // thread's capture mode allows it, and the capture is invalidated.
        if driver.unsafe_call_forbidden() {
            return Err(driver.refuse_unsafe_call());
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
        if !driver.allocations.contains_key(&dptr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Freeing is an unsafe call during a capture, as allocating is.
        if driver.unsafe_call_forbidden() {
            return Err(driver.refuse_unsafe_call());
        }
        let allocation = driver
            .allocations
            .remove(&dptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // "This API may perform implicit synchronization": it does here, so freed memory has no
        // pending work left (PyTorch relies on this, unlike for cuMemUnmap).
        driver.timeline.counts.frees_checked += 1;
        driver
            .timeline
            .context_finished(crate::device::primary_context(allocation.device));
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

/// Checks the device sides of a copy or memset of `count` bytes: a side in device memory must
/// lie wholly in one live allocation or accessible mapping; a host side must not be NULL.
fn check_sides(driver: &Driver, node: Node) -> Outcome {
    let sides = match node {
        Node::Copy { dst, src, count } => vec![(dst, count), (src, count)],
        Node::Set { dst, count, .. } => vec![(dst, count)],
    };
    for (side, count) in sides {
        if side == 0 && count > 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if driver.is_device_address(side) {
            driver.check_device_range(side, count)?;
        }
    }
    Ok(())
}

/// A copy or memset on `stream`: asynchronous, as the `*Async` functions and memsets are.
fn enqueue(driver: &mut Driver, stream: *mut c_void, node: Node, what: &str) -> Outcome {
    driver.require_primary_context()?;
    check_sides(driver, node)?;
    driver.submit(stream, node, what)
}

/// A synchronous copy: on the legacy default stream, and the host waits for it (so for every
/// blocking stream's earlier work too).
fn copy_synchronously(driver: &mut Driver, node: Node, what: &str) -> Outcome {
    enqueue(driver, LEGACY_STREAM, node, what)?;
    let lane = driver.lane_of(LEGACY_STREAM)?;
    driver.timeline.lane_finished(lane);
    Ok(())
}

/// A device side that must be device memory or device address space (`cuMemcpyDtoD` and the
/// like); whether it may be touched is checked with the work.
fn require_device(driver: &Driver, ptr: u64) -> Outcome {
    if driver.is_device_address(ptr) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

const LEGACY_STREAM: *mut c_void = std::ptr::null_mut();

/// A memset of device memory on `stream`: asynchronous with respect to the host.
fn memset(driver: &mut Driver, dst: u64, value: u8, count: usize, stream: *mut c_void) -> Outcome {
    require_device(driver, dst)?;
    let count = count as u64;
    enqueue(driver, stream, Node::Set { dst, value, count }, "a memset")
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dptr: u64, value: u8, count: usize) -> CuResult {
    call("cuMemsetD8_v2", |driver| {
        memset(driver, dptr, value, count, LEGACY_STREAM)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(
    dptr: u64,
    value: u8,
    count: usize,
    stream: *mut c_void,
) -> CuResult {
    call("cuMemsetD8Async", |driver| {
        memset(driver, dptr, value, count, stream)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, count: usize) -> CuResult {
    call("cuMemcpyHtoD_v2", |driver| {
        require_device(driver, dst)?;
        let node = Node::Copy {
            dst,
            src: src as u64,
            count: count as u64,
        };
        copy_synchronously(driver, node, "cuMemcpyHtoD")
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, count: usize) -> CuResult {
    call("cuMemcpyDtoH_v2", |driver| {
        require_device(driver, src)?;
        let node = Node::Copy {
            dst: dst as u64,
            src,
            count: count as u64,
        };
        copy_synchronously(driver, node, "cuMemcpyDtoH")
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, count: usize) -> CuResult {
    call("cuMemcpyDtoD_v2", |driver| {
        require_device(driver, dst)?;
        require_device(driver, src)?;
        let node = Node::Copy {
            dst,
            src,
            count: count as u64,
        };
        // Asynchronous for device-to-device copies, as the documentation says.
        enqueue(driver, LEGACY_STREAM, node, "cuMemcpyDtoD")
    })
}

/// The unified-addressing copy: either side may be host or device memory. Synchronous, as the
/// documentation describes it for copies that involve host memory.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpy(dst: u64, src: u64, count: usize) -> CuResult {
    call("cuMemcpy", |driver| {
        let node = Node::Copy {
            dst,
            src,
            count: count as u64,
        };
        copy_synchronously(driver, node, "cuMemcpy")
    })
}

/// The unified-addressing copy on a stream, asynchronous.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyAsync(dst: u64, src: u64, count: usize, stream: *mut c_void) -> CuResult {
    call("cuMemcpyAsync", |driver| {
        let node = Node::Copy {
            dst,
            src,
            count: count as u64,
        };
        enqueue(driver, stream, node, "cuMemcpyAsync")
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
            // The address a kernel uses for it: the same (Triton checks its pointer arguments).
            // SAFETY: as above.
            POINTER_ATTRIBUTE_DEVICE_POINTER => unsafe { put(data.cast::<u64>(), ptr) },
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}
