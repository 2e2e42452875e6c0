//! Why a call failed: the allocator's error types, and PyTorch's out-of-memory error built
//! from the allocator's figures (`c10::OutOfMemoryError` and its message).

use super::history::TraceAction;
use super::private_pool::{self, MempoolId};
use super::{DeviceAllocator, Request};
use crate::device::{Device, DeviceError, DevicePtr};
use crate::logging;
use crate::policy;
use std::fmt;

/// PyTorch's out-of-memory error, with the figures its message quotes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfMemoryError {
    pub device: i32,
    /// What the program asked for.
    pub requested: usize,
    /// The segment size that could not be obtained (what PyTorch's message names).
    pub allocation_size: usize,
    pub device_free: usize,
    pub device_total: usize,
    /// The memory-fraction limit, when one is set.
    pub allowed: Option<usize>,
    pub allocated: usize,
    pub reserved: usize,
    /// The full message, starting `CUDA out of memory.`.
    pub message: String,
    /// `throw_on_cudamalloc_oom` refused the allocation before the device was asked. PyTorch
    /// then calls no out-of-memory observer (it has rejection observers instead, which no
    /// Python API reaches).
    pub preemptively_rejected: bool,
}

/// Why `malloc` failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// The device is out of memory even after releasing everything cached.
    OutOfMemory(Box<OutOfMemoryError>),
    /// The driver failed for another reason (PyTorch raises at once in that case too).
    Device(DeviceError),
    /// The caller asked for something impossible (a fraction outside [0, 1], ...).
    InvalidArgument(String),
    /// The stream filter of a capture failed, so it is unknown whether the allocation belongs
    /// to the capture's private pool; it is refused rather than risk handing a graph's memory
    /// to someone else.
    StreamFilter { pool: MempoolId, message: String },
    /// Not a failure: the first search of the cached blocks missed and free-memory callbacks
    /// are on ([`DeviceAllocator::set_free_memory_callbacks`]). Nothing was allocated; the
    /// caller runs the callbacks, then calls
    /// [`DeviceAllocator::malloc_after_free_memory_callbacks`].
    RunFreeMemoryCallbacks,
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(oom) => f.write_str(&oom.message),
            AllocError::Device(DeviceError::Unavailable(why) | DeviceError::Unusable(why)) => {
                f.write_str(why)
            }
            AllocError::Device(err) => write!(f, "CUDA error: {err}"),
            AllocError::InvalidArgument(why) => f.write_str(why),
            AllocError::StreamFilter { pool, message } => write!(
                f,
                "the stream filter of the CUDA graph capture into pool {} failed ({message}); \
                 the allocation is refused",
                private_pool::PoolName(*pool)
            ),
            AllocError::RunFreeMemoryCallbacks => f.write_str(
                "the cache missed and the free-memory callbacks have not run yet (an internal \
                 step of an allocation, never its outcome)",
            ),
        }
    }
}

impl std::error::Error for AllocError {}

impl From<DeviceError> for AllocError {
    fn from(err: DeviceError) -> Self {
        AllocError::Device(err)
    }
}

/// Why an operation on a pointer was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PointerError {
    /// Not a pointer this allocator handed out, or one already freed.
    Unknown(DevicePtr),
}

impl fmt::Display for PointerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointerError::Unknown(ptr) => write!(
                f,
                "invalid device pointer: {ptr:#x} (never allocated by ferrocache, or already freed)"
            ),
        }
    }
}

impl std::error::Error for PointerError {}

impl<D: Device> DeviceAllocator<D> {
    /// The error of an allocation that `throw_on_cudamalloc_oom` refused, with PyTorch's
    /// message (which names what the program asked for). PyTorch counts it in
    /// `num_oom_rejections`, not `num_ooms`, and records no `oom` trace entry.
    pub(super) fn preemptive_rejection(
        &mut self,
        request: &Request,
        orig_size: usize,
    ) -> AllocError {
        let info = self
            .device
            .mem_get_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: 0 });
        let message = policy::preemptive_rejection_message(orig_size);
        self.out_of_memory_error(request, orig_size, info, message)
    }

    /// The out-of-memory error, in PyTorch's words and figures.
    pub(super) fn out_of_memory(&mut self, request: &Request, orig_size: usize) -> AllocError {
        let info = self
            .device
            .mem_get_info()
            .unwrap_or(crate::device::MemInfo { free: 0, total: 0 });
        self.ledger.stats.num_ooms += 1;
        let pools = &self.pools;
        self.ledger.history.record_in_pool(
            TraceAction::Oom,
            info.free as u64,
            request.size,
            request.stream,
            || pools.id_of(request.owner),
        );
        let allocated = self.ledger.stats.allocated_bytes.all.current as usize;
        let reserved = self.ledger.stats.reserved_bytes.all.current as usize;
        // PyTorch counts the free blocks cached in private pools as allocated: they are the
        // graphs' memory, which no other allocation can use.
        let in_private_pools = self.private_pool_cached_bytes();
        let reserve_class = self.reserve_class_of(request.stream);
        let reserve = policy::expandable_segment_reserve(&self.config, info.total, &reserve_class);
        // Asked of NVML under the lock, as PyTorch does; only its first call in the process
        // (loading and starting NVML) takes long.
        let processes = self.device.compute_processes();
        let message = policy::out_of_memory_message(
            &policy::OomFigures {
                alloc_size: request.alloc_size,
                device: self.device_index,
                device_total: info.total,
                device_free: info.free,
                allowed: self.source.guard.allowed_memory_maximum,
                allocated: allocated + in_private_pools,
                in_private_pools,
                reserved,
                expandable_segments: self.config.expandable_segments,
                configured_reserve: reserve.configured.then_some(reserve.bytes),
                reserve_class,
                processes,
                own_pid: std::process::id(),
            },
            self.config.modelled.oom_wording,
        );
        self.out_of_memory_error(request, orig_size, info, message)
    }

    /// An out-of-memory error with `message`, logged, and the figures it is about.
    pub(super) fn out_of_memory_error(
        &self,
        request: &Request,
        orig_size: usize,
        info: crate::device::MemInfo,
        message: String,
    ) -> AllocError {
        logging::out_of_memory(&message);
        AllocError::OutOfMemory(Box::new(OutOfMemoryError {
            device: self.device_index,
            requested: orig_size,
            allocation_size: request.alloc_size,
            device_free: info.free,
            device_total: info.total,
            allowed: self.source.guard.allowed_memory_maximum,
            allocated: self.ledger.stats.allocated_bytes.all.current as usize,
            reserved: self.ledger.stats.reserved_bytes.all.current as usize,
            message,
            preemptively_rejected: self.source.guard.preemptively_rejected,
        }))
    }
}
