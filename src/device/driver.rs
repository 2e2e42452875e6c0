//! Which CUDA driver library ferrocache calls, and the table of its functions.
//!
//! cudarc's loader opens the first of `libcuda.so`, ..., `libcuda.so.1` that the library search
//! path yields, and cannot be pointed at another. `libcuda.so` is what a CUDA toolkit's
//! `stubs/` directory holds (every call answers `CUDA_ERROR_STUB_LIBRARY`), and a compat
//! directory may hold a second driver: either on the path ahead of the driver PyTorch uses
//! would give ferrocache a library of its own, with contexts of its own. So ferrocache resolves
//! its driver functions itself, from one library chosen by [`choose_driver_library`]:
//! - the driver already loaded in the process (PyTorch's CUDA runtime loaded it), found among
//!   the loaded objects (`dl_iterate_phdr`) and opened with `RTLD_NOLOAD`, so it is that very
//!   library;
//! - with none loaded, `libcuda.so.1`, the name the NVIDIA driver installs and the CUDA runtime
//!   opens, and only then `libcuda.so`;
//! - two different driver libraries loaded, or a stub, are refused with one message each.
//!
//! [`sys`] is cudarc's `driver::sys` with each function this crate calls replaced by one that
//! goes through the table; its types are cudarc's.

use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;

/// The chosen driver library and its functions.
struct DriverLibrary {
    path: String,
    functions: sys::Functions,
    /// Keeps the library loaded (and the function pointers valid) for the process's life.
    _library: libloading::Library,
}

static DRIVER: OnceLock<Result<DriverLibrary, String>> = OnceLock::new();

/// Chooses and opens the driver library, once per process; the reason it could not be used.
pub fn load() -> Result<(), String> {
    DRIVER
        .get_or_init(|| {
            let (path, library) = choose_driver_library()?;
            let functions = sys::Functions::resolve(&path, &library)?;
            crate::logging::driver_library(&path);
            Ok(DriverLibrary {
                path,
                functions,
                _library: library,
            })
        })
        .as_ref()
        .map(drop)
        .map_err(String::clone)
}

fn functions() -> Option<&'static sys::Functions> {
    match DRIVER.get() {
        Some(Ok(driver)) => Some(&driver.functions),
        _ => None,
    }
}

/// The names a driver installation gives its library, in the order ferrocache opens them when
/// none is loaded: the versioned name first, as NVIDIA's runtime does.
pub const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The driver library to use: the one already loaded, else the first of [`LIBRARY_NAMES`] that
/// loads. Two different ones loaded is an error that names both.
fn choose_driver_library() -> Result<(String, libloading::Library), String> {
    let loaded = loaded_driver_libraries();
    match loaded.as_slice() {
        [] => open_first(&LIBRARY_NAMES),
        [path] => open_loaded(path).map(|library| (path.clone(), library)),
        [first, second, ..] => Err(format!(
            "two different CUDA driver libraries are loaded in this process, {first} and \
             {second}; ferrocache would not know which one PyTorch uses (a CUDA toolkit's stubs/ \
             or compat/ directory on LD_LIBRARY_PATH ahead of the NVIDIA driver's libcuda.so.1 \
             does this): take that directory off the library path"
        )),
    }
}

/// Whether a loaded object's path names a CUDA driver library (`libcuda.so`, `libcuda.so.1`,
/// `libcuda.so.580.65.06`, ...).
fn is_driver_library_path(path: &str) -> bool {
    let file = path.rsplit('/').next().unwrap_or(path);
    file == "libcuda.so" || file.starts_with("libcuda.so.")
}

