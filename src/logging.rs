//! Logging: stderr output set up from `TORCH_CUDA_ALLOC_LOG_LEVEL`, and every message format.
//!
//! Lines look like `[INFO] Allocator: block 0x7f8c4a000000 (size 1024 MB) allocated to stream 0`.
//! Each event has one function here, so the formats live in one place. The `log` macros check the
//! level before they format anything, so a disabled level costs one relaxed atomic load.
//!
//! [`init`] installs the logger; the C ABI calls it on the library's first use (not when the
//! library is loaded, so that loading it never writes anything or reads the environment early).
//!
//! One rank of a job of several (`WORLD_SIZE` > 1, as `torchrun` sets it) starts each line with
//! `[rankN]:` ([`rank_prefix`]), PyTorch's own prefix for a rank's tracebacks and log lines, so
//! that the ranks' lines, interleaved on one terminal, can be told apart, and one grep finds
//! all of a rank's lines, PyTorch's and ferrocache's; a single process keeps the plain format.

use crate::config::{Config, LOG_LEVEL_VAR, LogLevel};
use crate::device::{DevicePtr, StreamId};
use log::{debug, error, info, warn};
use std::cell::Cell;
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

/// Memory went to sleep (`ferrocache.sleep`): `bytes` given back in `segments` segments
/// holding `blocks` live blocks, `copied` of them copied to host memory (`backup`), and
/// `skipped` bytes that cannot sleep.
pub fn slept(
    bytes: usize,
    segments: usize,
    blocks: usize,
    copied: usize,
    skipped: usize,
    backup: bool,
    elapsed: std::time::Duration,
) {
    info!(target: TARGET, "Allocator: sleep gave back {} in {segments} segment(s) holding {blocks} live block(s), {} copied to host memory{}, in {:.3} ms{}",
        HumanSize(bytes), HumanSize(copied),
        if backup { "" } else { " (contents dropped)" }, elapsed.as_secs_f64() * 1e3,
        if skipped > 0 { format!("; {} could not sleep (not VMM-backed)", HumanSize(skipped)) } else { String::new() });
}

/// Memory woke (`ferrocache.wake`).
pub fn woke(
    bytes: usize,
    segments: usize,
    blocks: usize,
    copied: usize,
    elapsed: std::time::Duration,
) {
    info!(target: TARGET, "Allocator: wake mapped {} in {segments} segment(s) holding {blocks} live block(s) at the same addresses, {} copied back, in {:.3} ms",
        HumanSize(bytes), HumanSize(copied), elapsed.as_secs_f64() * 1e3);
}

/// One segment's physical memory went to sleep, its addresses kept.
#[inline]
pub fn segment_slept(ptr: DevicePtr, size: usize) {
    info!(target: TARGET, "Allocator: segment {ptr:#x} (size {}) sleeps: its memory went back to the device, its addresses stay", HumanSize(size));
}

/// One segment's physical memory woke at its addresses.
#[inline]
pub fn segment_woke(ptr: DevicePtr, size: usize) {
    info!(target: TARGET, "Allocator: segment {ptr:#x} (size {}) woke at the same addresses", HumanSize(size));
}

pub fn alloc_retry(size: usize, what: &str) {
    info!(target: TARGET, "Allocator: device allocation of {} failed; {what} and retrying", HumanSize(size));
}

#[inline]
pub fn out_of_memory(message: &str) {
    error!(target: TARGET, "Allocator: {message}");
}

/// A private pool's own allocator (`MemPool(allocator=...)`) failed instead of returning NULL:
/// the allocation goes on as out of memory.
pub fn pool_allocator_failed(size: usize, why: &str) {
    warn!(target: TARGET, "Allocator: the pool's own allocator failed to allocate {} ({why}); taken for out of memory", HumanSize(size));
}

/// A warning of PyTorch's, in its words.
#[inline]
pub fn warning(message: &str) {
    warn!(target: TARGET, "Allocator: {message}");
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

thread_local! {
    /// Set on threads that replay recordings on simulated GPUs (`ferrocache.advise()`, the
    /// out-of-memory advice): their allocators' lines are not the process's.
    static SILENCED: Cell<bool> = const { Cell::new(false) };
}

/// From now on, nothing this thread logs is written (for threads that only run simulations).
pub fn silence_this_thread() {
    SILENCED.with(|s| s.set(true));
}

/// Runs `body` with this thread's log lines dropped, then restores what was before.
pub fn silenced<R>(body: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SILENCED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SILENCED.with(|s| s.replace(true)));
    body()
}

/// The stderr logger, less the lines of silenced threads. The check comes after the level
/// check, so a disabled level still costs one atomic load.
struct UnlessSilenced(env_logger::Logger);

impl log::Log for UnlessSilenced {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.0.enabled(metadata) && !SILENCED.with(Cell::get)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !SILENCED.with(Cell::get) {
            self.0.log(record);
        }
    }

    fn flush(&self) {
        self.0.flush();
    }
}

/// The variable that gives the number of processes of a distributed job (`torchrun` sets it).
pub const WORLD_SIZE_VAR: &str = crate::env::WORLD_SIZE.name;
/// The variable that gives this process's rank in the job (`torchrun` sets it).
pub const RANK_VAR: &str = crate::env::RANK.name;

