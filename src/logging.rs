//! Logging: stderr output set up from `TORCH_CUDA_ALLOC_LOG_LEVEL`, and every message format.
//!
//! Lines look like `[INFO] Allocator: block 0x7f8c4a000000 (size 1024 MB) allocated to stream 0`.
//! Each event has one function here, so the formats live in one place. The `log` macros check the
//! level before they format anything, so a disabled level costs one relaxed atomic load.
//!
//! [`init`] installs the logger; the C ABI calls it on the library's first use (not when the
//! library is loaded, so that loading it never writes anything or reads the environment early).

use crate::config::{Config, LOG_LEVEL_VAR, LogLevel};
use crate::device::{DevicePtr, StreamId};
use log::{debug, error, info, warn};
use std::fmt;
use std::io::Write;
use std::sync::{Once, OnceLock};

/// The log target of every ferrocache line.
pub const TARGET: &str = "ferrocache";

/// A size for humans: bytes below 1 KiB, KB below 1 MiB, MB above (the README's forms).
pub struct HumanSize(pub usize);

impl fmt::Display for HumanSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const KB: usize = 1024;
        const MB: usize = 1024 * 1024;
        let size = self.0;
        let (unit, scale) = if size < KB {
            return write!(f, "{size} bytes");
        } else if size < MB {
            ("KB", KB)
        } else {
            ("MB", MB)
        };
        if size.is_multiple_of(scale) {
            write!(f, "{} {unit}", size / scale)
        } else {
            let text = format!("{:.2}", size as f64 / scale as f64);
            write!(
                f,
                "{} {unit}",
                text.trim_end_matches('0').trim_end_matches('.')
            )
        }
    }
}

/// The stream as people know it: the default stream is `stream 0`, others by handle.
pub struct StreamName(pub StreamId);

impl fmt::Display for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            f.write_str("0")
        } else {
            write!(f, "{:#x}", self.0)
        }
    }
}

#[inline]
pub fn block_allocated(ptr: DevicePtr, size: usize, stream: StreamId) {
    info!(target: TARGET, "Allocator: block {ptr:#x} (size {}) allocated to stream {}", HumanSize(size), StreamName(stream));
}

#[inline]
pub fn cross_stream_reuse(ptr: DevicePtr, size: usize, from: StreamId, to: StreamId) {
    info!(target: TARGET, "Allocator: block {ptr:#x} (size {}) moves from stream {} to stream {} after an event wait", HumanSize(size), StreamName(from), StreamName(to));
}

#[inline]
pub fn block_split(ptr: DevicePtr, size: usize, remaining: usize) {
    info!(target: TARGET, "Allocator: splitting block {ptr:#x}: {} allocated, {} remains free", HumanSize(size), HumanSize(remaining));
}

#[inline]
pub fn block_freed(ptr: DevicePtr) {
    info!(target: TARGET, "Allocator: block {ptr:#x} freed, returning to pool");
}

#[inline]
pub fn block_waits_for_streams(ptr: DevicePtr, streams: usize) {
    info!(target: TARGET, "Allocator: block {ptr:#x} freed, waiting for {streams} other stream(s) before reuse");
}

#[inline]
pub fn block_merged(ptr: DevicePtr) {
    info!(target: TARGET, "Allocator: merging block {ptr:#x} with adjacent free block");
}

#[inline]
pub fn new_free_block(size: usize) {
    info!(target: TARGET, "Allocator: new free block size {}", HumanSize(size));
}

#[inline]
pub fn segment_allocated(ptr: DevicePtr, size: usize, stream: StreamId) {
    info!(target: TARGET, "Allocator: new segment {ptr:#x} (size {}) from the device for stream {}", HumanSize(size), StreamName(stream));
}

#[inline]
pub fn segment_released(ptr: DevicePtr, size: usize) {
    info!(target: TARGET, "Allocator: segment {ptr:#x} (size {}) released to the device", HumanSize(size));
}

#[inline]
pub fn pages_mapped(ptr: DevicePtr, size: usize, stream: StreamId) {
    info!(target: TARGET, "Allocator: mapped pages {ptr:#x} (size {}) into the expandable segment of stream {}", HumanSize(size), StreamName(stream));
}

