//! `CUDAAllocator::getExpandableSegmentSizes`: each expandable segment of a device, with its
//! stream, its pool and the bytes mapped in it now, as PyTorch's `StreamSegmentSize` holds them.

use std::ffi::c_int;

use super::registry::{self, with_last_error};
use super::{cudaStream_t, stream_handle};

/// One expandable segment's size, as PyTorch's `StreamSegmentSize` holds it.
#[repr(C)]
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub struct ferrocache_stream_segment_size {
    pub stream: cudaStream_t,
    /// 1 when its pages are the small pool's (2 MiB), else 0.
    pub is_small_pool: c_int,
    /// Bytes mapped in it now.
    pub total_size: u64,
}

/// `CUDAAllocator::getExpandableSegmentSizes(device)`: writes up to `capacity` of the device's
/// expandable segments to `out`, in address order (those of the legacy default stream left out,
/// as PyTorch leaves them out), and returns how many there are (call again
/// with more room when that is more than `capacity`); 0 for a device not used yet (not opened
/// for the question). Returns -1 (last error set) for a bad device or a NULL `out` with a
/// non-zero `capacity`.
///
/// # Safety
/// `out` is valid for `capacity` writes (or `capacity` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_expandable_segment_sizes(
    device: c_int,
    out: *mut ferrocache_stream_segment_size,
    capacity: usize,
) -> i64 {
    with_last_error("ferrocache_expandable_segment_sizes", -1, || {
        if out.is_null() && capacity != 0 {
            return Err("ferrocache_expandable_segment_sizes: out is NULL".to_string());
        }
        let Some(device) = registry::if_used(device)? else {
            return Ok(0);
        };
        let sizes = device.lock()?.allocator().expandable_segment_sizes();
        for (k, size) in sizes.iter().take(capacity).enumerate() {
            let entry = ferrocache_stream_segment_size {
                stream: stream_handle(size.stream),
                is_small_pool: c_int::from(size.is_small_pool),
                total_size: size.mapped_size,
            };
            // SAFETY: k < capacity, and the caller promises `capacity` writable entries.
            unsafe { out.add(k).write(entry) };
        }
        Ok(sizes.len() as i64)
    })
}