/// What starts each log line: `[rankN]:` for rank `N` of a job of more than one process
/// (`WORLD_SIZE` > 1 and a `RANK`), nothing otherwise. It is the prefix `torch.distributed`
/// puts on a rank's tracebacks and PyTorch's logging on its lines. Values that are not numbers
/// count as unset: a line without the prefix is better than a wrong one.
pub fn rank_prefix(world_size: Option<&str>, rank: Option<&str>) -> String {
    let number = |text: Option<&str>| text.and_then(|t| t.trim().parse::<u64>().ok());
    match (number(world_size), number(rank)) {
        (Some(size), Some(rank)) if size > 1 => format!("[rank{rank}]:"),
        _ => String::new(),
    }
}

/// Installs the stderr logger at the level `TORCH_CUDA_ALLOC_LOG_LEVEL` names (WARN when unset),
/// once per process; later calls do nothing. Lines are exactly `[LEVEL] message`: no timestamp,
/// no module path, no colour; one rank of several puts `[rankN]:` before ([`rank_prefix`]).
/// Only ferrocache's own target is shown.
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
        let variable = crate::env::lookup;
        let prefix = rank_prefix(
            variable(WORLD_SIZE_VAR).as_deref(),
            variable(RANK_VAR).as_deref(),
        );
        let logger = env_logger::Builder::new()
            .filter_level(log::LevelFilter::Off)
            .filter_module(TARGET, level.to_level_filter())
            .format(move |out, record| {
                writeln!(out, "{prefix}[{}] {}", record.level(), record.args())
            })
            .target(env_logger::Target::Stderr)
            .build();
        let filter = logger.filter();
        let installed = log::set_boxed_logger(Box::new(UnlessSilenced(logger)))
            .map(|()| log::set_max_level(filter));
        if let (Ok(()), Some(err)) = (installed, problem) {
            warn!(target: TARGET, "Allocator: {err}; using {} (the default)", LogLevel::default());
        }
    });
}

/// The settings in effect, at start-up: where they came from, each one that differs from
/// PyTorch's defaults, the keys that ferrocache accepts but does not use (once), and the
/// warnings about things that look like mistakes.
pub fn configuration(config: &Config) {
    if let Some((variable, value)) = &config.provenance.source {
        info!(target: TARGET, "Allocator: settings from {variable}={value:?}");
    }
    settings_in_effect(config);
}

/// `torch.cuda.memory._set_allocator_settings` replaced the settings.
pub fn settings_changed(config: &Config) {
    if let Some((_, value)) = &config.provenance.source {
        info!(target: TARGET, "Allocator: settings changed at run time to {value:?}");
    }
    settings_in_effect(config);
}

/// Each setting that differs from PyTorch's defaults, the keys ferrocache accepts but does not
/// use, and the warnings.
fn settings_in_effect(config: &Config) {
    if log::log_enabled!(target: TARGET, log::Level::Info) {
        for line in config.describe().lines() {
            info!(target: TARGET, "Allocator: settings in effect: {line}");
        }
    }
    if !config.provenance.ignored_keys.is_empty() {
        info!(target: TARGET, "Allocator: keys accepted as PyTorch does but not used by ferrocache: {}", config.provenance.ignored_keys.join(", "));
    }
    for warning in &config.provenance.warnings {
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

/// The CUDA driver library every driver call goes to (the one PyTorch loaded, see `driver.rs`).
pub fn driver_library(path: &str) {
    info!(target: TARGET, "Allocator: CUDA driver library {path}");
}

/// `expandable_segments:True` on a device without virtual memory management: its segments come
/// from `cudaMalloc` instead.
pub fn expandable_segments_unsupported(device: i32, name: &str) {
    warn!(target: TARGET, "Allocator: CUDA device {device} ({name}) does not support virtual memory management, which expandable segments need; expandable_segments:True is ignored on it and its segments are allocated with cudaMalloc");
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

/// Whether ERROR lines are written (every level but `OFF`).
pub fn errors_enabled() -> bool {
    log::log_enabled!(target: TARGET, log::Level::Error)
}

/// The line after an out-of-memory that says which setting would have served the program
/// (`tune::live`), or why none would.
pub fn oom_advice(line: &str) {
    error!(target: TARGET, "Allocator: {line}");
}

/// An out-of-memory without recorded history: once per process, how to get the advice.
pub fn oom_advice_needs_history() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        error!(target: TARGET, "Allocator: to learn which PYTORCH_CUDA_ALLOC_CONF would have served this program, record its allocation history from the start (torch.cuda.memory._record_memory_history() with ferrocache installed, or ferrocache.record_memory_history()): the next out-of-memory then names the setting, and ferrocache.advise() shows the table");
    });
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
    fn only_a_rank_of_several_prefixes_its_lines() {
        assert_eq!(rank_prefix(Some("8"), Some("3")), "[rank3]:");
        assert_eq!(rank_prefix(Some("2"), Some("0")), "[rank0]:");
        // A single process, or no job at all: the seed's format.
        assert_eq!(rank_prefix(Some("1"), Some("0")), "");
        assert_eq!(rank_prefix(None, None), "");
        assert_eq!(rank_prefix(None, Some("3")), "");
        // Unreadable values: no prefix rather than a wrong one.
        assert_eq!(rank_prefix(Some("2"), None), "");
        assert_eq!(rank_prefix(Some("2"), Some("first")), "");
        assert_eq!(rank_prefix(Some("many"), Some("1")), "");
    }

    #[test]
    fn the_default_stream_is_stream_0() {
        assert_eq!(StreamName(0).to_string(), "0");
        assert_eq!(StreamName(0x55aa).to_string(), "0x55aa");
    }
}
