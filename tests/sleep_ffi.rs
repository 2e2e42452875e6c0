//! Sleep and wake through the C ABI (function pointers into the real `libferrocache.so`), on the
//! fake libcuda: the memory goes back to the driver, a raw driver allocation gets it, and wake
//! brings every byte back at the same address. Each scenario runs in a process of its own.

mod cdylib;
mod support;

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr;

use cdylib::Ferrocache;
use serde_json::Value;
use support::{FakeCuda, in_own_process, new_stream};

const MIB: usize = 1 << 20;

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type TagFn = unsafe extern "C" fn(*const c_char) -> c_int;
type SleepFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_char;
type WakeFn = unsafe extern "C" fn(*const c_char) -> *mut c_char;
type StringFreeFn = unsafe extern "C" fn(*mut c_char);
type StatusFn = unsafe extern "C" fn() -> c_int;

struct Api {
    library: Ferrocache,
}

impl Api {
    fn malloc(&self, size: usize, stream: u64) -> *mut c_void {
        let malloc: MallocFn = self.library.function("rust_malloc");
        // SAFETY: plain values; a stream handle is only passed on.
        unsafe { malloc(size, 0, ptr::without_provenance_mut(stream as usize)) }
    }

    fn set_tag(&self, tag: Option<&str>) {
        let set: TagFn = self.library.function("ferrocache_set_thread_tag");
        let tag = tag.map(|t| CString::new(t).unwrap());
        // SAFETY: NULL or a NUL-terminated string.
        let status = unsafe { set(tag.as_ref().map_or(ptr::null(), |t| t.as_ptr())) };
        assert_eq!(status, 0, "{}", self.last_error());
    }

    fn report(&self, text: *mut c_char) -> Value {
        assert!(!text.is_null(), "{}", self.last_error());
        // SAFETY: a string from ferrocache, freed once below.
        let json = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
        let free: StringFreeFn = self.library.function("ferrocache_string_free");
        // SAFETY: returned by ferrocache, not freed before.
        unsafe { free(text) };
        serde_json::from_str(&json).unwrap()
    }

    fn sleep(&self, tags: Option<&str>, backup: bool) -> Value {
        let sleep: SleepFn = self.library.function("ferrocache_sleep");
        let tags = tags.map(|t| CString::new(t).unwrap());
        // SAFETY: NULL or a NUL-terminated string.
        let text = unsafe {
            sleep(
                tags.as_ref().map_or(ptr::null(), |t| t.as_ptr()),
                c_int::from(backup),
            )
        };
        self.report(text)
    }

    fn wake(&self, tags: Option<&str>) -> Value {
        let wake: WakeFn = self.library.function("ferrocache_wake");
        let tags = tags.map(|t| CString::new(t).unwrap());
        // SAFETY: NULL or a NUL-terminated string.
        let text = unsafe { wake(tags.as_ref().map_or(ptr::null(), |t| t.as_ptr())) };
        self.report(text)
    }

    fn check_invariants(&self) {
        let check: StatusFn = self.library.function("ferrocache_check_invariants");
        // SAFETY: no arguments.
        assert_eq!(unsafe { check() }, 0, "{}", self.last_error());
    }

    fn last_error(&self) -> String {
        self.library.last_error()
    }
}

/// The fake's device memory is host memory: a pattern written straight into an allocation.
fn write(ptr: *mut c_void, len: usize, seed: u8) {
    // SAFETY: a live allocation from ferrocache on the fake (host memory), mapped, used only here.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = seed.wrapping_add(i as u8);
    }
}

fn holds(ptr: *mut c_void, len: usize, seed: u8) -> bool {
    // SAFETY: as in `write`; the memory is mapped again.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == seed.wrapping_add(i as u8))
}

/// The driver's `cuMemGetInfo` and `cuMemAlloc`/`cuMemFree`, called as another user of the
/// device would (after `new_stream`, device 0's primary context is current on this thread).
struct Driver {
    cuda: libloading::Library,
}

impl Driver {
    fn open() -> Driver {
        // SAFETY: the fake, already loaded by ferrocache.
        let cuda = unsafe { libloading::Library::new("libcuda.so") }.expect("load the fake");
        Driver { cuda }
    }

