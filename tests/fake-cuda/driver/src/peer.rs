//! Peer access between devices, and the device features that the virtual memory calls need.
//!
//! Two kinds of access, as in NVIDIA's documentation:
//! - `cuCtxEnablePeerAccess` lets the current context's device reach memory that
//!   `cuMemAlloc` gave the peer context's device. It applies to that memory only: pages mapped
//!   with `cuMemMap` are reached only by the devices `cuMemSetAccess` names (`vmm.rs`), whatever
//!   peer access was enabled. Copies of `cuMemAlloc` memory between devices work either way (the
//!   driver stages them), so the fake only keeps and checks the state.
//! - `cuDeviceCanAccessPeer` says which pairs of devices can reach each other at all; it bounds
//!   both `cuCtxEnablePeerAccess` and the devices `cuMemSetAccess` may name.

use std::ffi::{c_int, c_uint, c_void};

use crate::{
    CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, CuResult, Driver, call,
    put,
};

/// What every device of the fake supports; each can be turned off with its variable set to `0`,
/// to stand for a GPU or a platform without it.
#[derive(Clone, Copy, Debug)]
pub struct Features {
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (`FAKE_LIBCUDA_VMM`): without
    /// it every virtual memory call answers `CUDA_ERROR_NOT_SUPPORTED`.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`
    /// (`FAKE_LIBCUDA_POSIX_FD_HANDLES`): without it `cuMemCreate` refuses to make memory
    /// exportable as a file descriptor.
    pub posix_fd_handles: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`
    /// (`FAKE_LIBCUDA_RDMA_WITH_VMM`): without it `cuMemCreate` refuses `gpuDirectRDMACapable`.
    pub rdma_with_vmm: bool,
    /// `cuDeviceCanAccessPeer` between two different devices (`FAKE_LIBCUDA_PEER_ACCESS`).
    pub peer_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` (`FAKE_LIBCUDA_MULTICAST=1`; off unless asked:
    /// the fake has no multicast objects, its `cuMulticast*` are stubs).
    pub multicast: bool,
}

impl Features {
    pub fn from_environment() -> Features {
        let enabled = |name: &str| std::env::var(name).map_or(true, |value| value.trim() != "0");
        Features {
            vmm: enabled("FAKE_LIBCUDA_VMM"),
            posix_fd_handles: enabled("FAKE_LIBCUDA_POSIX_FD_HANDLES"),
            rdma_with_vmm: enabled("FAKE_LIBCUDA_RDMA_WITH_VMM"),
            peer_access: enabled("FAKE_LIBCUDA_PEER_ACCESS"),
            multicast: std::env::var("FAKE_LIBCUDA_MULTICAST").is_ok_and(|v| v.trim() == "1"),
        }
    }
}

impl Default for Features {
    fn default() -> Features {
        Features {
            vmm: true,
            posix_fd_handles: true,
            rdma_with_vmm: true,
            peer_access: true,
            multicast: false,
        }
    }
}

impl Driver {
    /// `cuDeviceCanAccessPeer(device, peer)`: whether `device` can reach memory on `peer`. A
    /// device is not its own peer.
    pub fn can_access_peer(&self, device: i32, peer: i32) -> bool {
        device != peer && self.features.peer_access
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can_access: *mut c_int,
    device: c_int,
    peer: c_int,
) -> CuResult {
    call("cuDeviceCanAccessPeer", |driver| {
        driver.valid_device(device)?;
        driver.valid_device(peer)?;
        let answer = c_int::from(driver.can_access_peer(device, peer));
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(can_access, answer) }
    })
}

/// The devices of the current context and of `peer_context`, both retained primary contexts.
fn devices_of(driver: &Driver, peer_context: *mut c_void) -> Result<(i32, i32), CuResult> {
    let device = driver.require_primary_context()?;
    let peer = driver
        .retained_primary_context_device(peer_context as usize)
        .ok_or(crate::CUDA_ERROR_INVALID_CONTEXT)?;
    Ok((device, peer))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxEnablePeerAccess(peer_context: *mut c_void, flags: c_uint) -> CuResult {
    call("cuCtxEnablePeerAccess", |driver| {
        let (device, peer) = devices_of(driver, peer_context)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if device == peer {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        if !driver.can_access_peer(device, peer) {
            return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        }
        if !driver.peer_links.insert((device, peer)) {
            return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDisablePeerAccess(peer_context: *mut c_void) -> CuResult {
    call("cuCtxDisablePeerAccess", |driver| {
        let (device, peer) = devices_of(driver, peer_context)?;
        if driver.peer_links.remove(&(device, peer)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)
        }
    })
}
