//! Math and communication libraries that succeed and do nothing: the hand-written part of the
//! fake cuBLAS, cuBLASLt, cuDNN, NCCL, cuFFT, cuSPARSE and cuSOLVER.
//!
//! `build.py` generates a stub for every function PyTorch imports from these libraries; only
//! the functions that must answer something (a handle to write, a size or an algorithm to
//! report, a version) or that do work on a stream are written here. Work is pending on its
//! stream, booked by the fake driver as a kernel (`fake_cuda_library_work`): the ordering check
//! sees the device ranges each call reads and writes. No value is computed: outputs hold
//! whatever bytes the memory held, except NCCL's, which move as if every rank held this rank's
//! bytes (see `nccl.rs`).
//!
//! One static library, linked into each library's `.so`: each exports its own functions (by
//! the version script `build.py` writes), and keeps its own state.

#![allow(
    non_snake_case,
    non_camel_case_types,
    reason = "the exports carry the libraries' names"
)]
#![allow(
    clippy::missing_safety_doc,
    reason = "every export has the contract of the library function of the same name"
)]
#![allow(
    clippy::too_many_arguments,
    reason = "the exports take the libraries' own arguments"
)]

mod cublas;
mod cublaslt;
mod cudnn;
mod nccl;
mod others;

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard};

/// One device range a library call touches, as the fake driver takes it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub start: u64,
    pub len: u64,
    pub write: u32,
}

impl Range {
    pub fn read(start: *const c_void, len: u64) -> Range {
        Range {
            start: start as u64,
            len,
            write: 0,
        }
    }

    pub fn write(start: *const c_void, len: u64) -> Range {
        Range {
            start: start as u64,
            len,
            write: 1,
        }
    }
}

unsafe extern "C" {
    /// The fake driver's books of work (`driver/src/launch.rs`).
    fn fake_cuda_library_work(
        stream: *mut c_void,
        ranges: *const Range,
        count: usize,
        what: *const c_char,
    ) -> u32;
}

/// Books a library call as pending work on `stream` that touches `ranges`; the driver's
/// result (0, or a `CUresult` such as an invalidated capture's).
#[allow(
    clippy::not_unsafe_ptr_arg_deref,
    reason = "the stream is an opaque handle the driver looks up, never dereferenced"
)]
pub fn work(stream: *mut c_void, ranges: &[Range], what: &'static std::ffi::CStr) -> u32 {
    if logging() {
        eprintln!("[fake-cuda-libs] {what:?} on stream {stream:?}: {ranges:x?}");
    }
    // SAFETY: `ranges.len()` ranges and a NUL-terminated name.
    unsafe { fake_cuda_library_work(stream, ranges.as_ptr(), ranges.len(), what.as_ptr()) }
}

/// Whether `FAKE_CUDA_LOG` asks for a line per library call that books work, on stderr.
pub fn logging() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FAKE_CUDA_LOG").is_some())
}

/// Runs an export's body; a panic becomes `failure` (nothing may unwind into the caller).
pub fn guard<T: Copy>(failure: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(failure)
}

/// Writes through an out pointer; false when it is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub unsafe fn put<T>(out: *mut T, value: T) -> bool {
    if out.is_null() {
        return false;
    }
    // SAFETY: not NULL, and the caller promises it is writable.
    unsafe { out.write(value) };
    true
}

/// Objects of one kind (handles, descriptors), by the opaque pointer the library hands out.
pub struct Registry<T> {
    objects: Mutex<Option<HashMap<usize, T>>>,
    /// Distinguishes the kinds' numbers (a handle of one kind is never mistaken for another's).
    tag: usize,
}

impl<T> Registry<T> {
    pub const fn new(tag: usize) -> Registry<T> {
        Registry {
            objects: Mutex::new(None),
            tag,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<HashMap<usize, T>>> {
        self.objects
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps `object`; its new opaque handle (never NULL).
    pub fn add(&self, object: T) -> *mut c_void {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        let handle = (self.tag << 40) | (number << 4);
        self.lock()
            .get_or_insert_with(HashMap::new)
            .insert(handle, object);
        handle as *mut c_void
    }

    pub fn remove(&self, handle: *mut c_void) -> Option<T> {
        self.lock().as_mut()?.remove(&(handle as usize))
    }

    /// Runs `f` on the object of `handle`, if there is one.
    pub fn with<R>(&self, handle: *const c_void, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.lock().as_mut()?.get_mut(&(handle as usize)).map(f)
    }

    pub fn contains(&self, handle: *const c_void) -> bool {
        self.with(handle, |_| ()).is_some()
    }

    /// Keeps only the objects `keep` accepts.
    pub fn retain(&self, mut keep: impl FnMut(&T) -> bool) {
        if let Some(objects) = self.lock().as_mut() {
            objects.retain(|_, object| keep(object));
        }
    }

    /// Every live object, copied.
    pub fn values(&self) -> Vec<T>
    where
        T: Clone,
    {
        self.lock()
            .as_ref()
            .map_or_else(Vec::new, |objects| objects.values().cloned().collect())
    }
}

/// Bytes per element of a `cudaDataType`; 0 for one the fake does not know (its ranges then
/// count by their first byte).
pub fn data_type_size(data_type: i32) -> u64 {
    match data_type {
        // R_32F, R_32I, R_32U, C_16F, C_16BF
        0 | 10 | 12 | 6 | 15 => 4,
        // R_64F, C_32F, R_64I, R_64U
        1 | 4 | 24 | 26 => 8,
        // R_16F, R_16BF, R_16I, R_16U
        2 | 14 | 20 | 22 => 2,
        // R_8I, R_8U, R_8F_E4M3, R_8F_E5M2, C_8I, C_8U
        3 | 8 | 28 | 29 => 1,
        7 | 9 => 2,
        // C_64F
        5 => 16,
        _ => 0,
    }
}

/// The extent, in elements, of a column-major `rows` x `cols` matrix with leading dimension
/// `ld`: `ld * (cols - 1) + rows`; 0 when empty.
pub fn matrix_elements(rows: i64, cols: i64, ld: i64) -> u64 {
    if rows <= 0 || cols <= 0 {
        return 0;
    }
    u64::try_from(ld.max(rows) * (cols - 1) + rows).unwrap_or(0)
}
