//! A fake CUDA runtime (`libcudart.so.13`, or `.12`), layered on the fake driver as NVIDIA's
//! runtime is layered on theirs: streams, events, captures and memory are the driver's, so a
//! stream PyTorch creates here is one ferrocache can record events on with `cuEventRecord`, a
//! capture begun here is seen by `cuStreamIsCapturing`, and `cudaMalloc` and `cuMemAlloc` draw
//! on one capacity. What the runtime adds is its own per-thread state: the current device and
//! the last error.
//!
//! Kernels launch and do nothing: a launch is work on its stream, booked by the driver
//! (`kernels.rs`). See `../README.md` for the whole picture and the knobs.
//!
//! Every export goes through [`api`], which turns a panic into `cudaErrorUnknown` (nothing may
//! unwind into PyTorch) and remembers a failure as the thread's last error.

#![allow(
    non_snake_case,
    non_camel_case_types,
    reason = "the exports carry the CUDA runtime's names"
)]
#![allow(
    clippy::missing_safety_doc,
    reason = "every export has the contract of the CUDA runtime function of the same name"
)]

/// A runtime function that is its driver function on the current device: the same arguments,
/// the driver's result (`api_on_device`: the device's context made current, the call counted by
/// the sweep, a failure kept as the last error).
macro_rules! forward_on_device {
    (fn $name:ident($($arg:ident: $type:ty),*) => $driver:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $type),*) -> $crate::CudaError {
            $crate::api_on_device(stringify!($name), |_| {
                // SAFETY: the arguments are the caller's, passed on to the driver function with
                // the same contract.
                $crate::check(unsafe { $crate::driver::$driver($($arg),*) })
            })
        }
    };
}

mod device;
mod driver;
mod errors;
mod kernels;
mod memory;
mod streams;

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

pub use errors::{cudaGetErrorName, cudaGetErrorString, cudaGetLastError, cudaPeekAtLastError};

/// `cudaError_t`. The fake driver's `CUresult` codes have the same numbers as the runtime codes
/// they become (out of memory 2, invalid device 101, not ready 600, ...), so driver failures
/// pass through unchanged.
pub type CudaError = u32;
pub const SUCCESS: CudaError = 0;
pub const INVALID_VALUE: CudaError = 1;
pub const MEMORY_ALLOCATION: CudaError = 2;
pub const INVALID_DEVICE: CudaError = 101;
pub const NO_KERNEL_IMAGE: CudaError = 209;
pub const NOT_READY: CudaError = 600;
pub const NOT_SUPPORTED: CudaError = 801;
pub const UNKNOWN: CudaError = 999;

/// What an export's body returns: `Err` carries the failure code.
type Outcome = Result<(), CudaError>;

thread_local! {
    /// The calling thread's current device, as `cudaSetDevice` left it (0 by default).
    static CURRENT_DEVICE: Cell<i32> = const { Cell::new(0) };
    /// The last failure on this thread, until `cudaGetLastError` reads and clears it.
    static LAST_ERROR: Cell<CudaError> = const { Cell::new(SUCCESS) };
}

/// Runs the body of the export `name`, catching panics and recording a failure as the last
/// error. The driver's fault sweep counts the call first, as it counts its own, and may fail it.
fn api(name: &'static str, body: impl FnOnce() -> Outcome) -> CudaError {
    // SAFETY: a string literal: it lives as long as this library, which is never unloaded.
    let injected = unsafe { driver::fake_cuda_sweep_runtime_call(name.as_ptr(), name.len()) };
    let code = if injected != SUCCESS {
        injected
    } else {
        match catch_unwind(AssertUnwindSafe(body)) {
            Ok(Ok(())) => SUCCESS,
            Ok(Err(code)) => code,
            Err(_) => UNKNOWN,
        }
    };
    // "Not ready" is an answer, not an error: the real runtime does not record it either.
    if code != SUCCESS && code != NOT_READY {
        LAST_ERROR.set(code);
    }
    code
}

/// Like [`api`], for the calls that work on the current device: makes its primary context
/// current on this thread first, as the runtime does implicitly.
fn api_on_device(name: &'static str, body: impl FnOnce(i32) -> Outcome) -> CudaError {
    api(name, || {
        let device = CURRENT_DEVICE.get();
        driver::enter(device)?;
        body(device)
    })
}

/// Writes a result through an out parameter, refusing NULL as the runtime does.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Outcome {
    if out.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: not NULL, and the caller promises it is valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

/// Writes through an optional out parameter: NULL means the caller does not want the value.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put_optional<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: not NULL, and the caller promises it is valid for writes.
        unsafe { out.write(value) };
    }
}

/// Turns a driver result into an outcome.
fn check(code: u32) -> Outcome {
    if code == SUCCESS { Ok(()) } else { Err(code) }
}

/// Whether `FAKE_CUDA_LOG` asks for a line per notable call on stderr.
fn logging() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FAKE_CUDA_LOG").is_some())
}

macro_rules! log {
    ($($arg:tt)*) => {
        if $crate::logging() {
            eprintln!("[fake-cudart] {}", format_args!($($arg)*));
        }
    };
}
pub(crate) use log;
