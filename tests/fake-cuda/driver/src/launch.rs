//! Kernels that launch and do nothing: modules and libraries loaded at run time
//! (`cuModuleLoadData`, `cuLibraryLoadData`: Triton and NVRTC), their functions and attributes,
//! occupancy, and launches (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuLaunchCooperativeKernel`,
//! and through the runtime the kernels of PyTorch's own libraries).
//!
//! A launch is work on its stream like a copy (`work.rs`): pending until a synchronization or a
//! completed event says it finished; under capture it becomes a node of the graph, and a graph
//! launch submits it again. No kernel code runs: its output holds whatever bytes the memory
//! held. The ordering check counts as touched (and written) the device memory the kernel's
//! arguments are seen to point into: every 8-byte-aligned word of the parameter buffer that
//! lies in a live allocation or accessible mapping, with the parameters' offsets and sizes read
//! from the cubin (`cubin.rs`) or, for `extra`'s packed buffer, its given size. A word found
//! touches the one byte it points at (the kernel's extent is not known): so the check sees a
//! block handed to another stream at its address, not a use of its far end alone.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::Arc;

use crate::cubin::{self, Param, ParamTable};
use crate::sync::Step;
use crate::work::Touch;
use crate::{
    CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CuResult, Driver, Outcome, call, get, put,
};

/// `CUDA_ERROR_INVALID_IMAGE`: the image is none the driver can load.
const CUDA_ERROR_INVALID_IMAGE: CuResult = 200;
/// `CUDA_ERROR_UNSUPPORTED_LIMIT`: no such `CUlimit`.
const CUDA_ERROR_UNSUPPORTED_LIMIT: CuResult = 215;
/// `CUDA_ERROR_FILE_NOT_FOUND`: `cuModuleLoad` could not read the file.
const CUDA_ERROR_FILE_NOT_FOUND: CuResult = 301;
/// `CUDA_ERROR_NOT_FOUND`: no function of that name in the module.
const CUDA_ERROR_NOT_FOUND: CuResult = 500;

/// `CUfunction_attribute` values the fake answers or sets.
const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
const FUNC_NUM_REGS: c_int = 4;
const FUNC_PTX_VERSION: c_int = 5;
const FUNC_BINARY_VERSION: c_int = 6;
const FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
const FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT: c_int = 9;
const FUNC_ATTRIBUTE_MAX: c_int = 16;

/// What an H100 allows (the fake's devices are compute capability 9.0): 1024 threads per
/// block, 48 KiB of dynamic shared memory unless a function opts in, 227 KiB when it does.
const MAX_THREADS_PER_BLOCK: u64 = 1024;
const MAX_BLOCK_DIM: [u32; 3] = [1024, 1024, 64];
const MAX_GRID_DIM: [u32; 3] = [i32::MAX as u32, 65535, 65535];
const DEFAULT_DYNAMIC_SHARED: c_int = 48 << 10;
pub const MAX_DYNAMIC_SHARED_OPTIN: c_int = 227 << 10;

/// `CU_LAUNCH_PARAM_*` markers of `extra`.
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

struct Function {
    /// `CUfunction_attribute` values set with `cuFuncSetAttribute`.
    attributes: HashMap<c_int, c_int>,
    params: Option<Arc<[Param]>>,
}

#[derive(Default)]
struct Module {
    params: Option<ParamTable>,
    /// Its functions' handles, by name.
    functions: HashMap<String, usize>,
}

/// The driver's books of modules, functions and launches.
#[derive(Default)]
pub struct Kernels {
    modules: HashMap<usize, Module>,
    functions: HashMap<usize, Function>,
    /// Parameter tables of the fat binaries the runtime registered, by wrapper address (None:
    /// none could be read).
    fatbins: HashMap<usize, Option<ParamTable>>,
    /// Context limits set with `cuCtxSetLimit`, by `CUlimit`.
    limits: HashMap<c_int, usize>,
    pub launches: u64,
    /// Pointer arguments found in device memory, over all launches.
    pub pointer_arguments: u64,
    /// Launches whose parameter layout was not known (their arguments were not scanned).
    pub without_parameter_info: u64,
}

