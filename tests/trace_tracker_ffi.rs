//! `ferrocache_attach_trace_tracker` and `ferrocache_expandable_segment_sizes` through the real
//! `libferrocache.so`, against the fake libcuda: what the front end (python/ferrocache/
//! frontend.cpp) hands to PyTorch's allocator trace trackers and `getExpandableSegmentSizes`.
//! Each scenario runs in a process of its own (the library keeps its allocators).

mod cdylib;
mod support;

use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Mutex;

use cdylib::Ferrocache;
use support::{in_own_process, in_own_process_stderr, new_stream};

const MIB: u64 = 1 << 20;

/// `struct ferrocache_trace_event`.
#[repr(C)]
struct TraceEvent {
    action: c_int,
    device: c_int,
    addr: u64,
    size: u64,
    stream: *mut c_void,
    pool_first: u64,
    pool_second: u64,
}

/// `struct ferrocache_stream_segment_size`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SegmentSize {
    stream: *mut c_void,
    is_small_pool: c_int,
    total_size: u64,
}

type Tracker = unsafe extern "C" fn(*const TraceEvent, *mut *const c_char) -> c_int;
type AttachFn = unsafe extern "C" fn(Option<Tracker>) -> c_int;
type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type EmptyFn = unsafe extern "C" fn() -> c_int;
type SizesFn = unsafe extern "C" fn(c_int, *mut SegmentSize, usize) -> i64;

const SEGMENT_ALLOC: c_int = 3;
const SEGMENT_FREE: c_int = 4;
const SEGMENT_MAP: c_int = 5;
const SEGMENT_UNMAP: c_int = 6;

/// (action, device, addr, size, pool) of an event seen.
type Seen = (c_int, c_int, u64, u64, (u64, u64));

/// Every event seen, in order.
static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

unsafe extern "C" fn record(event: *const TraceEvent, _error: *mut *const c_char) -> c_int {
    // SAFETY: the library passes a valid event for the duration of the call.
    let e = unsafe { &*event };
    SEEN.lock().unwrap().push((
        e.action,
        e.device,
        e.addr,
        e.size,
        (e.pool_first, e.pool_second),
    ));
    0
}

unsafe extern "C" fn refuse(_event: *const TraceEvent, error: *mut *const c_char) -> c_int {
    // SAFETY: the library passes a writable out pointer.
    unsafe { error.write(c"Memory already registered with NCCL".as_ptr()) };
    -1
}

fn segment_events() -> Vec<Seen> {
    SEEN.lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|e| (SEGMENT_ALLOC..=SEGMENT_UNMAP).contains(&e.0))
        .collect()
}

/// Allocates and frees `size` bytes on device 0, then empties the cache.
fn alloc_free_empty(library: &Ferrocache, size: u64) {
    let alloc: AllocFn = library.function("ferrocache_alloc");
    let free: FreeFn = library.function("ferrocache_free");
    let empty: EmptyFn = library.function("ferrocache_empty_cache");
    // SAFETY: plain values; the default stream.
    let block = unsafe { alloc(size as usize, 0, ptr::null_mut()) };
    assert!(!block.is_null());
    // SAFETY: a block ferrocache handed out.
    assert_eq!(unsafe { free(block) }, 0);
    // SAFETY: no arguments.
    assert_eq!(unsafe { empty() }, 0);
}

