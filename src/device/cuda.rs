//! The real GPU: [`Device`] on the CUDA driver API, through cudarc's raw bindings (`sys`).
//!
//! cudarc loads libcuda at the first driver call and resolves each symbol at that symbol's first
//! call, and it panics when either is missing. [`CudaDevice::new`] therefore loads the library
//! itself first, the same way and by the same names as cudarc, and checks every symbol this
//! module uses, so that a missing or too old driver is an [`DeviceError::Unavailable`] and never
//! a panic. Every call still runs under `catch_unwind`, as a second line of defence.
//!
//! All work happens in the device's primary context, the one PyTorch uses; [`ContextGuard`] makes
//! it current for the length of one operation when it is not already, and puts the caller's
//! context back afterwards.

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::nvml::{self, PciLocation};
use super::{
    DeviceError, DevicePtr, EventHandle, MemInfo, PhysicalHandle, ProcessMemory, StreamId,
};
use crate::device::Device;
use crate::logging;

/// The oldest driver we accept, as `cuDriverGetVersion` reports it (CUDA 12.0).
const MIN_DRIVER_VERSION: i32 = 12000;

/// Every driver function this module calls (a unit test checks the list against the source).
/// cudarc resolves symbols lazily and panics on a missing one, so [`CudaDevice::new`] checks
/// them all up front; the C ABI tests count calls to them all.
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuCtxSynchronize",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
];

/// One GPU, driven through the CUDA driver API in its primary context.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: sys::CUdevice,
    name: String,
    driver_version: i32,
    context: sys::CUcontext,
    supports_virtual_memory: bool,
    /// Physical memory is created exportable as a POSIX file descriptor, like PyTorch does, when
    /// the device supports it.
    supports_posix_fd_handles: bool,
    granularity: Option<usize>,
    /// Where the GPU sits on the PCI bus (how NVML finds it), asked at the first out-of-memory.
    pci: Option<PciLocation>,
    /// Events that [`Device::release_event`] gave back, ready for the next record.
    idle_events: Vec<sys::CUevent>,
}

