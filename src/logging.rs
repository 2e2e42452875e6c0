//! Logging: stderr output set up from `TORCH_CUDA_ALLOC_LOG_LEVEL`, and every message format.
//!
//! Lines look like `[INFO] Allocator: block 0x7f8c4a000000 (size 1024 MB) allocated to stream 0`.
//! Each event has one function here, so the formats live in one place. The `log` macros check the
//! level before they format anything, so a disabled level costs one relaxed atomic load.

use crate::device::{DevicePtr, StreamId};
use log::{error, info};
use std::fmt;

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
pub fn alloc_retry(size: usize, what: &str) {
    info!(target: TARGET, "Allocator: device allocation of {} failed; {what} and retrying", HumanSize(size));
}

#[inline]
pub fn out_of_memory(message: &str) {
    error!(target: TARGET, "Allocator: {message}");
}

#[inline]
pub fn device_error(what: &str, err: &dyn fmt::Display) {
    error!(target: TARGET, "Allocator: {what}: {err}");
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