#[test]
fn an_attached_tracker_hears_each_segment_allocated_and_freed_with_its_device_and_pool() {
    in_own_process(
        "an_attached_tracker_hears_each_segment_allocated_and_freed_with_its_device_and_pool",
        &[],
        || {
            let library = Ferrocache::open();
            let attach: AttachFn = library.function("ferrocache_attach_trace_tracker");
            // SAFETY: `record` stays callable and never unwinds.
            assert_eq!(unsafe { attach(Some(record)) }, 0);
            alloc_free_empty(&library, 3 * MIB);
            let events = segment_events();
            assert_eq!(events.len(), 2, "{events:?}");
            let (alloc, free) = (events[0], events[1]);
            assert_eq!((alloc.0, free.0), (SEGMENT_ALLOC, SEGMENT_FREE));
            assert_eq!((alloc.1, alloc.3, alloc.4), (0, 20 * MIB, (0, 0)));
            assert_eq!(
                (free.2, free.3),
                (alloc.2, alloc.3),
                "the segment allocated is freed"
            );
            let everything: Vec<c_int> = SEEN.lock().unwrap().iter().map(|e| e.0).collect();
            assert_eq!(
                everything,
                vec![3, 0, 1, 2, 4],
                "alloc, free_requested, free_completed"
            );
            // Detached: nothing more.
            // SAFETY: NULL detaches.
            assert_eq!(unsafe { attach(None) }, 0);
            alloc_free_empty(&library, 3 * MIB);
            assert_eq!(SEEN.lock().unwrap().len(), 5);
        },
    );
}

#[test]
fn a_tracker_that_refuses_is_logged_and_the_allocation_stands() {
    let stderr = in_own_process_stderr(
        "a_tracker_that_refuses_is_logged_and_the_allocation_stands",
        &[],
        || {
            let library = Ferrocache::open();
            let attach: AttachFn = library.function("ferrocache_attach_trace_tracker");
            // SAFETY: `refuse` stays callable and never unwinds.
            assert_eq!(unsafe { attach(Some(refuse)) }, 0);
            alloc_free_empty(&library, MIB);
        },
    );
    if let Some(stderr) = stderr {
        assert!(
            stderr.contains("an allocator trace tracker on segment_alloc of 2097152 bytes at 0x")
                && stderr.contains("Memory already registered with NCCL"),
            "{stderr}"
        );
    }
}

#[test]
fn expandable_segment_sizes_list_each_segment_with_its_pool_and_mapped_bytes() {
    in_own_process(
        "expandable_segment_sizes_list_each_segment_with_its_pool_and_mapped_bytes",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
        || {
            let library = Ferrocache::open();
            let attach: AttachFn = library.function("ferrocache_attach_trace_tracker");
            let sizes: SizesFn = library.function("ferrocache_expandable_segment_sizes");
            let alloc: AllocFn = library.function("ferrocache_alloc");
            // SAFETY: `record` stays callable and never unwinds.
            assert_eq!(unsafe { attach(Some(record)) }, 0);
            // SAFETY: no room asked for.
            assert_eq!(unsafe { sizes(0, ptr::null_mut(), 0) }, 0);
            // PyTorch leaves out the default stream's segments; a stream of its own is listed.
            let stream = ptr::without_provenance_mut(new_stream() as usize);
            // SAFETY: plain values; a live stream.
            let small = unsafe { alloc(4096, 0, stream) };
            // SAFETY: as above.
            let large = unsafe { alloc(30 * MIB as usize, 0, stream) };
            assert!(!small.is_null() && !large.is_null());
            // SAFETY: no room: the count only.
            assert_eq!(unsafe { sizes(0, ptr::null_mut(), 0) }, 2);
            let mut room = [SegmentSize {
                stream: ptr::null_mut(),
                is_small_pool: -1,
                total_size: 0,
            }; 2];
            // SAFETY: room for two.
            assert_eq!(unsafe { sizes(0, room.as_mut_ptr(), 2) }, 2);
            let mut got: Vec<(c_int, u64)> = room
                .iter()
                .map(|s| (s.is_small_pool, s.total_size))
                .collect();
            got.sort();
            assert_eq!(got, vec![(0, 40 * MIB), (1, 2 * MIB)]);
            assert!(room.iter().all(|s| s.stream == stream));
            let maps: Vec<u64> = segment_events()
                .iter()
                .filter(|e| e.0 == SEGMENT_MAP)
                .map(|e| e.3)
                .collect();
            assert_eq!(maps, vec![2 * MIB, 40 * MIB]);
        },
    );
}
