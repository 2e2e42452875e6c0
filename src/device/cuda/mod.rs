//! The real GPU: [`Device`] on the CUDA driver API, with cudarc's types and the functions of the
//! driver library that `driver.rs` chose (the one PyTorch loaded; see there why not cudarc's).
//!
//! [`CudaDevice::new`] loads that library and checks every symbol this module uses, so that a
//! missing, stub or too old driver is an [`DeviceError::Unavailable`] and never a crash. Every
//! call still runs under `catch_unwind`, as a second line of defence.
//!
//! All work happens in the device's primary context, the one PyTorch uses; [`ContextGuard`] makes
//! it current for the length of one operation when it is not already, and puts the caller's
//! context back afterwards.

use std::collections::HashMap;
use std::ffi::CStr;
use std::ptr;

use super::driver::{self, sys};
use super::nvml::{self, PciLocation};
use super::{
    DeviceError, DevicePtr, EventHandle, MemInfo, PhysicalHandle, PinnedHostBuffer, ProcessMemory,
    SharedPhysical, StreamId,
};
use crate::device::Device;
use crate::logging;

mod calls;
mod context;
mod ipc;

pub use calls::unusable;
use calls::{
    DEFAULT_STREAM_HANDLES, check, check_call, error, event_handle, invoke, stream_handle,
    unavailable,
};
use context::{ContextGuard, RelaxedCaptureMode, may_be_capturing};

/// The oldest driver we accept, as `cuDriverGetVersion` reports it (CUDA 12.0).
const MIN_DRIVER_VERSION: i32 = 12000;

/// Every driver function this module calls (a unit test checks the list against the source).
pub use super::driver::sys::REQUIRED_SYMBOLS;

