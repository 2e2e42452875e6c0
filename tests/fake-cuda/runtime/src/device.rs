//! Devices: count, current device, properties and attributes, all answered by the driver so
//! that `cudaGetDeviceProperties` and `cuDeviceTotalMem` agree.

use std::ffi::{c_char, c_int, c_uint};

use cudarc::runtime::sys::cudaDeviceProp;

use crate::driver::{self, enter};
use crate::{CURRENT_DEVICE, CudaError, INVALID_DEVICE, Outcome, api, api_on_device, check, put};

/// The driver's `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`.
const PEER_ACCESS_UNSUPPORTED: u32 = 217;

/// The runtime version this build reports (the headers its `cudaDeviceProp` follows).
#[cfg(feature = "cuda-13")]
const RUNTIME_VERSION: c_int = 13020;
#[cfg(not(feature = "cuda-13"))]
const RUNTIME_VERSION: c_int = 12080;

const ATTRIBUTE_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTRIBUTE_WARP_SIZE: c_int = 10;
const ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const ATTRIBUTE_PCI_BUS_ID: c_int = 33;
const ATTRIBUTE_PCI_DEVICE_ID: c_int = 34;
const ATTRIBUTE_PCI_DOMAIN_ID: c_int = 50;

fn valid_device(device: c_int) -> Outcome {
    let count = driver::device_count()?;
    if (0..count).contains(&device) {
        Ok(())
    } else {
        Err(INVALID_DEVICE)
    }
}

