//! What the allocator asks of a GPU.
//!
//! The allocator is generic over [`Device`]; [`sim::SimDevice`] is the simulated GPU that drives
//! every test, and `cuda::CudaDevice` is the real one on the CUDA driver API. Neither knows
//! anything about the allocator.

pub mod cuda;
mod driver;
mod nvml;
pub mod sim;

use std::fmt;

/// A device (virtual) address, as the driver hands it out.
pub type DevicePtr = u64;

/// A stream, as the raw `cudaStream_t` value; `0` is the legacy default stream.
pub type StreamId = u64;

/// An event recorded on a stream; its meaning belongs to the device implementation.
pub type EventHandle = u64;

/// A physical memory handle (`CUmemGenericAllocationHandle`) for expandable segments.
pub type PhysicalHandle = u64;

/// Page-locked host memory from [`Device::alloc_pinned_host`], named by the device (the host
/// address on a real one), so that the allocator never touches it through a raw pointer.
pub type PinnedHostBuffer = u64;

/// Free and total bytes of device memory, as `cudaMemGetInfo` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

/// A process that has a context on a GPU and the device memory it uses, as NVML lists them
/// (`nvmlProcessInfo_v1_t`): what PyTorch's out-of-memory message reports per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    pub pid: u32,
    /// Bytes of device memory in use, the CUDA context's own included.
    pub used_bytes: u64,
}

/// Physical memory of another process, as `cuMemImportFromShareableHandle` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedPhysical {
    /// A POSIX file descriptor of this process (taken from the exporter with `pidfd_getfd`);
    /// the import does not close it.
    FileDescriptor(i32),
    /// A `CUmemFabricHandle`'s 64 bytes.
    Fabric([u8; 64]),
}

/// The refusal of a device that does not share memory between processes (the simulated one).
fn no_ipc(call: &'static str) -> DeviceError {
    DeviceError::Unavailable(format!(
        "{call}: this device does not share memory between processes"
    ))
}