// SAFETY: the raw pointers are driver handles (a primary context and events), which belong to
// the process, not to a thread: the driver API accepts them from any thread and is thread-safe.
// `CudaDevice` keeps no thread-affine state; it makes its context current per operation.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal`: checks that the driver library loads and has every symbol we
    /// need, that it is for CUDA 12.0 or newer, and that the device exists; then retains the
    /// device's primary context.
    pub fn new(ordinal: i32) -> Result<CudaDevice, DeviceError> {
        load_driver_library()?;

        let mut driver_version = 0;
        // SAFETY: the out pointer is a live local.
        check_call("cuDriverGetVersion", || unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })?;
        if driver_version < MIN_DRIVER_VERSION {
            return Err(DeviceError::Unavailable(format!(
                "ferrocache needs an NVIDIA driver for CUDA 12.0 or newer, but the installed \
                 driver supports CUDA {}.{} (cuDriverGetVersion = {driver_version}); please \
                 update the driver",
                driver_version / 1000,
                driver_version % 1000 / 10,
            )));
        }

        // SAFETY: no pointers involved; cuInit may be called any number of times.
        let result = invoke("cuInit", || unsafe { sys::cuInit(0) })?;
        check("cuInit", result).map_err(|e| unavailable("the CUDA driver failed to start", e))?;

        let mut count = 0;
        // SAFETY: the out pointer is a live local.
        check_call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if !(0..count).contains(&ordinal) {
            return Err(DeviceError::Unavailable(format!(
                "there is no CUDA device {ordinal}: the driver reports {count} device(s)"
            )));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: the out pointer is a live local.
        check_call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;

        let mut name_buffer = [0 as std::ffi::c_char; 256];
        // The driver gets one byte less than the buffer, so the last byte stays NUL whatever
        // it writes.
        let name_room = name_buffer.len() as i32 - 1;
        // SAFETY: the buffer is live and has room for `name_room` bytes.
        check_call("cuDeviceGetName", || unsafe {
            sys::cuDeviceGetName(name_buffer.as_mut_ptr(), name_room, device)
        })?;
        // SAFETY: the buffer is NUL-terminated (its last byte at least).
        let name = unsafe { CStr::from_ptr(name_buffer.as_ptr()) }
            .to_string_lossy()
            .into_owned();

        let supports_virtual_memory = device_attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0;
        let supports_posix_fd_handles = device_attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0;

        let mut context: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local; `device` came from cuDeviceGet.
        check_call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, device)
        })?;

        Ok(CudaDevice {
            ordinal,
            device,
            name,
            driver_version,
            context,
            supports_virtual_memory,
            supports_posix_fd_handles,
            granularity: None,
            pci: None,
            idle_events: Vec::new(),
        })
    }

    /// The device ordinal, as PyTorch numbers devices.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version, as `cuDriverGetVersion` reports it (12040 = CUDA 12.4).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether the device supports the virtual memory calls behind expandable segments.
    pub fn supports_virtual_memory(&self) -> bool {
        self.supports_virtual_memory
    }

    /// Where the GPU sits on the PCI bus, asked of the driver once.
    fn pci_location(&mut self) -> Result<PciLocation, DeviceError> {
        if let Some(pci) = self.pci {
            return Ok(pci);
        }
        use sys::CUdevice_attribute::*;
        let attribute = |which| device_attribute(self.device, which).map(|v| v as u32);
        let pci = PciLocation {
            domain: attribute(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            bus: attribute(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            device: attribute(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
        };
        self.pci = Some(pci);
        Ok(pci)
    }

    /// Makes the primary context current until the guard is dropped.
    fn enter(&self) -> Result<ContextGuard, DeviceError> {
        ContextGuard::enter(self.context)
    }

    /// Where physical memory lives and who may access it: this device.
    fn location(&self) -> sys::CUmemLocation {
        sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            __bindgen_anon_1: sys::CUmemLocation_st__bindgen_ty_1 { id: self.ordinal },
        }
    }

    /// The properties of expandable-segment pages: pinned device memory on this device.
    fn allocation_properties(&self) -> sys::CUmemAllocationProp {
        let handle_type = if self.supports_posix_fd_handles {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: handle_type,
            location: self.location(),
            win32HandleMetaData: ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Errors are ignored: at process exit the driver may already be shut down, and there is
        // nobody left to tell.
        if let Ok(_context) = self.enter() {
            for event in self.idle_events.drain(..) {
                // SAFETY: an event we created and nobody else holds.
                let _ = invoke("cuEventDestroy_v2", || unsafe {
                    sys::cuEventDestroy_v2(event)
                });
            }
        }
        // SAFETY: balances the retain in `new`.
        let _ = invoke("cuDevicePrimaryCtxRelease_v2", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device)
        });
    }
}

