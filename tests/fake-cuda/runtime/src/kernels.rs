//! Kernels and modules: the fat-binary registration PyTorch's libraries make at load time
//! (about 500 binaries and 24,000 kernels for torch 2.15: each kernel's host stub is kept with
//! its binary and device name), launches (work on their stream, booked by the driver, which
//! reads the kernel's parameter layout from the binary; no code runs), function attributes,
//! and the driver entry points PyTorch asks the runtime for.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::runtime::sys::cudaFuncAttributes;

use crate::driver::CuStream;
use crate::{CudaError, INVALID_VALUE, NOT_SUPPORTED, api, api_on_device, log, put, put_optional};

static FAT_BINARIES: AtomicU64 = AtomicU64::new(0);
static KERNELS: AtomicU64 = AtomicU64::new(0);

/// `dim3`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Dim3 {
    x: c_uint,
    y: c_uint,
    z: c_uint,
}

/// What `__cudaRegisterFatBinary` returns: a handle of its own per binary, holding the wrapper
/// it received (the compiler's code passes the handle back to `__cudaRegisterFunction`).
#[repr(C)]
struct Binary {
    wrapper: *const c_void,
}

/// The kernels registered with `__cudaRegisterFunction`, by host stub address: the wrapper of
/// their fat binary and their device name (both live as long as the library that holds them).
static FUNCTIONS: Mutex<Option<HashMap<usize, (usize, usize)>>> = Mutex::new(None);

