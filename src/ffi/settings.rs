//! The settings' exports: `PYTORCH_CUDA_ALLOC_CONF` checked and described for the Python
//! package, and replaced at run time (`torch.cuda.memory._set_allocator_settings`); caching
//! turned on or off (`torch.cuda.memory.caching_allocator_enable`). A setting applies to every
//! device, those created later included; the registry keeps what is in effect.

use std::ffi::{CStr, c_char, c_int};
use std::ptr;

use super::guard::{guarded, reporting_errors};
use super::registry::{self, created_devices, with_last_error};
use super::strings::{into_c_string, text_argument};
use crate::config::Config;
use crate::logging;

/// `torch.cuda.memory._set_allocator_settings(text)`: the settings in effect become
/// [`Config::with_runtime_settings`]'s, on every device created so far and those created
/// later. A refused `text` changes nothing.
fn set_allocator_settings(text: &str) -> Result<(), String> {
    let settings = registry::settings().as_ref().map_err(String::clone)?;
    // Under the creation lock, so that no device is made meanwhile with the old settings.
    let _creation = registry::process_wide();
    let mut current = settings.lock();
    let updated = current
        .with_runtime_settings(text)
        .map_err(|err| err.message)?;
    // A device out of service serves nothing, and keeps its settings.
    for mut memory in created_devices().filter_map(|device| device.lock().ok()) {
        let allocator = memory.allocator_mut();
        let config = registry::settings_for_device(allocator.device(), &updated);
        allocator.replace_config(config);
    }
    logging::settings_changed(&updated);
    *current = updated;
    Ok(())
}

/// `torch.cuda.memory._set_allocator_settings(text)`: parses `text` as PyTorch's
/// `setAllocatorSettings` does, over the settings in effect (a key not named keeps its value,
/// except `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold`,
/// which go back to their defaults), and applies the result from each device's next decision
/// on. Returns 0, or -1 with PyTorch's wording in the last error, nothing changed.
///
/// # Safety
/// `text` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_allocator_settings(text: *const c_char) -> c_int {
    with_last_error("ferrocache_set_allocator_settings", -1, || {
        // SAFETY: passed on from our caller, who promises the same.
        let text = unsafe { text_argument(text, "the allocator setting") }?;
        set_allocator_settings(text).map(|()| 0)
    })
}

/// `torch.cuda.memory.caching_allocator_enable(enabled)` (PyTorch's `enable`): with 0, the
/// allocations made from now on go to the driver at their exact size and back at their free,
/// outside the cache and its statistics; with non-zero, caching resumes (allocations made
/// meanwhile still go back to the driver). Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_caching_enabled(enabled: c_int) -> c_int {
    reporting_errors("ferrocache_set_caching_enabled", -1, || {
        let mut process_wide = registry::process_wide();
        process_wide.caching_enabled = enabled != 0;
        for mut memory in created_devices().filter_map(|device| device.lock().ok()) {
            memory.set_caching_enabled(enabled != 0);
        }
        Ok(0)
    })
}

/// Whether caching is on (PyTorch's `isEnabled`): 1 or 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_caching_enabled() -> c_int {
    guarded("ferrocache_caching_enabled", 1, || {
        c_int::from(registry::process_wide().caching_enabled)
    })
}

/// Reads a `PYTORCH_CUDA_ALLOC_CONF` value, or the process environment when `text` is NULL.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
unsafe fn read_config(text: *const c_char) -> Result<Config, String> {
    if text.is_null() {
        return Config::from_env().map_err(|err| err.message);
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    let text = text
        .to_str()
        .map_err(|_| "the setting is not valid UTF-8".to_string())?;
    Config::parse(text).map_err(|err| err.message)
}

/// Checks a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the one in the process environment, read as
/// PyTorch reads it). Returns 1 when PyTorch would accept it, 0 when not, with PyTorch's
/// wording in the last error.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_check_config(text: *const c_char) -> c_int {
    reporting_errors("ferrocache_check_config", 0, || {
        // SAFETY: passed on from our caller, who promises the same.
        unsafe { read_config(text) }.map(|_| 1)
    })
}

/// What a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the process environment's) sets: one line per
/// setting that differs from PyTorch's defaults, then the keys ferrocache does not use and the
/// warnings. Returns a string to free with `ferrocache_string_free`, or NULL when the value is
/// invalid (last error set, with PyTorch's wording).
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_describe_config(text: *const c_char) -> *mut c_char {
    reporting_errors("ferrocache_describe_config", ptr::null_mut(), || {
        // SAFETY: passed on from our caller, who promises the same.
        let config = unsafe { read_config(text) }?;
        let mut lines = vec![config.describe()];
        if !config.ignored_keys.is_empty() {
            lines.push(format!(
                "not used by ferrocache: {}",
                config.ignored_keys.join(", ")
            ));
        }
        lines.extend(config.warnings.iter().map(|w| format!("warning: {w}")));
        Ok(into_c_string(lines.join("\n")))
    })
}
