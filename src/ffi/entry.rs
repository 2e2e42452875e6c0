//! Allocation and free, the hot path: `rust_malloc`'s core (`ferrocache_internal_malloc`, which
//! `src/oom.cpp` turns into a C++ exception on failure), `rust_free`, and the NULL-returning
//! `ferrocache_alloc` / `ferrocache_free` for the Python package and C callers.
//!
//! A cache hit here is: the device's slot (one load), the caller's context (one load while no
//! thread set a tag or metadata), the lock (one compare-exchange), the core, the release (one
//! store). Everything else is out of line.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Arc;

use super::callbacks::{
    StackEvent, ferrocache_oom_thrower, gather_stack, notify_oom_observers, oom_thrower,
};
use super::guard::{guarded, last_error_ptr, set_last_error};
use super::registry::{self, Found, Memory, with_last_error};
use super::{cudaStream_t, device_address, device_pointer, stream_id, thread, unknown_pointer};
use crate::allocator::history::StackId;
use crate::allocator::uncached::{Caller, UncachedFreeError};
use crate::allocator::{AllocError, AllocationInfo};
use crate::device::{DevicePtr, StreamId};
use crate::logging;

/// Why an allocation failed: out of memory (PyTorch's message) or anything else.
pub(crate) enum AllocFailure {
    OutOfMemory(String),
    Other(String),
}

impl AllocFailure {
    fn into_message(self) -> String {
        match self {
            AllocFailure::OutOfMemory(message) | AllocFailure::Other(message) => message,
        }
    }
}

/// Runs `action` with the caller's metadata given to the trace entries it records (the usual
/// caller has none, and costs nothing here).
#[inline(always)]
fn with_metadata<R>(
    memory: &mut Memory,
    metadata: Option<Arc<str>>,
    action: impl FnOnce(&mut Memory) -> R,
) -> R {
    if metadata.is_none() {
        return action(memory);
    }
    let previous = memory.allocator_mut().set_user_metadata(metadata);
    let result = action(memory);
    memory.allocator_mut().set_user_metadata(previous);
    result
}

/// Allocates, or says why not (the message the C++ exception or the last error carries).
#[inline(always)]
fn allocate(size: usize, device: c_int, stream: cudaStream_t) -> Result<*mut c_void, AllocFailure> {
    if size == 0 {
        return Ok(ptr::null_mut());
    }
    let device = registry::device(device).map_err(AllocFailure::Other)?;
    if let Some(why) = crate::device::cuda::unusable() {
        return Err(unusable(why));
    }
    let stack = gather_stack(StackEvent::Alloc);
    let stream = stream_id(stream);
    if thread::context_in_use() {
        return allocate_in_context(device, size, stream, stack);
    }
    // The allocator's malloc is called here, not in a closure, so that it inlines into this
    // function: a call between the two made each copy its arguments and results through the
    // stack, a store-forwarding stall each way (`docs/performance.md`). Its result is matched at
    // once, the lock given back in each arm: merged with another path's result first (the
    // out-of-line context path's, or across the guard's drop), the whole `Result`, the large
    // `AllocError` included, went through the stack on every allocation.
    let caller = Caller { stack, tag: None };
    let mut memory = device.lock().map_err(refused)?;
    match memory.malloc(size, stream, caller) {
        Ok(ptr) => {
            memory.unlock();
            Ok(device_pointer(ptr))
        }
        Err(err) => {
            memory.unlock();
            missed_or_failed(device, size, stream, stack, err)
        }
    }
}

/// A malloc that stopped at a miss for PyTorch's free-memory callbacks (the device's lock is
/// released by now): they run, and the allocation goes on ([`super::free_memory`]); or one that
/// failed.
#[cold]
#[inline(never)]
fn missed_or_failed(
    device: &registry::Device,
    size: usize,
    stream: StreamId,
    stack: StackId,
    err: AllocError,
) -> Result<*mut c_void, AllocFailure> {
    let result = match err {
        AllocError::RunFreeMemoryCallbacks => {
            super::free_memory::run_then_continue(device, size, stream, stack)
                .map_err(AllocFailure::Other)?
        }
        err => Err(err),
    };
    result
        .map(device_pointer)
        .map_err(|err| allocation_failed(device, err))
}

/// [`allocate`] once some thread has set a tag or metadata: this thread's are read, and the
/// metadata given to the trace entries the allocation records.
#[inline(never)]
fn allocate_in_context(
    device: &registry::Device,
    size: usize,
    stream: StreamId,
    stack: StackId,
) -> Result<*mut c_void, AllocFailure> {
    let (caller, metadata) = thread::caller(stack);
    let result = with_metadata(&mut *device.lock().map_err(refused)?, metadata, |memory| {
        memory.malloc(size, stream, caller)
    });
    match result {
        Ok(ptr) => Ok(device_pointer(ptr)),
        Err(err) => missed_or_failed(device, size, stream, stack, err),
    }
}

