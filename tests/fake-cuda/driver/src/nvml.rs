//! The few NVML functions PyTorch's allocator calls, exported by the fake driver and reached as
//! `libnvidia-ml.so.1` (a link to the driver, made by build.py). PyTorch's expandable segments
//! ask NVML whether the GPU has fabric memory before they map pages, and call through a NULL
//! pointer when no NVML library loads; a real driver always ships one. Here NVML starts, knows
//! the one device, reports the driver's CUDA version, and answers "not supported" to the rest
//! (no fabric, no NVLink, no per-process list in out-of-memory messages).

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `nvmlReturn_t`.
type NvmlReturn = c_uint;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;

/// The handle of the device; never dereferenced by callers.
const DEVICE_HANDLE: usize = 0x4e56_4d4c;

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    _pci_bus_id: *const c_char,
    device: *mut usize,
) -> NvmlReturn {
    if device.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-NULL; the caller passes a writable handle.
    unsafe { device.write(DEVICE_HANDLE) };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    if version.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let driver_version = std::env::var("FAKE_LIBCUDA_DRIVER_VERSION")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(13020);
    // SAFETY: checked non-NULL; the caller passes a writable int.
    unsafe { version.write(driver_version) };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuFabricInfoV(_device: usize, _info: *mut c_void) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    _device: usize,
    _count: *mut c_uint,
    _infos: *mut c_void,
) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    _device: usize,
    _link: c_uint,
    _kind: *mut c_int,
) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    _device: usize,
    _link: c_uint,
    _pci: *mut c_void,
) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}