/// The paths of the CUDA driver libraries loaded in this process, in load order.
fn loaded_driver_libraries() -> Vec<String> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        found: *mut c_void,
    ) -> c_int {
        // SAFETY: `found` is the Vec passed to dl_iterate_phdr below; `info` is valid for the
        // length of this call, and its name is NULL or a NUL-terminated string.
        unsafe {
            let found = &mut *found.cast::<Vec<String>>();
            let name = (*info).dlpi_name;
            if !name.is_null() {
                let path = CStr::from_ptr(name).to_string_lossy();
                if is_driver_library_path(&path) {
                    found.push(path.into_owned());
                }
            }
        }
        0
    }
    let mut found: Vec<String> = Vec::new();
    // SAFETY: the callback only reads what the loader hands it and pushes to `found`, which
    // outlives the call; it never unwinds (no panicking operation in it).
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast::<c_void>()) };
    found
}

/// Opens a library that is already loaded, without loading anything new.
fn open_loaded(path: &str) -> Result<libloading::Library, String> {
    // SAFETY: the library is loaded already, so no initialiser runs; RTLD_NOLOAD refuses
    // anything else.
    let library = unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libc::RTLD_NOLOAD,
        )
    };
    library.map(libloading::Library::from).map_err(|e| {
        format!(
            "could not open the loaded CUDA driver {path}: {}",
            with_source(&e)
        )
    })
}

/// Opens the first library in `candidates` that loads, in order.
pub(crate) fn open_first(candidates: &[&str]) -> Result<(String, libloading::Library), String> {
    let mut failures = Vec::new();
    for candidate in candidates {
        // SAFETY: loading libcuda runs its initialisers, which is what loading a driver means.
        match unsafe { libloading::Library::new(*candidate) } {
            Ok(library) => return Ok((candidate.to_string(), library)),
            Err(e) => failures.push(with_source(&e)),
        }
    }
    // "No such file" for every name is the common case; anything else (a broken or foreign
    // library) is the more useful thing to show.
    let reason = failures
        .iter()
        .find(|f| !f.contains("No such file"))
        .or(failures.first())
        .cloned()
        .unwrap_or_else(|| "no names to try".to_string());
    Err(format!(
        "ferrocache could not load the CUDA driver library libcuda.so.1 (nor {}): {reason}; is \
         an NVIDIA driver installed, and is the directory holding libcuda.so.1 on the library \
         search path?",
        candidates.get(1..).unwrap_or_default().join(", ")
    ))
}

/// libloading's errors say only "dlopen failed"; the reason (dlerror's text) is their source.
pub(crate) fn with_source(error: &libloading::Error) -> String {
    match std::error::Error::source(error) {
        Some(source) => source.to_string(),
        None => error.to_string(),
    }
}

/// Why a driver library that answered `CUDA_ERROR_STUB_LIBRARY` cannot be used: a CUDA
/// toolkit's `stubs/libcuda.so` answers every call so; it exists for linking, never for running.
pub fn stub_message() -> String {
    let path = match DRIVER.get() {
        Some(Ok(driver)) => driver.path.as_str(),
        _ => "libcuda.so",
    };
    format!(
        "the CUDA driver library {path} is a stub (CUDA_ERROR_STUB_LIBRARY): a CUDA toolkit's \
         stubs/ directory is on the library search path ahead of the NVIDIA driver's \
         libcuda.so.1; take it off LD_LIBRARY_PATH"
    )
}