    fn free_memory(&self) -> usize {
        // SAFETY: the driver API's signature; two live out pointers.
        unsafe {
            let info = self
                .cuda
                .get::<unsafe extern "C" fn(*mut usize, *mut usize) -> c_int>(b"cuMemGetInfo_v2")
                .unwrap();
            let (mut free, mut total) = (0, 0);
            assert_eq!(info(&mut free, &mut total), 0);
            free
        }
    }

    fn alloc_and_free(&self, size: usize) {
        // SAFETY: the driver API's signatures; a live out pointer.
        unsafe {
            let alloc = self
                .cuda
                .get::<unsafe extern "C" fn(*mut u64, usize) -> c_int>(b"cuMemAlloc_v2")
                .unwrap();
            let free = self
                .cuda
                .get::<unsafe extern "C" fn(u64) -> c_int>(b"cuMemFree_v2")
                .unwrap();
            let mut ptr = 0;
            assert_eq!(
                alloc(&mut ptr, size),
                0,
                "the raw allocation of {size} bytes"
            );
            assert_eq!(free(ptr), 0);
        }
    }
}

fn as_usize(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

#[test]
fn everything_sleeps_a_raw_allocation_takes_the_memory_and_wake_restores_it() {
    let test = "everything_sleeps_a_raw_allocation_takes_the_memory_and_wake_restores_it";
    in_own_process(test, &[("FERROCACHE_SLEEP", "1")], || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let fake = FakeCuda::open();
        let stream = new_stream();
        let driver = Driver::open();
        let sizes = [4096, 3 * MIB, 25 * MIB, 100 * MIB];
        let live: Vec<(*mut c_void, usize, u8)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let ptr = api.malloc(size, if i % 2 == 0 { 0 } else { stream });
                assert!(!ptr.is_null(), "{}", api.last_error());
                write(ptr, size, i as u8 * 31);
                (ptr, size, i as u8 * 31)
            })
            .collect();
        let free_before = driver.free_memory();
        let slept = api.sleep(None, true);
        let bytes = as_usize(&slept["bytes"]);
        assert!(bytes >= sizes.iter().sum::<usize>(), "{slept}");
        assert_eq!(as_usize(&slept["blocks"]), live.len());
        assert_eq!(as_usize(&slept["skipped_bytes"]), 0);
        assert!(driver.free_memory() >= free_before + bytes);
        assert_eq!(fake.stat("live_physical"), 0);
        // Another user of the device takes the memory that slept.
        driver.alloc_and_free(driver.free_memory() - 64 * MIB);
        assert_eq!(
            as_usize(&api.sleep(None, true)["segments"]),
            0,
            "idempotent"
        );
        api.check_invariants();

        let woke = api.wake(None);
        assert_eq!(as_usize(&woke["bytes"]), bytes);
        for &(ptr, size, seed) in &live {
            assert!(holds(ptr, size, seed), "{ptr:?}");
        }
        assert_eq!(as_usize(&api.wake(None)["segments"]), 0, "idempotent");
        api.check_invariants();
    });
}

#[test]
fn a_tag_sleeps_without_backup_while_another_stays_awake() {
    let test = "a_tag_sleeps_without_backup_while_another_stays_awake";
    in_own_process(test, &[], || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let _stream = new_stream();
        // Made before the first tag: `cudaMalloc`'d, so it cannot sleep.
        let untagged = api.malloc(30 * MIB, 0);
        api.set_tag(Some("weights"));
        let weights = api.malloc(30 * MIB, 0);
        api.set_tag(Some("kv_cache"));
        let cache = api.malloc(30 * MIB, 0);
        api.set_tag(None);
        for (ptr, seed) in [(weights, 1), (cache, 2), (untagged, 3)] {
            assert!(!ptr.is_null(), "{}", api.last_error());
            write(ptr, 30 * MIB, seed);
        }
        let slept = api.sleep(Some("kv_cache"), false);
        assert_eq!(as_usize(&slept["blocks"]), 1, "{slept}");
        assert_eq!(as_usize(&slept["copied_bytes"]), 0);
        assert!(holds(weights, 30 * MIB, 1) && holds(untagged, 30 * MIB, 3));
        api.wake(Some("kv_cache"));
        assert!(holds(weights, 30 * MIB, 1));
        api.check_invariants();
        // Sleeping everything covers the tags but not the segment made before the first tag.
        let all = api.sleep(None, true);
        assert_eq!(as_usize(&all["blocks"]), 2, "{all}");
        assert!(as_usize(&all["skipped_bytes"]) >= 30 * MIB, "{all}");
        api.wake(None);
        assert!(holds(weights, 30 * MIB, 1) && holds(untagged, 30 * MIB, 3));
    });
}

