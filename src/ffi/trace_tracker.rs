//! `CUDAAllocator::attachAllocatorTraceTracker`: the C side (python/ferrocache/frontend.cpp)
//! registers one callback, which receives every trace entry of every device as PyTorch's
//! `record_trace` gives its trackers (`TraceEntry`), and calls each tracker PyTorch attached.
//! NCCL's register hook (`TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`, and torch 2.15's
//! default NCCL backend) registers each `segment_alloc` with its communicators and deregisters
//! each `segment_free`. Which entries are made, with which address, size, stream and pool, is the
//! allocator's ([`crate::allocator::tracker`]); here they become C.

use std::ffi::{CStr, c_char, c_int, c_ulonglong};
use std::ptr;
use std::sync::Arc;

use super::registry::{self, created_devices, with_last_error};
use super::{cudaStream_t, stream_handle};
use crate::allocator::tracker::{TraceTracker, TrackedEvent};
use crate::logging;
use crate::trace::TraceAction;

/// One trace entry, as PyTorch's `TraceEntry` holds it.
#[repr(C)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_trace_event {
    /// PyTorch's `TraceEntry::Action`: 0 alloc, 1 free_requested, 2 free_completed,
    /// 3 segment_alloc, 4 segment_free, 5 segment_map, 6 segment_unmap, 7 snapshot, 8 oom.
    pub action: c_int,
    pub device: c_int,
    /// The address; for an `oom`, the device's free bytes.
    pub addr: u64,
    pub size: u64,
    pub stream: cudaStream_t,
    /// The pool's id: (0, 0) for the ordinary pools, else the private pool's.
    pub pool_first: c_ulonglong,
    pub pool_second: c_ulonglong,
}

/// Receives one entry; returns 0, or -1 with why in `*error` (valid until the callback's next
/// call on the thread). Called with the device's allocator lock held: it must not call
/// ferrocache for that device, and must never unwind.
pub type TrackerCallback =
    unsafe extern "C" fn(event: *const ferrocache_trace_event, error: *mut *const c_char) -> c_int;
/// A [`TrackerCallback`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_trace_tracker = Option<TrackerCallback>;

/// PyTorch's `TraceEntry::Action` value of `action` (the C++ side checks the numbering against
/// the PyTorch it is built for); `None` for the actions the allocator never records.
fn pytorch_action(action: TraceAction) -> Option<c_int> {
    Some(match action {
        TraceAction::Alloc => 0,
        TraceAction::FreeRequested => 1,
        TraceAction::FreeCompleted => 2,
        TraceAction::SegmentAlloc => 3,
        TraceAction::SegmentFree => 4,
        TraceAction::SegmentMap => 5,
        TraceAction::SegmentUnmap => 6,
        TraceAction::Snapshot => 7,
        TraceAction::Oom => 8,
        TraceAction::Free | TraceAction::UserDefined => return None,
    })
}

/// The tracker that hands each entry to `callback`; a refusal is logged at ERROR with what the
/// tracker said (PyTorch would throw it out of the allocation; here the allocation stands, as
/// the memory is already the allocator's).
fn calling(callback: TrackerCallback) -> TraceTracker {
    Arc::new(move |event: &TrackedEvent| {
        let Some(action) = pytorch_action(event.action) else {
            return;
        };
        let entry = ferrocache_trace_event {
            action,
            device: event.device,
            addr: event.addr,
            size: event.size,
            stream: stream_handle(event.stream),
            pool_first: event.pool.0,
            pool_second: event.pool.1,
        };
        let mut error: *const c_char = ptr::null();
        // SAFETY: the attacher promises the callback stays callable and never unwinds; `entry`
        // and `error` live across the call.
        if unsafe { callback(&entry, &mut error) } == 0 {
            return;
        }
        let why = if error.is_null() {
            "it gave no reason".to_string()
        } else {
            // SAFETY: a NUL-terminated string, valid until the callback's next call.
            unsafe { CStr::from_ptr(error) }
                .to_string_lossy()
                .into_owned()
        };
        let what = format!(
            "an allocator trace tracker on {} of {} bytes at {:#x} (device {})",
            event.action.name(),
            event.size,
            event.addr,
            event.device
        );
        logging::call_failed(&what, &why);
    })
}

/// `CUDAAllocator::attachAllocatorTraceTracker`: from now on `tracker` (NULL: none) receives
/// every trace entry of every device, those opened later included, as PyTorch's trackers
/// receive its own: the `segment_alloc` after the device gave the memory, the `segment_free`
/// before it takes it back, a `segment_map` / `segment_unmap` per range of an expandable
/// segment, and each `alloc`, `free_requested`, `free_completed` and `oom`, whether history is
/// recorded or not. It replaces an earlier one (the C++ side keeps PyTorch's list of trackers
/// and calls each). It is called with the device's lock held, on the thread that allocates or
/// frees: it must stay callable for the life of the process (or until replaced), never call
/// ferrocache for the same device, and never unwind. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_attach_trace_tracker(tracker: ferrocache_trace_tracker) -> c_int {
    with_last_error("ferrocache_attach_trace_tracker", -1, || {
        let tracker = tracker.map(calling);
        let mut process_wide = registry::process_wide();
        process_wide.trace_tracker = tracker.clone();
        // A device out of service serves nothing, nor sends.
        for mut memory in created_devices().filter_map(|device| device.lock().ok()) {
            memory.allocator_mut().set_trace_tracker(tracker.clone());
        }
        Ok(0)
    })
}
