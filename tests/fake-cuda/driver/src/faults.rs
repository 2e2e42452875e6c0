//! Fault sweeps: "fail the i-th driver call", counted over every driver function together, and
//! over the fake runtime's functions too where the runtime is loaded (it reports each of its
//! calls through [`fake_cuda_sweep_runtime_call`]).
//!
//! A test arms the sweep with [`fake_cuda_sweep_arm`]; from then on every driver call is counted
//! (and its name kept), and call number `fail_at` (1-based) returns `code` without doing anything.
//! A sticky failure models an error that leaves the context unusable (an illegal address, ...):
//! every call after it fails with the same code too, except the two error-text look-ups, which
//! the real driver answers whatever state a context is in. A failed `cuInit` is remembered, as
//! the driver remembers it: every later `cuInit` fails the same way. `fail_at` 0 only counts.

use crate::{CuResult, lock};
use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Default)]
pub struct Sweep {
    armed: bool,
    fail_at: u64,
    code: CuResult,
    sticky: bool,
    /// The names of the calls counted since arming, in order.
    calls: Vec<&'static str>,
    /// Whether call `fail_at` has been made (and failed).
    fired: bool,
    /// The function that call was made to.
    failed_call: Option<&'static str>,
}

impl Sweep {
    /// Counts the call `name`; the code it must fail with, if it must.
    pub fn on_call(&mut self, name: &'static str) -> Option<CuResult> {
        if !self.armed {
            return None;
        }
        self.calls.push(name);
        if self.fired {
            if name == "cuInit" && self.failed_call == Some("cuInit") {
                return Some(self.code);
            }
            let answers_anyway = matches!(name, "cuGetErrorString" | "cuGetErrorName");
            return (self.sticky && !answers_anyway).then_some(self.code);
        }
        if self.calls.len() as u64 == self.fail_at {
            self.fired = true;
            self.failed_call = Some(name);
            return Some(self.code);
        }
        None
    }
}

/// Starts counting driver calls afresh; call number `fail_at` (1-based; 0 = none) fails with
/// `code`, and with `sticky` non-zero every call after it as well.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_sweep_arm(fail_at: u64, code: CuResult, sticky: i32) {
    ARMED.store(true, Ordering::Release);
    lock().sweep = Sweep {
        armed: true,
        fail_at,
        code,
        sticky: sticky != 0,
        calls: Vec::new(),
        fired: false,
        failed_call: None,
    };
}

/// Counts a call of the fake runtime's function `name` (`len` bytes) as the driver counts its
/// own: runtime and driver calls are numbered together. Returns the code the call must fail
/// with, or 0 (success: go on).
///
/// # Safety
/// `name` is `len` bytes of UTF-8 that live as long as the process: a string literal of the fake
/// runtime, which is never unloaded.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_sweep_runtime_call(name: *const u8, len: usize) -> CuResult {
    // Unarmed (every run but a sweep's), a runtime call that needs no driver call must not take
    // the driver's lock: the host-cost benchmarks time PyTorch's cudaGetDevice on this fake.
    if !ARMED.load(Ordering::Acquire) {
        return crate::CUDA_SUCCESS;
    }
    // SAFETY: the caller's contract: valid UTF-8 for the life of the process.
    let name: &'static str =
        unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(name, len)) };
    lock().sweep.on_call(name).unwrap_or(crate::CUDA_SUCCESS)
}

/// Whether a sweep was ever armed in this process (it is never disarmed, only re-armed).
static ARMED: AtomicBool = AtomicBool::new(false);

/// How many driver calls were made since the sweep was armed.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_sweep_calls() -> u64 {
    lock().sweep.calls.len() as u64
}

/// 1 once the armed call has failed, else 0.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_sweep_fired() -> i32 {
    i32::from(lock().sweep.fired)
}

/// Copies the name of counted call `index` (1-based) into `buffer` (NUL-terminated, cut to
/// `len` bytes); returns the name's length, or -1 when there is no such call.
///
/// # Safety
/// `buffer` is valid for `len` bytes of writes (or `len` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_sweep_call_name(
    index: u64,
    buffer: *mut c_char,
    len: usize,
) -> i64 {
    let driver = lock();
    let Some(name) = index
        .checked_sub(1)
        .and_then(|i| driver.sweep.calls.get(i as usize))
    else {
        return -1;
    };
    if len > 0 && !buffer.is_null() {
        let n = name.len().min(len - 1);
        // SAFETY: the caller promises `len` writable bytes; `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr().cast::<c_char>(), buffer, n);
            buffer.add(n).write(0);
        }
    }
    name.len() as i64
}