impl Device for CudaDevice {
    fn malloc(&mut self, size: usize, stream: StreamId) -> Result<DevicePtr, DeviceError> {
        let _context = self.enter()?;
        // A cudaMalloc while a graph capture is under way would invalidate the capture unless
        // the thread's capture mode is relaxed, as in PyTorch's cudaMallocMaybeCapturing. The
        // new memory is fine to use in the graph as long as it is not freed before replay.
        let _relaxed = if may_be_capturing(stream)? {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out pointer is a live local; the primary context is current.
        check_call("cuMemAlloc_v2", || unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size)
        })?;
        Ok(ptr)
    }

    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `ptr` came from `malloc`; the driver validates it.
        check_call("cuMemFree_v2", || unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError> {
        let _context = self.enter()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: both out pointers are live locals; the primary context is current.
        check_call("cuMemGetInfo_v2", || unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo { free, total })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventHandle, DeviceError> {
        let _context = self.enter()?;
        let event = match self.idle_events.pop() {
            Some(event) => event,
            None => {
                let mut event: sys::CUevent = ptr::null_mut();
                // Timing is never read, and events without it are cheaper to record and query.
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: the out pointer is a live local; the primary context is current.
                check_call("cuEventCreate", || unsafe {
                    sys::cuEventCreate(&mut event, flags)
                })?;
                event
            }
        };
        // SAFETY: `event` is one of ours; `stream` is a stream handle from PyTorch.
        let recorded = check_call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event, stream_handle(stream))
        });
        if let Err(error) = recorded {
            self.idle_events.push(event);
            return Err(error);
        }
        Ok(event as EventHandle)
    }

    fn query_event(&mut self, event: EventHandle) -> Result<bool, DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `event` came from `record_event` and has not been released.
        let result = invoke("cuEventQuery", || unsafe {
            sys::cuEventQuery(event_handle(event))
        })?;
        match result {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            failure => Err(error("cuEventQuery", failure)),
        }
    }

    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `event` came from `record_event` and has not been released.
        check_call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event_handle(event))
        })
    }

    fn release_event(&mut self, event: EventHandle) {
        self.idle_events.push(event_handle(event));
    }

    fn destroy_idle_events(&mut self) -> Result<(), DeviceError> {
        if self.idle_events.is_empty() {
            return Ok(());
        }
        let _context = self.enter()?;
        while let Some(&event) = self.idle_events.last() {
            // SAFETY: an event we created and nobody else holds. One the driver refuses to
            // destroy stays in the pool, to be used or destroyed later.
            check_call("cuEventDestroy_v2", || unsafe {
                sys::cuEventDestroy_v2(event)
            })?;
            self.idle_events.pop();
        }
        Ok(())
    }

    fn wait_event(&mut self, stream: StreamId, event: EventHandle) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `event` came from `record_event` and has not been released; `stream` is a
        // stream handle from PyTorch.
        check_call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream_handle(stream), event_handle(event), 0)
        })
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `stream` is a stream handle from PyTorch; the primary context is current.
        check_call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream_handle(stream))
        })
    }

    fn page_granularity(&mut self) -> Result<usize, DeviceError> {
        if !self.supports_virtual_memory {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {} ({}) does not support virtual memory management, which \
                 expandable segments need",
                self.ordinal, self.name
            )));
        }
        if let Some(granularity) = self.granularity {
            return Ok(granularity);
        }
        let _context = self.enter()?;
        let properties = self.allocation_properties();
        let mut granularity = 0;
        // SAFETY: the out pointer and the properties are live locals.
        check_call("cuMemGetAllocationGranularity", || unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &properties,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        self.granularity = Some(granularity);
        Ok(granularity)
    }

    fn reserve_address_range(&mut self, size: usize) -> Result<DevicePtr, DeviceError> {
        let _context = self.enter()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out pointer is a live local; no alignment, address hint or flags.
        check_call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        })?;
        Ok(ptr)
    }

    fn free_address_range(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: a range from `reserve_address_range`; the driver validates it.
        check_call("cuMemAddressFree", || unsafe {
            sys::cuMemAddressFree(ptr, size)
        })
    }

    fn create_physical(&mut self, size: usize) -> Result<PhysicalHandle, DeviceError> {
        let _context = self.enter()?;
        let properties = self.allocation_properties();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the out pointer and the properties are live locals.
        check_call("cuMemCreate", || unsafe {
            sys::cuMemCreate(&mut handle, size, &properties, 0)
        })?;
        Ok(handle)
    }

    fn release_physical(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: a handle from `create_physical`; the driver validates it.
        check_call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) })
    }

    fn map(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: plain values; the driver validates the range and the handle.
        check_call("cuMemMap", || unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        })
    }

    fn set_access(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        let access = sys::CUmemAccessDesc {
            location: self.location(),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one live descriptor, and a count of one.
        check_call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        })
    }

    fn unmap(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: plain values; the driver validates the range.
        check_call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, size) })
    }

    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: no arguments; the primary context is current.
        check_call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }

    fn copy_to_host(&mut self, ptr: DevicePtr, host: &mut [u8]) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `host` is a live buffer of `host.len()` bytes; the driver validates `ptr`.
        check_call("cuMemcpyDtoH_v2", || unsafe {
            sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, host.len())
        })
    }

    fn copy_from_host(&mut self, ptr: DevicePtr, host: &[u8]) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        // SAFETY: `host` is a live buffer of `host.len()` bytes; the driver validates `ptr`.
        check_call("cuMemcpyHtoD_v2", || unsafe {
            sys::cuMemcpyHtoD_v2(ptr, host.as_ptr().cast(), host.len())
        })
    }

    /// Asks NVML (see `nvml.rs`); a driver error on the way leaves the list empty.
    fn compute_processes(&mut self) -> Vec<ProcessMemory> {
        match self.pci_location() {
            Ok(pci) => nvml::compute_processes(pci),
            Err(_) => Vec::new(),
        }
    }
}