/// One device range a library call touches (`fake_cuda_library_work`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FakeCudaRange {
    pub start: u64,
    pub len: u64,
    pub write: u32,
}

/// Where a kernel's arguments are.
enum Arguments<'a> {
    /// `kernelParams`: one pointer per parameter, laid out as `params` says.
    PerParameter(*mut *mut c_void, Option<&'a [Param]>),
    /// `extra`'s packed buffer.
    Packed(*const u8, usize),
    None,
}

impl Driver {
    /// The words of the arguments that point into live device memory, each as a one-byte touch.
    fn scan(&self, arguments: &Arguments) -> Vec<Touch> {
        let mut words = Vec::new();
        match *arguments {
            Arguments::PerParameter(values, Some(params)) if !values.is_null() => {
                for (ordinal, param) in params.iter().enumerate() {
                    // SAFETY: `kernelParams` has one pointer per parameter, the launch contract.
                    let value = unsafe { *values.add(ordinal) }.cast::<u8>();
                    if value.is_null() {
                        continue;
                    }
                    let first = (8 - param.offset % 8) % 8;
                    for at in (first..param.size.saturating_sub(7)).step_by(8) {
                        // SAFETY: within the parameter's `size` bytes that `value` points to.
                        words
                            .push(unsafe { value.add(at as usize).cast::<u64>().read_unaligned() });
                    }
                }
            }
            Arguments::Packed(buffer, len) if !buffer.is_null() => {
                for at in (0..len.saturating_sub(7)).step_by(8) {
                    // SAFETY: within the `len` bytes of the caller's buffer.
                    words.push(unsafe { buffer.add(at).cast::<u64>().read_unaligned() });
                }
            }
            _ => {}
        }
        words.sort_unstable();
        words.dedup();
        words
            .into_iter()
            .filter(|&word| word != 0 && self.check_device_range(word, 1).is_ok())
            .map(|start| Touch {
                start,
                len: 1,
                write: true,
            })
            .collect()
    }

    /// A kernel's (or a library call's) touches that still lie in live, accessible device
    /// memory; a range no longer wholly live shrinks to its first byte, or goes. Unlike a copy's,
    /// a kernel's ranges are what the fake could tell, not what the kernel will touch, so a graph
    /// replayed after memory went is not taken for an illegal address on their account.
    pub fn live_kernel_touches(&self, touches: &[Touch]) -> Vec<Touch> {
        touches
            .iter()
            .filter_map(|t| {
                if self.check_device_range(t.start, t.len).is_ok() {
                    Some(*t)
                } else if self.check_device_range(t.start, 1).is_ok() {
                    Some(Touch { len: 1, ..*t })
                } else {
                    None
                }
            })
            .collect()
    }

    /// Submits a kernel launch to `stream`: checks its configuration, scans its arguments.
    fn launch(
        &mut self,
        stream: *mut c_void,
        grid: [u32; 3],
        block: [u32; 3],
        arguments: Arguments,
        what: &str,
    ) -> Outcome {
        self.require_primary_context()?;
        check_configuration(grid, block)?;
        let touches = self.scan(&arguments);
        self.kernels.launches += 1;
        self.kernels.pointer_arguments += touches.len() as u64;
        if matches!(arguments, Arguments::PerParameter(_, None)) {
            self.kernels.without_parameter_info += 1;
        }
        self.submit_step(stream, Step::Kernel(touches.into()), what)
    }

