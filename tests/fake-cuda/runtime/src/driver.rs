//! The fake driver's functions this runtime stands on (linked against libcuda.so.1), and the
//! implicit initialisation every runtime call makes: `cuInit`, then the device's primary
//! context retained once and made current on the calling thread.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::{Outcome, check};

pub type CuStream = *mut c_void;
pub type CuEvent = *mut c_void;
pub type CuContext = *mut c_void;

unsafe extern "C" {
    pub fn cuInit(flags: c_uint) -> u32;
    pub fn cuDriverGetVersion(version: *mut c_int) -> u32;
    pub fn cuDeviceGetCount(count: *mut c_int) -> u32;
    pub fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_int, device: c_int) -> u32;
    pub fn cuDeviceCanAccessPeer(can_access: *mut c_int, device: c_int, peer: c_int) -> u32;
    pub fn cuCtxEnablePeerAccess(peer_context: CuContext, flags: c_uint) -> u32;
    pub fn cuCtxDisablePeerAccess(peer_context: CuContext) -> u32;
    pub fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> u32;
    pub fn cuDeviceGetName(name: *mut c_char, length: c_int, device: c_int) -> u32;
    pub fn cuDevicePrimaryCtxRetain(context: *mut CuContext, device: c_int) -> u32;
    pub fn cuCtxGetCurrent(context: *mut CuContext) -> u32;
    pub fn cuCtxSetCurrent(context: CuContext) -> u32;
    pub fn cuCtxSynchronize() -> u32;
    pub fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) -> u32;
    pub fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> u32;
    pub fn cuMemFree_v2(dptr: u64) -> u32;
    pub fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> u32;
    pub fn cuMemsetD8_v2(dptr: u64, value: u8, count: usize) -> u32;
    pub fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, count: usize) -> u32;
    pub fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, count: usize) -> u32;
    pub fn cuMemcpyDtoD_v2(dst: u64, src: u64, count: usize) -> u32;
    pub fn cuMemcpy(dst: u64, src: u64, count: usize) -> u32;
    pub fn cuMemcpyAsync(dst: u64, src: u64, count: usize, stream: CuStream) -> u32;
    pub fn cuMemsetD8Async(dptr: u64, value: u8, count: usize, stream: CuStream) -> u32;
    pub fn cuGraphInstantiateWithFlags(
        exec: *mut *mut c_void,
        graph: *mut c_void,
        flags: u64,
    ) -> u32;
    pub fn cuGraphLaunch(exec: *mut c_void, stream: CuStream) -> u32;
    pub fn cuGraphGetNodes(graph: *mut c_void, nodes: *mut *mut c_void, count: *mut usize) -> u32;
    pub fn cuGraphDestroy(graph: *mut c_void) -> u32;
    pub fn cuGraphExecDestroy(exec: *mut c_void) -> u32;
    pub fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: u64) -> u32;
    pub fn cuStreamCreateWithPriority(stream: *mut CuStream, flags: c_uint, priority: c_int)
    -> u32;
    pub fn cuStreamDestroy_v2(stream: CuStream) -> u32;
    pub fn cuStreamSynchronize(stream: CuStream) -> u32;
    pub fn cuStreamQuery(stream: CuStream) -> u32;
    pub fn cuStreamWaitEvent(stream: CuStream, event: CuEvent, flags: c_uint) -> u32;
    pub fn cuStreamGetPriority(stream: CuStream, priority: *mut c_int) -> u32;
    pub fn cuStreamGetFlags(stream: CuStream, flags: *mut c_uint) -> u32;
    pub fn cuStreamIsCapturing(stream: CuStream, status: *mut u32) -> u32;
    pub fn cuStreamGetCaptureInfo(stream: CuStream, status: *mut u32, id: *mut u64) -> u32;
    pub fn cuStreamBeginCapture_v2(stream: CuStream, mode: u32) -> u32;
    pub fn cuStreamEndCapture(stream: CuStream, graph: *mut *mut c_void) -> u32;
    pub fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> u32;
    pub fn cuEventCreate(event: *mut CuEvent, flags: c_uint) -> u32;
    pub fn cuEventDestroy_v2(event: CuEvent) -> u32;
    pub fn cuEventRecord(event: CuEvent, stream: CuStream) -> u32;
    pub fn cuEventQuery(event: CuEvent) -> u32;
    pub fn cuEventSynchronize(event: CuEvent) -> u32;
    /// The fake driver's launch of a kernel the runtime registered (`driver/src/launch.rs`).
    pub fn fake_cuda_launch_registered(
        stream: CuStream,
        fatbin: *const c_void,
        name: *const c_char,
        args: *mut *mut c_void,
        grid: *const [c_uint; 3],
        block: *const [c_uint; 3],
    ) -> u32;
    /// The fake driver's fault sweep: counts a runtime call; the code it must fail with, or 0.
    pub fn fake_cuda_sweep_runtime_call(name: *const u8, len: usize) -> u32;
}

/// The most devices the fake driver is ever asked to model.
const MAX_DEVICES: usize = 64;

/// Makes `device`'s primary context current on this thread, initialising the driver and
/// retaining the context (once per process) on first use.
pub fn enter(device: i32) -> Outcome {
    static INIT: OnceLock<u32> = OnceLock::new();
    // SAFETY: plain driver call.
    check(*INIT.get_or_init(|| unsafe { cuInit(0) }))?;
    let context = primary_context(device)?;
    let mut current: CuContext = std::ptr::null_mut();
    // SAFETY: a valid out pointer.
    check(unsafe { cuCtxGetCurrent(&mut current) })?;
    if current != context {
        // SAFETY: a context the driver gave us and we keep retained.
        check(unsafe { cuCtxSetCurrent(context) })?;
    }
    Ok(())
}

/// The retained primary context of `device`; retained once and kept for the process's life.
pub fn primary_context(device: i32) -> Result<CuContext, u32> {
    static CONTEXTS: [OnceLock<Result<usize, u32>>; MAX_DEVICES] =
        [const { OnceLock::new() }; MAX_DEVICES];
    let slot = usize::try_from(device)
        .ok()
        .and_then(|index| CONTEXTS.get(index))
        .ok_or(crate::INVALID_DEVICE)?;
    let context = slot.get_or_init(|| {
        let mut context: CuContext = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the driver checks the ordinal.
        check(unsafe { cuDevicePrimaryCtxRetain(&mut context, device) })?;
        Ok(context as usize)
    });
    context.map(|address| address as CuContext)
}

/// The number of devices the driver reports.
pub fn device_count() -> Result<i32, u32> {
    static INIT: OnceLock<u32> = OnceLock::new();
    // SAFETY: plain driver call.
    check(*INIT.get_or_init(|| unsafe { cuInit(0) }))?;
    let mut count = 0;
    // SAFETY: a valid out pointer.
    check(unsafe { cuDeviceGetCount(&mut count) })?;
    Ok(count)
}