/// Keeps a context current for its lifetime: pushes it if it was not current already, and pops
/// it again on drop, which puts back whatever the caller had (or nothing).
struct ContextGuard {
    pushed: bool,
}

impl ContextGuard {
    fn enter(context: sys::CUcontext) -> Result<ContextGuard, DeviceError> {
        let mut current: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local.
        check_call("cuCtxGetCurrent", || unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current == context {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: `context` is the retained primary context of our device.
        check_call("cuCtxPushCurrent_v2", || unsafe {
            sys::cuCtxPushCurrent_v2(context)
        })?;
        Ok(ContextGuard { pushed: true })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local; we pushed, so there is something to pop.
        let result = check_call("cuCtxPopCurrent_v2", || unsafe {
            sys::cuCtxPopCurrent_v2(&mut popped)
        });
        if let Err(e) = result {
            logging::device_error("could not restore the caller's CUDA context", &e);
        }
    }
}

/// Switches the calling thread to relaxed stream-capture mode for its lifetime.
struct RelaxedCaptureMode {
    previous: u32,
}

impl RelaxedCaptureMode {
    fn enter() -> Result<RelaxedCaptureMode, DeviceError> {
        let previous =
            exchange_capture_mode(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as u32)?;
        Ok(RelaxedCaptureMode { previous })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Err(e) = exchange_capture_mode(self.previous) {
            logging::device_error("could not restore the thread's stream capture mode", &e);
        }
    }
}

/// `cuThreadExchangeStreamCaptureMode`: sets `mode`, returns the previous one. Modes travel as
/// plain integers so that no value the driver writes is ever read as a Rust enum.
fn exchange_capture_mode(mode: u32) -> Result<u32, DeviceError> {
    let mut mode = mode;
    let mode_ptr = ptr::from_mut(&mut mode).cast::<sys::CUstreamCaptureMode>();
    // SAFETY: `mode_ptr` points at a live u32, the C enum's size; the driver reads and writes it.
    check_call("cuThreadExchangeStreamCaptureMode", || unsafe {
        sys::cuThreadExchangeStreamCaptureMode(mode_ptr)
    })?;
    Ok(mode)
}

/// Whether `stream` may be capturing a CUDA graph. A capture error from the query counts as
/// "maybe": the legacy stream answers so while another stream captures, exactly when relaxing
/// is needed, and relaxing the mode around one malloc is harmless anyway. Any other error fails
/// the allocation, as PyTorch's C10_CUDA_CHECK does (the stream handle is most likely bad).
fn may_be_capturing(stream: StreamId) -> Result<bool, DeviceError> {
    let mut status: u32 = 0;
    let status_ptr = ptr::from_mut(&mut status).cast::<sys::CUstreamCaptureStatus>();
    // SAFETY: `status_ptr` points at a live u32, the C enum's size; read back as an integer.
    let result = invoke("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(stream_handle(stream), status_ptr)
    })?;
    if is_capture_error(result) {
        return Ok(true);
    }
    check("cuStreamIsCapturing", result)?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32)
}

/// The errors that a stream capture under way causes (`CUDA_ERROR_STREAM_CAPTURE_*`).
fn is_capture_error(result: sys::CUresult) -> bool {
    (sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as u32
        ..=sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD as u32)
        .contains(&(result as u32))
}