#[inline]
pub fn pages_unmapped(ptr: DevicePtr, size: usize) {
    info!(target: TARGET, "Allocator: unmapped pages {ptr:#x} (size {}) from an expandable segment", HumanSize(size));
}

#[inline]
/// A CUDA graph capture begins: allocations on its streams now come from its private pool.
pub fn capture_begins(pool: (u64, u64), use_count: u32) {
    info!(target: TARGET, "Allocator: capture into private pool ({}, {}) begins; the pool has {use_count} reference(s)", pool.0, pool.1);
}

/// A capture ended; its pool keeps its memory for the graph.
pub fn capture_ends(pool: (u64, u64)) {
    info!(target: TARGET, "Allocator: capture into private pool ({}, {}) ends", pool.0, pool.1);
}

/// A graph holding a private pool is gone (`releasePool`).
pub fn pool_released(pool: (u64, u64), use_count: u32) {
    info!(target: TARGET, "Allocator: private pool ({}, {}) released; {use_count} reference(s) remain", pool.0, pool.1);
}

/// An unreferenced private pool gave back its last segment and is forgotten.
pub fn pool_forgotten(pool: (u64, u64)) {
    info!(target: TARGET, "Allocator: private pool ({}, {}) holds no memory any more and is gone", pool.0, pool.1);
}

pub fn alloc_retry(size: usize, what: &str) {
    info!(target: TARGET, "Allocator: device allocation of {} failed; {what} and retrying", HumanSize(size));
}

#[inline]
pub fn out_of_memory(message: &str) {
    error!(target: TARGET, "Allocator: {message}");
}

/// A warning of PyTorch's, in its words.
#[inline]
pub fn warning(message: &str) {
    warn!(target: TARGET, "Allocator: {message}");
}

/// `throw_on_cudamalloc_oom` refused a device allocation (PyTorch's warning, in its words).
#[inline]
pub fn preemptive_rejection(warning: &str) {
    warn!(target: TARGET, "Allocator: {warning}");
}

#[inline]
pub fn device_error(what: &str, err: &dyn fmt::Display) {
    let why = err.to_string();
    if repeats_unusable(&why) {
        debug!(target: TARGET, "Allocator: {what}: {why}");
    } else {
        error!(target: TARGET, "Allocator: {what}: {why}");
    }
}

/// Why CUDA became unusable in this process, once [`context_unusable`] said so.
static UNUSABLE: OnceLock<String> = OnceLock::new();

/// A sticky error left CUDA unusable: said once, at ERROR. The failures it causes later are
/// returned to their callers as usual but logged at DEBUG only ([`repeats_unusable`]), so the
/// log says it once instead of once per call.
pub fn context_unusable(why: &str) {
    if UNUSABLE.set(why.to_string()).is_ok() {
        error!(target: TARGET, "Allocator: {why}");
    }
}

/// Whether `why` is a failure that only repeats the unusable state already reported.
fn repeats_unusable(why: &str) -> bool {
    UNUSABLE
        .get()
        .is_some_and(|unusable| why.contains(unusable.as_str()))
}

/// Installs the stderr logger at the level `TORCH_CUDA_ALLOC_LOG_LEVEL` names (WARN when unset),
/// once per process; later calls do nothing. Lines are exactly `[LEVEL] message`: no timestamp,
/// no module path, no colour. Only ferrocache's own target is shown.
///
/// Another logger already installed in this copy of the `log` crate (a test harness, a program
/// that links the rlib) is left alone.
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let (level, problem) = match LogLevel::from_env() {
            Ok(level) => (level, None),
            Err(err) => (LogLevel::default(), Some(err)),
        };
        let installed = env_logger::Builder::new()
            .filter_level(log::LevelFilter::Off)
            .filter_module(TARGET, level.to_level_filter())
            .format(|out, record| writeln!(out, "[{}] {}", record.level(), record.args()))
            .target(env_logger::Target::Stderr)
            .try_init();
        if let (Ok(()), Some(err)) = (installed, problem) {
            warn!(target: TARGET, "Allocator: {err}; using {} (the default)", LogLevel::default());
        }
    });
}

