//! Which settings to use: `ferrocache_advise` (`ferrocache.advise()`), and the one ERROR line
//! after an out-of-memory. The search itself is `tune`'s; this unit copies the history out of
//! the device's lock and hands it over.

use std::ffi::{c_char, c_int, c_ulonglong};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use super::guard::panic_message;
use super::registry::{self, Device, with_last_error};
use super::strings::into_c_string;
use crate::allocator::OutOfMemoryError;
use crate::device::Device as _;
use crate::logging;
use crate::policy::TieRule;
use crate::tune;

/// After an out-of-memory (with the allocator's lock released): one ERROR line naming the
/// setting that would have served the program so far within the memory it could use, from the
/// recorded history (`tune::live`); without history, once per process, how to get that line.
/// The search runs only here, never on the allocation path, and never fails the allocation
/// further: an error in it is logged and dropped.
#[cold]
#[inline(never)]
pub(crate) fn advise_after_out_of_memory(device: &Device, oom: &OutOfMemoryError) {
    if !logging::errors_enabled() {
        // TORCH_CUDA_ALLOC_LOG_LEVEL=OFF: nobody would read the line.
        return;
    }
    let capacity = tune::live::oom_capacity(
        oom.reserved as u64,
        oom.device_free as u64,
        oom.allowed.map(|a| a as u64),
    );
    let live = (oom.allocated as u64).saturating_add(oom.allocation_size as u64);
    let recorded = match device.lock() {
        Ok(memory) => {
            let allocator = memory.allocator();
            allocator
                .is_recording_history()
                .then(|| (allocator.history_snapshot(), allocator.config().clone()))
        }
        Err(_) => return,
    };
    let Some((snapshot, config)) = recorded else {
        logging::oom_advice_needs_history();
        return;
    };
    let index = device.index();
    let advice = catch_unwind(AssertUnwindSafe(|| {
        tune::live::oom_advice(&snapshot, &config, index, capacity, live)
    }));
    match advice {
        Ok(Ok(advice)) => logging::oom_advice(&advice.line(index)),
        Ok(Err(why)) => logging::oom_advice(&format!("advice: none ({why})")),
        Err(panic) => logging::internal_error("the out-of-memory advice", &panic_message(&*panic)),
    }
}

/// Which `PYTORCH_CUDA_ALLOC_CONF` to set (`ferrocache.advise()`): the settings space searched
/// with the replay engine, as `ferrocache tune` does, on a snapshot or on this process's
/// recorded history. Returns one JSON object (`ferrocache tune --json`'s keys, plus `table`: the
/// text the command prints) to free with `ferrocache_string_free`, or NULL (last error set: no
/// history recorded, with how to record it; a snapshot that cannot be read).
///
/// - `snapshot`, `length`: a snapshot's bytes (pickle or JSON, as `ferrocache tune` reads
///   them); NULL for this process's recorded history.
/// - `device`: the device whose history to search (required for the history); for a snapshot,
///   -1 searches every device in it.
/// - `capacity_bytes`: the GPU's memory to fit in; 0: for the history, the device's memory (or
///   the memory fraction's limit), for a snapshot what its out-of-memory entries tell, else
///   80 GiB. A capacity given also tries `garbage_collection_threshold`.
/// - `max_candidates`: try at most this many settings, the simplest first (0: all).
///
/// # Safety
/// `snapshot` is NULL or points to `length` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_advise(
    snapshot: *const c_char,
    length: usize,
    device: c_int,
    capacity_bytes: c_ulonglong,
    max_candidates: usize,
) -> *mut c_char {
    with_last_error("ferrocache_advise", ptr::null_mut(), || {
        let limit = (max_candidates > 0).then_some(max_candidates);
        let given = (capacity_bytes > 0).then_some(capacity_bytes);
        let tuning = if snapshot.is_null() {
            advise_on_history(device, given, limit)?
        } else {
            // SAFETY: non-NULL, and the caller promises `length` readable bytes.
            let bytes = unsafe { std::slice::from_raw_parts(snapshot.cast::<u8>(), length) };
            let only = usize::try_from(device).ok();
            tune::tune_snapshot(
                bytes,
                only,
                given,
                limit,
                TieRule::default(),
                crate::config::tie_rule_from_env(),
            )?
        };
        let mut value = tune::report::json(&tuning);
        let table = tune::report::text(&tuning, &tune::report::TextOptions::default());
        if let Some(object) = value.as_object_mut() {
            object.insert("table".to_string(), serde_json::Value::String(table));
        }
        Ok(into_c_string(value.to_string()))
    })
}

/// The search on `device`'s recorded history (its lock held only to copy the history).
fn advise_on_history(
    device: c_int,
    capacity: Option<u64>,
    max_candidates: Option<usize>,
) -> Result<tune::Tuning, String> {
    let created = registry::created(device).ok_or_else(|| {
        format!(
            "device {device} has allocated nothing through ferrocache in this process: {}",
            tune::live::HOW_TO_RECORD
        )
    })?;
    let (snapshot, config, device_memory) = {
        let mut memory = created.lock()?;
        let allocator = memory.allocator_mut();
        if !allocator.is_recording_history() {
            return Err(tune::live::HOW_TO_RECORD.to_string());
        }
        let device_memory = match allocator.allowed_memory_maximum() {
            Some(allowed) => allowed as u64,
            None => {
                allocator
                    .device_mut()
                    .mem_get_info()
                    .map_err(|err| format!("cudaMemGetInfo failed: {err}"))?
                    .total as u64
            }
        };
        (
            allocator.history_snapshot(),
            allocator.config().clone(),
            device_memory,
        )
    };
    let capacity = match capacity {
        Some(bytes) => (bytes, tune::CapacitySource::Given),
        None => (device_memory, tune::CapacitySource::Device),
    };
    tune::live::advise_live(&snapshot, &config, device, capacity, max_candidates)
}