fn functions() -> std::sync::MutexGuard<'static, Option<HashMap<usize, (usize, usize)>>> {
    FUNCTIONS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterFatBinary(fat_cubin: *mut c_void) -> *mut *mut c_void {
    FAT_BINARIES.fetch_add(1, Ordering::Relaxed);
    // Never freed: the compiler's code keeps the handle for the library's life (a library
    // unloaded and loaded again registers anew; the few bytes stay).
    Box::into_raw(Box::new(Binary {
        wrapper: fat_cubin.cast_const(),
    }))
    .cast()
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterFatBinaryEnd(_handle: *mut *mut c_void) {}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaUnregisterFatBinary(_handle: *mut *mut c_void) {}

/// Takes the real function's ten arguments; keeps the host stub's binary and device name.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __cudaRegisterFunction(
    handle: *mut *mut c_void,
    host_function: *const c_char,
    _device_function: *mut c_char,
    device_name: *const c_char,
) {
    KERNELS.fetch_add(1, Ordering::Relaxed);
    let wrapper = if handle.is_null() {
        0
    } else {
        // SAFETY: a handle this runtime made in __cudaRegisterFatBinary.
        unsafe { (*handle.cast::<Binary>()).wrapper as usize }
    };
    functions()
        .get_or_insert_with(HashMap::new)
        .insert(host_function as usize, (wrapper, device_name as usize));
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterVar() {}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterManagedVar() {}

thread_local! {
    /// What `__cudaPushCallConfiguration` left for the launch stub's `__cudaPopCallConfiguration`.
    static CALL_CONFIGURATION: Cell<(Dim3, Dim3, usize, usize)> =
        const { Cell::new((Dim3 { x: 1, y: 1, z: 1 }, Dim3 { x: 1, y: 1, z: 1 }, 0, 0)) };
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaPushCallConfiguration(
    grid: Dim3,
    block: Dim3,
    shared_memory: usize,
    stream: CuStream,
) -> c_uint {
    CALL_CONFIGURATION.set((grid, block, shared_memory, stream as usize));
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __cudaPopCallConfiguration(
    grid: *mut Dim3,
    block: *mut Dim3,
    shared_memory: *mut usize,
    stream: *mut CuStream,
) -> CudaError {
    let (pushed_grid, pushed_block, pushed_shared, pushed_stream) = CALL_CONFIGURATION.get();
    // SAFETY: the caller's out pointers, NULL or writable.
    unsafe {
        put_optional(grid, pushed_grid);
        put_optional(block, pushed_block);
        put_optional(shared_memory, pushed_shared);
        put_optional(stream, pushed_stream as CuStream);
    }
    crate::SUCCESS
}

/// `cudaErrorInvalidDeviceFunction`: the function is no registered kernel.
const INVALID_DEVICE_FUNCTION: CudaError = 98;
/// `cudaErrorInvalidConfiguration`: a grid or block beyond the device's limits.
const INVALID_CONFIGURATION: CudaError = 9;
/// The per-thread default stream, what `_ptsz` launches use for the NULL stream.
const PER_THREAD_STREAM: usize = 2;

/// A launch of a registered kernel: work on `stream` that the driver books as it books a copy,
/// touching the device memory its arguments point into (`driver/src/launch.rs`). No code runs.
fn launch(
    name: &'static str,
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    stream: CuStream,
) -> CudaError {
    api_on_device(name, |_| {
        let registered = functions()
            .as_ref()
            .and_then(|f| f.get(&(function as usize)).copied());
        let (wrapper, device_name) = registered.ok_or(INVALID_DEVICE_FUNCTION)?;
        let grid = [grid.x, grid.y, grid.z];
        let block = [block.x, block.y, block.z];
        // SAFETY: a registered binary and name, the caller's arguments, dimensions on the stack.
        let code = unsafe {
            crate::driver::fake_cuda_launch_registered(
                stream,
                wrapper as *const c_void,
                device_name as *const c_char,
                arguments,
                &grid,
                &block,
            )
        };
        match code {
            crate::SUCCESS => Ok(()),
            INVALID_VALUE => Err(INVALID_CONFIGURATION),
            other => Err(other),
        }
    })
}

fn per_thread(stream: CuStream) -> CuStream {
    if stream.is_null() {
        PER_THREAD_STREAM as CuStream
    } else {
        stream
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchKernel(
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    _shared_memory: usize,
    stream: CuStream,
) -> CudaError {
    launch("cudaLaunchKernel", function, grid, block, arguments, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaLaunchKernel(
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    _shared_memory: usize,
    stream: CuStream,
) -> CudaError {
    launch(
        "__cudaLaunchKernel",
        function,
        grid,
        block,
        arguments,
        stream,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchKernel_ptsz(
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    _shared_memory: usize,
    stream: CuStream,
) -> CudaError {
    let stream = per_thread(stream);
    launch(
        "cudaLaunchKernel_ptsz",
        function,
        grid,
        block,
        arguments,
        stream,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaLaunchKernel_ptsz(
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    _shared_memory: usize,
    stream: CuStream,
) -> CudaError {
    let stream = per_thread(stream);
    launch(
        "__cudaLaunchKernel_ptsz",
        function,
        grid,
        block,
        arguments,
        stream,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchCooperativeKernel(
    function: *const c_void,
    grid: Dim3,
    block: Dim3,
    arguments: *mut *mut c_void,
    _shared_memory: usize,
    stream: CuStream,
) -> CudaError {
    launch(
        "cudaLaunchCooperativeKernel",
        function,
        grid,
        block,
        arguments,
        stream,
    )
}

/// `cudaLaunchConfig_t`: grid, block, dynamic shared memory, stream; its attributes (clusters,
/// programmatic serialization) change nothing here.
#[repr(C)]
pub struct LaunchConfig {
    grid: Dim3,
    block: Dim3,
    shared_memory: usize,
    stream: CuStream,
    attributes: *mut c_void,
    attribute_count: c_uint,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaLaunchKernelExC(
    config: *const LaunchConfig,
    function: *const c_void,
    arguments: *mut *mut c_void,
) -> CudaError {
    if config.is_null() {
        return api("cudaLaunchKernelExC", || Err(INVALID_VALUE));
    }
    // SAFETY: not NULL; a cudaLaunchConfig_t by the runtime API contract.
    let config = unsafe { &*config };
    launch(
        "cudaLaunchKernelExC",
        function,
        config.grid,
        config.block,
        arguments,
        config.stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaFuncGetAttributes(
    attributes: *mut cudaFuncAttributes,
    _function: *const c_void,
) -> CudaError {
    api("cudaFuncGetAttributes", || {
        // SAFETY: cudaFuncAttributes is plain integers: all zeroes is a valid value.
        let mut answer: cudaFuncAttributes = unsafe { std::mem::zeroed() };
        answer.maxThreadsPerBlock = 1024;
        answer.numRegs = 32;
        // SAFETY: an out pointer from the caller, writable by the runtime API contract.
        unsafe { put(attributes, answer) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaFuncSetAttribute(
    _function: *const c_void,
    _attribute: c_int,
    _value: c_int,
) -> CudaError {
    api("cudaFuncSetAttribute", || Ok(()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    _function: *const c_void,
    _block_size: c_int,
    _shared_memory: usize,
) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("cudaOccupancyMaxActiveBlocksPerMultiprocessor", || unsafe {
        put(blocks, 1)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    blocks: *mut c_int,
    function: *const c_void,
    block_size: c_int,
    shared_memory: usize,
    _flags: c_uint,
) -> CudaError {
    // SAFETY: the same contract.
    unsafe {
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, function, block_size, shared_memory)
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaProfilerStart() -> CudaError {
    api("cudaProfilerStart", || Ok(()))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaProfilerStop() -> CudaError {
    api("cudaProfilerStop", || Ok(()))
}

// ---- Driver entry points -------------------------------------------------------------------

const ENTRY_POINT_SUCCESS: c_int = 0;

/// What a driver function the fake driver lacks resolves to: it takes any arguments, does
/// nothing and answers `CUDA_ERROR_NOT_SUPPORTED`, so PyTorch's table of required driver
/// functions fills and a call that matters fails loudly instead of crashing.
extern "C" fn unsupported_driver_function() -> u32 {
    log!("a driver function the fake driver lacks was called");
    NOT_SUPPORTED
}

/// The fake driver's function `name`, preferring the `_v2` form that a current driver hands out
/// for APIs that have one; the unsupported stand-in for what it lacks.
fn driver_function(name: &CStr) -> *mut c_void {
    // SAFETY: looking up an already loaded library (the runtime links against it).
    let library =
        unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if library.is_null() {
        return unsupported_driver_function as *mut c_void;
    }
    let versioned = format!("{}_v2\0", name.to_string_lossy());
    for candidate in [versioned.as_ptr().cast::<c_char>(), name.as_ptr()] {
        // SAFETY: a valid handle and NUL-terminated names.
        let found = unsafe { libc::dlsym(library, candidate) };
        if !found.is_null() {
            return found;
        }
    }
    log!("driver entry point {name:?} is not in the fake driver: an unsupported stand-in");
    unsupported_driver_function as *mut c_void
}

/// # Safety
/// `symbol` is NULL or NUL-terminated; the out pointers are NULL or writable.
unsafe fn entry_point(
    name: &'static str,
    symbol: *const c_char,
    function: *mut *mut c_void,
    status: *mut c_int,
) -> CudaError {
    api(name, || {
        if symbol.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: NUL-terminated by the caller's contract.
        let name = unsafe { CStr::from_ptr(symbol) };
        // SAFETY: the caller's out pointers.
        unsafe {
            put(function, driver_function(name))?;
            put_optional(status, ENTRY_POINT_SUCCESS);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    function: *mut *mut c_void,
    _flags: u64,
    status: *mut c_int,
) -> CudaError {
    // SAFETY: the caller's arguments, by the runtime API contract.
    unsafe { entry_point("cudaGetDriverEntryPoint", symbol, function, status) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    function: *mut *mut c_void,
    _version: c_uint,
    _flags: u64,
    status: *mut c_int,
) -> CudaError {
    // SAFETY: the caller's arguments, by the runtime API contract.
    unsafe { entry_point("cudaGetDriverEntryPointByVersion", symbol, function, status) }
}

/// Logs what was registered when the process ends, with `FAKE_CUDA_LOG` set.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cudart_registered_kernels() -> u64 {
    log!(
        "{} fat binaries, {} kernels registered",
        FAT_BINARIES.load(Ordering::Relaxed),
        KERNELS.load(Ordering::Relaxed)
    );
    KERNELS.load(Ordering::Relaxed)
}

/// CUDA 13's launch path asks for the kernel handle of a host stub first; the stub's address
/// serves (no kernel runs anyway).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __cudaGetKernel(
    kernel: *mut *const c_void,
    function: *const c_void,
) -> CudaError {
    // SAFETY: an out pointer from the caller, writable by the runtime API contract.
    api("__cudaGetKernel", || unsafe { put(kernel, function) })
}