/// Why a device operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceError {
    /// The device could not provide the memory (`CUDA_ERROR_OUT_OF_MEMORY`). The allocator
    /// answers this by releasing cached memory and retrying.
    OutOfMemory,
    /// Any other driver failure: the allocator gives up on the operation at once.
    Driver {
        /// The driver call that failed, e.g. `cuMemAlloc_v2`.
        call: &'static str,
        /// The driver's numeric error code.
        code: i32,
        /// The driver's own description of the code.
        message: String,
    },
    /// No usable driver at all (libcuda missing, too old, no device).
    Unavailable(String),
    /// An earlier error left CUDA unusable in this process (a "sticky" error: an illegal
    /// address, a failed launch, ...): every later call would fail the same way, so none is
    /// made. Only a new process recovers.
    Unusable(String),
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory => write!(f, "out of memory"),
            DeviceError::Driver {
                call,
                code,
                message,
            } => write!(f, "{call} failed with error {code}: {message}"),
            DeviceError::Unavailable(why) | DeviceError::Unusable(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for DeviceError {}

/// The operations of one GPU that the caching allocator needs.
///
/// Every method takes `&mut self`: the allocator calls them while it holds its own lock, so an
/// implementation never sees two calls at once for the same device.
pub trait Device {
    /// `cudaMalloc`: a new allocation of exactly `size` bytes, aligned to at least 512 bytes.
    /// `stream` is the stream the allocation is for; the real device uses it to relax a graph
    /// capture that may be under way on it.
    fn malloc(&mut self, size: usize, stream: StreamId) -> Result<DevicePtr, DeviceError>;
    /// `cudaFree` of a pointer that `malloc` returned.
    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError>;
    /// `cudaMemGetInfo`.
    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError>;

    /// Records a new event on `stream` (`cudaEventRecord` on a pooled event).
    fn record_event(&mut self, stream: StreamId) -> Result<EventHandle, DeviceError>;
    /// `cudaEventQuery`: `Ok(true)` once the work before the event has completed.
    fn query_event(&mut self, event: EventHandle) -> Result<bool, DeviceError>;
    /// `cudaEventSynchronize`: waits until the event has completed.
    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), DeviceError>;
    /// Gives an event back (to a pool, or destroys it). Never fails visibly.
    fn release_event(&mut self, event: EventHandle);
    /// Destroys the events that [`Device::release_event`] pooled for reuse, so that an emptied
    /// cache holds no driver resources at all. A device without a pool has nothing to do.
    fn destroy_idle_events(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    /// `cuStreamWaitEvent`: work submitted to `stream` from now on runs after the work that
    /// preceded `event` on its stream, with no host synchronization. The event may be released
    /// (and recorded again) at once: the wait keeps the record it saw.
    fn wait_event(&mut self, stream: StreamId, event: EventHandle) -> Result<(), DeviceError>;
    /// `cudaStreamSynchronize`.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError>;
    /// `cudaStreamGetCaptureInfo`'s status: whether `stream` is capturing a CUDA graph (PyTorch
    /// 2.15's `is_capture_context` asks this of the current stream). `Err` when the driver
    /// cannot say; the allocator then acts as during a capture.
    fn stream_is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError>;

    /// The physical page granularity of `cuMemCreate` (2 MiB on current GPUs).
    fn page_granularity(&mut self) -> Result<usize, DeviceError>;
    /// `cuMemAddressReserve`: a virtual address range of `size` bytes, backed by nothing.
    fn reserve_address_range(&mut self, size: usize) -> Result<DevicePtr, DeviceError>;
    /// `cuMemAddressFree` of a whole range that `reserve_address_range` returned.
    fn free_address_range(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError>;
    /// `cuMemCreate`: `size` bytes of physical memory (a multiple of the granularity).
    fn create_physical(&mut self, size: usize) -> Result<PhysicalHandle, DeviceError>;
    /// `cuMemRelease` of a physical handle.
    fn release_physical(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError>;
    /// `cuMemMap`: maps all of `handle` at `ptr` (inside a reserved range).
    fn map(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError>;
    /// `cuMemSetAccess`: makes a mapped range readable and writable from the device.
    fn set_access(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError>;
    /// `cuMemUnmap`.
    fn unmap(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError>;

    /// `cuCtxSynchronize`: waits for all work on every stream of the device.
    fn synchronize_device(&mut self) -> Result<(), DeviceError>;
    /// `cuMemcpyDtoH`: copies `host.len()` bytes at `ptr` to host memory (synchronous).
    fn copy_to_host(&mut self, ptr: DevicePtr, host: &mut [u8]) -> Result<(), DeviceError>;
    /// `cuMemcpyHtoD`: copies `host` to `ptr` (synchronous).
    fn copy_from_host(&mut self, ptr: DevicePtr, host: &[u8]) -> Result<(), DeviceError>;

    /// `cuMemHostAlloc`: `size` bytes of page-locked host memory, which the device copies to
    /// and from at the bus's speed and asynchronously.
    fn alloc_pinned_host(&mut self, size: usize) -> Result<PinnedHostBuffer, DeviceError>;
    /// `cuMemFreeHost` of a buffer that `alloc_pinned_host` returned (no copy may be pending).
    fn free_pinned_host(&mut self, buffer: PinnedHostBuffer) -> Result<(), DeviceError>;
    /// `cuStreamCreate(CU_STREAM_NON_BLOCKING)`: a stream of the allocator's own, for the
    /// copies of sleep and wake; it lives as long as the device.
    fn create_stream(&mut self) -> Result<StreamId, DeviceError>;
    /// `cuMemcpyDtoHAsync`: queues a copy of `len` bytes at `ptr` into `buffer` at `offset`
    /// on `stream`; the bytes are there once the stream's later event completes.
    fn copy_to_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError>;
    /// `cuMemcpyHtoDAsync`: queues a copy of `len` bytes of `buffer` at `offset` to `ptr` on
    /// `stream`.
    fn copy_from_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError>;

    /// The processes running on the GPU and the memory each uses, in the order NVML lists
    /// them; empty where nobody can say (no NVML, or it failed). Asked only to write an
    /// out-of-memory message, never on the allocation path.
    fn compute_processes(&mut self) -> Vec<ProcessMemory> {
        Vec::new()
    }

    /// `cuIpcGetMemHandle` of the base of a `malloc`'d allocation: the 64 bytes another
    /// process opens with [`Device::open_ipc_memory`]. A device without CUDA IPC refuses.
    fn ipc_memory_handle(&mut self, _base: DevicePtr) -> Result<[u8; 64], DeviceError> {
        Err(no_ipc("cuIpcGetMemHandle"))
    }
    /// `cuIpcOpenMemHandle` (lazy peer access) in this device's context: where another
    /// process's allocation is mapped here, until [`Device::close_ipc_memory`].
    fn open_ipc_memory(&mut self, _handle: &[u8; 64]) -> Result<DevicePtr, DeviceError> {
        Err(no_ipc("cuIpcOpenMemHandle"))
    }
    /// `cuIpcCloseMemHandle` of what [`Device::open_ipc_memory`] returned.
    fn close_ipc_memory(&mut self, _ptr: DevicePtr) -> Result<(), DeviceError> {
        Err(no_ipc("cuIpcCloseMemHandle"))
    }
    /// `cuMemExportToShareableHandle` as a POSIX file descriptor of this process, which the
    /// device keeps open (one per physical handle, made once) until the handle's
    /// [`Device::release_physical`]: another process takes it with `pidfd_getfd` meanwhile.
    fn export_physical(&mut self, _handle: PhysicalHandle) -> Result<i32, DeviceError> {
        Err(no_ipc("cuMemExportToShareableHandle"))
    }
    /// `cuMemImportFromShareableHandle`: physical memory of another process, as a handle of
    /// this one that [`Device::map`] maps and [`Device::release_physical`] gives back.
    fn import_physical(&mut self, _shared: &SharedPhysical) -> Result<PhysicalHandle, DeviceError> {
        Err(no_ipc("cuMemImportFromShareableHandle"))
    }
}