/// Declares the driver functions ferrocache calls: [`sys::REQUIRED_SYMBOLS`], the table that
/// holds them, and one function per name that calls through the table (or, before [`load`]
/// succeeded, answers `CUDA_ERROR_NOT_INITIALIZED`).
macro_rules! driver_functions {
    ($(fn $name:ident($($arg:ident: $type:ty),* $(,)?);)*) => {
        /// Every driver function ferrocache calls; [`load`](super::load) checks that the library
        /// has them all, so that a missing one is an error and never a crash.
        pub const REQUIRED_SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        #[allow(non_snake_case, reason = "the driver's function names")]
        pub(super) struct Functions {
            $(pub(super) $name: unsafe extern "C" fn($($type),*) -> CUresult,)*
        }

        impl Functions {
            /// Looks every function up in `library`; names all the missing ones.
            #[allow(non_snake_case, reason = "the driver's function names")]
            pub(super) fn resolve(
                path: &str,
                library: &libloading::Library,
            ) -> Result<Functions, String> {
                let mut missing: Vec<&str> = Vec::new();
                $(
                    // SAFETY: the type is the driver API's signature of this function.
                    let $name = unsafe {
                        library.get::<unsafe extern "C" fn($($type),*) -> CUresult>(
                            stringify!($name).as_bytes(),
                        )
                    }
                    .map(|symbol| *symbol)
                    .inspect_err(|_| missing.push(stringify!($name)))
                    .ok();
                )*
                match ($($name,)*) {
                    ($(Some($name),)*) => Ok(Functions { $($name,)* }),
                    _ => Err(super::missing_symbols_message(path, &missing)),
                }
            }
        }

        $(
            #[allow(non_snake_case, clippy::missing_safety_doc, reason = "the driver's API")]
            pub unsafe fn $name($($arg: $type),*) -> CUresult {
                match super::functions() {
                    // SAFETY: the caller keeps the driver function's contract.
                    Some(functions) => unsafe { (functions.$name)($($arg),*) },
                    None => CUresult::CUDA_ERROR_NOT_INITIALIZED,
                }
            }
        )*
    };
}

/// The message for a driver library that lacks some of [`sys::REQUIRED_SYMBOLS`].
fn missing_symbols_message(path: &str, missing: &[&str]) -> String {
    format!(
        "the CUDA driver library {path} lacks {}, which ferrocache needs; is the NVIDIA driver \
         older than CUDA 12.0?",
        missing.join(", ")
    )
}

/// cudarc's driver types, and the functions ferrocache calls, through the chosen library.
pub mod sys {
    use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

    pub use cudarc::driver::sys::*;

