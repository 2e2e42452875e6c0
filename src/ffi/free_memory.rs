//! PyTorch's free-memory callbacks on a cache miss (`c10::FreeCudaMemoryCallbacksRegistry`),
//! for the C++ front end. libtorch_python registers one, "cuda_ipc_collect": it frees the blocks
//! waiting in the CUDA IPC limbo (shared with other processes, let go by the sender) once every
//! receiver let go, so that a miss reuses them instead of asking the device for more.
//!
//! The front end registers one C function that runs PyTorch's registry
//! (`ferrocache_set_free_memory_callbacks`). From then on a device's malloc stops where PyTorch
//! runs the callbacks, after its first search missed ([`crate::allocator`]'s `free_memory`);
//! here the callbacks run with the device's lock released, since they free through ferrocache
//! (the limbo's deleter is the front end's) and ferrocache's lock is not recursive as PyTorch's
//! is; then the lock is taken again and the core finishes the allocation from the state it finds,
//! searching the cache a second time only when a callback freed memory. The hit path is
//! untouched; without a registration (the pluggable path, `rust_malloc`) nothing changes.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use parking_lot::Mutex;

use super::guard::panic_message;
use super::registry::{self, created_devices, with_last_error};
use super::thread;
use crate::allocator::AllocError;
use crate::allocator::history::StackId;
use crate::device::{DevicePtr, StreamId};
use crate::logging;

/// Runs every free-memory callback PyTorch has registered, as its
/// `trigger_free_memory_callbacks`: returns 1 when one of them says it freed memory, 0 when
/// none did, -1 when one failed (why in `*error`, valid until the function's next call on the
/// thread). Called with no allocator lock held, on the allocating thread; it may call
/// ferrocache (to free, above all). It must not unwind (a Rust panic from it is caught).
pub type FreeMemoryCallbacks = unsafe extern "C-unwind" fn(error: *mut *const c_char) -> c_int;
/// A [`FreeMemoryCallbacks`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_free_memory_callbacks = Option<FreeMemoryCallbacks>;

/// The function registered, if any.
static REGISTERED: Mutex<Option<FreeMemoryCallbacks>> = Mutex::new(None);

thread_local! {
    /// Whether this thread is running the callbacks: an allocation they make themselves does
    /// not run them again (it cannot recurse without end).
    static RUNNING: Cell<bool> = const { Cell::new(false) };
}

/// Registers `callbacks` (NULL: none), as PyTorch's allocator runs its free-memory callbacks
/// (`c10::FreeCudaMemoryCallbacksRegistry`): from now on, when the first search of a device's
/// cached blocks misses, the allocation runs `callbacks` with no allocator lock held, then
/// searches again only if they freed memory, before asking the device for more. `callbacks`
/// returns 1 when one of them freed memory, 0 when none did, -1 when one failed (why in
/// `*error`, valid until its next call on the thread: logged at ERROR, and the cache is
/// searched again); it may call ferrocache (to free, above all) and must never unwind. It
/// replaces an earlier one and must stay callable until replaced. Returns 0, or -1 (last error
/// set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_free_memory_callbacks(
    callbacks: ferrocache_free_memory_callbacks,
) -> c_int {
    with_last_error("ferrocache_set_free_memory_callbacks", -1, || {
        // Held so that a device created meanwhile cannot miss the change.
        let mut process_wide = registry::process_wide();
        *REGISTERED.lock() = callbacks;
        process_wide.free_memory_callbacks = callbacks.is_some();
        // A device out of service serves nothing.
        for mut memory in created_devices().filter_map(|device| device.lock().ok()) {
            memory
                .allocator_mut()
                .set_free_memory_callbacks(callbacks.is_some());
        }
        Ok(0)
    })
}

