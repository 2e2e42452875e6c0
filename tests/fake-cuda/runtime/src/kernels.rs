//! Kernels and modules: the fat-binary registration PyTorch's libraries make at load time
//! (no-ops: about 500 binaries and 24,000 kernels for torch 2.15), launches (refused: no kernel
//! runs here), function attributes, and the driver entry points PyTorch asks the runtime for.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::runtime::sys::cudaFuncAttributes;

use crate::driver::CuStream;
use crate::{
    CudaError, INVALID_VALUE, NO_KERNEL_IMAGE, NOT_SUPPORTED, api, log, put, put_optional,
};

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

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterFatBinary(_fat_cubin: *mut c_void) -> *mut *mut c_void {
    // The handle is opaque to the caller; one shared, never-NULL slot serves every binary.
    static mut HANDLE: [*mut c_void; 2] = [std::ptr::null_mut(); 2];
    FAT_BINARIES.fetch_add(1, Ordering::Relaxed);
    (&raw mut HANDLE).cast()
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterFatBinaryEnd(_handle: *mut *mut c_void) {}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaUnregisterFatBinary(_handle: *mut *mut c_void) {}

/// Takes the real function's ten arguments, and uses none.
#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterFunction() {
    KERNELS.fetch_add(1, Ordering::Relaxed);
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterVar() {}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaRegisterManagedVar() {}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaPushCallConfiguration(
    _grid: Dim3,
    _block: Dim3,
    _shared_memory: usize,
    _stream: CuStream,
) -> c_uint {
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __cudaPopCallConfiguration(
    grid: *mut Dim3,
    block: *mut Dim3,
    shared_memory: *mut usize,
    stream: *mut CuStream,
) -> CudaError {
    let one = Dim3 { x: 1, y: 1, z: 1 };
    // SAFETY: the caller's out pointers, NULL or writable.
    unsafe {
        put_optional(grid, one);
        put_optional(block, one);
        put_optional(shared_memory, 0);
        put_optional(stream, std::ptr::null_mut());
    }
    crate::SUCCESS
}

/// Every launch fails: the fake has no GPU to run a kernel on. PyTorch reports the error as a
/// `torch.AcceleratorError`, and the process goes on.
fn refuse_launch(name: &'static str) -> CudaError {
    log!("kernel launch refused (the fake CUDA runs no kernels)");
    api(name, || Err(NO_KERNEL_IMAGE))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchKernel(
    _function: *const c_void,
    _grid: Dim3,
    _block: Dim3,
    _arguments: *mut *mut c_void,
    _shared_memory: usize,
    _stream: CuStream,
) -> CudaError {
    refuse_launch("cudaLaunchKernel")
}

#[unsafe(no_mangle)]
pub extern "C" fn __cudaLaunchKernel(
    _function: *const c_void,
    _grid: Dim3,
    _block: Dim3,
    _arguments: *mut *mut c_void,
    _shared_memory: usize,
    _stream: CuStream,
) -> CudaError {
    refuse_launch("__cudaLaunchKernel")
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchCooperativeKernel(
    _function: *const c_void,
    _grid: Dim3,
    _block: Dim3,
    _arguments: *mut *mut c_void,
    _shared_memory: usize,
    _stream: CuStream,
) -> CudaError {
    refuse_launch("cudaLaunchCooperativeKernel")
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaLaunchKernelExC(
    _config: *const c_void,
    _function: *const c_void,
    _arguments: *mut *mut c_void,
) -> CudaError {
    refuse_launch("cudaLaunchKernelExC")
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