fn device_attribute(
    device: sys::CUdevice,
    attribute: sys::CUdevice_attribute,
) -> Result<i32, DeviceError> {
    let mut value = 0;
    // SAFETY: the out pointer is a live local; `device` came from cuDeviceGet.
    check_call("cuDeviceGetAttribute", || unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// A `cudaStream_t` value as the driver's handle type; 0 is the legacy default stream.
fn stream_handle(stream: StreamId) -> sys::CUstream {
    ptr::without_provenance_mut(stream as usize)
}

fn event_handle(event: EventHandle) -> sys::CUevent {
    ptr::without_provenance_mut(event as usize)
}

/// Runs one cudarc call and returns the driver's code; a panic (which only a symbol missing
/// despite [`load_driver_library`]'s check could cause) becomes an error instead of unwinding.
fn invoke(
    call: &'static str,
    driver_call: impl FnOnce() -> sys::CUresult,
) -> Result<sys::CUresult, DeviceError> {
    if let Some(why) = UNUSABLE.get() {
        // Every call would fail the same way: none is made, so nothing spins on a dead context.
        return Err(DeviceError::Unusable(why.clone()));
    }
    catch_unwind(AssertUnwindSafe(driver_call)).map_err(|_| {
        DeviceError::Unavailable(format!(
            "the CUDA driver call {call} could not be made (cudarc panicked; does the driver \
             library lack the symbol?)"
        ))
    })
}

/// [`invoke`], then [`check`].
fn check_call(
    call: &'static str,
    driver_call: impl FnOnce() -> sys::CUresult,
) -> Result<(), DeviceError> {
    check(call, invoke(call, driver_call)?)
}

/// Success is `Ok`; out of memory is [`DeviceError::OutOfMemory`], which the allocator answers
/// by freeing cached memory and retrying; anything else is a [`DeviceError::Driver`].
fn check(call: &'static str, result: sys::CUresult) -> Result<(), DeviceError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
        failure => Err(error(call, failure)),
    }
}

fn error(call: &'static str, result: sys::CUresult) -> DeviceError {
    let message = error_string(result);
    if is_sticky_error(result) {
        let why = format!(
            "CUDA is unusable in this process since {call} failed with error {}: {message}; \
             ferrocache makes no more CUDA calls and every allocation fails (restart the process)",
            result as i32
        );
        if UNUSABLE.set(why.clone()).is_ok() {
            logging::context_unusable(&why);
        }
        return DeviceError::Unusable(why);
    }
    DeviceError::Driver {
        call,
        code: result as i32,
        message,
    }
}

/// Set by the first sticky error: why CUDA is unusable in this process.
static UNUSABLE: OnceLock<String> = OnceLock::new();

/// Why CUDA is unusable in this process, once a sticky error said so.
pub fn unusable() -> Option<&'static str> {
    UNUSABLE.get().map(String::as_str)
}

/// The errors that CUDA's documentation calls sticky: they leave the process's CUDA state
/// inconsistent, every later call returns the same error, and only a new process recovers.
fn is_sticky_error(result: sys::CUresult) -> bool {
    use sys::CUresult::*;
    matches!(
        result,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
    )
}

/// Turns an error from startup into [`DeviceError::Unavailable`], keeping the driver's words.
fn unavailable(what: &str, error: DeviceError) -> DeviceError {
    match error {
        DeviceError::Unavailable(_) => error,
        other => DeviceError::Unavailable(format!("{what}: {other}")),
    }
}

/// The driver's description of an error code (`cuGetErrorString`).
fn error_string(result: sys::CUresult) -> String {
    let mut text: *const std::ffi::c_char = ptr::null();
    // SAFETY: the out pointer is a live local.
    let found = invoke("cuGetErrorString", || unsafe {
        sys::cuGetErrorString(result, &mut text)
    });
    match found {
        Ok(sys::CUresult::CUDA_SUCCESS) if !text.is_null() => {
            // SAFETY: the driver returned a pointer to a static NUL-terminated string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        }
        _ => format!("unrecognized CUDA error {}", result as i32),
    }
}

/// Makes sure the driver library that cudarc will load is there and complete, once per process.
fn load_driver_library() -> Result<(), DeviceError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates = cudarc::get_lib_name_candidates("cuda");
            let (name, library) = open_first(&candidates)?;
            check_symbols(&name, &library, REQUIRED_SYMBOLS)?;
            // Kept open for the life of the process: cudarc holds its own handle to the same
            // library, and closing ours would be pointless churn.
            std::mem::forget(library);
            Ok(())
        })
        .clone()
        .map_err(DeviceError::Unavailable)
}