/// A copy into memory that sleeps is an illegal address on the fake, as on a GPU: the driver
/// names the address on stderr and every later call fails the same way, so wake reports the
/// error instead of waking (CUDA is unusable in the process).
#[test]
fn a_copy_into_sleeping_memory_is_a_sticky_illegal_address() {
    let test = "a_copy_into_sleeping_memory_is_a_sticky_illegal_address";
    let stderr = support::in_own_process_stderr(test, &[("FERROCACHE_SLEEP", "1")], || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let _stream = new_stream();
        let driver = Driver::open();
        let ptr = api.malloc(25 * MIB, 0);
        assert!(!ptr.is_null(), "{}", api.last_error());
        write(ptr, 25 * MIB, 5);
        api.sleep(None, true);
        eprintln!("sleeping block at {:#x}", ptr as u64);
        let host = vec![1u8; 4096];
        // SAFETY: the driver API's signature; the host side is live.
        let copied = unsafe {
            driver
                .cuda
                .get::<unsafe extern "C" fn(u64, *const c_void, usize) -> c_int>(b"cuMemcpyHtoD_v2")
                .unwrap()(ptr as u64, host.as_ptr().cast(), host.len())
        };
        assert_eq!(copied, 700, "CUDA_ERROR_ILLEGAL_ADDRESS");
        let wake: WakeFn = api.library.function("ferrocache_wake");
        // SAFETY: NULL: every tag.
        assert!(unsafe { wake(ptr::null()) }.is_null(), "wake fails");
        let error = api.last_error();
        assert!(error.contains("illegal memory access"), "{error}");
    });
    if let Some(stderr) = stderr {
        let line = stderr
            .lines()
            .find(|l| l.contains("ILLEGAL ADDRESS"))
            .unwrap_or_else(|| panic!("no ILLEGAL ADDRESS line:\n{stderr}"));
        assert!(line.contains("is reserved but not mapped"), "{line}");
        let address = stderr
            .lines()
            .find_map(|l| l.strip_prefix("sleeping block at "))
            .expect("the child says where the block is");
        assert!(line.contains(&format!("[{address}, ")), "{line}");
    }
}

/// Expandable segments sleep and wake through the C ABI, and the pages mapped at wake are
/// granted to the same devices as when they were first mapped: the peer device 1 reads them
/// (without the grant, its copy is an illegal address).
#[test]
fn expandable_pages_wake_granted_to_the_peer_device() {
    let test = "expandable_pages_wake_granted_to_the_peer_device";
    let env = [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("FAKE_LIBCUDA_DEVICE_COUNT", "2"),
    ];
    in_own_process(test, &env, || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let fake = FakeCuda::open();
        let _stream = new_stream();
        let size = 30 * MIB;
        let block = api.malloc(size, 0);
        assert!(!block.is_null(), "{}", api.last_error());
        write(block, size, 7);
        let slept = api.sleep(None, true);
        assert_eq!(as_usize(&slept["skipped_bytes"]), 0, "{slept}");
        assert!(as_usize(&slept["bytes"]) >= size, "{slept}");
        assert_eq!(fake.stat("live_physical"), 0);
        api.check_invariants();
        let woke = api.wake(None);
        assert_eq!(woke["bytes"], slept["bytes"]);
        assert!(holds(block, size, 7));
        // Awake, the segment grows for a second block (pages mapped, not woken).
        let copy = api.malloc(size, 0);
        assert!(!copy.is_null(), "{}", api.last_error());
        fake.make_current(1);
        assert_eq!(
            fake.copy(copy as u64, block as u64, size),
            0,
            "device 1 reads"
        );
        assert_eq!(fake.synchronize(), 0);
        fake.make_current(0);
        assert!(holds(copy, size, 7));
        assert_eq!(fake.stat("cuMemAlloc_v2"), 0, "all of it expandable");
        api.check_invariants();
    });
}