/// Memory from the cache would be as unusable as new memory after a sticky error, and a
/// capture's stream filter (PyTorch's code, which asks CUDA) must not be asked either: the
/// allocation fails at once.
#[cold]
#[inline(never)]
fn unusable(why: &str) -> AllocFailure {
    logging::call_failed("allocation", &why);
    AllocFailure::Other(why.to_string())
}

#[cold]
#[inline(never)]
fn refused(why: String) -> AllocFailure {
    logging::call_failed("allocation", &why);
    AllocFailure::Other(why)
}

/// An allocation that failed, with the device's lock released: PyTorch's observers first (they
/// may dump a snapshot), then the advice line.
#[cold]
#[inline(never)]
fn allocation_failed(device: &registry::Device, err: AllocError) -> AllocFailure {
    match err {
        // A preemptive rejection (throw_on_cudamalloc_oom) is the user's own limit: PyTorch calls
        // no out-of-memory observer for it, and no setting would have served it better.
        AllocError::OutOfMemory(oom) if oom.preemptively_rejected => {
            AllocFailure::OutOfMemory(oom.message)
        }
        // The allocator has logged it, with the same message.
        AllocError::OutOfMemory(oom) => {
            notify_oom_observers(&oom);
            super::advice::advise_after_out_of_memory(device, &oom);
            AllocFailure::OutOfMemory(oom.message)
        }
        err => {
            let message = err.to_string();
            logging::call_failed("allocation", &message);
            AllocFailure::Other(message)
        }
    }
}

/// What the caller of a free says about the allocation; `None` where it says nothing. Passed
/// by value: a reference kept it in memory, built on every free for the rare paths that read it.
#[derive(Clone, Copy)]
struct FreeClaims {
    size: Option<usize>,
    device: Option<c_int>,
    stream: Option<StreamId>,
}

/// Frees `ptr`. Wrong claims about it are logged at WARN and the recorded values used; a pointer
/// no allocator knows is refused (logged at ERROR by the caller) and nothing changes.
///
/// The device the caller names is tried first, and the free itself is the look-up: one lock and
/// one hash-map removal on the usual path.
#[inline(always)]
fn release(ptr: DevicePtr, claims: FreeClaims) -> Result<(), String> {
    let stack = gather_stack(StackEvent::Free);
    if thread::context_in_use() {
        return release_in_context(ptr, claims, stack);
    }
    if let Some(device) = claims.device
        && let Some(created) = registry::created(device)
    {
        // The allocator's free is called here, not in a closure, so that it inlines (as in
        // `allocate`), and its result matched at once with the lock given back in each arm
        // (before any warning: a warning never holds up other threads). `free_cached` answers
        // only while no allocation made with caching off is live (else `release_elsewhere`
        // asks `free`): its result has no room for the driver's refusal, so it stays in
        // registers, where `free`'s, merged with the out-of-line uncached path's, went through
        // the stack on every free.
        let mut memory = created.lock()?;
        match memory.free_cached(ptr, stack) {
            // Only the two fields checked are read here: moving the whole record to pass it on
            // cost a store-forwarding stall on every free.
            Some(Ok(recorded))
                if claims_hold(claims, device, recorded.requested_size, recorded.stream) =>
            {
                memory.unlock();
                return Ok(());
            }
            Some(Ok(recorded)) => {
                memory.unlock();
                log_wrong_claims(claims, device, &recorded);
                return Ok(());
            }
            Some(Err(_)) | None => memory.unlock(),
        }
    }
    release_elsewhere(ptr, claims, Caller { stack, tag: None }, None)
}

/// [`release`] once some thread has set a tag or metadata: this thread's metadata is given to
/// the trace entries the free records.
#[inline(never)]
fn release_in_context(ptr: DevicePtr, claims: FreeClaims, stack: StackId) -> Result<(), String> {
    let (caller, metadata) = thread::caller(stack);
    if let Some(device) = claims.device
        && let Some(created) = registry::created(device)
    {
        let freed = with_metadata(&mut *created.lock()?, metadata.clone(), |memory| {
            memory.free(ptr, caller.stack)
        });
        match freed {
            Ok(recorded) => {
                report_wrong_claims(claims, device, &recorded);
                return Ok(());
            }
            Err(UncachedFreeError::Pointer(_)) => {}
            Err(err) => return Err(err.to_string()),
        }
    }
    release_elsewhere(ptr, claims, caller, metadata)
}

/// [`release`] when the device the caller named (if any) did not hand `ptr` out: every device
/// is asked (the named one again, which costs only on this rare path).
#[cold]
#[inline(never)]
fn release_elsewhere(
    ptr: DevicePtr,
    claims: FreeClaims,
    caller: Caller,
    metadata: Option<Arc<str>>,
) -> Result<(), String> {
    registry::read_once();
    let (device, recorded) = registry::with_owner(
        claims.device,
        || unknown_pointer(ptr),
        |memory| -> Found<AllocationInfo> {
            let freed = with_metadata(memory, metadata.clone(), |memory| {
                memory.free(ptr, caller.stack)
            });
            match freed {
                Ok(recorded) => Some(Ok(recorded)),
                Err(UncachedFreeError::Pointer(_)) => None,
                Err(err) => Some(Err(err.to_string())),
            }
        },
    )?;
    report_wrong_claims(claims, device, &recorded);
    Ok(())
}

