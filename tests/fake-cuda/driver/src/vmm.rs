//! The virtual memory management calls behind expandable segments, on mmap and memfd:
//! a reservation is `PROT_NONE` address space, a physical handle is a memfd, a mapping puts the
//! memfd's pages into a reservation (still `PROT_NONE`), and `cuMemSetAccess` opens them up.
//!
//! Access is kept per device, as the driver keeps it: a device reaches mapped pages only once a
//! `cuMemSetAccess` descriptor named it (peer access enabled with `cuCtxEnablePeerAccess` does
//! not apply to them), and a copy or memset made in another device's context touches them as
//! that device would: `CUDA_ERROR_ILLEGAL_ADDRESS`. The host pages are open while any device
//! has access.
//!
//! A handle made with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` can be exported
//! (`cuMemExportToShareableHandle`: a duplicate of its memfd) and imported in another process
//! (`cuMemImportFromShareableHandle`: a new handle on the same memfd), which is how PyTorch shares
//! expandable segments: both processes map the same pages.

use std::collections::BTreeMap;
use std::ffi::{CString, c_int, c_ulonglong, c_void};

use crate::address_space::put_back_inaccessible;
use crate::{
    CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, CuResult, Driver,
    GRANULARITY, Outcome, call, call_log, get, put,
};