/// The settings in effect, at start-up: where they came from, each one that differs from
/// PyTorch's defaults, the keys that ferrocache accepts but does not use (once), and the
/// warnings about things that look like mistakes.
pub fn configuration(config: &Config) {
    if let Some((variable, value)) = &config.source {
        info!(target: TARGET, "Allocator: settings from {variable}={value:?}");
    }
    if log::log_enabled!(target: TARGET, log::Level::Info) {
        for line in config.describe().lines() {
            info!(target: TARGET, "Allocator: settings in effect: {line}");
        }
    }
    if !config.ignored_keys.is_empty() {
        info!(target: TARGET, "Allocator: keys accepted as PyTorch does but not used by ferrocache: {}", config.ignored_keys.join(", "));
    }
    for warning in &config.warnings {
        warn!(target: TARGET, "Allocator: {warning}");
    }
}

/// The allocator settings are invalid: every allocation will fail with this message.
pub fn configuration_invalid(variable: &str, message: &str) {
    error!(target: TARGET, "Allocator: {variable} is invalid, so every allocation will fail: {message}");
}

/// Device `device` cannot be used (no driver, no such device): its allocations will fail.
pub fn device_unavailable(device: i32, why: &str) {
    if repeats_unusable(why) {
        debug!(target: TARGET, "Allocator: device {device} is unavailable, so its allocations will fail: {why}");
        return;
    }
    error!(target: TARGET, "Allocator: device {device} is unavailable, so its allocations will fail: {why}");
}

/// The library was initialised by PyTorch's `init` hook.
pub fn library_initialised(version: &str, device_count: i32) {
    info!(target: TARGET, "Allocator: ferrocache {version} initialised for {device_count} device(s); {LOG_LEVEL_VAR}={}", log::max_level());
}

/// A device number that cannot be one (PyTorch's device indices are 0 to 127).
pub fn invalid_device(why: &str) {
    error!(target: TARGET, "Allocator: {why}; nothing changed");
}

/// A call through the C ABI was refused (bad input); nothing changed.
pub fn call_refused(function: &str, why: &dyn fmt::Display) {
    let why = why.to_string();
    if repeats_unusable(&why) {
        debug!(target: TARGET, "Allocator: {function}: {why}; nothing changed");
        return;
    }
    error!(target: TARGET, "Allocator: {function}: {why}; nothing changed");
}

/// A call through the C ABI failed part way (a driver error); the message says what happened.
pub fn call_failed(function: &str, why: &dyn fmt::Display) {
    let why = why.to_string();
    if repeats_unusable(&why) {
        debug!(target: TARGET, "Allocator: {function} failed: {why}");
        return;
    }
    error!(target: TARGET, "Allocator: {function} failed: {why}");
}

/// `rust_free` was given an argument that differs from what the allocation recorded.
pub fn free_argument_mismatch(
    ptr: DevicePtr,
    argument: &str,
    given: &dyn fmt::Display,
    recorded: &dyn fmt::Display,
) {
    warn!(target: TARGET, "Allocator: rust_free of block {ptr:#x} was given {argument} {given}, but the block was allocated with {argument} {recorded}; using the recorded one");
}

/// A panic inside ferrocache was caught at the C ABI (a bug in ferrocache).
pub fn internal_error(function: &str, why: &str) {
    error!(target: TARGET, "Allocator: internal error in {function}: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_the_readme() {
        assert_eq!(HumanSize(1024 << 20).to_string(), "1024 MB");
        assert_eq!(HumanSize(2048 << 20).to_string(), "2048 MB");
        assert_eq!(HumanSize(512).to_string(), "512 bytes");
        assert_eq!(HumanSize(1536).to_string(), "1.5 KB");
        assert_eq!(HumanSize(3 << 19).to_string(), "1.5 MB");
        assert_eq!(HumanSize(1000 * 1024 + 512).to_string(), "1000.5 KB");
    }

    #[test]
    fn the_default_stream_is_stream_0() {
        assert_eq!(StreamName(0).to_string(), "0");
        assert_eq!(StreamName(0x55aa).to_string(), "0x55aa");
    }
}
