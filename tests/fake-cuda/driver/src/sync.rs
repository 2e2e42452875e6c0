//! Streams, events and stream capture, with work that stays pending (`work.rs`).
//!
//! Streams and events belong to the context current when they were made; an event can be
//! recorded only on a stream of its own context. Work submitted to a capturing stream is not
//! run: it becomes a node of the capture's graph, run when the graph is launched. The rules of
//! capture follow the CUDA Programming Guide ("Prohibited and Unhandled Operations",
//! "Invalidation"): synchronizing or querying a capturing stream, its context or an event
//! recorded in a capture is invalid and invalidates the capture; so is an unsafe call (such as
//! `cuMemFree`) while a capture is under way, unless the thread's capture mode allows it; and
//! the legacy default stream may not be used while a blocking stream of its context captures.
//! A stream waiting on an event recorded in a capture joins that capture, and must be joined
//! back before the capture ends. A stream can also be marked as capturing by a test
//! (`fake_cuda_set_capturing`).

use std::collections::HashSet;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::work::{Clock, Lane, Touch};
use crate::{
    CAPTURE_MODE, CUDA_ERROR_CAPTURED_EVENT, CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_READY,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CuResult, Driver,
    Outcome, call, current_context, get, lock, put,
};

/// The legacy default stream (`NULL` and `CU_STREAM_LEGACY`) and `CU_STREAM_PER_THREAD`.
const LEGACY_STREAMS: [usize; 2] = [0, 1];
const PER_THREAD_STREAM: usize = 2;
const STREAM_NON_BLOCKING: c_uint = 0x1;
pub const CAPTURE_MODE_GLOBAL: u32 = 0;
pub const CAPTURE_MODE_THREAD_LOCAL: u32 = 1;
pub const CAPTURE_MODE_RELAXED: u32 = 2;
const EVENT_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4;
const EVENT_DISABLE_TIMING: c_uint = 0x2;

#[derive(Default)]
pub struct Stream {
    priority: c_int,
    flags: c_uint,
    /// The context it was made in.
    context: usize,
    /// The capture it takes part in (its own, or one it joined through an event).
    capture: Option<u64>,
    /// How many `cuStreamWaitEvent` calls it received: a count, not a list, since a long run
    /// (the soak) makes one per step.
    waits: u64,
}

/// An ongoing stream capture.
pub struct Capture {
    mode: u32,
    /// The thread that began it (thread-local mode forbids unsafe calls on that thread only).
    thread: u64,
    /// The stream it was begun on.
    origin: usize,
    /// Set by an invalid operation: the capture can only be ended, with an error.
    invalidated: bool,
    /// Streams that joined and did work not yet joined back into the origin stream.
    unjoined: HashSet<usize>,
    nodes: Vec<Step>,
}

/// A piece of work: run at once on a stream, or kept in a graph.
#[derive(Clone, Copy)]
pub enum Node {
    Copy { dst: u64, src: u64, count: u64 },
    Set { dst: u64, value: u8, count: u64 },
}

/// What a stream or a graph holds: a copy or memset, or a kernel (or a library call, which is
/// kernels) that moves no bytes and touches what its arguments were seen to point into
/// (`launch.rs`).
#[derive(Clone)]
pub enum Step {
    Memory(Node),
    Kernel(std::sync::Arc<[Touch]>),
}

/// The priorities streams may have, as the driver reports them: lower numbers are higher
/// priorities, as on real GPUs.
const LEAST_PRIORITY: c_int = 0;
const GREATEST_PRIORITY: c_int = -5;
const CAPTURE_STATUS_NONE: u32 = 0;
const CAPTURE_STATUS_ACTIVE: u32 = 1;
const CAPTURE_STATUS_INVALIDATED: u32 = 2;

pub struct Event {
    /// Queries still to be answered with `CUDA_ERROR_NOT_READY`.
    busy_queries: u32,
    /// The context it was made in: it can be recorded only on that context's streams.
    context: usize,
    /// The work its last record follows (empty before any record: "complete").
    recorded: Clock,
    /// The capture it was last recorded in, if it was recorded on a capturing stream.
    captured: Option<u64>,
    /// The capturing stream it was last recorded on.
    captured_on: usize,
}

/// A number for the calling thread (per-thread default streams and thread-local captures).
pub fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

