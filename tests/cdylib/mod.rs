//! Finding the built `libferrocache.so`, and loading it as PyTorch does (dlopen by path).

#![allow(
    dead_code,
    reason = "each test binary uses its own part of the helpers"
)]

use std::path::{Path, PathBuf};

/// The cdylib that cargo built with this test binary: it lies beside it, in `target/*/deps`.
pub fn library_path() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary lies in a directory");
    let library = deps.join("libferrocache.so");
    assert!(
        library.exists(),
        "{} is missing: cargo builds it with the tests (crate-type cdylib)",
        library.display()
    );
    library
}

/// A directory that holds no libcuda, for a library search path without a driver.
pub fn empty_library_dir() -> PathBuf {
    let empty = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-libcuda");
    std::fs::create_dir_all(&empty).expect("create an empty library directory");
    empty
}

/// Why a test that needs "no driver at all" cannot run here: a real libcuda is installed where
/// the dynamic loader finds it even with an empty `LD_LIBRARY_PATH`.
pub fn real_driver_installed() -> Option<String> {
    // SAFETY: loading the system's libcuda runs its initialisers only, as any CUDA program does.
    match unsafe { libloading::Library::new("libcuda.so.1") } {
        Ok(_) => Some("a real libcuda.so.1 is installed on this machine".to_string()),
        Err(_) => None,
    }
}

/// `libferrocache.so`, opened by path, with typed look-ups.
pub struct Ferrocache {
    library: libloading::Library,
}

impl Ferrocache {
    pub fn open() -> Ferrocache {
        Ferrocache::open_at(&library_path())
    }

    /// Another build of the library (a benchmark's baseline), beside this one in the process:
    /// dlopen keeps each one's symbols to itself.
    pub fn open_at(path: &Path) -> Ferrocache {
        // SAFETY: ferrocache has no initialisers that run at load time.
        let library = unsafe { libloading::Library::new(path) }
            .unwrap_or_else(|e| panic!("load {}: {e}", path.display()));
        Ferrocache { library }
    }

    /// The exported function `name`; `T` must be its exact C signature.
    pub fn function<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every caller names an export of the C ABI and gives its signature.
        *unsafe { self.library.get::<T>(name.as_bytes()) }
            .unwrap_or_else(|e| panic!("libferrocache.so lacks {name}: {e}"))
    }

    /// The address of the export `name`, for C++ that calls it with its C++ type.
    pub fn address(&self, name: &str) -> *mut std::ffi::c_void {
        self.function(name)
    }

    /// `ferrocache_last_error()`: why this thread's last call failed, or "".
    pub fn last_error(&self) -> String {
        let last_error: unsafe extern "C" fn() -> *const std::ffi::c_char =
            self.function("ferrocache_last_error");
        // SAFETY: a NUL-terminated string, valid until our next call on this thread.
        unsafe { std::ffi::CStr::from_ptr(last_error()) }
            .to_string_lossy()
            .into_owned()
    }
}
