//! What stands at every export: a panic is caught and reported instead of unwinding into C, and
//! this thread's last error says why a call failed.
//!
//! A panic while a device's lock is held poisons that lock ([`crate::lock`]): the device's
//! allocator may be half-updated, so the registry refuses every later call on it
//! ([`super::registry::Device::lock`]). That is why the body can be run as `AssertUnwindSafe`:
//! nothing it could leave half-updated is used again.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::logging;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    // A NUL inside would cut the message short in C; none of ours has one, but be sure.
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = message);
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|last| {
        if !last.borrow().is_empty() {
            *last.borrow_mut() = CString::default();
        }
    });
}

/// This thread's last error, as a pointer that stays valid until the next call on this thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Runs `body`; a panic becomes an ERROR line, this thread's last error and `on_panic`.
#[inline(always)]
pub(crate) fn guarded<R>(function: &str, on_panic: R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => report_panic(function, &*payload, on_panic),
    }
}

#[cold]
#[inline(never)]
fn report_panic<R>(function: &str, payload: &(dyn std::any::Any + Send), on_panic: R) -> R {
    let why = panic_message(payload);
    // Even reporting must not unwind into C.
    let _ = catch_unwind(|| {
        logging::internal_error(function, &why);
        set_last_error(&format!("ferrocache: internal error in {function}: {why}"));
    });
    on_panic
}

/// What a caught panic said.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// [`guarded`] for the `ferrocache_*` functions that report through the last error: clears it,
/// runs `body`, and on `Err` sets it. Logging, where wanted, is `body`'s business. Calls that
/// read the settings use `registry::with_last_error`, which reads them first; this one is for
/// calls that must not read them for good (checking a configuration string before it is put
/// in the environment).
pub(crate) fn reporting_errors<T: Copy>(
    function: &str,
    on_error: T,
    body: impl FnOnce() -> Result<T, String>,
) -> T {
    guarded(function, on_error, || {
        clear_last_error();
        body().unwrap_or_else(|message| {
            set_last_error(&message);
            on_error
        })
    })
}

/// This thread's last error: empty when the latest `ferrocache_*` call that can fail succeeded.
/// Never NULL. Owned by ferrocache; valid until the next ferrocache call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_last_error() -> *const c_char {
    guarded("ferrocache_last_error", c"".as_ptr(), last_error_ptr)
}
