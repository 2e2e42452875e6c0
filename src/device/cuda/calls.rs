//! Calling the driver: each call under `catch_unwind`, its result as a [`DeviceError`], and the
//! sticky errors after which CUDA is unusable in the process (no more calls are made).

use super::super::{DeviceError, EventHandle, StreamId};
use super::sys;
use crate::logging;
use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::OnceLock;

/// The handles of the default streams: NULL and `CU_STREAM_LEGACY` (the legacy default stream)
/// and `CU_STREAM_PER_THREAD`.
pub(super) const DEFAULT_STREAM_HANDLES: StreamId = 2;

/// A `cudaStream_t` value as the driver's handle type; 0 is the legacy default stream.
pub(super) fn stream_handle(stream: StreamId) -> sys::CUstream {
    ptr::without_provenance_mut(stream as usize)
}

pub(super) fn event_handle(event: EventHandle) -> sys::CUevent {
    ptr::without_provenance_mut(event as usize)
}

/// Runs one driver call and returns the driver's code; a panic (which no driver function should
/// cause) becomes an error instead of unwinding.
pub(super) fn invoke(
    call: &'static str,
    driver_call: impl FnOnce() -> sys::CUresult,
) -> Result<sys::CUresult, DeviceError> {
    if let Some(why) = UNUSABLE.get() {
        // Every call would fail the same way: none is made, so nothing spins on a dead context.
        return Err(DeviceError::Unusable(why.clone()));
    }
    catch_unwind(AssertUnwindSafe(driver_call)).map_err(|_| {
        DeviceError::Unavailable(format!(
            "the CUDA driver call {call} could not be made (it panicked)"
        ))
    })
}

/// [`invoke`], then [`check`].
pub(super) fn check_call(
    call: &'static str,
    driver_call: impl FnOnce() -> sys::CUresult,
) -> Result<(), DeviceError> {
    check(call, invoke(call, driver_call)?)
}

/// Success is `Ok`; out of memory is [`DeviceError::OutOfMemory`], which the allocator answers
/// by freeing cached memory and retrying; anything else is a [`DeviceError::Driver`].
pub(super) fn check(call: &'static str, result: sys::CUresult) -> Result<(), DeviceError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(DeviceError::OutOfMemory),
        failure => Err(error(call, failure)),
    }
}

pub(super) fn error(call: &'static str, result: sys::CUresult) -> DeviceError {
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
pub(super) fn unavailable(what: &str, error: DeviceError) -> DeviceError {
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
