//! Sleep and wake (`ferrocache.sleep`, `ferrocache.wake`): the memory of some tags, or all that
//! can sleep, on every device in turn. The report says what each device did; a call that fails
//! on one device keeps the reports of the devices done before it (what slept stays asleep) and
//! of what the failing one did, for `ferrocache_last_sleep_report`.

use std::cell::RefCell;
use std::ffi::{c_char, c_int};
use std::ptr;

use serde::Serialize;

use super::registry::{created_devices, with_last_error};
use super::strings::{into_c_string, text_argument};
use super::thread::tag_ids;
use crate::allocator::sleep::{SleepError, SleepReport, Tags};

/// What a sleep or wake moved, as the JSON reports it.
#[derive(Serialize, Clone, Copy, Default, PartialEq, Debug)]
struct Moved {
    segments: usize,
    bytes: usize,
    blocks: usize,
    copied_bytes: usize,
    skipped_bytes: usize,
    seconds: f64,
}

impl Moved {
    fn of(report: &SleepReport) -> Moved {
        Moved {
            segments: report.segments,
            bytes: report.bytes,
            blocks: report.blocks,
            copied_bytes: report.copied_bytes,
            skipped_bytes: report.skipped_bytes,
            seconds: report.elapsed.as_secs_f64(),
        }
    }

    fn add(&mut self, other: &Moved) {
        self.segments += other.segments;
        self.bytes += other.bytes;
        self.blocks += other.blocks;
        self.copied_bytes += other.copied_bytes;
        self.skipped_bytes += other.skipped_bytes;
        self.seconds += other.seconds;
    }
}

#[derive(Serialize, Debug)]
struct DeviceMoved {
    device: c_int,
    #[serde(flatten)]
    moved: Moved,
}

#[derive(Serialize, Debug)]
struct Failure {
    device: c_int,
    error: String,
}

/// A whole report: the sums over devices (the keys the Python package reads), each device's
/// part, and the device that failed, if one did.
#[derive(Serialize, Debug, Default)]
struct Report {
    #[serde(flatten)]
    total: Moved,
    devices: Vec<DeviceMoved>,
    failed: Option<Failure>,
}

thread_local! {
    /// The JSON of this thread's latest sleep or wake.
    static LAST_REPORT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// What a failed sleep or wake did on its device before it stopped.
fn done_before(error: &SleepError) -> SleepReport {
    match error {
        SleepError::Capturing => SleepReport::default(),
        SleepError::Device { done, .. } | SleepError::OverMemoryFraction { done, .. } => *done,
    }
}

/// Sleep (`wake` false, with `backup` or not) or wake the memory of `tags` on every device,
/// in device order, stopping at the first device that fails. The report is kept as this
/// thread's last; a failure is `device N: why`.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
unsafe fn sleep_or_wake(tags: *const c_char, wake: bool, backup: bool) -> Result<String, String> {
    let ids = if tags.is_null() {
        None
    } else {
        // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
        Some(tag_ids(unsafe { text_argument(tags, "the list of tags") }?))
    };
    let tags = ids.as_deref().map_or(Tags::All, Tags::Only);
    let mut report = Report::default();
    for device in created_devices() {
        let outcome = match device.lock() {
            Err(out_of_service) => Err((SleepReport::default(), out_of_service)),
            Ok(mut memory) => {
                let allocator = memory.allocator_mut();
                let result = if wake {
                    allocator.wake(tags)
                } else {
                    allocator.sleep(tags, backup)
                };
                result.map_err(|error| (done_before(&error), error.to_string()))
            }
        };
        let (done, failure) = match outcome {
            Ok(done) => (done, None),
            Err((done, why)) => (done, Some(why)),
        };
        let moved = Moved::of(&done);
        report.total.add(&moved);
        report.devices.push(DeviceMoved {
            device: device.index(),
            moved,
        });
        if let Some(error) = failure {
            report.failed = Some(Failure {
                device: device.index(),
                error,
            });
            break;
        }
    }
    let json = serde_json::to_string(&report)
        .map_err(|err| format!("the report could not be written as JSON: {err}"))?;
    LAST_REPORT.with_borrow_mut(|last| *last = Some(json.clone()));
    match report.failed {
        None => Ok(json),
        Some(Failure { device, error }) => Err(format!("device {device}: {error}")),
    }
}

/// `ferrocache.sleep`: gives back the physical memory of the tags in `tags` (names separated by
/// newlines; NULL: all memory that can sleep), copied to host memory first when `backup` is
/// non-zero. Returns a JSON report to free with `ferrocache_string_free`: the sums (segments,
/// bytes, blocks, copied_bytes, skipped_bytes, seconds), `devices` (the same per device, with
/// `device`) and `failed` (null). Or NULL (last error set, `device N: why`): what slept stays
/// asleep, `ferrocache_last_sleep_report` says what and where, and the call can be repeated.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_sleep(tags: *const c_char, backup: c_int) -> *mut c_char {
    with_last_error("ferrocache_sleep", ptr::null_mut(), || {
        // SAFETY: passed on from the caller.
        unsafe { sleep_or_wake(tags, false, backup != 0) }.map(into_c_string)
    })
}

/// `ferrocache.wake`: maps the memory of `tags` (as for `ferrocache_sleep`) back at the same
/// addresses and restores its backup. Returns a JSON report as `ferrocache_sleep` does, or
/// NULL (last error set; what woke stays awake, `ferrocache_last_sleep_report` says what and
/// where, and the call can be repeated).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_wake(tags: *const c_char) -> *mut c_char {
    with_last_error("ferrocache_wake", ptr::null_mut(), || {
        // SAFETY: passed on from the caller.
        unsafe { sleep_or_wake(tags, true, false) }.map(into_c_string)
    })
}

/// The report of this thread's latest `ferrocache_sleep` or `ferrocache_wake`, failed or not,
/// as the JSON they return; after a failure, `devices` holds what each device did up to the one
/// that failed (included), and `failed` that device and why (`{"device": N, "error": "..."}`).
/// Returns a string to free with `ferrocache_string_free`, or NULL (last error set) before
/// this thread made either call.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_last_sleep_report() -> *mut c_char {
    with_last_error("ferrocache_last_sleep_report", ptr::null_mut(), || {
        LAST_REPORT
            .with_borrow(Clone::clone)
            .map(into_c_string)
            .ok_or_else(|| "this thread has made no sleep or wake yet".to_string())
    })
}