type PoolFn = unsafe extern "C" fn(c_int, u64, u64) -> c_int;

/// `ferrocache_last_sleep_report()`: the report of this thread's latest sleep or wake, per
/// device, a failed one's included.
fn last_sleep_report(api: &Api) -> Value {
    let last: unsafe extern "C" fn() -> *mut c_char =
        api.library.function("ferrocache_last_sleep_report");
    // SAFETY: no arguments; the string is freed by `report`.
    api.report(unsafe { last() })
}

/// A sleep that fails on one device (device 1, where a private pool records, which forbids
/// waiting for the device) keeps the report of the devices already done (device 0 slept): the
/// call returns NULL with the error, and the report says what slept where and which device
/// failed. After the pool closes, the call goes on where it stopped; a wake reports per device.
#[test]
fn a_sleep_that_fails_on_one_device_keeps_the_report_of_the_devices_done() {
    let test = "a_sleep_that_fails_on_one_device_keeps_the_report_of_the_devices_done";
    let env = [
        ("FERROCACHE_SLEEP", "1"),
        ("FAKE_LIBCUDA_DEVICE_COUNT", "2"),
    ];
    in_own_process(test, &env, || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let alloc: MallocFn = api.library.function("ferrocache_alloc");
        // SAFETY: plain values.
        let on_device = |device: c_int| unsafe { alloc(4 * MIB, device, ptr::null_mut()) };
        let (first, second) = (on_device(0), on_device(1));
        assert!(
            !first.is_null() && !second.is_null(),
            "{}",
            api.last_error()
        );
        let pool: PoolFn = api
            .library
            .function("ferrocache_begin_allocate_current_thread_to_pool");
        // SAFETY: plain values.
        assert_eq!(unsafe { pool(1, 0, 7) }, 0, "{}", api.last_error());

        let sleep: SleepFn = api.library.function("ferrocache_sleep");
        // SAFETY: NULL: every tag.
        let refused = unsafe { sleep(ptr::null(), 1) }.is_null();
        assert!(refused, "device 1 refuses");
        let error = api.last_error();
        assert!(error.starts_with("device 1: "), "{error}");
        let partial = last_sleep_report(&api);
        assert_eq!(as_usize(&partial["segments"]), 1, "{partial}");
        // The segment's bytes went back; only its live allocation's bytes were copied.
        assert_eq!(as_usize(&partial["bytes"]), 20 * MIB, "{partial}");
        assert_eq!(as_usize(&partial["copied_bytes"]), 4 * MIB, "{partial}");
        let devices = partial["devices"].as_array().expect("per device").clone();
        assert_eq!(devices.len(), 2, "{partial}");
        assert_eq!(devices[0]["device"], 0);
        assert_eq!(as_usize(&devices[0]["segments"]), 1);
        assert_eq!(devices[1]["device"], 1);
        assert_eq!(as_usize(&devices[1]["segments"]), 0);
        assert_eq!(partial["failed"]["device"], 1);
        assert_eq!(
            partial["failed"]["error"],
            error.strip_prefix("device 1: ").unwrap()
        );

        let end: PoolFn = api.library.function("ferrocache_end_allocate_to_pool");
        // SAFETY: plain values.
        assert_eq!(unsafe { end(1, 0, 7) }, 0, "{}", api.last_error());
        let rest = api.sleep(None, true);
        assert_eq!(
            as_usize(&rest["segments"]),
            1,
            "only device 1's was left: {rest}"
        );
        assert_eq!(rest["failed"], Value::Null);
        assert_eq!(last_sleep_report(&api), rest);
        let woke = api.wake(None);
        let per_device: Vec<usize> = woke["devices"]
            .as_array()
            .expect("per device")
            .iter()
            .map(|d| as_usize(&d["segments"]))
            .collect();
        assert_eq!(per_device, [1, 1], "{woke}");
        api.check_invariants();
    });
}

/// The fast path through the C ABI on the fake: a half-empty segment copies its live half,
/// into pinned host memory (`cuMemHostAlloc`) made once and kept for the second cycle, with one
/// wait per call (sleep's copy stream waits for the program's streams on the device, never the
/// host: no `cuCtxSynchronize`), and every byte comes back at its address. The fake's ordering
/// check (fatal in these children) sees no memory unmapped under a pending copy or under the
/// program's work. The same for VMM-backed segments and for an expandable segment's page.
#[test]
fn a_half_empty_segment_copies_its_live_half_into_pinned_memory_kept_between_cycles() {
    let test = "a_half_empty_segment_copies_its_live_half_into_pinned_memory_kept_between_cycles";
    half_empty_segment_cycles(test, &[]);
}