/// One GPU, driven through the CUDA driver API in its primary context.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: sys::CUdevice,
    name: String,
    driver_version: i32,
    context: sys::CUcontext,
    supports_virtual_memory: bool,
    /// Physical memory is made GPUDirect RDMA capable where the device supports that with VMM,
    /// as PyTorch's `ExpandableSegment::map` does (NCCL's zero-copy across nodes needs it).
    supports_rdma_with_vmm: bool,
    /// The other devices that can reach this one's memory (`cuDeviceCanAccessPeer`): each is
    /// granted access to every page an expandable segment maps, see [`Device::set_access`].
    peers: Vec<i32>,
    granularity: Option<usize>,
    /// Where the GPU sits on the PCI bus (how NVML finds it), asked at the first out-of-memory.
    pci: Option<PciLocation>,
    /// Events that [`Device::release_event`] gave back, ready for the next record on a stream
    /// of the same context.
    idle_events: Vec<(sys::CUcontext, sys::CUevent)>,
    /// The context each event was made in: an event can be recorded only on a stream of its
    /// own context, and `record_stream` may name another device's stream.
    event_contexts: HashMap<usize, sys::CUcontext>,
    /// Page-locked host buffers from `cuMemHostAlloc`, by their address, with their sizes:
    /// each copy into one is checked to stay inside it.
    pinned: HashMap<PinnedHostBuffer, (*mut std::ffi::c_void, usize)>,
    /// The shareable handle type physical memory is created with: POSIX file descriptors
    /// where the device has them, as PyTorch's expandable segments ask (see [`ipc`]).
    shareable_handle_type: sys::CUmemAllocationHandleType,
    /// The file descriptor each exported physical handle was shared as, closed at its release.
    exported: HashMap<PhysicalHandle, i32>,
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
        driver::load().map_err(DeviceError::Unavailable)?;

        let mut driver_version = 0;
        // SAFETY: the out pointer is a live local.
        let result = invoke("cuDriverGetVersion", || unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })?;
        if result == sys::CUresult::CUDA_ERROR_STUB_LIBRARY {
            return Err(DeviceError::Unavailable(driver::stub_message()));
        }
        check("cuDriverGetVersion", result)?;
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
        let supports_rdma_with_vmm = device_attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        )? != 0;
        let peers = peers_of(device, ordinal, count)?;
        let shareable_handle_type = ipc::shareable_handle_type(device_attribute(
            device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0);

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
            supports_rdma_with_vmm,
            peers,
            granularity: None,
            pci: None,
            idle_events: Vec::new(),
            event_contexts: HashMap::new(),
            pinned: HashMap::new(),
            shareable_handle_type,
            exported: HashMap::new(),
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

    /// The context `stream` belongs to, where events recorded on it must be made. A stream
    /// that `record_stream` names can be another device's, as PyTorch allows; the default
    /// streams (the NULL handle, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) carry no device,
    /// so they are taken as this device's own.
    fn context_of_stream(&self, stream: StreamId) -> Result<sys::CUcontext, DeviceError> {
        if stream <= DEFAULT_STREAM_HANDLES {
            return Ok(self.context);
        }
        let mut context: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local; `stream` is a stream handle from PyTorch.
        check_call("cuStreamGetCtx", || unsafe {
            sys::cuStreamGetCtx(stream_handle(stream), &mut context)
        })?;
        Ok(context)
    }

    /// An idle event of `context`, or a new one made there (the context is current).
    fn event_in(&mut self, context: sys::CUcontext) -> Result<sys::CUevent, DeviceError> {
        if let Some(i) = self.idle_events.iter().position(|&(c, _)| c == context) {
            return Ok(self.idle_events.swap_remove(i).1);
        }
        let mut event: sys::CUevent = ptr::null_mut();
        // Timing is never read, and events without it are cheaper to record and query.
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the out pointer is a live local; `context` is current.
        check_call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        self.event_contexts.insert(event as usize, context);
        Ok(event)
    }

    /// The devices that may access physical memory of this device: itself, then its peers.
    pub fn devices_with_access(&self) -> impl Iterator<Item = i32> {
        std::iter::once(self.ordinal).chain(self.peers.iter().copied())
    }

    /// The properties of expandable-segment pages: pinned device memory on this device, GPUDirect
    /// RDMA capable where the device supports it, exportable as a POSIX file descriptor where the
    /// device has them (as PyTorch sets them; a handle type the device lacks would fail every
    /// `cuMemCreate`, so none is asked then, and such memory cannot be shared).
    fn allocation_properties(&self) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: self.shareable_handle_type,
            location: device_location(self.ordinal),
            win32HandleMetaData: ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: u8::from(self.supports_rdma_with_vmm),
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
            for (_, event) in self.idle_events.drain(..) {
                // SAFETY: an event we created and nobody else holds.
                let _ = invoke("cuEventDestroy_v2", || unsafe {
                    sys::cuEventDestroy_v2(event)
                });
            }
            for (_, (host, _)) in self.pinned.drain() {
                // SAFETY: a buffer from cuMemHostAlloc, freed once (just removed).
                let _ = invoke("cuMemFreeHost", || unsafe { sys::cuMemFreeHost(host) });
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
        // The event is made and recorded in the stream's own context: the driver refuses to
        // record an event of one context on a stream of another.
        let context = self.context_of_stream(stream)?;
        let _context = ContextGuard::enter(context)?;
        let event = self.event_in(context)?;
        // SAFETY: `event` is one of ours, of the stream's context; `stream` is a stream handle
        // from PyTorch.
        let recorded = check_call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event, stream_handle(stream))
        });
        if let Err(error) = recorded {
            self.idle_events.push((context, event));
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
        let context = self
            .event_contexts
            .get(&(event as usize))
            .copied()
            .unwrap_or(self.context);
        self.idle_events.push((context, event_handle(event)));
    }

    fn destroy_idle_events(&mut self) -> Result<(), DeviceError> {
        if self.idle_events.is_empty() {
            return Ok(());
        }
        let _context = self.enter()?;
        while let Some(&(_, event)) = self.idle_events.last() {
            // SAFETY: an event we created and nobody else holds. One the driver refuses to
            // destroy stays in the pool, to be used or destroyed later.
            check_call("cuEventDestroy_v2", || unsafe {
                sys::cuEventDestroy_v2(event)
            })?;
            self.idle_events.pop();
            self.event_contexts.remove(&(event as usize));
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

    fn stream_is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let _context = self.enter()?;
        // A capture error of the query itself (the legacy stream while another captures) says
        // "maybe", which the allocator treats as a capture.
        may_be_capturing(stream)
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
        check_call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) })?;
        if let Some(fd) = self.exported.remove(&handle) {
            ipc::close_exported(fd);
        }
        Ok(())
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

    /// Read and write access for this device and every peer that can reach it. Mapped pages
    /// are reachable only by the devices named here (`cudaDeviceEnablePeerAccess` does not
    /// apply to them), and PyTorch does not tell a plugged-in allocator when it enables peer
    /// access; so every capable peer is granted access at once, and a copy or kernel on a peer
    /// works whenever it comes (see docs/driver.md). Should the driver refuse the peers, they
    /// are dropped with one WARN line and the device alone gets access, so that its own
    /// allocations go on.
    fn set_access(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        match grant_access(ptr, size, self.devices_with_access()) {
            Err(why @ DeviceError::Driver { .. }) if !self.peers.is_empty() => {
                logging::warning(&format!(
                    "CUDA device {} could not grant its peer devices {:?} access to expandable \
                     segment pages ({why}); only the device itself gets access from now on, and \
                     a copy or kernel on another device that touches this device's expandable \
                     memory will fail",
                    self.ordinal, self.peers
                ));
                self.peers.clear();
                grant_access(ptr, size, self.devices_with_access())
            }
            other => other,
        }
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

    fn alloc_pinned_host(&mut self, size: usize) -> Result<PinnedHostBuffer, DeviceError> {
        let _context = self.enter()?;
        let mut host: *mut std::ffi::c_void = ptr::null_mut();
        // SAFETY: the out pointer is a live local; flags 0 is plain page-locked memory.
        check_call("cuMemHostAlloc", || unsafe {
            sys::cuMemHostAlloc(&mut host, size, 0)
        })?;
        let buffer = host.expose_provenance() as PinnedHostBuffer;
        self.pinned.insert(buffer, (host, size));
        Ok(buffer)
    }

    fn free_pinned_host(&mut self, buffer: PinnedHostBuffer) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        let &(host, _) = self
            .pinned
            .get(&buffer)
            .ok_or_else(|| not_pinned("cuMemFreeHost"))?;
        // SAFETY: a buffer from cuMemHostAlloc that is still ours.
        check_call("cuMemFreeHost", || unsafe { sys::cuMemFreeHost(host) })?;
        self.pinned.remove(&buffer);
        Ok(())
    }

    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        let _context = self.enter()?;
        let mut stream: sys::CUstream = ptr::null_mut();
        // Non-blocking: the copies neither wait for nor hold up the legacy default stream.
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the out pointer is a live local; the primary context is current.
        check_call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut stream, flags)
        })?;
        Ok(stream.expose_provenance() as StreamId)
    }

    fn copy_to_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let host = self.pinned_range(buffer, offset, len, "cuMemcpyDtoHAsync_v2")?;
        let _context = self.enter()?;
        // SAFETY: `host` is `len` bytes inside a live pinned buffer of ours (checked); the
        // driver validates `ptr` and `stream`.
        check_call("cuMemcpyDtoHAsync_v2", || unsafe {
            sys::cuMemcpyDtoHAsync_v2(host, ptr, len, stream_handle(stream))
        })
    }

    fn copy_from_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let host = self.pinned_range(buffer, offset, len, "cuMemcpyHtoDAsync_v2")?;
        let _context = self.enter()?;
        // SAFETY: as in `copy_to_pinned_async`.
        check_call("cuMemcpyHtoDAsync_v2", || unsafe {
            sys::cuMemcpyHtoDAsync_v2(ptr, host, len, stream_handle(stream))
        })
    }

    fn ipc_memory_handle(&mut self, base: DevicePtr) -> Result<[u8; 64], DeviceError> {
        let _context = self.enter()?;
        ipc::memory_handle(base)
    }

    fn open_ipc_memory(&mut self, handle: &[u8; 64]) -> Result<DevicePtr, DeviceError> {
        let _context = self.enter()?;
        ipc::open_memory(handle)
    }

    fn close_ipc_memory(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let _context = self.enter()?;
        ipc::close_memory(ptr)
    }

    fn export_physical(&mut self, handle: PhysicalHandle) -> Result<i32, DeviceError> {
        if let Some(&fd) = self.exported.get(&handle) {
            return Ok(fd);
        }
        let _context = self.enter()?;
        let fd = ipc::export_fd(handle)?;
        self.exported.insert(handle, fd);
        Ok(fd)
    }

    fn import_physical(&mut self, shared: &SharedPhysical) -> Result<PhysicalHandle, DeviceError> {
        let _context = self.enter()?;
        ipc::import(shared)
    }

    /// Asks NVML (see `nvml.rs`); a driver error on the way leaves the list empty.
    fn compute_processes(&mut self) -> Vec<ProcessMemory> {
        match self.pci_location() {
            Ok(pci) => nvml::compute_processes(pci),
            Err(_) => Vec::new(),
        }
    }
}

