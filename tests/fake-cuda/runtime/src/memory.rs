//! Device memory (the driver's `cuMemAlloc`: real host memory, so copies work), pinned host
//! memory (plain host memory, tracked so `cudaFreeHost` and pointer queries know it), copies
//! and memsets. Work completes at once, so the `Async` forms do the work before they return.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;

use cudarc::runtime::sys::{cudaMemoryType, cudaPointerAttributes};

use crate::driver::{self, CuStream};
use crate::{CudaError, INVALID_VALUE, MEMORY_ALLOCATION, Outcome, api, api_on_device, check, put};

const COPY_HOST_TO_HOST: c_int = 0;
const COPY_HOST_TO_DEVICE: c_int = 1;
const COPY_DEVICE_TO_HOST: c_int = 2;
const COPY_DEVICE_TO_DEVICE: c_int = 3;
const COPY_DEFAULT: c_int = 4;
const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const HOST_ALIGNMENT: usize = 4096;

/// Pinned host allocations by address.
static PINNED: Mutex<BTreeMap<usize, Layout>> = Mutex::new(BTreeMap::new());

fn pinned() -> std::sync::MutexGuard<'static, BTreeMap<usize, Layout>> {
    PINNED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> CudaError {
    api_on_device("cudaMalloc", |_| {
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        if size == 0 {
            // SAFETY: checked non-NULL; the caller promises it is writable.
            return unsafe { put(ptr, std::ptr::null_mut()) };
        }
        let mut address = 0u64;
        // SAFETY: a valid out pointer.
        check(unsafe { driver::cuMemAlloc_v2(&mut address, size) })?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(ptr, address as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaFree(ptr: *mut c_void) -> CudaError {
    // cudaFree(NULL) is the idiom that makes the runtime set up its context: nothing else.
    api_on_device("cudaFree", |_| {
        if ptr.is_null() {
            return Ok(());
        }
        // SAFETY: plain driver call; the driver checks the address.
        check(unsafe { driver::cuMemFree_v2(ptr as u64) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMallocAsync(
    ptr: *mut *mut c_void,
    size: usize,
    _stream: CuStream,
) -> CudaError {
    // SAFETY: the same contract as cudaMalloc.
    unsafe { cudaMalloc(ptr, size) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaFreeAsync(ptr: *mut c_void, _stream: CuStream) -> CudaError {
    cudaFree(ptr)
}

forward_on_device!(fn cudaMemGetInfo(free: *mut usize, total: *mut usize) => cuMemGetInfo_v2);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaHostAlloc(
    ptr: *mut *mut c_void,
    size: usize,
    _flags: c_uint,
) -> CudaError {
    api("cudaHostAlloc", || {
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let layout =
            Layout::from_size_align(size.max(1), HOST_ALIGNMENT).map_err(|_| MEMORY_ALLOCATION)?;
        // SAFETY: the layout has a non-zero size.
        let memory = unsafe { std::alloc::alloc(layout) };
        if memory.is_null() {
            return Err(MEMORY_ALLOCATION);
        }
        pinned().insert(memory as usize, layout);
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(ptr, memory.cast()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMallocHost(ptr: *mut *mut c_void, size: usize) -> CudaError {
    // SAFETY: the same contract as cudaHostAlloc.
    unsafe { cudaHostAlloc(ptr, size, 0) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaFreeHost(ptr: *mut c_void) -> CudaError {
    api("cudaFreeHost", || {
        let layout = pinned().remove(&(ptr as usize)).ok_or(INVALID_VALUE)?;
        // SAFETY: allocated by cudaHostAlloc with this layout, freed once (just removed).
        unsafe { std::alloc::dealloc(ptr.cast(), layout) };
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaHostRegister(_ptr: *mut c_void, _size: usize, _flags: c_uint) -> CudaError {
    api("cudaHostRegister", || Ok(()))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaHostUnregister(_ptr: *mut c_void) -> CudaError {
    api("cudaHostUnregister", || Ok(()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaHostGetDevicePointer(
    device_ptr: *mut *mut c_void,
    host_ptr: *mut c_void,
    _flags: c_uint,
) -> CudaError {
    // Unified addressing: the host address is the device address.
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaHostGetDevicePointer", || unsafe {
        put(device_ptr, host_ptr)
    })
}

/// The device that owns the device memory at `ptr`, or None for host memory.
fn device_of(ptr: *const c_void) -> Option<c_int> {
    let mut device: c_int = -1;
    // SAFETY: a valid out pointer of the attribute's type.
    let code = unsafe {
        driver::cuPointerGetAttribute(
            (&raw mut device).cast(),
            POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as u64,
        )
    };
    (code == crate::SUCCESS).then_some(device)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaPointerGetAttributes(
    attributes: *mut cudaPointerAttributes,
    ptr: *const c_void,
) -> CudaError {
    api_on_device("cudaPointerGetAttributes", |_| {
        // SAFETY: plain integers and pointers (and, in CUDA 13, reserved words): all zeroes
        // is a valid value.
        let mut answer: cudaPointerAttributes = unsafe { std::mem::zeroed() };
        if let Some(device) = device_of(ptr) {
            answer.type_ = cudaMemoryType::cudaMemoryTypeDevice;
            answer.device = device;
            answer.devicePointer = ptr.cast_mut();
        } else {
            let is_pinned = pinned()
                .range(..=ptr as usize)
                .next_back()
                .is_some_and(|(&start, layout)| (ptr as usize) < start + layout.size());
            answer.type_ = if is_pinned {
                cudaMemoryType::cudaMemoryTypeHost
            } else {
                cudaMemoryType::cudaMemoryTypeUnregistered
            };
            answer.device = -2;
            answer.hostPointer = ptr.cast_mut();
            if is_pinned {
                answer.devicePointer = ptr.cast_mut();
            }
        }
        // SAFETY: an out pointer from the caller, writable by the runtime API contract.
        unsafe { put(attributes, answer) }
    })
}

/// Copies `count` bytes; the driver checks that each device side is live device memory. With
/// a stream the copy is asynchronous (booked as pending work of that stream); without, it is
/// the synchronous copy on the legacy default stream.
fn copy(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: Option<CuStream>,
) -> Outcome {
    if count == 0 {
        return Ok(());
    }
    if !matches!(
        kind,
        COPY_HOST_TO_DEVICE | COPY_DEVICE_TO_HOST | COPY_DEVICE_TO_DEVICE | COPY_DEFAULT
    ) {
        return if kind == COPY_HOST_TO_HOST {
            // SAFETY: host memory on both sides, the caller's promise, as with the real runtime.
            unsafe { std::ptr::copy(src.cast::<u8>(), dst.cast::<u8>(), count) };
            Ok(())
        } else {
            Err(INVALID_VALUE)
        };
    }
    let (dst, src) = (dst as u64, src as u64);
    // SAFETY (all arms): device sides are checked by the driver; host sides are the caller's
    // promise, as with the real runtime.
    let code = unsafe {
        match (kind, stream) {
            (_, Some(stream)) => driver::cuMemcpyAsync(dst, src, count, stream),
            (COPY_HOST_TO_DEVICE, None) => {
                driver::cuMemcpyHtoD_v2(dst, src as *const c_void, count)
            }
            (COPY_DEVICE_TO_HOST, None) => driver::cuMemcpyDtoH_v2(dst as *mut c_void, src, count),
            (COPY_DEVICE_TO_DEVICE, None) => driver::cuMemcpyDtoD_v2(dst, src, count),
            _ => driver::cuMemcpy(dst, src, count),
        }
    };
    check(code)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
) -> CudaError {
    api_on_device("cudaMemcpy", |_| copy(dst, src, count, kind, None))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: CuStream,
) -> CudaError {
    api_on_device("cudaMemcpyAsync", |_| {
        copy(dst, src, count, kind, Some(stream))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemcpyPeerAsync(
    dst: *mut c_void,
    _dst_device: c_int,
    src: *const c_void,
    _src_device: c_int,
    count: usize,
    stream: CuStream,
) -> CudaError {
    api_on_device("cudaMemcpyPeerAsync", |_| {
        copy(dst, src, count, COPY_DEVICE_TO_DEVICE, Some(stream))
    })
}

#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "the runtime's signature")]
pub unsafe extern "C" fn cudaMemcpy2DAsync(
    dst: *mut c_void,
    dst_pitch: usize,
    src: *const c_void,
    src_pitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: CuStream,
) -> CudaError {
    api_on_device("cudaMemcpy2DAsync", |_| {
        if width > dst_pitch || width > src_pitch {
            return Err(INVALID_VALUE);
        }
        for row in 0..height {
            let to = dst.cast::<u8>().wrapping_add(row * dst_pitch);
            let from = src.cast::<u8>().wrapping_add(row * src_pitch);
            copy(to.cast(), from.cast(), width, kind, Some(stream))?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemset(ptr: *mut c_void, value: c_int, count: usize) -> CudaError {
    // The runtime takes an int and uses its low byte.
    // SAFETY: plain driver call; the driver checks the range.
    api_on_device("cudaMemset", |_| {
        check(unsafe { driver::cuMemsetD8_v2(ptr as u64, value as u8, count) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemsetAsync(
    ptr: *mut c_void,
    value: c_int,
    count: usize,
    stream: CuStream,
) -> CudaError {
    // SAFETY: plain driver call; the driver checks the range and the stream.
    api_on_device("cudaMemsetAsync", |_| {
        check(unsafe { driver::cuMemsetD8Async(ptr as u64, value as u8, count, stream) })
    })
}

// ---- CUDA IPC ------------------------------------------------------------------------------
// PyTorch shares `cudaMalloc` memory between processes with these (`shareIpcHandle`,
// `getIpcDevPtr`) and orders the two sides with interprocess events; the driver does the work
// (`driver/src/ipc.rs`).

/// `cudaIpcMemHandle_t` and `cudaIpcEventHandle_t`: 64 opaque bytes, the driver's handle.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    reserved: [u8; 64],
}

unsafe extern "C" {
    fn cuIpcGetMemHandle(handle: *mut IpcHandle, dptr: u64) -> u32;
    fn cuIpcOpenMemHandle_v2(dptr: *mut u64, handle: IpcHandle, flags: c_uint) -> u32;
    fn cuIpcCloseMemHandle(dptr: u64) -> u32;
    fn cuIpcGetEventHandle(handle: *mut IpcHandle, event: driver::CuEvent) -> u32;
    fn cuIpcOpenEventHandle(event: *mut driver::CuEvent, handle: IpcHandle) -> u32;
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcGetMemHandle(
    handle: *mut IpcHandle,
    dev_ptr: *mut c_void,
) -> CudaError {
    // SAFETY: the caller's out pointer, checked by the driver.
    api_on_device("cudaIpcGetMemHandle", |_| {
        check(unsafe { cuIpcGetMemHandle(handle, dev_ptr as u64) })
    })
}

/// Opens on the current device; `flags` must be `cudaIpcMemLazyEnablePeerAccess`, as the
/// driver's must be `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` (the same value).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcOpenMemHandle(
    dev_ptr: *mut *mut c_void,
    handle: IpcHandle,
    flags: c_uint,
) -> CudaError {
    api_on_device("cudaIpcOpenMemHandle", |_| {
        if dev_ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let mut address = 0u64;
        // SAFETY: a valid out pointer; the handle is passed on as it came.
        check(unsafe { cuIpcOpenMemHandle_v2(&mut address, handle, flags) })?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(dev_ptr, address as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaIpcCloseMemHandle(dev_ptr: *mut c_void) -> CudaError {
    // SAFETY: plain driver call; the driver checks the address.
    api_on_device("cudaIpcCloseMemHandle", |_| {
        check(unsafe { cuIpcCloseMemHandle(dev_ptr as u64) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcGetEventHandle(
    handle: *mut IpcHandle,
    event: driver::CuEvent,
) -> CudaError {
    // SAFETY: the caller's out pointer and event, checked by the driver.
    api_on_device("cudaIpcGetEventHandle", |_| {
        check(unsafe { cuIpcGetEventHandle(handle, event) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaIpcOpenEventHandle(
    event: *mut driver::CuEvent,
    handle: IpcHandle,
) -> CudaError {
    // SAFETY: the caller's out pointer, checked by the driver; the handle as it came.
    api_on_device("cudaIpcOpenEventHandle", |_| {
        check(unsafe { cuIpcOpenEventHandle(event, handle) })
    })
}
