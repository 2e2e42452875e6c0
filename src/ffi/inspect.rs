//! What the Python package reads: statistics (`torch.cuda.memory_stats` and their resets), the
//! snapshot (`torch.cuda.memory._snapshot`), history recording, and the invariant check.

use std::ffi::{c_char, c_int};
use std::ptr;

use super::registry::{self, created_devices, with_last_error};
use super::strings::into_c_string;
use crate::allocator::history::MemorySnapshot;
use crate::allocator::stats::DeviceStats;

/// `torch.cuda.memory_stats(device)`: one JSON object with PyTorch's flat keys
/// (`allocated_bytes.all.current`, `num_ooms`, ...). Returns a string to free with
/// `ferrocache_string_free`, or NULL (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_memory_stats(device: c_int) -> *mut c_char {
    with_last_error("ferrocache_memory_stats", ptr::null_mut(), || {
        let json = match registry::if_used(device)? {
            Some(device) => device.lock()?.allocator().stats().to_json(),
            None => DeviceStats::new(registry::config()?.max_split_size).to_json(),
        };
        Ok(into_c_string(json))
    })
}

/// `torch.cuda.reset_peak_memory_stats(device)`. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_reset_peak_stats(device: c_int) -> c_int {
    with_last_error("ferrocache_reset_peak_stats", -1, || {
        if let Some(device) = registry::if_used(device)? {
            device.lock()?.allocator_mut().reset_peak_stats();
        }
        Ok(0)
    })
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_reset_accumulated_stats(device: c_int) -> c_int {
    with_last_error("ferrocache_reset_accumulated_stats", -1, || {
        if let Some(device) = registry::if_used(device)? {
            device.lock()?.allocator_mut().reset_accumulated_stats();
        }
        Ok(0)
    })
}

/// `torch.cuda.memory._snapshot()`: PyTorch's structure as JSON (`segments` of every device,
/// `device_traces` indexed by device, `allocator_settings`). Returns a string to free with
/// `ferrocache_string_free`, or NULL (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_snapshot() -> *mut c_char {
    with_last_error("ferrocache_snapshot", ptr::null_mut(), || {
        let config = registry::config()?;
        let mut combined = MemorySnapshot {
            segments: Vec::new(),
            device_traces: Vec::new(),
            allocator_settings: config.to_pytorch_settings(),
        };
        for device in created_devices() {
            let snapshot = device.lock()?.allocator_mut().snapshot();
            combined.segments.extend(snapshot.segments);
            let index = device.index() as usize;
            if combined.device_traces.len() <= index {
                combined.device_traces.resize_with(index + 1, Vec::new);
            }
            combined.device_traces[index] = snapshot.device_traces.into_iter().flatten().collect();
        }
        let reported_devices = registry::reported_device_count();
        if combined.device_traces.len() < reported_devices {
            combined
                .device_traces
                .resize_with(reported_devices, Vec::new);
        }
        combined.segments.sort_by_key(|s| (s.device, s.address));
        serde_json::to_string(&combined)
            .map(into_c_string)
            .map_err(|err| format!("the snapshot could not be written as JSON: {err}"))
    })
}

/// `torch.cuda.memory._record_memory_history`: `enabled` non-zero starts recording allocator
/// events (at most `max_entries`, the newest kept) on every device, including devices used
/// later; zero stops and clears. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_record_history(enabled: c_int, max_entries: usize) -> c_int {
    with_last_error("ferrocache_record_history", -1, || {
        let mut process_wide = registry::process_wide();
        process_wide.history = (enabled != 0).then_some(max_entries);
        // A device out of service serves nothing, nor records.
        for mut memory in created_devices().filter_map(|device| device.lock().ok()) {
            memory
                .allocator_mut()
                .record_history(enabled != 0, max_entries);
        }
        Ok(0)
    })
}

/// Checks every device allocator's structural invariants and recomputes its statistics from its
/// block table (a full walk: for tests and debugging). Returns 0, or -1 with what is wrong in
/// the last error.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_check_invariants() -> c_int {
    with_last_error("ferrocache_check_invariants", -1, || {
        for device in created_devices() {
            device
                .lock()?
                .allocator()
                .check_invariants()
                .map_err(|why| format!("device {}: {why}", device.index()))?;
        }
        Ok(0)
    })
}
