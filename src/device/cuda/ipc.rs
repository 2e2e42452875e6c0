//! CUDA IPC on the driver API: memory handles of `cuMemAlloc`'d allocations, and physical
//! memory exported and imported as shareable handles (what PyTorch's expandable segments use).
//! The caller has made the device's context current.

use super::super::{DeviceError, DevicePtr, PhysicalHandle, SharedPhysical};
use super::calls::check_call;
use super::sys;
use std::ffi::c_void;

/// The shareable handle type physical memory is created with: POSIX file descriptors where the
/// device supports them, unless `TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0` turns them off, as it
/// does PyTorch's (for drivers that refuse the handle type in some containers).
pub(super) fn shareable_handle_type(posix_fd_supported: bool) -> sys::CUmemAllocationHandleType {
    if posix_fd_supported && crate::env::expandable_segments_ipc_enabled() {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    }
}

pub(super) fn memory_handle(base: DevicePtr) -> Result<[u8; 64], DeviceError> {
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: the out pointer is a live local; the driver validates `base`.
    check_call("cuIpcGetMemHandle", || unsafe {
        sys::cuIpcGetMemHandle(&mut handle, base)
    })?;
    Ok(handle.reserved.map(|byte| byte as u8))
}

pub(super) fn open_memory(handle: &[u8; 64]) -> Result<DevicePtr, DeviceError> {
    let handle = sys::CUipcMemHandle {
        reserved: handle.map(|byte| byte as std::ffi::c_char),
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // As PyTorch opens them (cudaIpcMemLazyEnablePeerAccess), so that memory of another
    // device opens too.
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: the out pointer is a live local; the handle is passed by value.
    check_call("cuIpcOpenMemHandle_v2", || unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags)
    })?;
    Ok(ptr)
}

pub(super) fn close_memory(ptr: DevicePtr) -> Result<(), DeviceError> {
    // SAFETY: plain value; the driver validates it.
    check_call("cuIpcCloseMemHandle", || unsafe {
        sys::cuIpcCloseMemHandle(ptr)
    })
}

pub(super) fn export_fd(handle: PhysicalHandle) -> Result<i32, DeviceError> {
    let mut fd: i32 = -1;
    // SAFETY: a POSIX file descriptor handle is an int, and the out pointer is a live one.
    check_call("cuMemExportToShareableHandle", || unsafe {
        sys::cuMemExportToShareableHandle(
            std::ptr::from_mut(&mut fd).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    Ok(fd)
}

pub(super) fn import(shared: &SharedPhysical) -> Result<PhysicalHandle, DeviceError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let mut fabric;
    let (shareable, handle_type) = match shared {
        // The driver takes the descriptor itself, cast to a pointer.
        SharedPhysical::FileDescriptor(fd) => (
            std::ptr::without_provenance_mut::<c_void>(*fd as usize),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ),
        SharedPhysical::Fabric(bytes) => {
            fabric = *bytes;
            (
                fabric.as_mut_ptr().cast::<c_void>(),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        }
    };
    // SAFETY: the out pointer is a live local; `shareable` is a descriptor value, or points at
    // the 64 live bytes of a fabric handle.
    check_call("cuMemImportFromShareableHandle", || unsafe {
        sys::cuMemImportFromShareableHandle(&mut handle, shareable, handle_type)
    })?;
    Ok(handle)
}

/// Closes a descriptor that `export_fd` made, once its physical memory was released.
pub(super) fn close_exported(fd: i32) {
    // SAFETY: a descriptor this process owns (made by the export, closed once: removed from
    // the table before).
    unsafe { libc::close(fd) };
}