/// Logs at WARN each claim of a free that differs from what the allocation recorded.
#[inline(always)]
fn report_wrong_claims(claims: FreeClaims, device: c_int, recorded: &AllocationInfo) {
    if !claims_hold(claims, device, recorded.requested_size, recorded.stream) {
        log_wrong_claims(claims, device, recorded);
    }
}

/// Whether every claim of a free agrees with what the allocation recorded.
#[inline(always)]
fn claims_hold(claims: FreeClaims, device: c_int, requested_size: usize, stream: StreamId) -> bool {
    claims.device.is_none_or(|claimed| claimed == device)
        && claims.size.is_none_or(|size| size == requested_size)
        && claims.stream.is_none_or(|claimed| claimed == stream)
}

/// [`report_wrong_claims`] once a claim differs (out of line: PyTorch's wrapper always passes
/// what the allocation recorded).
#[cold]
#[inline(never)]
fn log_wrong_claims(claims: FreeClaims, device: c_int, recorded: &AllocationInfo) {
    let ptr = recorded.ptr;
    if let Some(claimed) = claims.device
        && claimed != device
    {
        logging::free_argument_mismatch(ptr, "device", &claimed, &device);
    }
    if let Some(size) = claims.size
        && size != recorded.requested_size
    {
        logging::free_argument_mismatch(ptr, "size", &size, &recorded.requested_size);
    }
    if let Some(stream) = claims.stream
        && stream != recorded.stream
    {
        logging::free_argument_mismatch(
            ptr,
            "stream",
            &logging::StreamName(stream),
            &logging::StreamName(recorded.stream),
        );
    }
}

/// For `rust_malloc` in `oom.cpp` only (not exported from the library): allocates `size` bytes
/// on `device` for `stream`. Returns the pointer with `*error` set to NULL, or NULL with `*error`
/// pointing at the reason (this thread's last error, valid until the next call on this thread).
/// Size 0 gives NULL with no error. `*thrower` is the registered `OomThrower` when the
/// allocation failed for lack of memory and one is registered, else NULL: what `rust_malloc`
/// throws is decided here.
///
/// # Safety
/// `error` and `thrower` are NULL or valid for one pointer write each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_internal_malloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
    error: *mut *const c_char,
    thrower: *mut ferrocache_oom_thrower,
) -> *mut c_void {
    let failure = guarded("rust_malloc", Err(None), || {
        allocate(size, device, stream).map_err(|failure| {
            let throw_with = match &failure {
                AllocFailure::OutOfMemory(_) => oom_thrower(),
                AllocFailure::Other(_) => None,
            };
            set_last_error(&failure.into_message());
            throw_with
        })
    });
    let (ptr, reason, throw_with) = match failure {
        Ok(ptr) => (ptr, ptr::null(), None),
        Err(throw_with) => (ptr::null_mut(), last_error_ptr(), throw_with),
    };
    if !error.is_null() {
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { error.write(reason) };
    }
    if !thrower.is_null() {
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { thrower.write(throw_with) };
    }
    ptr
}

/// `CUDAPluggableAllocator`'s free function. NULL does nothing. A pointer ferrocache did not give
/// out, or one already freed, is logged at ERROR and nothing changes. A `size`, `device` or
/// `stream` that differs from what the allocation recorded is logged at WARN and the recorded
/// value is used.
#[unsafe(no_mangle)]
pub extern "C" fn rust_free(ptr: *mut c_void, size: usize, device: c_int, stream: cudaStream_t) {
    if ptr.is_null() {
        return;
    }
    guarded("rust_free", (), || {
        let claims = FreeClaims {
            size: Some(size),
            device: Some(device),
            stream: Some(stream_id(stream)),
        };
        if let Err(why) = release(device_address(ptr), claims) {
            logging::call_refused("rust_free", &why);
        }
    });
}

/// Allocates `size` bytes on `device` for `stream` (0 is the default stream). Returns NULL when
/// `size` is 0 (last error empty) or on failure (last error set: PyTorch's out-of-memory
/// message, a driver error, or why the device or the settings are unusable). Never throws.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_alloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) -> *mut c_void {
    with_last_error("ferrocache_alloc", ptr::null_mut(), || {
        allocate(size, device, stream).map_err(AllocFailure::into_message)
    })
}

/// Frees an allocation from `ferrocache_alloc` or `rust_malloc`, on whichever device it is.
/// Returns 0, or -1 (last error set, logged at ERROR, nothing changed) for a pointer ferrocache
/// did not give out or already freed. NULL returns 0 and does nothing.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_free(ptr: *mut c_void) -> c_int {
    with_last_error("ferrocache_free", -1, || {
        if ptr.is_null() {
            return Ok(0);
        }
        let claims = FreeClaims {
            size: None,
            device: None,
            stream: None,
        };
        release(device_address(ptr), claims)
            .map(|()| 0)
            .inspect_err(|why| logging::call_refused("ferrocache_free", why))
    })
}
