//! The C ABI: what PyTorch's `CUDAPluggableAllocator` and the Python package call. A shell:
//! each export turns C arguments into a call on the core and the answer back into C, and every
//! decision is the core's.
//!
//! - `rust_malloc` lives in `src/oom.cpp`: it calls `ferrocache_internal_malloc` and throws a
//!   `std::runtime_error` with the message when that returns NULL, because PyTorch does not check
//!   the pointer `alloc` returns. Every decision is made here; the C++ only throws.
//! - The CUDA graph pool hooks take C++ types, so they live in `src/pool_hooks.cpp`, which hands
//!   everything to `ferrocache_internal_begin_allocate_to_pool` and its two siblings.
//! - Functions that can fail set this thread's last error (`ferrocache_last_error`), which
//!   every such call clears on entry.
//!
//! One allocator per device ([`registry`]), created on first use and kept for the life of the
//! process, each behind its own lock. Every export catches panics ([`guard`]), so nothing unwinds
//! into C, and a panic while a device's lock is held puts that device out of service.
//!
//! | unit | owns |
//! |---|---|
//! | [`registry`] | the per-device allocators, their creation, and what applies to every device: the settings (read on first use), history recording, caching on or off |
//! | [`guard`] | panics caught at every export, this thread's last error |
//! | [`entry`] | allocation and free: `rust_malloc`'s core, `rust_free`, `ferrocache_alloc`/`free` |
//! | [`frontend`] | what ferrocache's own `CUDAAllocator` object asks beyond the hooks: allocation, pools, `cacheInfo`, `DeviceStats`, a pool's live allocations |
//! | [`free_memory`] | PyTorch's free-memory callbacks (CUDA IPC's limbo collected) on a cache miss, run with the lock released |
//! | [`checkpoint`] | CUDA graph trees' checkpoints of a private pool, and their restore, for the front end |
//! | [`hooks`] | PyTorch's other `set_*_fn` hooks: init, reset, memory fraction, record stream, base allocation |
//! | [`pools`] | private pools: CUDA graph captures and `torch.cuda.MemPool` |
//! | [`callbacks`] | functions C registers: stack gatherer, OOM thrower and observers, reserve-class lookup |
//! | [`thread`] | what a thread sets for its own allocations: its tag and its trace metadata |
//! | [`inspect`] | statistics, snapshot, history recording, invariant checks |
//! | [`ipc`] | CUDA IPC for the front end: `shareIpcHandle` and `getIpcDevPtr` in PyTorch's handle format |
//! | [`advice`] | `ferrocache_advise` and the advice line after an out-of-memory |
//! | [`settings`] | `PYTORCH_CUDA_ALLOC_CONF` checked, described, replaced at run time; caching turned on or off |
//! | [`sleep`] | sleep and wake of tagged memory, with per-device reports |
//! | [`strings`] | C strings in and out, the version and the command line |
//! | [`trace_tracker`] | `attachAllocatorTraceTracker`: every trace entry, to the callback the front end registers |
//! | [`segment_sizes`] | `getExpandableSegmentSizes` |

mod advice;
mod callbacks;
mod checkpoint;
mod entry;
mod free_memory;
mod frontend;
mod guard;
mod hooks;
mod inspect;
mod ipc;
mod pools;
mod registry;
mod segment_sizes;
mod settings;
mod sleep;
mod strings;
mod thread;
mod trace_tracker;

use std::ffi::c_void;
use std::ptr;

use crate::device::{DevicePtr, StreamId};

/// A CUDA stream handle as PyTorch passes it; 0 is the legacy default stream.
#[allow(
    non_camel_case_types,
    reason = "the CUDA runtime's name, as the header shows it"
)]
pub type cudaStream_t = *mut c_void;

fn stream_id(stream: cudaStream_t) -> StreamId {
    stream.addr() as StreamId
}

fn stream_handle(stream: StreamId) -> cudaStream_t {
    ptr::without_provenance_mut(stream as usize)
}

fn device_pointer(ptr: DevicePtr) -> *mut c_void {
    // The address is the driver's; Rust never dereferences it.
    ptr::without_provenance_mut(ptr as usize)
}

fn device_address(ptr: *mut c_void) -> DevicePtr {
    ptr.addr() as DevicePtr
}

fn unknown_pointer(ptr: DevicePtr) -> String {
    crate::allocator::PointerError::Unknown(ptr).to_string()
}