/// The rest of an allocation whose malloc returned [`AllocError::RunFreeMemoryCallbacks`],
/// with the device's lock released: runs the callbacks, takes the lock again and lets the core
/// finish from the state it finds. `stack` is the allocation's.
#[cold]
#[inline(never)]
pub(super) fn run_then_continue(
    device: &registry::Device,
    size: usize,
    stream: StreamId,
    stack: StackId,
) -> Result<Result<DevicePtr, AllocError>, String> {
    let freed = run_callbacks(device.index(), size);
    let (caller, metadata) = thread::caller(stack);
    let mut memory = device
        .lock()
        .inspect_err(|why| logging::call_failed("allocation", why))?;
    if metadata.is_none() {
        return Ok(memory.malloc_after_free_memory_callbacks(size, stream, caller, freed));
    }
    let previous = memory.allocator_mut().set_user_metadata(metadata);
    let result = memory.malloc_after_free_memory_callbacks(size, stream, caller, freed);
    memory.allocator_mut().set_user_metadata(previous);
    Ok(result)
}

/// Runs the registered callbacks, if any: whether they freed memory, or may have. One that
/// failed or panicked is logged at ERROR and counts as having freed: what it freed before
/// failing is then found by the second search (PyTorch would throw out of the allocation).
fn run_callbacks(device: c_int, size: usize) -> bool {
    let Some(callbacks) = *REGISTERED.lock() else {
        return false;
    };
    if RUNNING.try_with(|running| running.replace(true)) != Ok(false) {
        return false;
    }
    let mut error: *const c_char = ptr::null();
    // SAFETY: the registrant promises the function stays callable; `error` lives across the
    // call. A Rust panic is caught here; nothing else may unwind (the contract).
    let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { callbacks(&mut error) }));
    let _ = RUNNING.try_with(|running| running.set(false));
    let why = match outcome {
        Ok(status) if status >= 0 => return status > 0,
        Ok(_) if error.is_null() => "they gave no reason".to_string(),
        // SAFETY: a NUL-terminated string, valid until the function's next call on this thread.
        Ok(_) => unsafe { CStr::from_ptr(error) }
            .to_string_lossy()
            .into_owned(),
        Err(payload) => format!("a panic: {}", panic_message(&*payload)),
    };
    let what =
        format!("the free-memory callbacks on a cache miss of {size} bytes (device {device})");
    logging::call_failed(&what, &format!("{why}; the cache is searched again"));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    // The registration is process-wide: one test runs every case in turn.
    unsafe extern "C-unwind" fn freed(_error: *mut *const c_char) -> c_int {
        1
    }

    unsafe extern "C-unwind" fn nothing(_error: *mut *const c_char) -> c_int {
        0
    }

    unsafe extern "C-unwind" fn fails(error: *mut *const c_char) -> c_int {
        // SAFETY: the caller passes a writable out pointer.
        unsafe { error.write(c"the limbo is locked".as_ptr()) };
        -1
    }

    unsafe extern "C-unwind" fn panics(_error: *mut *const c_char) -> c_int {
        panic!("a callback panicked");
    }

    unsafe extern "C-unwind" fn allocates_again(_error: *mut *const c_char) -> c_int {
        // An allocation made by a callback does not run the callbacks again.
        c_int::from(run_callbacks(0, 512))
    }

    #[test]
    fn the_callbacks_say_whether_to_search_again_and_a_failure_or_panic_counts_as_freed() {
        let set = |callbacks| assert_eq!(ferrocache_set_free_memory_callbacks(callbacks), 0);
        set(None);
        assert!(!registry::process_wide().free_memory_callbacks);
        assert!(!run_callbacks(0, 512), "none registered");
        set(Some(freed));
        assert!(registry::process_wide().free_memory_callbacks && run_callbacks(0, 512));
        set(Some(nothing));
        assert!(!run_callbacks(0, 512));
        set(Some(fails));
        assert!(
            run_callbacks(0, 512),
            "what it freed before failing is searched for"
        );
        set(Some(panics));
        assert!(run_callbacks(0, 512), "a panic is caught");
        assert!(
            RUNNING.with(|running| !running.get()),
            "and the thread can run them again"
        );
        set(Some(allocates_again));
        assert!(!run_callbacks(0, 512), "the nested run returned 0");
        set(None);
    }
}
