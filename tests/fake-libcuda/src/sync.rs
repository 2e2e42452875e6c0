//! Streams, events and stream capture. Work completes at once; events can be made to look busy
//! for a few queries (`fake_cuda_set_event_delay`), and a stream can be marked as capturing
//! (`fake_cuda_set_capturing`) to exercise the allocator's graph-capture path.

use std::ffi::{c_int, c_uint, c_void};

use crate::{
    CAPTURE_MODE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY,
    CuResult, Driver, Outcome, call, get, lock, put,
};

/// The legacy default stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: always valid.
const BUILT_IN_STREAMS: [usize; 3] = [0, 1, 2];
pub const CAPTURE_MODE_RELAXED: u32 = 2;
const EVENT_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4;
const EVENT_DISABLE_TIMING: c_uint = 0x2;

#[derive(Default)]
pub struct Stream {
    capturing: bool,
}

pub struct Event {
    /// Queries still to be answered with `CUDA_ERROR_NOT_READY`.
    busy_queries: u32,
}

impl Driver {
    fn check_stream(&self, stream: *mut c_void) -> Outcome {
        let stream = stream as usize;
        if BUILT_IN_STREAMS.contains(&stream) || self.streams.contains_key(&stream) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }

    pub fn any_stream_capturing(&self) -> bool {
        self.streams.values().any(|stream| stream.capturing)
    }

    fn event_mut(&mut self, event: *mut c_void) -> Result<&mut Event, CuResult> {
        self.events
            .get_mut(&(event as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
}

pub fn thread_capture_mode() -> u32 {
    CAPTURE_MODE.get()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) -> CuResult {
    call("cuStreamCreate", |driver| {
        driver.require_primary_context()?;
        if flags > 1 || stream.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = driver.new_handle() as usize;
        driver.streams.insert(handle, Stream::default());
        // SAFETY: `stream` was checked non-NULL; the caller promises it is writable.
        unsafe { put(stream, handle as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CuResult {
    call("cuStreamDestroy_v2", |driver| {
        driver
            .streams
            .remove(&(stream as usize))
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CuResult {
    call("cuStreamSynchronize", |driver| driver.check_stream(stream))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(stream: *mut c_void) -> CuResult {
    call("cuStreamQuery", |driver| driver.check_stream(stream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, status: *mut u32) -> CuResult {
    call("cuStreamIsCapturing", |driver| {
        driver.check_stream(stream)?;
        let capturing = driver
            .streams
            .get(&(stream as usize))
            .is_some_and(|s| s.capturing);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(status, u32::from(capturing)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> CuResult {
    call("cuThreadExchangeStreamCaptureMode", |_| {
        // SAFETY: an in/out pointer from the caller, valid by the driver API contract.
        let wanted = unsafe { get(mode) }?;
        if wanted > CAPTURE_MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let previous = CAPTURE_MODE.replace(wanted);
        // SAFETY: as above.
        unsafe { put(mode, previous) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, flags: c_uint) -> CuResult {
    call("cuEventCreate", |driver| {
        driver.require_primary_context()?;
        if flags & !EVENT_FLAGS_ALL != 0 || event.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if flags & EVENT_DISABLE_TIMING == 0 {
            driver.timed_events += 1;
        }
        let handle = driver.new_handle() as usize;
        driver.events.insert(handle, Event { busy_queries: 0 });
        // SAFETY: `event` was checked non-NULL; the caller promises it is writable.
        unsafe { put(event, handle as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CuResult {
    call("cuEventDestroy_v2", |driver| {
        driver
            .events
            .remove(&(event as usize))
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CuResult {
    call("cuEventRecord", |driver| {
        driver.check_stream(stream)?;
        let delay = driver.event_delay;
        driver.event_mut(event)?.busy_queries = delay;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CuResult {
    call("cuEventQuery", |driver| {
        let event = driver.event_mut(event)?;
        if event.busy_queries > 0 {
            event.busy_queries -= 1;
            return Err(CUDA_ERROR_NOT_READY);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(event: *mut c_void) -> CuResult {
    call("cuEventSynchronize", |driver| {
        driver.event_mut(event)?.busy_queries = 0;
        Ok(())
    })
}

/// Marks a stream made by `cuStreamCreate` as capturing (`on != 0`) or not.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_capturing(stream: *mut c_void, on: c_int) -> CuResult {
    match lock().streams.get_mut(&(stream as usize)) {
        Some(s) => {
            s.capturing = on != 0;
            crate::CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

/// The calling thread's stream-capture mode (0 global, 1 thread-local, 2 relaxed).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_capture_mode() -> u32 {
    thread_capture_mode()
}
