//! PyTorch's other hooks (`CUDAPluggableAllocator._allocator.set_*_fn`): init, reset (empty
//! cache), memory fraction, record stream and base allocation, with the `ferrocache_*` forms of
//! the same calls for the Python package.

use std::ffi::{c_double, c_int, c_void};

use super::guard::guarded;
use super::registry::{self, created_devices, with_last_error};
use super::{cudaStream_t, device_address, device_pointer, stream_id, unknown_pointer};
use crate::device::StreamId;
use crate::logging;

/// `set_init_fn`: PyTorch tells the device count. Reads the settings and sets up logging; device
/// allocators are still created on first use.
#[unsafe(no_mangle)]
pub extern "C" fn rust_init(device_count: c_int) {
    guarded("rust_init", (), || {
        registry::read_once();
        registry::set_device_count(device_count);
        logging::library_initialised(env!("CARGO_PKG_VERSION"), device_count);
    });
}

/// `set_reset_fn`, which PyTorch calls for `torch.cuda.empty_cache()`: gives every wholly free
/// cached segment of every device back to the driver. Errors are logged.
#[unsafe(no_mangle)]
pub extern "C" fn rust_reset() {
    guarded("rust_reset", (), || {
        registry::read_once();
        if let Err(why) = empty_all_caches(|_| None) {
            logging::call_failed("rust_reset", &why);
        }
    });
}

/// `torch.cuda.empty_cache()`: gives every wholly free cached segment of every device back to
/// the driver. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_empty_cache() -> c_int {
    with_last_error("ferrocache_empty_cache", -1, || {
        empty_all_caches(|_| None).map(|()| 0)
    })
}

/// [`ferrocache_empty_cache`] as PyTorch's `emptyCache` runs it: `current_streams[d]` is
/// device d's current stream (`getCurrentCUDAStream(d)`), for the `count` first devices. Inside
/// `torch.cuda.use_mem_pool` with no graph capture on it, the ordinary pools are then released
/// as PyTorch 2.13+ releases them; without it a recording pool counts as a capture. Returns 0,
/// or -1 (last error set).
///
/// # Safety
/// `current_streams` points to `count` streams, or `count` is 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_empty_cache_with_current_streams(
    current_streams: *const cudaStream_t,
    count: c_int,
) -> c_int {
    with_last_error("ferrocache_empty_cache_with_current_streams", -1, || {
        let count = usize::try_from(count).unwrap_or(0);
        let streams: &[cudaStream_t] = if current_streams.is_null() || count == 0 {
            &[]
        } else {
            // SAFETY: the caller promises `count` streams at `current_streams`.
            unsafe { std::slice::from_raw_parts(current_streams, count) }
        };
        empty_all_caches(|device| {
            let index = usize::try_from(device).ok()?;
            streams.get(index).map(|&stream| stream_id(stream))
        })
        .map(|()| 0)
    })
}

/// Every device is emptied, those after a failure too; the failures are reported together.
/// `current_stream` gives a device's current stream, where the caller knows it.
fn empty_all_caches(current_stream: impl Fn(c_int) -> Option<StreamId>) -> Result<(), String> {
    let mut failures = Vec::new();
    for device in created_devices() {
        let current = current_stream(device.index());
        let emptied = device.lock().and_then(|mut memory| {
            memory
                .allocator_mut()
                .empty_cache_for(current)
                .map_err(|err| err.to_string())
        });
        if let Err(why) = emptied {
            failures.push(format!("device {}: {why}", device.index()));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// `set_memory_fraction_fn`: `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
/// Errors (a fraction outside [0, 1], an unusable device) are logged.
#[unsafe(no_mangle)]
pub extern "C" fn rust_memory_fraction(fraction: c_double, device: c_int) {
    guarded("rust_memory_fraction", (), || {
        registry::read_once();
        if let Err(why) = set_memory_fraction(fraction, device) {
            logging::call_refused("rust_memory_fraction", &why);
        }
    });
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`. Returns 0, or -1 (last error
/// set: a fraction outside [0, 1], an unusable device).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_memory_fraction(fraction: c_double, device: c_int) -> c_int {
    with_last_error("ferrocache_set_memory_fraction", -1, || {
        set_memory_fraction(fraction, device).map(|()| 0)
    })
}

fn set_memory_fraction(fraction: f64, device: c_int) -> Result<(), String> {
    let mut memory = registry::device(device)?.lock()?;
    let result = memory.allocator_mut().set_memory_fraction(fraction);
    result.map_err(|err| err.to_string())
}

/// `torch.cuda.get_per_process_memory_fraction(device)`: the limit
/// `set_per_process_memory_fraction` (or `per_process_memory_fraction`) set on `device`, as a
/// share of its memory; 1 when none was set. Returns -1 when the device cannot be used (last
/// error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_get_memory_fraction(device: c_int) -> c_double {
    with_last_error("ferrocache_get_memory_fraction", -1.0, || {
        let mut memory = registry::device(device)?.lock()?;
        let fraction = memory.allocator_mut().memory_fraction();
        fraction.map_err(|err| err.to_string())
    })
}

/// `set_record_stream_fn`: `Tensor.record_stream(stream)`. The allocation at `ptr` is not reused
/// after its free until the work queued on `stream` by then has completed. An unknown pointer is
/// logged at ERROR.
#[unsafe(no_mangle)]
pub extern "C" fn rust_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    guarded("rust_record_stream", (), || {
        registry::read_once();
        let address = device_address(ptr);
        let recorded = registry::with_owner(
            None,
            || unknown_pointer(address),
            |memory| {
                let recorded = memory
                    .allocator_mut()
                    .record_stream(address, stream_id(stream));
                recorded.ok().map(Ok)
            },
        );
        if let Err(why) = recorded {
            logging::call_refused("rust_record_stream", &why);
        }
    });
}

/// `set_base_alloc_fn`: the start of the segment that holds the allocation at `ptr`, with the
/// segment's size in `*size` (used for CUDA IPC). An unknown pointer is logged at ERROR and
/// gives `ptr` itself with `*size` = 0.
///
/// # Safety
/// `size` is NULL or valid for one `size_t` write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rust_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    let (base, base_size) = guarded("rust_base_alloc", (ptr, 0), || {
        registry::read_once();
        let address = device_address(ptr);
        let found = registry::with_owner(
            None,
            || unknown_pointer(address),
            |memory| memory.allocator().base_allocation(address).ok().map(Ok),
        );
        match found {
            Ok((_, (base, base_size))) => (device_pointer(base), base_size),
            Err(why) => {
                logging::call_refused("rust_base_alloc", &why);
                (ptr, 0)
            }
        }
    });
    if !size.is_null() {
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { size.write(base_size) };
    }
    base
}