/// Where physical memory lives, or who may access it: device `ordinal`.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        __bindgen_anon_1: sys::CUmemLocation_st__bindgen_ty_1 { id: ordinal },
    }
}

/// `cuMemSetAccess`: read and write access to `[ptr, ptr + size)` for each of `devices`, in
/// one call.
fn grant_access(
    ptr: DevicePtr,
    size: usize,
    devices: impl Iterator<Item = i32>,
) -> Result<(), DeviceError> {
    let access: Vec<sys::CUmemAccessDesc> = devices
        .map(|device| sys::CUmemAccessDesc {
            location: device_location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect();
    // SAFETY: `access` holds `access.len()` live descriptors.
    check_call("cuMemSetAccess", || unsafe {
        sys::cuMemSetAccess(ptr, size, access.as_ptr(), access.len())
    })
}

/// The other devices among the first `count` that can reach `device`'s (number `ordinal`)
/// memory directly (`cuDeviceCanAccessPeer(peer, device)`), the peers PyTorch could enable
/// access for. One device asks the driver nothing.
fn peers_of(device: sys::CUdevice, ordinal: i32, count: i32) -> Result<Vec<i32>, DeviceError> {
    let mut peers = Vec::new();
    for other in (0..count).filter(|&other| other != ordinal) {
        let mut peer: sys::CUdevice = 0;
        // SAFETY: the out pointer is a live local; the ordinal is below the device count.
        check_call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut peer, other)
        })?;
        let mut can_access = 0;
        // SAFETY: the out pointer is a live local; both devices came from cuDeviceGet.
        check_call("cuDeviceCanAccessPeer", || unsafe {
            sys::cuDeviceCanAccessPeer(&mut can_access, peer, device)
        })?;
        if can_access != 0 {
            peers.push(other);
        }
    }
    Ok(peers)
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

/// The refusal of a pinned buffer that is not ours, or of a range outside it, made before the
/// driver could be handed a wild host pointer.
fn not_pinned(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i32,
        message: "not inside a pinned host buffer of this device".to_string(),
    }
}

impl CudaDevice {
    /// The host address of `len` bytes at `offset` in `buffer`, checked to lie inside it.
    fn pinned_range(
        &self,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        call: &'static str,
    ) -> Result<*mut std::ffi::c_void, DeviceError> {
        match self.pinned.get(&buffer) {
            Some(&(host, size)) if offset.checked_add(len).is_some_and(|end| end <= size) => {
                Ok(host.wrapping_byte_add(offset))
            }
            _ => Err(not_pinned(call)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_driver_function_called_is_checked_up_front() {
        // A call missing from REQUIRED_SYMBOLS would go to cudarc's own function, which loads a
        // library of its own choosing.
        let source = [
            include_str!("mod.rs"),
            include_str!("calls.rs"),
            include_str!("context.rs"),
            include_str!("ipc.rs"),
        ]
        .concat();
        for after in source.split("sys::cu").skip(1) {
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
}