/// Opens the first library in `candidates` that loads, in order: the same search that cudarc's
/// loader makes, so it finds the same library.
fn open_first(candidates: &[String]) -> Result<(String, libloading::Library), String> {
    let mut failures = Vec::new();
    for candidate in candidates {
        // SAFETY: loading libcuda runs its initialisers, which is what loading a driver means;
        // cudarc would do the same at its first call.
        match unsafe { libloading::Library::new(candidate) } {
            Ok(library) => return Ok((candidate.clone(), library)),
            Err(e) => failures.push(with_source(&e)),
        }
    }
    // "No such file" for every name is the common case; anything else (a broken or foreign
    // library) is the more useful thing to show.
    let reason = failures
        .iter()
        .find(|f| !f.contains("No such file"))
        .or(failures.first())
        .cloned()
        .unwrap_or_else(|| "no names to try".to_string());
    Err(format!(
        "ferrocache could not load the CUDA driver library libcuda.so (also tried {} other \
         names, including libcuda.so.1): {reason}; is an NVIDIA driver installed, and is the \
         directory holding libcuda.so.1 on the library search path?",
        candidates.len().saturating_sub(1)
    ))
}

/// libloading's errors say only "dlopen failed"; the reason (dlerror's text) is their source.
fn with_source(error: &libloading::Error) -> String {
    match std::error::Error::source(error) {
        Some(source) => source.to_string(),
        None => error.to_string(),
    }
}

/// Checks that `library` exports every name in `symbols`; names all the missing ones.
fn check_symbols(
    name: &str,
    library: &libloading::Library,
    symbols: &[&str],
) -> Result<(), String> {
    let missing: Vec<&str> = symbols
        .iter()
        .copied()
        // SAFETY: we only look the symbol up; its type is never used.
        .filter(|symbol| unsafe { library.get::<*const ()>(symbol.as_bytes()) }.is_err())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the CUDA driver library {name} lacks {}, which ferrocache needs; is the NVIDIA \
             driver older than CUDA 12.0?",
            missing.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_by_name_without_panicking() {
        let candidates = vec![
            "libferrocache-no-such-driver.so".to_string(),
            "libferrocache-no-such-driver.so.1".to_string(),
        ];
        let message = open_first(&candidates).err().unwrap_or_default();
        assert!(message.contains("could not load the CUDA driver library libcuda.so"));
        // dlerror's words, not just libloading's "dlopen failed".
        assert!(
            message.contains("cannot open shared object file"),
            "{message}"
        );
        assert!(message.contains("libferrocache-no-such-driver.so"));
        assert!(message.contains("NVIDIA driver installed"));
    }

    #[test]
    fn every_driver_function_called_is_checked_up_front() {
        // A call missing from REQUIRED_SYMBOLS would be a cudarc panic on an old driver.
        for after in include_str!("cuda.rs").split("sys::cu").skip(1) {
            let rest: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if after[rest.len()..].starts_with('(') {
                let symbol = format!("cu{rest}");
                assert!(
                    REQUIRED_SYMBOLS.contains(&symbol.as_str()),
                    "{symbol} is not checked"
                );
            }
        }
    }

    #[test]
    fn missing_symbols_are_all_named() {
        let (name, library) = open_first(&["libc.so.6".to_string()]).expect("libc is always there");
        let message = check_symbols(&name, &library, &["malloc", "cuNoSuchA", "cuNoSuchB"])
            .err()
            .unwrap_or_default();
        assert!(
            message.contains("libc.so.6 lacks cuNoSuchA, cuNoSuchB"),
            "{message}"
        );
        assert!(check_symbols(&name, &library, &["malloc", "free"]).is_ok());
    }
}