impl Driver {
    /// The lane a stream handle's work goes to; the default streams are those of the current
    /// context, which must exist.
    pub fn lane_of(&self, stream: *mut c_void) -> Result<Lane, CuResult> {
        match stream as usize {
            handle if LEGACY_STREAMS.contains(&handle) => Ok(Lane::Legacy(self.current_usable()?)),
            PER_THREAD_STREAM => Ok(Lane::PerThread(self.current_usable()?, thread_number())),
            handle if self.streams.contains_key(&handle) => Ok(Lane::Created(handle)),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    /// The calling thread's current context, which must be a retained primary context.
    fn current_usable(&self) -> Result<usize, CuResult> {
        self.require_primary_context()?;
        Ok(current_context())
    }

    fn context_of_lane(&self, lane: Lane) -> usize {
        match lane {
            Lane::Created(handle) => self.streams.get(&handle).map_or(0, |s| s.context),
            Lane::Legacy(context) | Lane::PerThread(context, _) => context,
        }
    }

    /// The capture `stream` takes part in, if any.
    fn capture_of(&self, stream: *mut c_void) -> Option<u64> {
        self.streams.get(&(stream as usize)).and_then(|s| s.capture)
    }

    /// Whether a capture is under way that forbids the calling thread "unsafe" calls such as
    /// `cuMemAlloc` and `cuMemFree`: a global-mode capture on any thread, or a thread-local one
    /// on this thread, unless this thread is in relaxed mode.
    pub fn unsafe_call_forbidden(&self) -> bool {
        if thread_capture_mode() == CAPTURE_MODE_RELAXED {
            return false;
        }
        let me = thread_number();
        self.captures.values().any(|c| {
            c.mode == CAPTURE_MODE_GLOBAL || (c.mode == CAPTURE_MODE_THREAD_LOCAL && c.thread == me)
        })
    }

    /// An unsafe call made while a capture forbids it: refused, and every capture it broke is
    /// invalidated, as the driver does.
    pub fn refuse_unsafe_call(&mut self) -> CuResult {
        let me = thread_number();
        for capture in self.captures.values_mut() {
            if capture.mode == CAPTURE_MODE_GLOBAL
                || (capture.mode == CAPTURE_MODE_THREAD_LOCAL && capture.thread == me)
            {
                capture.invalidated = true;
            }
        }
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    }

    /// Legacy-stream use while a blocking stream of the context captures: refused, and that
    /// capture invalidated.
    fn check_legacy_use(&mut self, lane: Lane) -> Outcome {
        let Lane::Legacy(context) = lane else {
            return Ok(());
        };
        let blocking_captures: Vec<u64> = self
            .streams
            .values()
            .filter(|s| s.context == context && s.flags & STREAM_NON_BLOCKING == 0)
            .filter_map(|s| s.capture)
            .collect();
        if blocking_captures.is_empty() {
            return Ok(());
        }
        for id in blocking_captures {
            self.invalidate(id);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    }

    fn invalidate(&mut self, id: u64) {
        if let Some(capture) = self.captures.get_mut(&id) {
            capture.invalidated = true;
        }
    }

    /// Synchronizing or querying `stream`: invalid while it captures (the capture is
    /// invalidated); otherwise its lane.
    fn lane_to_synchronize(&mut self, stream: *mut c_void) -> Result<Lane, CuResult> {
        let lane = self.lane_of(stream)?;
        self.check_legacy_use(lane)?;
        if let Some(id) = self.capture_of(stream) {
            self.invalidate(id);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(lane)
    }

    /// Submits one piece of work to `stream`: kept in the graph of the capture it takes part
    /// in, or run now and booked as pending work of its stream. Each device side must already
    /// have been checked.
    pub fn submit(&mut self, stream: *mut c_void, node: Node, what: &str) -> Outcome {
        self.submit_step(stream, Step::Memory(node), what)
    }

    /// [`Driver::submit`] for any step, a kernel's included.
    pub fn submit_step(&mut self, stream: *mut c_void, step: Step, what: &str) -> Outcome {
        let lane = self.lane_of(stream)?;
        self.check_legacy_use(lane)?;
        if let Some(id) = self.capture_of(stream) {
            let capture = self
                .captures
                .get_mut(&id)
                .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
            if capture.invalidated {
                return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            capture.nodes.push(step);
            if stream as usize != capture.origin {
                capture.unjoined.insert(stream as usize);
            }
            return Ok(());
        }
        match step {
            Step::Memory(node) => self.run(lane, node, what),
            Step::Kernel(touches) => {
                let live = self.live_kernel_touches(&touches);
                self.timeline.counts.kernels += 1;
                self.timeline.submit(lane, &live, what);
                Ok(())
            }
        }
    }

    /// Runs `node` on `lane`: checks its device sides, books it, moves the bytes.
    fn run(&mut self, lane: Lane, node: Node, what: &str) -> Outcome {
        let touches = self.touches(node)?;
        self.timeline.submit(lane, &touches, what);
        // SAFETY: every device side was just checked to lie in live, accessible device memory
        // (= host memory); host sides are the caller's promise, as with the real driver.
        unsafe {
            match node {
                Node::Copy { dst, src, count } => {
                    std::ptr::copy(src as *const u8, dst as *mut u8, count as usize)
                }
                Node::Set { dst, value, count } => {
                    std::ptr::write_bytes(dst as *mut u8, value, count as usize)
                }
            }
        }
        Ok(())
    }

    /// The device ranges `node` touches; a device side that is not wholly live, accessible
    /// device memory is an illegal address (what a graph launched after its memory was freed
    /// meets).
    fn touches(&self, node: Node) -> Result<Vec<Touch>, CuResult> {
        let sides = match node {
            Node::Copy { dst, src, count } => vec![(dst, count, true), (src, count, false)],
            Node::Set { dst, count, .. } => vec![(dst, count, true)],
        };
        let mut touches = Vec::new();
        for (start, len, write) in sides {
            if self.is_device_address(start) {
                self.check_device_range(start, len).map_err(|code| {
                    if code == CUDA_ERROR_ILLEGAL_ADDRESS {
                        code
                    } else {
                        crate::vmm::illegal_address(start, len, "not live device memory")
                    }
                })?;
                touches.push(Touch { start, len, write });
            }
        }
        Ok(touches)
    }

    fn event_mut(&mut self, event: *mut c_void) -> Result<&mut Event, CuResult> {
        self.events
            .get_mut(&(event as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Querying or synchronizing an event recorded in a capture is invalid (the capture is
    /// invalidated); otherwise what its record follows.
    fn recorded_clock(&mut self, event: *mut c_void) -> Result<Clock, CuResult> {
        let event = self.event_mut(event)?;
        if let Some(id) = event.captured {
            self.invalidate(id);
            return Err(CUDA_ERROR_CAPTURED_EVENT);
        }
        Ok(event.recorded.clone())
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
    let context = driver.current_usable()?;
    if flags > STREAM_NON_BLOCKING || stream.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let handle = driver.new_handle() as usize;
    let new = Stream {
        priority,
        flags,
        context,
        ..Stream::default()
    };
    driver.streams.insert(handle, new);
    let blocking = flags & STREAM_NON_BLOCKING == 0;
    driver.timeline.stream_created(handle, context, blocking);
    // SAFETY: `stream` was checked non-NULL; the caller promises it is writable.
    unsafe { put(stream, handle as *mut c_void) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetPriority(
    stream: *mut c_void,
    priority: *mut c_int,
) -> CuResult {
    call("cuStreamGetPriority", |driver| {
        driver.lane_of(stream)?;
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
        driver.lane_of(stream)?;
        let value = driver
            .streams
            .get(&(stream as usize))
            .map_or(0, |s| s.flags);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(flags, value) }
    })
}

/// The context a stream belongs to: its creator's, or for a default stream the current one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(
    stream: *mut c_void,
    context: *mut *mut c_void,
) -> CuResult {
    call("cuStreamGetCtx", |driver| {
        let lane = driver.lane_of(stream)?;
        let owner = driver.context_of_lane(lane);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(context, owner as *mut c_void) }
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

/// Destroys the handle; work already submitted still runs (the driver releases the stream
/// once it is done), so its lane stays in the books.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CuResult {
    call("cuStreamDestroy_v2", |driver| {
        let removed = driver
            .streams
            .remove(&(stream as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(id) = removed.capture {
            driver.invalidate(id);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CuResult {
    call("cuStreamSynchronize", |driver| {
        let lane = driver.lane_to_synchronize(stream)?;
        driver.timeline.lane_finished(lane);
        Ok(())
    })
}

/// Work here is never found still running by a query: the host learns it finished.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(stream: *mut c_void) -> CuResult {
    call("cuStreamQuery", |driver| {
        let lane = driver.lane_to_synchronize(stream)?;
        driver.timeline.lane_finished(lane);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, status: *mut u32) -> CuResult {
    call("cuStreamIsCapturing", |driver| {
        let lane = driver.lane_of(stream)?;
        driver.check_legacy_use(lane)?;
        let state = capture_status(driver, stream);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(status, state) }
    })
}

fn capture_status(driver: &Driver, stream: *mut c_void) -> u32 {
    match driver
        .capture_of(stream)
        .and_then(|id| driver.captures.get(&id))
    {
        None => CAPTURE_STATUS_NONE,
        Some(capture) if capture.invalidated => CAPTURE_STATUS_INVALIDATED,
        Some(_) => CAPTURE_STATUS_ACTIVE,
    }
}

/// The original three-argument form, which the real driver still exports.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    stream: *mut c_void,
    status: *mut u32,
    id: *mut u64,
) -> CuResult {
    call("cuStreamGetCaptureInfo", |driver| {
        let lane = driver.lane_of(stream)?;
        driver.check_legacy_use(lane)?;
        let state = capture_status(driver, stream);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(status, state) }?;
        // The id is optional, and only meaningful while capturing.
        if let (Some(capture), false) = (driver.capture_of(stream), id.is_null()) {
            // SAFETY: not NULL, and writable by the driver API contract.
            unsafe { put(id, capture) }?;
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
        begin_capture(driver, stream as usize, mode)
    })
}

fn begin_capture(driver: &mut Driver, stream: usize, mode: u32) -> Outcome {
    let id = driver.new_handle();
    // The legacy default stream cannot be captured.
    let target = driver
        .streams
        .get_mut(&stream)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if target.capture.is_some() {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    target.capture = Some(id);
    let capture = Capture {
        mode,
        thread: thread_number(),
        origin: stream,
        invalidated: false,
        unjoined: HashSet::new(),
        nodes: Vec::new(),
    };
    driver.captures.insert(id, capture);
    Ok(())
}

/// Ends the capture begun on `stream`: every stream that joined it leaves it. The graph holds
/// the captured work; an invalidated or unjoined capture gives an error and no graph.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    graph: *mut *mut c_void,
) -> CuResult {
    call("cuStreamEndCapture", |driver| {
        let id = driver.capture_of(stream).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        let origin = driver.captures.get(&id).map(|c| c.origin);
        if origin != Some(stream as usize) {
            // Only the stream that began a capture can end it; this one joined it.
            driver.invalidate(id);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
        }
        let capture = driver
            .captures
            .remove(&id)
            .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
        for s in driver.streams.values_mut() {
            if s.capture == Some(id) {
                s.capture = None;
            }
        }
        if capture.invalidated {
            // SAFETY: an out pointer from the caller; NULL, as the driver leaves it.
            let _ = unsafe { put(graph, std::ptr::null_mut()) };
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        if !capture.unjoined.is_empty() {
            // SAFETY: as above.
            let _ = unsafe { put(graph, std::ptr::null_mut()) };
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
        }
        let handle = driver.new_handle() as usize;
        driver.graphs.insert(handle, capture.nodes);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(graph, handle as *mut c_void) }
    })
}

/// Later work on `stream` runs after what the event's record follows; the event may be of
/// another context. Waiting on an event recorded in a capture joins that capture (or, for a
/// stream of the capture, joins the event's stream back into it).
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> CuResult {
    call("cuStreamWaitEvent", |driver| {
        let lane = driver.lane_of(stream)?;
        driver.check_legacy_use(lane)?;
        if flags > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (recorded, captured, captured_on) = {
            let event = driver.event_mut(event)?;
            (event.recorded.clone(), event.captured, event.captured_on)
        };
        if let Some(id) = captured {
            let Some(s) = driver.streams.get_mut(&(stream as usize)) else {
                // The default streams cannot join a capture.
                driver.invalidate(id);
                return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
            };
            s.waits += 1;
            match s.capture {
                None => s.capture = Some(id),
                Some(own) if own == id => {
                    if let Some(capture) = driver.captures.get_mut(&id) {
                        capture.unjoined.remove(&captured_on);
                    }
                }
                Some(_) => return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
            }
            return Ok(());
        }
        if driver.capture_of(stream).is_none() {
            driver.timeline.wait(lane, &recorded);
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
        let context = driver.current_usable()?;
        if flags & !EVENT_FLAGS_ALL != 0 || event.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if flags & EVENT_DISABLE_TIMING == 0 {
            driver.timed_events += 1;
        }
        let handle = driver.new_handle() as usize;
        let new = Event {
            busy_queries: 0,
            context,
            recorded: Clock::default(),
            captured: None,
            captured_on: 0,
        };
        driver.events.insert(handle, new);
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

/// Records what `stream`'s work so far follows. The event and the stream must belong to one
/// context (`CUDA_ERROR_INVALID_HANDLE` otherwise, as the driver answers).
#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CuResult {
    call("cuEventRecord", |driver| {
        let lane = driver.lane_of(stream)?;
        driver.check_legacy_use(lane)?;
        let stream_context = driver.context_of_lane(lane);
        if driver.event_mut(event)?.context != stream_context {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let captured = driver.capture_of(stream);
        if let Some(id) = captured
            && driver.captures.get(&id).is_none_or(|c| c.invalidated)
        {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let recorded = if captured.is_some() {
            Clock::default()
        } else {
            driver.timeline.clock_of(lane)
        };
        let delay = driver.event_delay;
        let target = driver.event_mut(event)?;
        target.busy_queries = delay;
        target.recorded = recorded;
        target.captured = captured;
        target.captured_on = stream as usize;
        Ok(())
    })
}

/// "Not ready" for the first `FAKE_LIBCUDA_EVENT_DELAY` queries after a record; then done, and
/// the host knows that the work the record follows has finished.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(event: *mut c_void) -> CuResult {
    call("cuEventQuery", |driver| {
        let recorded = driver.recorded_clock(event)?;
        let target = driver.event_mut(event)?;
        if target.busy_queries > 0 {
            target.busy_queries -= 1;
            return Err(CUDA_ERROR_NOT_READY);
        }
        driver.timeline.finished(&recorded);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(event: *mut c_void) -> CuResult {
    call("cuEventSynchronize", |driver| {
        let recorded = driver.recorded_clock(event)?;
        driver.event_mut(event)?.busy_queries = 0;
        driver.timeline.finished(&recorded);
        Ok(())
    })
}

/// `cuCtxSynchronize`: every stream of the current context has finished its work; invalid
/// while one of them captures.
pub fn synchronize_context(driver: &mut Driver) -> Outcome {
    let context = driver.current_usable()?;
    let capturing: Vec<u64> = driver
        .streams
        .values()
        .filter(|s| s.context == context)
        .filter_map(|s| s.capture)
        .collect();
    if !capturing.is_empty() {
        for id in capturing {
            driver.invalidate(id);
        }
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    driver.timeline.context_finished(context);
    Ok(())
}

// ---- Graphs --------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: u64,
) -> CuResult {
    call("cuGraphInstantiateWithFlags", |driver| {
        let nodes = driver
            .graphs
            .get(&(graph as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .clone();
        let handle = driver.new_handle() as usize;
        driver.graph_execs.insert(handle, nodes);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(exec, handle as *mut c_void) }
    })
}

/// Runs the graph's work on `stream`, each node checked and booked as when it was captured; a
/// node whose memory is no longer there is an illegal address, as on a GPU.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> CuResult {
    call("cuGraphLaunch", |driver| {
        let nodes = driver
            .graph_execs
            .get(&(exec as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .clone();
        for node in nodes {
            driver.submit_step(stream, node, "a graph's node")?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphGetNodes(
    graph: *mut c_void,
    nodes: *mut *mut c_void,
    count: *mut usize,
) -> CuResult {
    call("cuGraphGetNodes", |driver| {
        let len = driver
            .graphs
            .get(&(graph as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .len();
        if !nodes.is_null() {
            // Node handles are never used by the callers this fake serves.
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(count, len) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(graph: *mut c_void) -> CuResult {
    call("cuGraphDestroy", |driver| {
        driver
            .graphs
            .remove(&(graph as usize))
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: *mut c_void) -> CuResult {
    call("cuGraphExecDestroy", |driver| {
        driver
            .graph_execs
            .remove(&(exec as usize))
            .map(drop)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

// ---- Test-only exports -------------------------------------------------------------------

/// Marks a stream made by `cuStreamCreate` as capturing (`on != 0`, in global mode) or not.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_capturing(stream: *mut c_void, on: c_int) -> CuResult {
    let mut driver = lock();
    let handle = stream as usize;
    let Some(current) = driver.streams.get(&handle).map(|s| s.capture) else {
        return CUDA_ERROR_INVALID_HANDLE;
    };
    if let Some(id) = current {
        driver.captures.remove(&id);
        if let Some(s) = driver.streams.get_mut(&handle) {
            s.capture = None;
        }
    }
    if on != 0 && begin_capture(&mut driver, handle, CAPTURE_MODE_GLOBAL).is_err() {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    crate::CUDA_SUCCESS
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