    fn function(&self, function: *mut c_void) -> Result<&Function, CuResult> {
        self.kernels
            .functions
            .get(&(function as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Launches a function of a loaded module; its dynamic shared memory may not exceed what
    /// the function allows (48 KiB unless raised with `cuFuncSetAttribute`).
    #[allow(clippy::too_many_arguments, reason = "cuLaunchKernel's own arguments")]
    fn launch_function(
        &mut self,
        function: *mut c_void,
        grid: [u32; 3],
        block: [u32; 3],
        shared: c_uint,
        stream: *mut c_void,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
        what: &str,
    ) -> Outcome {
        let found = self.function(function)?;
        let allowed = found
            .attributes
            .get(&FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .copied()
            .unwrap_or(DEFAULT_DYNAMIC_SHARED);
        if u64::from(shared) > u64::try_from(allowed).unwrap_or(0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let layout = found.params.clone();
        // SAFETY: `extra`, when given, is the NULL-terminated list the launch contract names.
        let arguments = match unsafe { packed_arguments(extra) }? {
            Some((buffer, len)) if params.is_null() => Arguments::Packed(buffer, len),
            Some(_) => return Err(CUDA_ERROR_INVALID_VALUE),
            None if params.is_null() => Arguments::None,
            None => Arguments::PerParameter(params, None),
        };
        let arguments = match arguments {
            Arguments::PerParameter(values, _) => {
                Arguments::PerParameter(values, layout.as_deref())
            }
            other => other,
        };
        self.launch(stream, grid, block, arguments, what)
    }

    fn new_function(&mut self, params: Option<Arc<[Param]>>) -> usize {
        let handle = self.new_handle() as usize;
        let function = Function {
            attributes: HashMap::new(),
            params,
        };
        self.kernels.functions.insert(handle, function);
        handle
    }

    /// The function `name` of `module` (one handle per name, as the driver gives).
    fn module_function(&mut self, module: usize, name: &str) -> Result<usize, CuResult> {
        let loaded = self
            .kernels
            .modules
            .get(&module)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(&handle) = loaded.functions.get(name) {
            return Ok(handle);
        }
        let params = match &loaded.params {
            // A cubin lists every kernel it holds: another name is not there.
            Some(table) => Some(table.get(name).cloned().ok_or(CUDA_ERROR_NOT_FOUND)?),
            None => None,
        };
        let handle = self.new_function(params);
        if let Some(loaded) = self.kernels.modules.get_mut(&module) {
            loaded.functions.insert(name.to_owned(), handle);
        }
        Ok(handle)
    }

    /// Loads a module image: a cubin, a fat binary or PTX text (NUL-terminated).
    ///
    /// # Safety
    /// `image` is NULL or points to a whole image.
    unsafe fn load_module(&mut self, image: *const c_void) -> Result<usize, CuResult> {
        self.require_primary_context()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller promises a whole image.
        let params = unsafe { cubin::image_params(image) };
        if params.is_none() && !looks_like_ptx(image) && !looks_like_binary(image) {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let handle = self.new_handle() as usize;
        let module = Module {
            params,
            functions: HashMap::new(),
        };
        self.kernels.modules.insert(handle, module);
        Ok(handle)
    }

    fn unload_module(&mut self, module: *mut c_void) -> Outcome {
        let removed = self
            .kernels
            .modules
            .remove(&(module as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for handle in removed.functions.values() {
            self.kernels.functions.remove(handle);
        }
        Ok(())
    }
}

/// The grid and block limits of a compute capability 9.0 device: a block of at most 1024
/// threads within (1024, 1024, 64), a grid within (2^31 - 1, 65535, 65535), none empty.
fn check_configuration(grid: [u32; 3], block: [u32; 3]) -> Outcome {
    let threads: u64 = block.iter().map(|&d| u64::from(d)).product();
    let fits = |dims: [u32; 3], max: [u32; 3]| dims.iter().zip(max).all(|(&d, m)| d >= 1 && d <= m);
    if threads > MAX_THREADS_PER_BLOCK || !fits(block, MAX_BLOCK_DIM) || !fits(grid, MAX_GRID_DIM) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// `extra`'s packed buffer and its size, if it gives one.
///
/// # Safety
/// `extra` is NULL or a list of (marker, value) pairs ending with `CU_LAUNCH_PARAM_END`.
unsafe fn packed_arguments(
    extra: *mut *mut c_void,
) -> Result<Option<(*const u8, usize)>, CuResult> {
    if extra.is_null() {
        return Ok(None);
    }
    let (mut buffer, mut size) = (None, None);
    let mut at = 0;
    loop {
        // SAFETY: the list's entries up to its end marker, by the caller's promise.
        let marker = unsafe { *extra.add(at) } as usize;
        match marker {
            LAUNCH_PARAM_END => break,
            LAUNCH_PARAM_BUFFER_POINTER => {
                // SAFETY: as above: each marker but the end is followed by its value.
                buffer = Some(unsafe { *extra.add(at + 1) }.cast_const().cast::<u8>());
            }
            LAUNCH_PARAM_BUFFER_SIZE => {
                // SAFETY: as above; the value points to a size_t.
                let value = unsafe { *extra.add(at + 1) }.cast::<usize>();
                // SAFETY: as above.
                size = Some(unsafe { get(value) }?);
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        at += 2;
    }
    match (buffer, size) {
        (Some(buffer), Some(size)) => Ok(Some((buffer, size))),
        (None, None) => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// PTX text starts with a comment or a directive.
fn looks_like_ptx(image: *const c_void) -> bool {
    // SAFETY: the image is at least NUL-terminated text or a binary header, 2 bytes either way.
    let head = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 2) };
    head == b"//" || head[0] == b'.' || head[0].is_ascii_whitespace()
}

/// A cubin or fat binary whose kernels' parameters could not be read (an LZ4 entry, say).
fn looks_like_binary(image: *const c_void) -> bool {
    // SAFETY: every image is at least 4 bytes long.
    let head = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 4) };
    head == b"\x7fELF" || head == 0xBA55_ED50u32.to_le_bytes()
}

/// The limits of an H100 (compute capability 9.0, what the fake's devices report) that kernel
/// compilers size their kernels by, by `CUdevice_attribute`: threads and block and grid
/// dimensions, shared memory (per block, opt-in, per multiprocessor), registers, warp size,
/// clocks (kHz), bus width, L2 cache, blocks and threads per multiprocessor.
pub fn device_limit(attribute: c_int) -> Option<c_int> {
    Some(match attribute {
        1 => 1024,
        2 | 3 => 1024,
        4 => 64,
        5 => i32::MAX,
        6 | 7 => 65535,
        8 => DEFAULT_DYNAMIC_SHARED,
        9 => 64 << 10,
        10 => 32,
        12 => 65536,
        13 => 1_980_000,
        31 | 41 => 1,
        36 => 2_619_000,
        37 => 5120,
        38 => 50 << 20,
        39 => 2048,
        40 => 2,
        81 => 228 << 10,
        82 => 65536,
        97 => MAX_DYNAMIC_SHARED_OPTIN,
        106 => 32,
        _ => return None,
    })
}

// ---- Modules and libraries -----------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> CuResult {
    call("cuModuleLoadData", |driver| {
        // SAFETY: the caller's image, by the driver API contract.
        let handle = unsafe { driver.load_module(image) }?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(module, handle as *mut c_void) }
    })
}

/// JIT options change nothing here: the image is not compiled.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut *mut c_void,
    image: *const c_void,
    _options: c_uint,
    _keys: *mut c_int,
    _values: *mut *mut c_void,
) -> CuResult {
    call("cuModuleLoadDataEx", |driver| {
        // SAFETY: the caller's image, by the driver API contract.
        let handle = unsafe { driver.load_module(image) }?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(module, handle as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadFatBinary(
    module: *mut *mut c_void,
    image: *const c_void,
) -> CuResult {
    call("cuModuleLoadFatBinary", |driver| {
        // SAFETY: the caller's image, by the driver API contract.
        let handle = unsafe { driver.load_module(image) }?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(module, handle as *mut c_void) }
    })
}

/// A module image from a file (a cubin, a fat binary or PTX), read whole; a file that cannot be
/// read is `CUDA_ERROR_FILE_NOT_FOUND`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut *mut c_void, path: *const c_char) -> CuResult {
    call("cuModuleLoad", |driver| {
        // SAFETY: the caller's NUL-terminated path, by the driver API contract.
        let path = unsafe { name_of(path) }?;
        let mut image = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        // PTX text must end with its NUL, as an image in memory does.
        image.push(0);
        // SAFETY: the whole file, in memory for the call.
        let handle = unsafe { driver.load_module(image.as_ptr().cast()) }?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(module, handle as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: *mut c_void) -> CuResult {
    call("cuModuleUnload", |driver| driver.unload_module(module))
}

/// # Safety
/// `name` is NULL or NUL-terminated.
unsafe fn name_of(name: *const c_char) -> Result<String, CuResult> {
    if name.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: NUL-terminated by the caller's promise.
    Ok(unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CuResult {
    call("cuModuleGetFunction", |driver| {
        // SAFETY: the caller's name, by the driver API contract.
        let name = unsafe { name_of(name) }?;
        let handle = driver.module_function(module as usize, &name)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(function, handle as *mut c_void) }
    })
}

/// A library (CUDA 12's context-independent loading) is a module here; its kernels are its
/// functions.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut *mut c_void,
    code: *const c_void,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _jit_count: c_uint,
    _library_options: *mut c_int,
    _library_values: *mut *mut c_void,
    _library_count: c_uint,
) -> CuResult {
    call("cuLibraryLoadData", |driver| {
        // SAFETY: the caller's image, by the driver API contract.
        let handle = unsafe { driver.load_module(code) }?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(library, handle as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLibraryUnload(library: *mut c_void) -> CuResult {
    call("cuLibraryUnload", |driver| driver.unload_module(library))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetKernel(
    kernel: *mut *mut c_void,
    library: *mut c_void,
    name: *const c_char,
) -> CuResult {
    call("cuLibraryGetKernel", |driver| {
        // SAFETY: the caller's name, by the driver API contract.
        let name = unsafe { name_of(name) }?;
        let handle = driver.module_function(library as usize, &name)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(kernel, handle as *mut c_void) }
    })
}

/// A kernel's function in the current context: the same handle here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetFunction(
    function: *mut *mut c_void,
    kernel: *mut c_void,
) -> CuResult {
    call("cuKernelGetFunction", |driver| {
        driver.require_primary_context()?;
        driver.function(kernel)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(function, kernel) }
    })
}

// ---- Function attributes and occupancy -----------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    function: *mut c_void,
) -> CuResult {
    call("cuFuncGetAttribute", |driver| {
        let found = driver.function(function)?;
        if !(0..FUNC_ATTRIBUTE_MAX).contains(&attribute) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let answer = found
            .attributes
            .get(&attribute)
            .copied()
            .unwrap_or(match attribute {
                FUNC_MAX_THREADS_PER_BLOCK => MAX_THREADS_PER_BLOCK as c_int,
                FUNC_NUM_REGS => 32,
                FUNC_PTX_VERSION | FUNC_BINARY_VERSION => 90,
                FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES => DEFAULT_DYNAMIC_SHARED,
                FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT => -1,
                // Static shared, constant and local memory, spills: none.
                _ => 0,
            });
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(value, answer) }
    })
}

/// Only the settable attributes; dynamic shared memory up to the device's opt-in maximum.
#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetAttribute(
    function: *mut c_void,
    attribute: c_int,
    value: c_int,
) -> CuResult {
    call("cuFuncSetAttribute", |driver| {
        let valid = match attribute {
            FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES => (0..=MAX_DYNAMIC_SHARED_OPTIN).contains(&value),
            FUNC_PREFERRED_SHARED_MEMORY_CARVEOUT => (-1..=100).contains(&value),
            10..FUNC_ATTRIBUTE_MAX => true,
            _ => false,
        };
        if !valid {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver
            .kernels
            .functions
            .get_mut(&(function as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .attributes
            .insert(attribute, value);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetCacheConfig(function: *mut c_void, _config: c_int) -> CuResult {
    call("cuFuncSetCacheConfig", |driver| {
        driver.function(function).map(drop)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetSharedMemConfig(function: *mut c_void, _config: c_int) -> CuResult {
    call("cuFuncSetSharedMemConfig", |driver| {
        driver.function(function).map(drop)
    })
}

/// Blocks of `block_size` threads that fit on one multiprocessor (2048 threads, 32 blocks),
/// for functions of the fake's 32 registers and no shared memory.
fn blocks_per_multiprocessor(block_size: c_int) -> c_int {
    if block_size <= 0 {
        return 0;
    }
    (2048 / block_size).min(32)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    function: *mut c_void,
    block_size: c_int,
    _shared: usize,
) -> CuResult {
    call("cuOccupancyMaxActiveBlocksPerMultiprocessor", |driver| {
        driver.function(function)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(blocks, blocks_per_multiprocessor(block_size)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    blocks: *mut c_int,
    function: *mut c_void,
    block_size: c_int,
    _shared: usize,
    _flags: c_uint,
) -> CuResult {
    call(
        "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
        |driver| {
            driver.function(function)?;
            // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
            unsafe { put(blocks, blocks_per_multiprocessor(block_size)) }
        },
    )
}

/// The block size that fills a multiprocessor best: 1024 threads, or the limit given.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxPotentialBlockSize(
    min_grid: *mut c_int,
    block_size: *mut c_int,
    function: *mut c_void,
    _shared_for_block: *mut c_void,
    _shared: usize,
    limit: c_int,
) -> CuResult {
    call("cuOccupancyMaxPotentialBlockSize", |driver| {
        driver.function(function)?;
        let size = if limit > 0 { limit.min(1024) } else { 1024 };
        // SAFETY: out pointers from the caller, valid for writes by the driver API contract.
        unsafe {
            put(min_grid, 132 * blocks_per_multiprocessor(size))?;
            put(block_size, size)
        }
    })
}

/// One cluster per multiprocessor pair: what an H100 answers for small clusters.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveClusters(
    clusters: *mut c_int,
    function: *mut c_void,
    _config: *const c_void,
) -> CuResult {
    call("cuOccupancyMaxActiveClusters", |driver| {
        driver.function(function)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(clusters, 66) }
    })
}

// ---- Launches ------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    function: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    call("cuLaunchKernel", |driver| {
        driver.launch_function(
            function,
            [grid_x, grid_y, grid_z],
            [block_x, block_y, block_z],
            shared,
            stream,
            params,
            extra,
            "a kernel",
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    function: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
) -> CuResult {
    call("cuLaunchCooperativeKernel", |driver| {
        driver.launch_function(
            function,
            [grid_x, grid_y, grid_z],
            [block_x, block_y, block_z],
            shared,
            stream,
            params,
            std::ptr::null_mut(),
            "a cooperative kernel",
        )
    })
}

/// `CUlaunchConfig`: the grid, the block, dynamic shared memory and the stream (its attributes,
/// clusters and the like, change nothing here).
#[repr(C)]
pub struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    stream: *mut c_void,
    attributes: *mut c_void,
    attribute_count: c_uint,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    function: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    call("cuLaunchKernelEx", |driver| {
        if config.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: not NULL; a CUlaunchConfig by the driver API contract.
        let config = unsafe { &*config };
        driver.launch_function(
            function,
            config.grid,
            config.block,
            config.shared,
            config.stream,
            params,
            extra,
            "a kernel",
        )
    })
}

/// The runtime's launch of a kernel registered with `__cudaRegisterFunction`: `fatbin` is the
/// wrapper `__cudaRegisterFatBinary` received (NULL if unknown), `name` the device function's
/// name, `args` the runtime's `void **args`. The parameter layout is read from the fat binary
/// the first time one of its kernels launches.
///
/// # Safety
/// `fatbin` is NULL or a registered wrapper whose binary is loaded; `name` is NULL or
/// NUL-terminated; `args` holds one pointer per parameter.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_launch_registered(
    stream: *mut c_void,
    fatbin: *const c_void,
    name: *const c_char,
    args: *mut *mut c_void,
    grid: *const [c_uint; 3],
    block: *const [c_uint; 3],
) -> CuResult {
    call("fake_cuda_launch_registered", |driver| {
        // SAFETY: the caller's dimensions.
        let (grid, block) = unsafe { (get(grid)?, get(block)?) };
        let table = driver
            .kernels
            .fatbins
            .entry(fatbin as usize)
            // SAFETY: a registered wrapper, by the caller's promise.
            .or_insert_with(|| unsafe { cubin::fatbin_params(fatbin) });
        let params = if name.is_null() {
            None
        } else {
            // SAFETY: NUL-terminated by the caller's promise.
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
            table.as_ref().and_then(|t| t.get(name.as_ref()).cloned())
        };
        driver.launch(
            stream,
            grid,
            block,
            Arguments::PerParameter(args, params.as_deref()),
            "a kernel",
        )
    })
}

/// Work of a math or communication library (cuBLAS, cuDNN, NCCL, ...) on `stream`: pending like
/// a kernel, touching the `count` ranges given (a range not wholly in live device memory counts
/// by its first byte, or not at all).
///
/// # Safety
/// `ranges` holds `count` ranges; `what` is NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_library_work(
    stream: *mut c_void,
    ranges: *const FakeCudaRange,
    count: usize,
    what: *const c_char,
) -> CuResult {
    call("fake_cuda_library_work", |driver| {
        driver.require_primary_context()?;
        let ranges = if ranges.is_null() || count == 0 {
            &[][..]
        } else {
            // SAFETY: `count` ranges, by the caller's promise.
            unsafe { std::slice::from_raw_parts(ranges, count) }
        };
        let touches: Vec<Touch> = ranges
            .iter()
            .filter(|r| r.start != 0 && r.len > 0)
            .map(|r| Touch {
                start: r.start,
                len: r.len,
                write: r.write != 0,
            })
            .collect();
        let live = driver.live_kernel_touches(&touches);
        let what = if what.is_null() {
            "a library call".to_owned()
        } else {
            // SAFETY: NUL-terminated by the caller's promise.
            unsafe { CStr::from_ptr(what) }
                .to_string_lossy()
                .into_owned()
        };
        driver.kernels.launches += 1;
        driver.submit_step(stream, Step::Kernel(live.into()), &what)
    })
}

// ---- Context limits ------------------------------------------------------------------------

/// `CUlimit` values and what the driver starts with: stack size per thread, the `printf` FIFO,
/// the device `malloc` heap, device-runtime depth and pending launches, L2 fetch granularity,
/// persisting L2 cache.
const LIMIT_DEFAULTS: [(c_int, usize); 7] = [
    (0, 1024),
    (1, 1 << 20),
    (2, 8 << 20),
    (3, 2),
    (4, 2048),
    (5, 32),
    (6, 0),
];

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(value: *mut usize, limit: c_int) -> CuResult {
    call("cuCtxGetLimit", |driver| {
        driver.require_primary_context()?;
        let default = LIMIT_DEFAULTS
            .iter()
            .find(|(known, _)| *known == limit)
            .map(|&(_, v)| v)
            .ok_or(CUDA_ERROR_UNSUPPORTED_LIMIT)?;
        let answer = driver
            .kernels
            .limits
            .get(&limit)
            .copied()
            .unwrap_or(default);
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(value, answer) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CuResult {
    call("cuCtxSetLimit", |driver| {
        driver.require_primary_context()?;
        if !LIMIT_DEFAULTS.iter().any(|(known, _)| *known == limit) {
            return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        driver.kernels.limits.insert(limit, value);
        Ok(())
    })
}