#[test]
fn a_half_empty_expandable_page_copies_its_live_half_into_pinned_memory_kept_between_cycles() {
    let test =
        "a_half_empty_expandable_page_copies_its_live_half_into_pinned_memory_kept_between_cycles";
    half_empty_segment_cycles(
        test,
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
    );
}

/// Ten 2 MiB blocks (one 20 MiB segment, or one 20 MiB page of an expandable segment), every
/// other one freed, slept with backup and woken twice; `extra` is added to the environment.
fn half_empty_segment_cycles(test: &str, extra: &[(&str, &str)]) {
    // Events answer "not ready" to their first queries: the copies are still running when
    // sleep asks, so it waits for them once at the end (with no delay, the fake's copies are
    // done when asked, and sleep unmaps each segment without that wait).
    let mut env = vec![
        ("FERROCACHE_SLEEP", "1"),
        ("FAKE_LIBCUDA_EVENT_DELAY", "1000"),
    ];
    env.extend_from_slice(extra);
    in_own_process(test, &env, || {
        let api = Api {
            library: Ferrocache::open(),
        };
        let fake = FakeCuda::open();
        let _stream = new_stream();
        let rust_free: unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void) =
            api.library.function("rust_free");
        let blocks: Vec<*mut c_void> = (0..10).map(|_| api.malloc(2 * MIB, 0)).collect();
        let mut live = Vec::new();
        for (i, &block) in blocks.iter().enumerate() {
            assert!(!block.is_null(), "{}", api.last_error());
            if i % 2 == 0 {
                // SAFETY: a block from rust_malloc, freed once.
                unsafe { rust_free(block, 2 * MIB, 0, ptr::null_mut()) };
            } else {
                write(block, 2 * MIB, i as u8);
                live.push((block, i as u8));
            }
        }
        for cycle in 0..2 {
            let device_waits = fake.stat("cuCtxSynchronize");
            let slept = api.sleep(None, true);
            assert_eq!(
                fake.stat("cuCtxSynchronize"),
                device_waits,
                "no device-wide wait"
            );
            assert_eq!(as_usize(&slept["bytes"]), 20 * MIB, "{slept}");
            assert_eq!(as_usize(&slept["copied_bytes"]), 10 * MIB, "{slept}");
            assert_eq!(slept["host_memory_pinned"], true, "{slept}");
            assert_eq!(as_usize(&slept["host_allocations"]), 1 - cycle, "{slept}");
            assert_eq!(as_usize(&slept["host_synchronizations"]), 1, "{slept}");
            assert!(as_usize(&slept["host_memory_bytes"]) >= 10 * MIB, "{slept}");
            let woke = api.wake(None);
            assert_eq!(as_usize(&woke["copied_bytes"]), 10 * MIB, "{woke}");
            assert_eq!(woke["host_memory_pinned"], true, "{woke}");
            assert_eq!(as_usize(&woke["host_allocations"]), 0, "{woke}");
            assert_eq!(as_usize(&woke["host_synchronizations"]), 1, "{woke}");
            for &(block, seed) in &live {
                assert!(holds(block, 2 * MIB, seed), "cycle {cycle}: {block:?}");
            }
            api.check_invariants();
        }
        assert_eq!(
            fake.stat("cuMemHostAlloc"),
            1,
            "one pinned buffer for both cycles"
        );
        assert_eq!(fake.stat("live_pinned_host"), 1);
        assert_eq!(fake.stat("cuMemcpyDtoH_v2"), 0, "no synchronous copy");
        assert_eq!(fake.stat("order_violations"), 0);
        let release: unsafe extern "C" fn() -> u64 =
            api.library.function("ferrocache_release_host_memory");
        // SAFETY: no arguments.
        assert!(unsafe { release() } >= 10 * MIB as u64);
        assert_eq!(fake.stat("live_pinned_host"), 0);
        assert_eq!(fake.stat("cuMemFreeHost"), 1);
    });
}
