//! What the fuzz targets share: an allocator that counts, and the memory bound every parser must
//! hold to.
//!
//! A parser of outside input must not let a lying length field or a deep structure allocate far
//! more than the input itself. Each target runs its parser inside [`within_memory_bound`], which
//! fails (panics, so libFuzzer keeps the input as a crash) when the bytes allocated at the peak
//! of the call exceed [`memory_bound`] of the input's length.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes live now and the peak since the last reset.
pub struct CountingAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

impl CountingAllocator {
    fn add(bytes: usize) {
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }

    fn sub(bytes: usize) {
        LIVE.fetch_sub(bytes, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds `GlobalAlloc`'s contract;
// the counters are only arithmetic on the side.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout is passed on as it came.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            Self::add(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout is passed on as it came.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            Self::add(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every allocation goes through us).
        unsafe { System.dealloc(ptr, layout) };
        Self::sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; the caller guarantees `new_size`.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            Self::add(new_size);
            Self::sub(layout.size());
        }
        new
    }
}

/// How many bytes a parser may have allocated at its peak for an input of `input_len` bytes:
/// a fixed allowance for small inputs (messages, tables) plus a small multiple of the input.
pub fn memory_bound(input_len: usize) -> usize {
    const PER_INPUT_BYTE: usize = 96;
    const FIXED: usize = 1 << 20;
    FIXED + PER_INPUT_BYTE * input_len
}

/// Runs `parse` and panics when its peak allocation exceeds [`memory_bound`]`(input_len)`.
/// The counters are process-wide: call it from one thread at a time (libFuzzer runs one input at
/// a time).
pub fn within_memory_bound<T>(input_len: usize, parse: impl FnOnce() -> T) -> T {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = parse();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let bound = memory_bound(input_len);
    assert!(
        peak <= bound,
        "allocated {peak} bytes at the peak for an input of {input_len} bytes (bound {bound})"
    );
    result
}