    driver_functions! {
        fn cuInit(flags: c_uint);
        fn cuDriverGetVersion(version: *mut c_int);
        fn cuGetErrorString(error: CUresult, text: *mut *const c_char);
        fn cuDeviceGetCount(count: *mut c_int);
        fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
        fn cuDeviceGetName(name: *mut c_char, len: c_int, device: CUdevice);
        fn cuDeviceGetAttribute(value: *mut c_int, attribute: CUdevice_attribute, device: CUdevice);
        fn cuDeviceCanAccessPeer(can_access: *mut c_int, device: CUdevice, peer: CUdevice);
        fn cuDevicePrimaryCtxRetain(context: *mut CUcontext, device: CUdevice);
        fn cuDevicePrimaryCtxRelease_v2(device: CUdevice);
        fn cuCtxGetCurrent(context: *mut CUcontext);
        fn cuCtxPushCurrent_v2(context: CUcontext);
        fn cuCtxPopCurrent_v2(context: *mut CUcontext);
        fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, size: usize);
        fn cuMemFree_v2(ptr: CUdeviceptr);
        fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
        fn cuStreamIsCapturing(stream: CUstream, status: *mut CUstreamCaptureStatus);
        fn cuThreadExchangeStreamCaptureMode(mode: *mut CUstreamCaptureMode);
        fn cuStreamSynchronize(stream: CUstream);
        fn cuEventCreate(event: *mut CUevent, flags: c_uint);
        fn cuEventDestroy_v2(event: CUevent);
        fn cuEventRecord(event: CUevent, stream: CUstream);
        fn cuEventQuery(event: CUevent);
        fn cuEventSynchronize(event: CUevent);
        fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint);
        fn cuStreamGetCtx(stream: CUstream, context: *mut CUcontext);
        fn cuMemGetAllocationGranularity(
            granularity: *mut usize,
            prop: *const CUmemAllocationProp,
            option: CUmemAllocationGranularity_flags,
        );
        fn cuMemAddressReserve(
            ptr: *mut CUdeviceptr,
            size: usize,
            alignment: usize,
            addr: CUdeviceptr,
            flags: c_ulonglong,
        );
        fn cuMemAddressFree(ptr: CUdeviceptr, size: usize);
        fn cuMemCreate(
            handle: *mut CUmemGenericAllocationHandle,
            size: usize,
            prop: *const CUmemAllocationProp,
            flags: c_ulonglong,
        );
        fn cuMemRelease(handle: CUmemGenericAllocationHandle);
        fn cuMemMap(
            ptr: CUdeviceptr,
            size: usize,
            offset: usize,
            handle: CUmemGenericAllocationHandle,
            flags: c_ulonglong,
        );
        fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
        fn cuMemUnmap(ptr: CUdeviceptr, size: usize);
        fn cuCtxSynchronize();
        fn cuMemcpyDtoH_v2(host: *mut std::ffi::c_void, ptr: CUdeviceptr, size: usize);
        fn cuMemcpyHtoD_v2(ptr: CUdeviceptr, host: *const std::ffi::c_void, size: usize);
        fn cuMemHostAlloc(host: *mut *mut std::ffi::c_void, size: usize, flags: c_uint);
        fn cuMemFreeHost(host: *mut std::ffi::c_void);
        fn cuStreamCreate(stream: *mut CUstream, flags: c_uint);
        fn cuMemcpyDtoHAsync_v2(
            host: *mut std::ffi::c_void,
            ptr: CUdeviceptr,
            size: usize,
            stream: CUstream,
        );
        fn cuMemcpyHtoDAsync_v2(
            ptr: CUdeviceptr,
            host: *const std::ffi::c_void,
            size: usize,
            stream: CUstream,
        );
        fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, ptr: CUdeviceptr);
        fn cuIpcOpenMemHandle_v2(ptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint);
        fn cuIpcCloseMemHandle(ptr: CUdeviceptr);
        fn cuMemExportToShareableHandle(
            shareable: *mut std::ffi::c_void,
            handle: CUmemGenericAllocationHandle,
            handle_type: CUmemAllocationHandleType,
            flags: c_ulonglong,
        );
        fn cuMemImportFromShareableHandle(
            handle: *mut CUmemGenericAllocationHandle,
            shareable: *mut std::ffi::c_void,
            handle_type: CUmemAllocationHandleType,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_reported_by_name_without_panicking() {
        let candidates = [
            "libferrocache-no-such-driver.so.1",
            "libferrocache-no-such-driver.so",
        ];
        let message = open_first(&candidates).err().unwrap_or_default();
        assert!(message.contains("could not load the CUDA driver library libcuda.so.1"));
        // dlerror's words, not just libloading's "dlopen failed".
        assert!(
            message.contains("cannot open shared object file"),
            "{message}"
        );
        assert!(message.contains("libferrocache-no-such-driver.so"));
        assert!(message.contains("NVIDIA driver installed"));
    }

    #[test]
    fn missing_symbols_are_all_named() {
        let (name, library) = open_first(&["libc.so.6"]).expect("libc is always there");
        let message = sys::Functions::resolve(&name, &library)
            .err()
            .unwrap_or_default();
        assert!(
            message.contains("libc.so.6 lacks cuInit, cuDriverGetVersion"),
            "{message}"
        );
        assert!(message.contains("cuMemUnmap"), "{message}");
    }

    #[test]
    fn driver_library_paths_are_recognised_by_file_name() {
        for path in [
            "libcuda.so",
            "libcuda.so.1",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
            "/usr/local/cuda/lib64/stubs/libcuda.so",
        ] {
            assert!(is_driver_library_path(path), "{path}");
        }
        for path in [
            "",
            "/usr/lib/libcudart.so.13",
            "/opt/libcuda.so-backup/libc.so.6",
        ] {
            assert!(!is_driver_library_path(path), "{path}");
        }
    }
}
