//! The runtime's error names and texts, and the per-thread last error.

use std::ffi::{CStr, c_char};

use crate::{CudaError, LAST_ERROR, SUCCESS};

/// Name and description of each code the fake runtime returns, as NVIDIA's runtime spells them.
const ERROR_TEXTS: &[(CudaError, &CStr, &CStr)] = &[
    (0, c"cudaSuccess", c"no error"),
    (1, c"cudaErrorInvalidValue", c"invalid argument"),
    (2, c"cudaErrorMemoryAllocation", c"out of memory"),
    (3, c"cudaErrorInitializationError", c"initialization error"),
    (
        100,
        c"cudaErrorNoDevice",
        c"no CUDA-capable device is detected",
    ),
    (101, c"cudaErrorInvalidDevice", c"invalid device ordinal"),
    (
        201,
        c"cudaErrorDeviceUninitialized",
        c"invalid device context",
    ),
    (
        209,
        c"cudaErrorNoKernelImageForDevice",
        c"no kernel image is available for execution on the device (the fake CUDA runs no kernels)",
    ),
    (
        400,
        c"cudaErrorInvalidResourceHandle",
        c"invalid resource handle",
    ),
    (
        401,
        c"cudaErrorIllegalState",
        c"the operation cannot be performed in the present state",
    ),
    (500, c"cudaErrorSymbolNotFound", c"named symbol not found"),
    (600, c"cudaErrorNotReady", c"device not ready"),
    (
        700,
        c"cudaErrorIllegalAddress",
        c"an illegal memory access was encountered",
    ),
    (
        704,
        c"cudaErrorPeerAccessAlreadyEnabled",
        c"peer access is already enabled",
    ),
    (
        705,
        c"cudaErrorPeerAccessNotEnabled",
        c"peer access has not been enabled",
    ),
    (801, c"cudaErrorNotSupported", c"operation not supported"),
    (
        900,
        c"cudaErrorStreamCaptureUnsupported",
        c"operation not permitted when stream is capturing",
    ),
    (
        901,
        c"cudaErrorStreamCaptureInvalidated",
        c"operation failed due to a previous error during capture",
    ),
    (
        904,
        c"cudaErrorStreamCaptureUnjoined",
        c"capture was not joined to the origin stream",
    ),
    (
        906,
        c"cudaErrorStreamCaptureImplicit",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        907,
        c"cudaErrorCapturedEvent",
        c"operation not permitted on an event last recorded in a capturing stream",
    ),
    (999, c"cudaErrorUnknown", c"unknown error"),
];

fn error_text(code: CudaError) -> Option<(&'static CStr, &'static CStr)> {
    ERROR_TEXTS
        .iter()
        .find(|(known, _, _)| *known == code)
        .map(|(_, name, text)| (*name, *text))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetErrorName(code: CudaError) -> *const c_char {
    error_text(code).map_or(c"cudaErrorUnknown".as_ptr(), |(name, _)| name.as_ptr())
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetErrorString(code: CudaError) -> *const c_char {
    error_text(code).map_or(c"unrecognized error code".as_ptr(), |(_, text)| {
        text.as_ptr()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetLastError() -> CudaError {
    LAST_ERROR.replace(SUCCESS)
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaPeekAtLastError() -> CudaError {
    LAST_ERROR.get()
}