fn attribute(attribute: c_int, device: c_int) -> Result<c_int, CudaError> {
    let mut value = 0;
    // SAFETY: a valid out pointer; the driver checks the rest.
    check(unsafe { driver::cuDeviceGetAttribute(&mut value, attribute, device) })?;
    Ok(value)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDeviceCount(count: *mut c_int) -> CudaError {
    api("cudaGetDeviceCount", || {
        let found = driver::device_count();
        // SAFETY: an out pointer from the caller, writable by the runtime API contract.
        unsafe { put(count, *found.as_ref().unwrap_or(&0)) }?;
        found.map(drop)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDevice(device: *mut c_int) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaGetDevice", || unsafe {
        put(device, CURRENT_DEVICE.get())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaSetDevice(device: c_int) -> CudaError {
    api("cudaSetDevice", || {
        valid_device(device)?;
        enter(device)?;
        CURRENT_DEVICE.set(device);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaSetDeviceFlags(_flags: c_uint) -> CudaError {
    api("cudaSetDeviceFlags", || Ok(()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDeviceFlags(flags: *mut c_uint) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaGetDeviceFlags", || unsafe { put(flags, 0) })
}

forward_on_device!(fn cudaDeviceSynchronize() => cuCtxSynchronize);

#[unsafe(no_mangle)]
pub extern "C" fn cudaDeviceReset() -> CudaError {
    api("cudaDeviceReset", || Ok(()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDriverGetVersion(version: *mut c_int) -> CudaError {
    // SAFETY: forwarded out pointer.
    api("cudaDriverGetVersion", || {
        check(unsafe { driver::cuDriverGetVersion(version) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaRuntimeGetVersion(version: *mut c_int) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaRuntimeGetVersion", || unsafe {
        put(version, RUNTIME_VERSION)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDeviceGetAttribute(
    value: *mut c_int,
    which: c_int,
    device: c_int,
) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaDeviceGetAttribute", || unsafe {
        put(value, attribute(which, device)?)
    })
}

forward_on_device!(fn cudaDeviceGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) => cuCtxGetStreamPriorityRange);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDeviceCanAccessPeer(
    can: *mut c_int,
    device: c_int,
    peer: c_int,
) -> CudaError {
    api("cudaDeviceCanAccessPeer", || {
        valid_device(device)?;
        valid_device(peer)?;
        let mut answer = 0;
        // SAFETY: a valid out pointer; the driver checks the ordinals.
        check(unsafe { driver::cuDeviceCanAccessPeer(&mut answer, device, peer) })?;
        // SAFETY: an out pointer from the caller, writable by the runtime API contract.
        unsafe { put(can, answer) }
    })
}

/// The current device's context reaches `peer`'s memory: the driver's
/// `cuCtxEnablePeerAccess` with `peer`'s primary context. As the runtime documents, a device
/// that cannot reach the peer is `cudaErrorInvalidDevice`.
#[unsafe(no_mangle)]
pub extern "C" fn cudaDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> CudaError {
    api_on_device("cudaDeviceEnablePeerAccess", |_| {
        valid_device(peer)?;
        let peer_context = driver::primary_context(peer)?;
        // SAFETY: a retained primary context.
        match unsafe { driver::cuCtxEnablePeerAccess(peer_context, flags) } {
            PEER_ACCESS_UNSUPPORTED => Err(INVALID_DEVICE),
            code => check(code),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaDeviceDisablePeerAccess(peer: c_int) -> CudaError {
    api_on_device("cudaDeviceDisablePeerAccess", |_| {
        valid_device(peer)?;
        let peer_context = driver::primary_context(peer)?;
        // SAFETY: a retained primary context.
        check(unsafe { driver::cuCtxDisablePeerAccess(peer_context) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDeviceGetPCIBusId(
    bus_id: *mut c_char,
    length: c_int,
    device: c_int,
) -> CudaError {
    api("cudaDeviceGetPCIBusId", || {
        valid_device(device)?;
        let text = format!(
            "{:04x}:{:02x}:{:02x}.0\0",
            attribute(ATTRIBUTE_PCI_DOMAIN_ID, device)?,
            attribute(ATTRIBUTE_PCI_BUS_ID, device)?,
            attribute(ATTRIBUTE_PCI_DEVICE_ID, device)?,
        );
        let length = usize::try_from(length).unwrap_or(0);
        if bus_id.is_null() || length < text.len() {
            return Err(crate::INVALID_VALUE);
        }
        // SAFETY: the caller provides `length` writable bytes, at least the text's length.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), bus_id.cast(), text.len()) };
        Ok(())
    })
}

/// The properties of `device`: what the driver says of it, plus fixed figures of a
/// Hopper-class GPU for what the fake driver does not model.
fn properties(device: c_int) -> Result<cudaDeviceProp, CudaError> {
    valid_device(device)?;
    // SAFETY: cudaDeviceProp is plain integers and arrays: all zeroes is a valid value.
    let mut prop: cudaDeviceProp = unsafe { std::mem::zeroed() };
    // SAFETY: the name buffer is 256 bytes, as the length says.
    check(unsafe { driver::cuDeviceGetName(prop.name.as_mut_ptr(), 256, device) })?;
    let mut total = 0usize;
    // SAFETY: a valid out pointer.
    check(unsafe { driver::cuDeviceTotalMem_v2(&mut total, device) })?;
    prop.totalGlobalMem = total;
    prop.major = attribute(ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)?;
    prop.minor = attribute(ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)?;
    prop.multiProcessorCount = attribute(ATTRIBUTE_MULTIPROCESSOR_COUNT, device)?;
    prop.warpSize = attribute(ATTRIBUTE_WARP_SIZE, device)?.max(32);
    prop.maxThreadsPerBlock = attribute(ATTRIBUTE_MAX_THREADS_PER_BLOCK, device)?.max(1024);
    // A distinct UUID per device (first byte), as tools that tell devices apart expect.
    prop.uuid.bytes[0] = device as c_char + 1;
    prop.sharedMemPerBlock = 48 << 10;
    prop.sharedMemPerBlockOptin = 227 << 10;
    prop.sharedMemPerMultiprocessor = 228 << 10;
    prop.regsPerBlock = 65536;
    prop.regsPerMultiprocessor = 65536;
    prop.maxThreadsDim = [1024, 1024, 64];
    prop.maxGridSize = [i32::MAX, 65535, 65535];
    prop.totalConstMem = 64 << 10;
    prop.l2CacheSize = 50 << 20;
    prop.maxThreadsPerMultiProcessor = 2048;
    prop.maxBlocksPerMultiProcessor = 32;
    prop.memoryBusWidth = 5120;
    prop.pciBusID = attribute(ATTRIBUTE_PCI_BUS_ID, device)?;
    prop.pciDeviceID = attribute(ATTRIBUTE_PCI_DEVICE_ID, device)?;
    prop.pciDomainID = attribute(ATTRIBUTE_PCI_DOMAIN_ID, device)?;
    prop.concurrentKernels = 1;
    prop.asyncEngineCount = 2;
    prop.unifiedAddressing = 1;
    prop.managedMemory = 1;
    prop.canMapHostMemory = 1;
    Ok(prop)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDeviceProperties(
    prop: *mut cudaDeviceProp,
    device: c_int,
) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaGetDeviceProperties", || unsafe {
        put(prop, properties(device)?)
    })
}

/// The name CUDA 12's headers give `cudaGetDeviceProperties`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDeviceProperties_v2(
    prop: *mut cudaDeviceProp,
    device: c_int,
) -> CudaError {
    // SAFETY: as for cudaGetDeviceProperties.
    unsafe { cudaGetDeviceProperties(prop, device) }
}
