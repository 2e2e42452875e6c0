//! Streams, events and stream capture. Work completes at once; events can be made to look busy
//! for a few queries (`fake_cuda_set_event_delay`), and a stream can be marked as capturing
//! (`fake_cuda_set_capturing`) to exercise the allocator's graph-capture path.

use std::ffi::{c_int, c_uint, c_void};

use crate::{
    CAPTURE_MODE, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, CuResult, Driver, Outcome, call,
    get, lock, put,
};

/// The legacy default stream, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: always valid.
const BUILT_IN_STREAMS: [usize; 3] = [0, 1, 2];
pub const CAPTURE_MODE_RELAXED: u32 = 2;
const EVENT_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4;
const EVENT_DISABLE_TIMING: c_uint = 0x2;

#[derive(Default)]
pub struct Stream {
    priority: c_int,
    flags: c_uint,
    capture: Option<Capture>,
    /// How many `cuStreamWaitEvent` calls it received: a count, not a list, since a long run
    /// (the soak) makes one per step.
    waits: u64,
}

/// An ongoing stream capture.
#[derive(Clone, Copy)]
struct Capture {
    id: u64,
    mode: u32,
}

/// The priorities streams may have, as the driver reports them: lower numbers are higher
/// priorities, as on real GPUs.
const LEAST_PRIORITY: c_int = 0;
const GREATEST_PRIORITY: c_int = -5;
const CAPTURE_STATUS_NONE: u32 = 0;
const CAPTURE_STATUS_ACTIVE: u32 = 1;

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

    /// Whether a capture is under way whose mode forbids "unsafe" calls such as `cuMemAlloc`
    /// on other threads and streams (every mode but relaxed).
    pub fn any_stream_capturing(&self) -> bool {
        self.streams.values().any(|stream| {
            stream
                .capture
                .is_some_and(|capture| capture.mode != CAPTURE_MODE_RELAXED)
        })
    }

    fn stream_mut(&mut self, stream: *mut c_void) -> Result<&mut Stream, CuResult> {
        self.streams
            .get_mut(&(stream as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    fn capture_of(&self, stream: *mut c_void) -> Option<Capture> {
        self.streams.get(&(stream as usize)).and_then(|s| s.capture)
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
        // SAFETY: forwarded from the caller, who promises a writable handle.
        unsafe { create_stream(driver, stream, flags, LEAST_PRIORITY) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut *mut c_void,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    call("cuStreamCreateWithPriority", |driver| {
        // Out-of-range priorities are clamped, as the driver does.
        let priority = priority.clamp(GREATEST_PRIORITY, LEAST_PRIORITY);
        // SAFETY: forwarded from the caller, who promises a writable handle.
        unsafe { create_stream(driver, stream, flags, priority) }
    })
}

/// # Safety
/// `stream` is NULL or valid for a write.
unsafe fn create_stream(
    driver: &mut Driver,
    stream: *mut *mut c_void,
    flags: c_uint,
    priority: c_int,
) -> Outcome {
    driver.require_primary_context()?;
    if flags > 1 || stream.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let handle = driver.new_handle() as usize;
    let new = Stream {
        priority,
        flags,
        ..Stream::default()
    };
    driver.streams.insert(handle, new);
    // SAFETY: `stream` was checked non-NULL; the caller promises it is writable.
    unsafe { put(stream, handle as *mut c_void) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetPriority(
    stream: *mut c_void,
    priority: *mut c_int,
) -> CuResult {
    call("cuStreamGetPriority", |driver| {
        driver.check_stream(stream)?;
        let value = driver
            .streams
            .get(&(stream as usize))
            .map_or(LEAST_PRIORITY, |s| s.priority);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(priority, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetFlags(stream: *mut c_void, flags: *mut c_uint) -> CuResult {
    call("cuStreamGetFlags", |driver| {
        driver.check_stream(stream)?;
        let value = driver
            .streams
            .get(&(stream as usize))
            .map_or(0, |s| s.flags);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(flags, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CuResult {
    call("cuCtxGetStreamPriorityRange", |driver| {
        driver.require_primary_context()?;
        // Both out parameters are optional.
        if !least.is_null() {
            // SAFETY: not NULL, and writable by the driver API contract.
            unsafe { put(least, LEAST_PRIORITY) }?;
        }
        if !greatest.is_null() {
            // SAFETY: as above.
            unsafe { put(greatest, GREATEST_PRIORITY) }?;
        }
        Ok(())
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
        let capturing = driver.capture_of(stream).is_some();
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(status, u32::from(capturing)) }
    })
}

/// The original three-argument form, which the real driver still exports.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    stream: *mut c_void,
    status: *mut u32,
    id: *mut u64,
) -> CuResult {
    call("cuStreamGetCaptureInfo", |driver| {
        driver.check_stream(stream)?;
        let capture = driver.capture_of(stream);
        let state = if capture.is_some() {
            CAPTURE_STATUS_ACTIVE
        } else {
            CAPTURE_STATUS_NONE
        };
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(status, state) }?;
        // The id is optional, and only meaningful while capturing.
        if let (Some(capture), false) = (capture, id.is_null()) {
            // SAFETY: not NULL, and writable by the driver API contract.
            unsafe { put(id, capture.id) }?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, mode: u32) -> CuResult {
    call("cuStreamBeginCapture_v2", |driver| {
        if mode > CAPTURE_MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = driver.new_handle();
        // The legacy default stream cannot be captured.
        let target = driver.stream_mut(stream)?;
        if target.capture.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        target.capture = Some(Capture { id, mode });
        Ok(())
    })
}

/// Ends the capture; the graph handle is a fresh number (the fake records no graph nodes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    graph: *mut *mut c_void,
) -> CuResult {
    call("cuStreamEndCapture", |driver| {
        let handle = driver.new_handle() as usize;
        let target = driver.stream_mut(stream)?;
        target
            .capture
            .take()
            .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(graph, handle as *mut c_void) }
    })
}

/// Work completes at once here, so waiting only checks the handles and remembers the order
/// (`fake_cuda_stream_waits`).
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> CuResult {
    call("cuStreamWaitEvent", |driver| {
        driver.check_stream(stream)?;
        driver.event_mut(event)?;
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(s) = driver.streams.get_mut(&(stream as usize)) {
            s.waits += 1;
        }
        Ok(())
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

/// Marks a stream made by `cuStreamCreate` as capturing (`on != 0`, in global mode) or not.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_capturing(stream: *mut c_void, on: c_int) -> CuResult {
    let mut driver = lock();
    let id = driver.new_handle();
    match driver.streams.get_mut(&(stream as usize)) {
        Some(s) => {
            s.capture = (on != 0).then_some(Capture { id, mode: 0 });
            crate::CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

/// How many `cuStreamWaitEvent` calls `stream` has received.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_stream_waits(stream: *mut c_void) -> i64 {
    lock()
        .streams
        .get(&(stream as usize))
        .map_or(-1, |s| s.waits as i64)
}

/// The calling thread's stream-capture mode (0 global, 1 thread-local, 2 relaxed).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_capture_mode() -> u32 {
    thread_capture_mode()
}