const ALLOCATION_TYPE_PINNED: u32 = 1;
const LOCATION_TYPE_DEVICE: u32 = 1;
const HANDLE_TYPE_NONE: u32 = 0;
const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: u32 = 1;
const ACCESS_NONE: u32 = 0;
const ACCESS_READ: u32 = 1;
const ACCESS_READWRITE: u32 = 3;
/// The start of a physical handle's memfd name; the device follows.
const PHYSICAL_NAME: &str = "fake-cuda-physical-";

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemLocation {
    kind: u32,
    id: c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AllocationProp {
    kind: u32,
    requested_handle_types: u32,
    location: MemLocation,
    win32_handle_metadata: *mut c_void,
    alloc_flags: AllocationFlags,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocationFlags {
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AccessDesc {
    location: MemLocation,
    flags: u32,
}

/// A `cuMemCreate` handle: a memfd of `size` bytes, named after its device
/// (`fake-cuda-physical-DEVICE`, so that an importer knows it).
pub struct Physical {
    fd: c_int,
    size: u64,
    /// The device whose memory it is.
    device: i32,
    mappings: u32,
    /// The creation or import, and each `cuMemRetainAllocationHandle`, not yet undone by
    /// `cuMemRelease`; at 0 the memory goes when the last mapping does.
    references: u32,
    /// Created with `gpuDirectRDMACapable` set.
    rdma_capable: bool,
    /// `CUmemAllocationProp::requestedHandleTypes` at creation: the types it can be exported as.
    handle_types: u32,
    /// Counted against this process's device memory (not so for memory imported from another
    /// process, which that process holds).
    charged: bool,
}

/// Pages of one physical handle mapped into a reservation.
pub struct Mapping {
    size: u64,
    handle: u64,
    /// The access flags `cuMemSetAccess` set, per device; a device not listed has none.
    access: BTreeMap<i32, u32>,
}

impl Driver {
    /// Every virtual memory call needs `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    fn require_vmm(&self) -> Outcome {
        if self.features.vmm {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_SUPPORTED)
        }
    }

    /// The handle types and flags `cuMemCreate` is asked for, against what the device supports.
    fn check_requested_features(&self, prop: AllocationProp) -> Outcome {
        match prop.requested_handle_types {
            HANDLE_TYPE_NONE => {}
            HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if self.features.posix_fd_handles => {}
            _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
        }
        if prop.alloc_flags.gpu_direct_rdma_capable != 0 && !self.features.rdma_with_vmm {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        Ok(())
    }

    /// Live physical handles created `gpuDirectRDMACapable` (`fake_cuda_stat`).
    pub fn rdma_capable_physical(&self) -> u64 {
        self.physical.values().filter(|p| p.rdma_capable).count() as u64
    }

    fn check_device_location(&self, location: MemLocation) -> Outcome {
        if location.kind != LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.valid_device(location.id)
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)
    }

    fn check_allocation_prop(&self, prop: AllocationProp) -> Outcome {
        if prop.kind != ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.check_device_location(prop.location)
    }

    /// The mappings that cover `[ptr, ptr + len)` exactly and without gaps, in address order;
    /// `None` when the range is not wholly mapped.
    fn mappings_covering(&self, ptr: u64, len: u64) -> Option<Vec<u64>> {
        let end = ptr.checked_add(len)?;
        // The mapping that contains `ptr` may start before it.
        let first = self
            .mappings
            .range(..=ptr)
            .next_back()
            .map(|(&start, _)| start)?;
        let mut covered_to = first;
        let mut starts = Vec::new();
        for (&start, mapping) in self.mappings.range(first..end) {
            if start != covered_to {
                return None;
            }
            covered_to = start + mapping.size;
            starts.push(start);
        }
        (!starts.is_empty() && covered_to >= end).then_some(starts)
    }

    /// Succeeds when `[ptr, ptr + len)` is wholly mapped and the device that touches it has
    /// access to every page: the calling thread's context's device, when that is the pages'
    /// device or a peer that can reach it directly; otherwise the driver stages the copy
    /// through the host and the pages' own device touches them. Reserved address space that is
    /// not mapped (never, or no more: sleeping memory), or mapped pages the touching device may
    /// not access, are an illegal address, the fault its copy engine or a kernel would take
    /// (said on stderr; the caller makes it sticky). A range outside any one reservation is an
    /// invalid value.
    pub fn check_accessible_mapping(&self, ptr: u64, len: u64) -> Outcome {
        if self.reservation_containing(ptr, len).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let Some(starts) = self.mappings_covering(ptr, len) else {
            return Err(illegal_address(ptr, len, "reserved but not mapped"));
        };
        if starts
            .iter()
            .all(|start| self.mappings[start].access.is_empty())
        {
            return Err(illegal_address(
                ptr,
                len,
                "mapped without access for any device",
            ));
        }
        let device = self.require_primary_context()?;
        let toucher = |start: &u64| {
            let owner = self.mapped_device(*start).unwrap_or(device);
            if owner == device || self.can_access_peer(device, owner) {
                device
            } else {
                owner
            }
        };
        match starts
            .iter()
            .find(|start| !self.mappings[*start].access.contains_key(&toucher(start)))
        {
            None => Ok(()),
            Some(start) => Err(illegal_address(
                ptr,
                len,
                &format!("mapped without access for device {}", toucher(start)),
            )),
        }
    }

    /// The device whose physical memory is mapped at `ptr`, if any.
    pub fn mapped_device(&self, ptr: u64) -> Option<i32> {
        let (&start, mapping) = self.mappings.range(..=ptr).next_back()?;
        (ptr < start + mapping.size)
            .then(|| self.physical.get(&mapping.handle).map(|p| p.device))
            .flatten()
    }

    fn reservation_containing(&self, ptr: u64, len: u64) -> Option<u64> {
        let (&start, &size) = self.reservations.range(..=ptr).next_back()?;
        (ptr.checked_add(len)? <= start + size).then_some(start)
    }

    /// Drops a physical handle's memory once it is released and no longer mapped.
    fn maybe_free_physical(&mut self, handle: u64) {
        let Some(physical) = self.physical.get(&handle) else {
            return;
        };
        if physical.references == 0 && physical.mappings == 0 {
            let (device, size, fd) = (physical.device, physical.size, physical.fd);
            if physical.charged {
                self.uncharge(device, size);
            }
            // SAFETY: the fd is ours, open, and closed exactly once (the entry goes with it).
            unsafe { libc::close(fd) };
            self.physical.remove(&handle);
        }
    }
}

/// The illegal address a copy, memset or graph node takes at `[ptr, ptr + len)`, said on stderr
/// with why (the real driver says nothing, but a test that meets it wants to know where).
pub fn illegal_address(ptr: u64, len: u64, why: &str) -> CuResult {
    eprintln!(
        "fake-cuda: ILLEGAL ADDRESS: device memory [{ptr:#x}, {:#x}) is {why}; every later call \
         returns CUDA_ERROR_ILLEGAL_ADDRESS",
        ptr.saturating_add(len)
    );
    CUDA_ERROR_ILLEGAL_ADDRESS
}

fn is_granular(value: u64) -> bool {
    value != 0 && value.is_multiple_of(GRANULARITY)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    option: u32,
) -> CuResult {
    call("cuMemGetAllocationGranularity", |driver| {
        driver.require_vmm()?;
        // SAFETY: `prop` is the caller's, readable by the driver API contract.
        driver.check_allocation_prop(unsafe { get(prop) }?)?;
        if option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(granularity, GRANULARITY as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    flags: c_ulonglong,
) -> CuResult {
    call("cuMemCreate", |driver| {
        driver.require_vmm()?;
        // SAFETY: `prop` is the caller's, readable by the driver API contract.
        let prop = unsafe { get(prop) }?;
        driver.check_allocation_prop(prop)?;
        driver.check_requested_features(prop)?;
        let size = size as u64;
        if handle.is_null() || flags != 0 || !is_granular(size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = prop.location.id;
        let charged = driver.charge(device, size);
        call_log::create(size, charged.is_ok());
        charged?;
        let name = CString::new(format!("{PHYSICAL_NAME}{device}")).unwrap_or_default();
        // SAFETY: plain syscalls on a fresh fd we own; failure is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: as above.
        if fd < 0 || unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            if fd >= 0 {
                // SAFETY: our own fd, closed once.
                unsafe { libc::close(fd) };
            }
            driver.uncharge(device, size);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let new_handle = driver.new_handle();
        let physical = Physical {
            fd,
            size,
            device,
            mappings: 0,
            references: 1,
            rdma_capable: prop.alloc_flags.gpu_direct_rdma_capable != 0,
            handle_types: prop.requested_handle_types,
            charged: true,
        };
        driver.physical.insert(new_handle, physical);
        // SAFETY: `handle` was checked non-NULL; the caller promises it is writable.
        unsafe { put(handle, new_handle) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    call("cuMemRelease", |driver| {
        match driver.physical.get_mut(&handle) {
            Some(physical) if physical.references > 0 => physical.references -= 1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        driver.maybe_free_physical(handle);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    size: usize,
    alignment: usize,
    _address_hint: u64,
    flags: c_ulonglong,
) -> CuResult {
    call("cuMemAddressReserve", |driver| {
        driver.require_vmm()?;
        let size = size as u64;
        if ptr.is_null() || flags != 0 || !is_granular(size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let alignment = (alignment as u64).max(GRANULARITY);
        // The hint is ignored: placement depends on the calls alone (`address_space.rs`). The
        // arena is PROT_NONE address space already.
        let arena = &mut driver
            .address_space
            .as_mut()
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?
            .reservations;
        let start = arena
            .place(size, alignment)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let offset = arena.offset(start);
        driver.reservations.insert(start, size);
        call_log::reserve(start, size, offset);
        // SAFETY: `ptr` was checked non-NULL; the caller promises it is writable.
        unsafe { put(ptr, start) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: u64, size: usize) -> CuResult {
    call("cuMemAddressFree", |driver| {
        let size = size as u64;
        if driver.reservations.get(&ptr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Stricter than the driver: freeing address space that still has pages mapped is a leak.
        if driver.mappings.range(ptr..ptr + size).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver.reservations.remove(&ptr);
        call_log::address_free(ptr, size);
        // Unmapping put PROT_NONE anonymous memory back over every page mapped in the range, so
        // it is as it was reserved: the arena takes it back as it is.
        if let Some(space) = driver.address_space.as_mut() {
            space.reservations.release(ptr, size);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: u64,
    size: usize,
    offset: usize,
    handle: u64,
    flags: c_ulonglong,
) -> CuResult {
    call("cuMemMap", |driver| {
        driver.require_vmm()?;
        let (size, offset) = (size as u64, offset as u64);
        let physical = driver
            .physical
            .get(&handle)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if physical.references == 0
            || flags != 0
            || !is_granular(size)
            || !ptr.is_multiple_of(GRANULARITY)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // "offset - Offset into the memory represented by handle from which to start mapping -
        // Note: currently must be zero."
        if offset != 0 || size > physical.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let range = driver
            .reservation_containing(ptr, size)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let overlaps_before = driver
            .mappings
            .range(..ptr)
            .next_back()
            .is_some_and(|(&start, mapping)| start + mapping.size > ptr);
        let overlaps_after = driver.mappings.range(ptr..ptr + size).next().is_some();
        if overlaps_before || overlaps_after {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: MAP_FIXED over PROT_NONE address space of one of our reservations that holds no
        // mapping; the fd is ours and open.
        let result = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                physical.fd,
                offset as libc::off_t,
            )
        };
        if result == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        if let Some(physical) = driver.physical.get_mut(&handle) {
            physical.mappings += 1;
        }
        let mapping = Mapping {
            size,
            handle,
            access: BTreeMap::new(),
        };
        driver.mappings.insert(ptr, mapping);
        call_log::mapping(true, range, ptr, size);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: u64,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CuResult {
    call("cuMemSetAccess", |driver| {
        driver.require_vmm()?;
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` readable descriptors at `desc`.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let size = size as u64;
        let starts = driver
            .mappings_covering(ptr, size)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for d in descs {
            driver.check_device_location(d.location)?;
            if ![ACCESS_NONE, ACCESS_READ, ACCESS_READWRITE].contains(&d.flags) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // A device reaches another's memory only where cuDeviceCanAccessPeer says it can.
            for start in &starts {
                let owner = driver.mapped_device(*start);
                if owner.is_some_and(|owner| {
                    owner != d.location.id && !driver.can_access_peer(d.location.id, owner)
                }) {
                    return Err(CUDA_ERROR_INVALID_DEVICE);
                }
            }
        }
        let mut widest = ACCESS_NONE;
        for start in &starts {
            if let Some(mapping) = driver.mappings.get_mut(start) {
                for d in descs {
                    match d.flags {
                        ACCESS_NONE => mapping.access.remove(&d.location.id),
                        flags => mapping.access.insert(d.location.id, flags),
                    };
                }
                widest = widest.max(
                    mapping
                        .access
                        .values()
                        .copied()
                        .max()
                        .unwrap_or(ACCESS_NONE),
                );
            }
        }
        // The host pages back every device's view: open as far as the widest access needs.
        let protection = match widest {
            ACCESS_NONE => libc::PROT_NONE,
            ACCESS_READ => libc::PROT_READ,
            _ => libc::PROT_READ | libc::PROT_WRITE,
        };
        // SAFETY: the range is wholly covered by our own mappings.
        if unsafe { libc::mprotect(ptr as *mut c_void, size as usize, protection) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: u64, size: usize) -> CuResult {
    call("cuMemUnmap", |driver| {
        let size = size as u64;
        // Like the driver, only whole mappings can be unmapped.
        let starts = driver
            .mappings_covering(ptr, size)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let last = starts[starts.len() - 1];
        if starts[0] != ptr || last + driver.mappings[&last].size != ptr + size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Unmapping does not wait for work still using the pages (PyTorch synchronizes first).
        driver.timeline.check_unmap(ptr, size);
        if let Some(range) = driver.reservation_containing(ptr, size) {
            call_log::mapping(false, range, ptr, size);
        }
        for start in starts {
            if let Some(mapping) = driver.mappings.remove(&start) {
                if let Some(physical) = driver.physical.get_mut(&mapping.handle) {
                    physical.mappings -= 1;
                }
                driver.maybe_free_physical(mapping.handle);
            }
        }
        if put_back_inaccessible(ptr, size) {
            Ok(())
        } else {
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    })
}

// ---- Sharing with other processes ----------------------------------------------------------

/// "Exports an allocation to a requested shareable handle type": for
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, a new fd (the caller's to close) on the handle's
/// memfd. The type must be one the handle was created with (`requestedHandleTypes`), else
/// `CUDA_ERROR_INVALID_VALUE`; other types are not supported, as at creation.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    handle_type: u32,
    flags: c_ulonglong,
) -> CuResult {
    call("cuMemExportToShareableHandle", |driver| {
        driver.require_vmm()?;
        let physical = driver
            .physical
            .get(&handle)
            .filter(|physical| physical.references > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if shareable.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if handle_type != HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if physical.handle_types & HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a plain syscall on our own open fd.
        let fd = unsafe { libc::fcntl(physical.fd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: checked non-NULL; for this type the caller passes room for an int.
        unsafe { put(shareable.cast::<c_int>(), fd) }
    })
}

/// "Imports an allocation from a requested shareable handle type": for
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, `os_handle` is the fd (the caller may close it
/// after). The new handle is memory of the device that made it, held by the process that made
/// it (not counted here). An fd that is not one of the fake's physical handles is
/// `CUDA_ERROR_INVALID_VALUE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    handle_type: u32,
) -> CuResult {
    call("cuMemImportFromShareableHandle", |driver| {
        driver.require_vmm()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if handle_type != HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let given = c_int::try_from(os_handle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let device = physical_device_of(given).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        driver
            .valid_device(device)
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: plain syscalls on the caller's open fd; the duplicate is ours.
        let (fd, size) = unsafe {
            let mut stat: libc::stat = std::mem::zeroed();
            if libc::fstat(given, &mut stat) != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            (
                libc::fcntl(given, libc::F_DUPFD_CLOEXEC, 0),
                stat.st_size as u64,
            )
        };
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let fd = if crate::ipc::private_copies() {
            private_copy_of(fd, size)
        } else {
            fd
        };
        let new_handle = driver.new_handle();
        let physical = Physical {
            fd,
            size,
            device,
            mappings: 0,
            references: 1,
            rdma_capable: false,
            handle_types: HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            charged: false,
        };
        driver.physical.insert(new_handle, physical);
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(handle, new_handle) }
    })
}

/// A broken import (`FAKE_LIBCUDA_IPC_PRIVATE_COPY=1`, see `ipc.rs`): a new memfd holding a copy
/// of `fd`'s bytes, which replaces `fd` (closed).
fn private_copy_of(fd: c_int, size: u64) -> c_int {
    let Some(copy) = crate::address_space::sized_memfd(c"fake-cuda-private-copy", size) else {
        return fd;
    };
    let mut buffer = vec![0u8; 1 << 20];
    let mut offset = 0;
    while offset < size {
        // SAFETY: a buffer of its length; plain syscalls on two open fds.
        let read = unsafe {
            libc::pread(
                fd,
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                offset as libc::off_t,
            )
        };
        if read <= 0 {
            break;
        }
        // SAFETY: as above, the `read` bytes just read.
        unsafe {
            libc::pwrite(
                copy,
                buffer.as_ptr().cast(),
                read as usize,
                offset as libc::off_t,
            )
        };
        offset += read as u64;
    }
    // SAFETY: our duplicate, replaced by the copy.
    unsafe { libc::close(fd) };
    copy
}

/// The device of the fake's physical memfd `fd`, from its name; None for any other fd.
fn physical_device_of(fd: c_int) -> Option<i32> {
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let link = link.to_string_lossy();
    let rest = link.strip_prefix("/memfd:")?.strip_prefix(PHYSICAL_NAME)?;
    rest.split(' ').next()?.parse().ok()
}

/// "Retrieve the contents of the property structure defining properties for this handle."
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut AllocationProp,
    handle: u64,
) -> CuResult {
    call("cuMemGetAllocationPropertiesFromHandle", |driver| {
        let physical = driver
            .physical
            .get(&handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let answer = AllocationProp {
            kind: ALLOCATION_TYPE_PINNED,
            requested_handle_types: physical.handle_types,
            location: MemLocation {
                kind: LOCATION_TYPE_DEVICE,
                id: physical.device,
            },
            win32_handle_metadata: std::ptr::null_mut(),
            alloc_flags: AllocationFlags {
                compression_type: 0,
                gpu_direct_rdma_capable: u8::from(physical.rdma_capable),
                usage: 0,
                reserved: [0; 4],
            },
        };
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(prop, answer) }
    })
}

/// "Given an address addr, returns the allocation handle of the backing memory allocation",
/// for any address of a mapping; "must be released with the corresponding number of calls to
/// cuMemRelease".
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut u64,
    addr: *mut c_void,
) -> CuResult {
    call("cuMemRetainAllocationHandle", |driver| {
        let ptr = addr as u64;
        let (&start, mapping) = driver
            .mappings
            .range(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if ptr >= start + mapping.size || handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let retained = mapping.handle;
        if let Some(physical) = driver.physical.get_mut(&retained) {
            physical.references += 1;
        }
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(handle, retained) }
    })
}
