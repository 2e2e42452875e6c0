//! What one operation needs around its driver calls: the device's context made current
//! ([`ContextGuard`]) and relaxed stream-capture mode while a graph may be capturing
//! ([`RelaxedCaptureMode`]).

use super::super::{DeviceError, StreamId};
use super::calls::{check, check_call, invoke, stream_handle};
use super::sys;
use crate::logging;
use std::ptr;

/// Keeps a context current for its lifetime: pushes it if it was not current already, and pops
/// it again on drop, which puts back whatever the caller had (or nothing).
pub(super) struct ContextGuard {
    pushed: bool,
}

impl ContextGuard {
    pub(super) fn enter(context: sys::CUcontext) -> Result<ContextGuard, DeviceError> {
        let mut current: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local.
        check_call("cuCtxGetCurrent", || unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current == context {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: `context` is the retained primary context of our device.
        check_call("cuCtxPushCurrent_v2", || unsafe {
            sys::cuCtxPushCurrent_v2(context)
        })?;
        Ok(ContextGuard { pushed: true })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: sys::CUcontext = ptr::null_mut();
        // SAFETY: the out pointer is a live local; we pushed, so there is something to pop.
        let result = check_call("cuCtxPopCurrent_v2", || unsafe {
            sys::cuCtxPopCurrent_v2(&mut popped)
        });
        if let Err(e) = result {
            logging::device_error("could not restore the caller's CUDA context", &e);
        }
    }
}

/// Switches the calling thread to relaxed stream-capture mode for its lifetime.
pub(super) struct RelaxedCaptureMode {
    previous: u32,
}

impl RelaxedCaptureMode {
    pub(super) fn enter() -> Result<RelaxedCaptureMode, DeviceError> {
        let previous =
            exchange_capture_mode(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as u32)?;
        Ok(RelaxedCaptureMode { previous })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Err(e) = exchange_capture_mode(self.previous) {
            logging::device_error("could not restore the thread's stream capture mode", &e);
        }
    }
}

/// `cuThreadExchangeStreamCaptureMode`: sets `mode`, returns the previous one. Modes travel as
/// plain integers so that no value the driver writes is ever read as a Rust enum.
fn exchange_capture_mode(mode: u32) -> Result<u32, DeviceError> {
    let mut mode = mode;
    let mode_ptr = ptr::from_mut(&mut mode).cast::<sys::CUstreamCaptureMode>();
    // SAFETY: `mode_ptr` points at a live u32, the C enum's size; the driver reads and writes it.
    check_call("cuThreadExchangeStreamCaptureMode", || unsafe {
        sys::cuThreadExchangeStreamCaptureMode(mode_ptr)
    })?;
    Ok(mode)
}

/// Whether `stream` may be capturing a CUDA graph. A capture error from the query counts as
/// "maybe": the legacy stream answers so while another stream captures, exactly when relaxing
/// is needed, and relaxing the mode around one malloc is harmless anyway. Any other error fails
/// the allocation, as PyTorch's C10_CUDA_CHECK does (the stream handle is most likely bad).
pub(super) fn may_be_capturing(stream: StreamId) -> Result<bool, DeviceError> {
    let mut status: u32 = 0;
    let status_ptr = ptr::from_mut(&mut status).cast::<sys::CUstreamCaptureStatus>();
    // SAFETY: `status_ptr` points at a live u32, the C enum's size; read back as an integer.
    let result = invoke("cuStreamIsCapturing", || unsafe {
        sys::cuStreamIsCapturing(stream_handle(stream), status_ptr)
    })?;
    if is_capture_error(result) {
        return Ok(true);
    }
    check("cuStreamIsCapturing", result)?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32)
}

/// The errors that a stream capture under way causes (`CUDA_ERROR_STREAM_CAPTURE_*`).
fn is_capture_error(result: sys::CUresult) -> bool {
    (sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as u32
        ..=sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD as u32)
        .contains(&(result as u32))
}
