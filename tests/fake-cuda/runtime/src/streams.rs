//! Streams, events, stream capture and CUDA graphs: the driver's streams and events under the
//! runtime's names. Work completes at once; an event can look busy for a few queries
//! (`FAKE_LIBCUDA_EVENT_DELAY`, a driver knob). A captured graph has no nodes and launching it
//! does nothing.

use std::ffi::{c_int, c_uint, c_void};

use crate::driver::{self, CuEvent, CuStream};
use crate::{CudaError, Outcome, api, api_on_device, check, put, put_optional};

/// What the runtime's stream priority range is: the driver's.
const DEFAULT_PRIORITY: c_int = 0;

fn create_stream(stream: *mut CuStream, flags: c_uint, priority: c_int) -> Outcome {
    // SAFETY: forwarded out pointer; the driver checks it and the flags.
    check(unsafe { driver::cuStreamCreateWithPriority(stream, flags, priority) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamCreate(stream: *mut CuStream) -> CudaError {
    api_on_device("cudaStreamCreate", |_| {
        create_stream(stream, 0, DEFAULT_PRIORITY)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamCreateWithFlags(
    stream: *mut CuStream,
    flags: c_uint,
) -> CudaError {
    api_on_device("cudaStreamCreateWithFlags", |_| {
        create_stream(stream, flags, DEFAULT_PRIORITY)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamCreateWithPriority(
    stream: *mut CuStream,
    flags: c_uint,
    priority: c_int,
) -> CudaError {
    api_on_device("cudaStreamCreateWithPriority", |_| {
        create_stream(stream, flags, priority)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaStreamDestroy(stream: CuStream) -> CudaError {
    // SAFETY: plain driver call; the driver checks the handle.
    api("cudaStreamDestroy", || {
        check(unsafe { driver::cuStreamDestroy_v2(stream) })
    })
}

forward_on_device!(fn cudaStreamSynchronize(stream: CuStream) => cuStreamSynchronize);

forward_on_device!(fn cudaStreamQuery(stream: CuStream) => cuStreamQuery);

forward_on_device!(fn cudaStreamWaitEvent(stream: CuStream, event: CuEvent, flags: c_uint) => cuStreamWaitEvent);

forward_on_device!(fn cudaStreamGetPriority(stream: CuStream, priority: *mut c_int) => cuStreamGetPriority);

forward_on_device!(fn cudaStreamGetFlags(stream: CuStream, flags: *mut c_uint) => cuStreamGetFlags);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaLaunchHostFunc(
    _stream: CuStream,
    function: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CudaError {
    api("cudaLaunchHostFunc", || {
        let function = function.ok_or(crate::INVALID_VALUE)?;
        // SAFETY: the caller's callback with the caller's data; the stream's work is done.
        unsafe { function(data) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamAddCallback(
    stream: CuStream,
    callback: Option<unsafe extern "C" fn(CuStream, CudaError, *mut c_void)>,
    data: *mut c_void,
    _flags: c_uint,
) -> CudaError {
    api("cudaStreamAddCallback", || {
        let callback = callback.ok_or(crate::INVALID_VALUE)?;
        // SAFETY: the caller's callback with the caller's data; the stream's work is done.
        unsafe { callback(stream, crate::SUCCESS, data) };
        Ok(())
    })
}

// ---- Capture -------------------------------------------------------------------------------

forward_on_device!(fn cudaStreamBeginCapture(stream: CuStream, mode: u32) => cuStreamBeginCapture_v2);

forward_on_device!(fn cudaStreamEndCapture(stream: CuStream, graph: *mut *mut c_void) => cuStreamEndCapture);

forward_on_device!(fn cudaStreamIsCapturing(stream: CuStream, status: *mut u32) => cuStreamIsCapturing);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaThreadExchangeStreamCaptureMode(mode: *mut u32) -> CudaError {
    // The mode is per thread in the driver, so the runtime and ferrocache see the same one.
    // SAFETY: forwarded in/out pointer.
    api("cudaThreadExchangeStreamCaptureMode", || {
        check(unsafe { driver::cuThreadExchangeStreamCaptureMode(mode) })
    })
}

/// Status and id of `stream`'s capture, and an empty dependency set: the fake's graphs have
/// no nodes.
///
/// # Safety
/// Each pointer is NULL or valid for a write.
unsafe fn capture_info(
    stream: CuStream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    dependencies: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> Outcome {
    let mut state = 0;
    let mut capture_id = 0;
    // SAFETY: valid out pointers.
    check(unsafe { driver::cuStreamGetCaptureInfo(stream, &mut state, &mut capture_id) })?;
    // SAFETY: the status is required; the rest are optional, as the runtime has them.
    unsafe {
        put(status, state)?;
        put_optional(id, capture_id);
        // A stand-in graph handle for the capture: the id, never NULL while capturing.
        put_optional(graph, capture_id as *mut c_void);
        put_optional(dependencies, std::ptr::null());
        put_optional(edges, std::ptr::null());
        put_optional(count, 0);
    }
    Ok(())
}

/// CUDA 13's form (with edge data).
#[cfg(feature = "cuda-13")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamGetCaptureInfo(
    stream: CuStream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    dependencies: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CudaError {
    // SAFETY: the caller's pointers, by the runtime API contract.
    api_on_device("cudaStreamGetCaptureInfo", |_| unsafe {
        capture_info(stream, status, id, graph, dependencies, edges, count)
    })
}

/// CUDA 12's original form.
#[cfg(not(feature = "cuda-13"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamGetCaptureInfo(
    stream: CuStream,
    status: *mut u32,
    id: *mut u64,
) -> CudaError {
    use std::ptr::null_mut;
    // SAFETY: the caller's pointers, by the runtime API contract.
    api_on_device("cudaStreamGetCaptureInfo", |_| unsafe {
        capture_info(
            stream,
            status,
            id,
            null_mut(),
            null_mut(),
            null_mut(),
            null_mut(),
        )
    })
}

#[cfg(not(feature = "cuda-13"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamGetCaptureInfo_v2(
    stream: CuStream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    dependencies: *mut *const c_void,
    count: *mut usize,
) -> CudaError {
    let no_edges = std::ptr::null_mut();
    // SAFETY: the caller's pointers, by the runtime API contract.
    api_on_device("cudaStreamGetCaptureInfo_v2", |_| unsafe {
        capture_info(stream, status, id, graph, dependencies, no_edges, count)
    })
}

#[cfg(not(feature = "cuda-13"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaStreamGetCaptureInfo_v3(
    stream: CuStream,
    status: *mut u32,
    id: *mut u64,
    graph: *mut *mut c_void,
    dependencies: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CudaError {
    // SAFETY: the caller's pointers, by the runtime API contract.
    api_on_device("cudaStreamGetCaptureInfo_v3", |_| unsafe {
        capture_info(stream, status, id, graph, dependencies, edges, count)
    })
}

// ---- Graphs --------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGraphInstantiate(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> CudaError {
    // SAFETY: forwarded out pointer; the driver checks the graph.
    api_on_device("cudaGraphInstantiate", |_| {
        check(unsafe { driver::cuGraphInstantiateWithFlags(exec, graph, flags) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    flags: u64,
) -> CudaError {
    // SAFETY: the same contract as cudaGraphInstantiate.
    unsafe { cudaGraphInstantiate(exec, graph, flags) }
}

forward_on_device!(fn cudaGraphLaunch(exec: *mut c_void, stream: CuStream) => cuGraphLaunch);

/// Nothing to upload: a graph's work runs from host memory here.
#[unsafe(no_mangle)]
pub extern "C" fn cudaGraphUpload(_exec: *mut c_void, _stream: CuStream) -> CudaError {
    api("cudaGraphUpload", || Ok(()))
}

forward_on_device!(fn cudaGraphDestroy(graph: *mut c_void) => cuGraphDestroy);

forward_on_device!(fn cudaGraphExecDestroy(exec: *mut c_void) => cuGraphExecDestroy);

forward_on_device!(fn cudaGraphGetNodes(graph: *mut c_void, nodes: *mut *mut c_void, count: *mut usize) => cuGraphGetNodes);

// ---- Events --------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaEventCreate(event: *mut CuEvent) -> CudaError {
    // SAFETY: forwarded out pointer.
    api_on_device("cudaEventCreate", |_| {
        check(unsafe { driver::cuEventCreate(event, 0) })
    })
}

forward_on_device!(fn cudaEventCreateWithFlags(event: *mut CuEvent, flags: c_uint) => cuEventCreate);

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventDestroy(event: CuEvent) -> CudaError {
    // SAFETY: plain driver call; the driver checks the handle.
    api("cudaEventDestroy", || {
        check(unsafe { driver::cuEventDestroy_v2(event) })
    })
}

forward_on_device!(fn cudaEventRecord(event: CuEvent, stream: CuStream) => cuEventRecord);

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventRecordWithFlags(
    event: CuEvent,
    stream: CuStream,
    _flags: c_uint,
) -> CudaError {
    // SAFETY: the caller's handles, passed on; the driver checks them.
    unsafe { cudaEventRecord(event, stream) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventQuery(event: CuEvent) -> CudaError {
    // SAFETY: plain driver call; the driver checks the handle.
    api("cudaEventQuery", || {
        check(unsafe { driver::cuEventQuery(event) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaEventSynchronize(event: CuEvent) -> CudaError {
    // SAFETY: plain driver call; the driver checks the handle.
    api("cudaEventSynchronize", || {
        check(unsafe { driver::cuEventSynchronize(event) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaEventElapsedTime(
    ms: *mut f32,
    _start: CuEvent,
    _end: CuEvent,
) -> CudaError {
    // Work takes no time here.
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaEventElapsedTime", || unsafe { put(ms, 0.0) })
}
