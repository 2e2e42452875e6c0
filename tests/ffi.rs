//! The C ABI from Rust, through the real `libferrocache.so` (dlopen by path, as PyTorch and the
//! Python package load it), against the fake libcuda. Each scenario runs in a process of its own
//! (see `support`): the library keeps its allocators for the life of the process.

mod cdylib;
mod support;

use std::ffi::{CStr, CString, c_char, c_double, c_int, c_void};
use std::ptr;

use cdylib::Ferrocache;
use serde_json::Value;
use support::{
    FakeCuda, in_own_process, in_own_process_stderr, in_own_process_without_libcuda, new_stream,
};

const MIB: usize = 1 << 20;

type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type RustFreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type StringFn = unsafe extern "C" fn() -> *const c_char;
type OwnedStringFn = unsafe extern "C" fn() -> *mut c_char;
type DeviceStringFn = unsafe extern "C" fn(c_int) -> *mut c_char;
type DeviceFn = unsafe extern "C" fn(c_int) -> c_int;
type ConfigFn = unsafe extern "C" fn(*const c_char) -> c_int;
type DescribeFn = unsafe extern "C" fn(*const c_char) -> *mut c_char;
type PoolFn = unsafe extern "C" fn(c_int, u64, u64) -> c_int;

/// The functions a test calls, with their C signatures.
struct Api {
    library: Ferrocache,
}

impl Api {
    fn open() -> Api {
        Api {
            library: Ferrocache::open(),
        }
    }

    fn alloc(&self, size: usize, device: c_int, stream: u64) -> *mut c_void {
        let alloc: AllocFn = self.library.function("ferrocache_alloc");
        // SAFETY: plain values; a stream handle is only passed on.
        unsafe { alloc(size, device, ptr::without_provenance_mut(stream as usize)) }
    }

    fn free(&self, ptr: *mut c_void) -> c_int {
        let free: FreeFn = self.library.function("ferrocache_free");
        // SAFETY: ferrocache checks the pointer against what it handed out.
        unsafe { free(ptr) }
    }

    /// PyTorch's allocation function (it throws a C++ exception on failure, which no test here
    /// provokes).
    fn rust_malloc(&self, size: usize, stream: u64) -> *mut c_void {
        let malloc: AllocFn = self.library.function("rust_malloc");
        // SAFETY: plain values; a stream handle is only passed on.
        unsafe { malloc(size, 0, ptr::without_provenance_mut(stream as usize)) }
    }

    fn rust_free(&self, ptr: *mut c_void, size: usize, stream: u64) {
        let free: RustFreeFn = self.library.function("rust_free");
        // SAFETY: as for `free`.
        unsafe { free(ptr, size, 0, ptr::without_provenance_mut(stream as usize)) }
    }

    fn last_error(&self) -> String {
        self.library.last_error()
    }

    /// Takes a string the library returned: its text, after freeing it; `None` for NULL.
    fn take_string(&self, text: *mut c_char) -> Option<String> {
        if text.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated string from the library, not yet freed.
        let owned = unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned();
        let free: unsafe extern "C" fn(*mut c_char) =
            self.library.function("ferrocache_string_free");
        // SAFETY: returned by the library and freed once.
        unsafe { free(text) };
        Some(owned)
    }

    fn stats(&self, device: c_int) -> Option<Value> {
        let stats: DeviceStringFn = self.library.function("ferrocache_memory_stats");
        // SAFETY: a plain value.
        let text = self.take_string(unsafe { stats(device) })?;
        Some(serde_json::from_str(&text).expect("the statistics are JSON"))
    }

    fn stat(&self, key: &str) -> i64 {
        let stats = self.stats(0).expect("statistics of device 0");
        stats[key]
            .as_i64()
            .unwrap_or_else(|| panic!("no {key} in {stats}"))
    }

    fn snapshot(&self) -> Option<Value> {
        let snapshot: OwnedStringFn = self.library.function("ferrocache_snapshot");
        // SAFETY: no arguments.
        let text = self.take_string(unsafe { snapshot() })?;
        Some(serde_json::from_str(&text).expect("the snapshot is JSON"))
    }

    fn device_call(&self, name: &str, device: c_int) -> c_int {
        let call: DeviceFn = self.library.function(name);
        // SAFETY: a plain value.
        unsafe { call(device) }
    }

    /// `ferrocache_empty_cache()`: 0, or -1 (last error set).
    fn empty_cache(&self) -> c_int {
        let empty_cache: unsafe extern "C" fn() -> c_int =
            self.library.function("ferrocache_empty_cache");
        // SAFETY: no arguments.
        unsafe { empty_cache() }
    }

    fn check_config(&self, text: Option<&str>) -> c_int {
        let check: ConfigFn = self.library.function("ferrocache_check_config");
        let text = text.map(|t| CString::new(t).expect("no NUL"));
        // SAFETY: NULL or a NUL-terminated string that outlives the call.
        unsafe { check(text.as_ref().map_or(ptr::null(), |t| t.as_ptr())) }
    }

    fn describe_config(&self, text: &str) -> Option<String> {
        let describe: DescribeFn = self.library.function("ferrocache_describe_config");
        let text = CString::new(text).expect("no NUL");
        // SAFETY: a NUL-terminated string that outlives the call.
        self.take_string(unsafe { describe(text.as_ptr()) })
    }

    fn record_history(&self, enabled: bool, max_entries: usize) {
        let record: unsafe extern "C" fn(c_int, usize) -> c_int =
            self.library.function("ferrocache_record_history");
        // SAFETY: plain values.
        assert_eq!(unsafe { record(c_int::from(enabled), max_entries) }, 0);
    }

    /// `ferrocache_advise`: the JSON, or the last error.
    fn advise(
        &self,
        snapshot: Option<&[u8]>,
        device: c_int,
        capacity: u64,
        max_candidates: usize,
    ) -> Result<Value, String> {
        let advise: unsafe extern "C" fn(*const c_char, usize, c_int, u64, usize) -> *mut c_char =
            self.library.function("ferrocache_advise");
        let (bytes, length) = snapshot.map_or((ptr::null(), 0), |b| (b.as_ptr().cast(), b.len()));
        // SAFETY: NULL, or a live slice of `length` bytes.
        let text =
            self.take_string(unsafe { advise(bytes, length, device, capacity, max_candidates) });
        match text {
            Some(text) => Ok(serde_json::from_str(&text).expect("the advice is JSON")),
            None => Err(self.last_error()),
        }
    }

    fn base_alloc(&self, ptr: *mut c_void) -> (*mut c_void, usize) {
        let base_alloc: unsafe extern "C" fn(*mut c_void, *mut usize) -> *mut c_void =
            self.library.function("rust_base_alloc");
        let mut size = usize::MAX;
        // SAFETY: the size pointer is a live local.
        let base = unsafe { base_alloc(ptr, &mut size) };
        (base, size)
    }

    fn record_stream(&self, ptr: *mut c_void, stream: u64) {
        let record: unsafe extern "C" fn(*mut c_void, *mut c_void) =
            self.library.function("rust_record_stream");
        // SAFETY: ferrocache checks the pointer; the stream is only passed on.
        unsafe { record(ptr, ptr::without_provenance_mut(stream as usize)) }
    }

    fn rust_memory_fraction(&self, fraction: f64, device: c_int) {
        let set: unsafe extern "C" fn(c_double, c_int) =
            self.library.function("rust_memory_fraction");
        // SAFETY: plain values.
        unsafe { set(fraction, device) }
    }

    fn set_memory_fraction(&self, fraction: f64, device: c_int) -> c_int {
        let set: unsafe extern "C" fn(c_double, c_int) -> c_int =
            self.library.function("ferrocache_set_memory_fraction");
        // SAFETY: plain values.
        unsafe { set(fraction, device) }
    }

    /// One of the `ferrocache_*_pool` functions: `int f(int device, ull first, ull second)`.
    fn pool_call(&self, name: &str, pool: (u64, u64)) -> c_int {
        let call: PoolFn = self.library.function(name);
        // SAFETY: plain values.
        unsafe { call(0, pool.0, pool.1) }
    }

    fn rust_reset(&self) {
        let reset: unsafe extern "C" fn() = self.library.function("rust_reset");
        // SAFETY: no arguments.
        unsafe { reset() }
    }
}

/// Writes `len` bytes at a device pointer, which on the fake is host memory, and reads them back.
fn fill_and_check(ptr: *mut c_void, len: usize, byte: u8) -> bool {
    // SAFETY: `ptr..ptr + len` is a live allocation from ferrocache on the fake (host memory)
    // that only this test uses.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) };
    bytes.fill(byte);
    bytes.iter().all(|&b| b == byte)
}

#[test]
fn allocations_round_trip_with_statistics() {
    in_own_process("allocations_round_trip_with_statistics", &[], || {
        let api = Api::open();
        assert!(api.alloc(0, 0, 0).is_null(), "size 0 gives NULL");
        assert_eq!(api.last_error(), "", "and it is no failure");

        let first = api.alloc(MIB, 0, 0);
        assert!(!first.is_null(), "{}", api.last_error());
        assert!(fill_and_check(first, MIB, 0xa5));
        let second = api.alloc(512 << 10, 0, 0);
        assert!(fill_and_check(second, 512 << 10, 0x5a));
        assert!(fill_and_check(first, MIB, 0xa5), "the blocks overlap");
        assert_eq!(
            api.stat("allocated_bytes.all.current"),
            (MIB + (512 << 10)) as i64
        );
        assert_eq!(api.stat("allocation.all.current"), 2);

        // Both are carved from one 2 MiB small-pool segment.
        let (base, size) = api.base_alloc(second);
        assert_eq!((base, size), (first, 2 * MIB));
        assert_eq!(api.base_alloc(first), (first, 2 * MIB));

        assert_eq!(api.free(first), 0);
        assert_eq!(api.free(ptr::null_mut()), 0);
        assert_eq!(api.free(first), -1, "a second free is refused");
        assert!(
            api.last_error().starts_with("invalid device pointer: 0x"),
            "{}",
            api.last_error()
        );
        // Another thread has its own last error.
        let other_thread = std::thread::scope(|s| s.spawn(|| api.last_error()).join());
        assert_eq!(other_thread.expect("the thread ran"), "");
        assert_eq!(api.free(second), 0);
        assert_eq!(api.last_error(), "", "a success clears the last error");
        assert_eq!(api.stat("allocated_bytes.all.current"), 0);

        assert_eq!(
            api.stat("allocated_bytes.all.peak"),
            (MIB + (512 << 10)) as i64
        );
        assert_eq!(api.device_call("ferrocache_reset_peak_stats", 0), 0);
        assert_eq!(api.stat("allocated_bytes.all.peak"), 0);
        assert_eq!(
            api.stat("allocated_bytes.all.allocated"),
            (MIB + (512 << 10)) as i64
        );
        assert_eq!(api.device_call("ferrocache_reset_accumulated_stats", 0), 0);
        assert_eq!(api.stat("allocated_bytes.all.allocated"), 0);

        let fake = FakeCuda::open();
        assert_eq!(
            fake.stat("bytes_in_use"),
            2 * MIB as i64,
            "the segment is cached"
        );
        assert_eq!(api.empty_cache(), 0);
        assert_eq!(fake.stat("bytes_in_use"), 0);

        let version: StringFn = api.library.function("ferrocache_version");
        // SAFETY: a static NUL-terminated string.
        let version = unsafe { CStr::from_ptr(version()) };
        assert_eq!(version.to_str(), Ok(env!("CARGO_PKG_VERSION")));
    });
}

#[test]
fn rust_free_uses_what_the_allocation_recorded() {
    in_own_process("rust_free_uses_what_the_allocation_recorded", &[], || {
        let api = Api::open();
        let block = api.alloc(3000, 0, 0);
        api.rust_free(ptr::null_mut(), 10, 0);
        api.rust_free(ptr::without_provenance_mut(0x1000), 10, 0);
        assert_eq!(
            api.stat("allocation.all.current"),
            1,
            "bad frees changed nothing"
        );
        api.rust_free(block, 1, 0);
        assert_eq!(
            api.stat("allocation.all.current"),
            0,
            "freed despite the wrong size"
        );
        api.rust_free(block, 3000, 0);
        assert_eq!(api.stat("allocation.all.current"), 0);
        assert_eq!(
            api.stat("inactive_split.all.current"),
            0,
            "{:?}",
            api.stats(0)
        );
    });
}

#[test]
fn history_and_snapshot_have_pytorchs_structure() {
    in_own_process("history_and_snapshot_have_pytorchs_structure", &[], || {
        let api = Api::open();
        // Asked for before the device is first used: applies once it is.
        api.record_history(true, 100);
        let block = api.alloc(MIB, 0, 0);
        assert_eq!(api.free(block), 0);
        let kept = api.alloc(4096, 0, 0);

        let snapshot = api.snapshot().expect("a snapshot");
        let segments = snapshot["segments"].as_array().expect("segments");
        assert_eq!(segments.len(), 1, "{snapshot}");
        assert_eq!(segments[0]["device"], 0);
        assert_eq!(segments[0]["total_size"], 2 * MIB);
        assert_eq!(segments[0]["allocated_size"], 4096);
        let traces = snapshot["device_traces"].as_array().expect("device_traces");
        assert_eq!(traces.len(), 1, "one device");
        let actions: Vec<&str> = traces[0]
            .as_array()
            .expect("a trace")
            .iter()
            .map(|entry| entry["action"].as_str().expect("an action"))
            .collect();
        assert_eq!(
            actions,
            [
                "segment_alloc",
                "alloc",
                "free_requested",
                "free_completed",
                "alloc"
            ]
        );
        assert_eq!(
            snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"],
            ""
        );

        api.record_history(false, 0);
        let snapshot = api.snapshot().expect("a snapshot");
        assert_eq!(snapshot["device_traces"][0], Value::Array(vec![]));
        assert_eq!(api.free(kept), 0);
    });
}

#[test]
fn advise_searches_the_recorded_history_or_a_snapshot() {
    let total = (200 * MIB).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", total.as_str())];
    in_own_process(
        "advise_searches_the_recorded_history_or_a_snapshot",
        &env,
        || {
            let api = Api::open();
            // No history: an error that says how to record one, for an unused device or not.
            let err = api.advise(None, 0, 0, 0).unwrap_err();
            assert!(err.starts_with("device 0 has allocated nothing"), "{err}");
            let small = api.alloc(4096, 0, 0);
            let err = api.advise(None, 0, 0, 0).unwrap_err();
            assert!(
                err.contains("torch.cuda.memory._record_memory_history()"),
                "{err}"
            );
            api.record_history(true, usize::MAX);
            assert!(
                api.advise(None, 0, 0, 0).is_err(),
                "recording, but nothing recorded yet"
            );
            // A split cached block strands 40 MiB under the defaults.
            let first = api.alloc(100 * MIB, 0, 0);
            assert_eq!(api.free(first), 0);
            let b = api.alloc(60 * MIB, 0, 0);
            let c = api.alloc(60 * MIB, 0, 0);

            let advice = api.advise(None, 0, 0, 0).expect("advice");
            assert_eq!(advice["capacity_bytes"], 200 * MIB, "the device's memory");
            assert_eq!(advice["capacity_source"], "device");
            assert_eq!(advice["recorded_conf"], "");
            assert_eq!(
                advice["recorded_peak_reserved_bytes"],
                api.stat("reserved_bytes.all.peak"),
                "the replay under the process's setting is what it did"
            );
            assert!(advice["recommended_conf"].is_string(), "{advice}");
            assert!(
                advice["peak_reserved_bytes"].as_u64()
                    < advice["recorded_peak_reserved_bytes"].as_u64(),
                "{advice}"
            );
            let table = advice["table"].as_str().unwrap();
            assert!(table.contains("this process (device 0)"), "{table}");
            assert!(
                table.contains("\n  export PYTORCH_CUDA_ALLOC_CONF="),
                "{table}"
            );
            // A capacity given adds garbage collection; a bound keeps the simplest settings.
            let bounded = api.advise(None, 0, (1 << 30) as u64, 5).expect("advice");
            assert_eq!(bounded["capacity_source"], "given");
            assert_eq!(bounded["candidates"].as_array().unwrap().len(), 5);

            // A snapshot's bytes: the same as `ferrocache tune` on the file.
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/oracle/training_expandable.pickle");
            let bytes = std::fs::read(path).unwrap();
            let from_file = api.advise(Some(&bytes), -1, 0, 0).expect("advice");
            assert_eq!(from_file["recorded_conf"], "expandable_segments:True");
            assert_eq!(from_file["capacity_source"], "default");
            let err = api.advise(Some(&bytes), 5, 0, 0).unwrap_err();
            assert_eq!(err, "the snapshot holds nothing of device 5");
            let err = api.advise(Some(b"\x80\x04garbage"), -1, 0, 0).unwrap_err();
            assert!(err.starts_with("the snapshot: "), "{err}");
            let err = api.advise(Some(b""), -1, 0, 0).unwrap_err();
            assert!(err.contains("empty file"), "{err}");

            for block in [small, b, c] {
                assert_eq!(api.free(block), 0);
            }
        },
    );
}

/// Calls made so far to every driver function ferrocache uses.
fn driver_calls(fake: &FakeCuda) -> Vec<(&'static str, i64)> {
    ferrocache::device::cuda::REQUIRED_SYMBOLS
        .iter()
        .map(|&symbol| (symbol, fake.stat(symbol)))
        .collect()
}

#[test]
fn a_cache_hit_never_calls_the_driver() {
    in_own_process("a_cache_hit_never_calls_the_driver", &[], || {
        let api = Api::open();
        let fake = FakeCuda::open();
        let stream = new_stream();
        let sizes = [4 << 10, 3 * MIB, 64 * MIB];
        // The first round creates the segments; every later one is served from the cache.
        for round in 0..100 {
            let calls = driver_calls(&fake);
            for stream in [0, stream] {
                for size in sizes {
                    let block = api.rust_malloc(size, stream);
                    assert!(!block.is_null(), "{}", api.last_error());
                    api.rust_free(block, size, stream);
                }
            }
            if round > 0 {
                assert_eq!(
                    driver_calls(&fake),
                    calls,
                    "round {round} called the driver"
                );
            }
        }
        assert!(fake.stat("cuMemAlloc_v2") > 0, "the counts are the fake's");
        assert_eq!(
            api.stat("num_device_alloc"),
            6,
            "one segment per size and stream"
        );
    });
}

#[test]
fn record_stream_holds_a_block_back_until_that_stream_is_done() {
    in_own_process(
        "record_stream_holds_a_block_back_until_that_stream_is_done",
        &[],
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let stream = new_stream();
            // Without record_stream, a freed block is reused at once.
            let block = api.alloc(MIB, 0, 0);
            assert_eq!(api.free(block), 0);
            let again = api.alloc(MIB, 0, 0);
            assert_eq!(again, block);

            fake.set_event_delay(1_000);
            api.record_stream(again, stream);
            assert_eq!(api.last_error(), "");
            api.rust_free(again, MIB, 0);
            let other = api.alloc(MIB, 0, 0);
            assert_ne!(
                other, again,
                "reused while the other stream may still use it"
            );
            assert!(fake.stat("cuEventRecord") >= 1);
            assert_eq!(api.free(other), 0);
        },
    );
}

#[test]
fn memory_fraction_and_reset_hooks_reach_the_allocator() {
    let total = (64 * MIB).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", total.as_str())];
    in_own_process(
        "memory_fraction_and_reset_hooks_reach_the_allocator",
        &env,
        || {
            let api = Api::open();
            api.rust_memory_fraction(0.25, 0);
            assert!(api.alloc(20 * MIB, 0, 0).is_null(), "16 MiB are allowed");
            let message = api.last_error();
            assert!(
                message.starts_with("CUDA out of memory. Tried to allocate 20.00 MiB."),
                "{message}"
            );
            assert!(message.contains("16.00 MiB allowed"), "{message}");
            assert_eq!(api.stat("num_ooms"), 1);

            assert_eq!(api.set_memory_fraction(1.5, 0), -1);
            assert!(
                api.last_error().contains("invalid fraction: 1.5"),
                "{}",
                api.last_error()
            );
            assert_eq!(api.set_memory_fraction(1.0, 0), 0);
            let block = api.alloc(20 * MIB, 0, 0);
            assert!(!block.is_null(), "{}", api.last_error());
            assert_eq!(api.free(block), 0);

            let fake = FakeCuda::open();
            assert_eq!(fake.stat("bytes_in_use"), 20 * MIB as i64);
            api.rust_reset();
            assert_eq!(fake.stat("bytes_in_use"), 0);
        },
    );
}

#[test]
fn out_of_memory_gives_null_and_pytorchs_message() {
    let total = (64 * MIB).to_string();
    let env = [
        ("FAKE_LIBCUDA_TOTAL_MEM", total.as_str()),
        ("FAKE_NVML_OTHER_PROCESSES", "4242:8388608"),
    ];
    in_own_process(
        "out_of_memory_gives_null_and_pytorchs_message",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let block = api.alloc(20 * MIB, 0, 0);
            assert!(!block.is_null(), "{}", api.last_error());
            assert_eq!(
                fake.stat("nvmlInit_v2"),
                0,
                "NVML is asked at an out-of-memory only"
            );
            assert!(api.alloc(1 << 40, 0, 0).is_null());
            // NVML's processes on the GPU (the fake lists the others first), between the free
            // memory and the allocated.
            assert_eq!(
                api.last_error(),
                format!(
                    "CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity \
                     of 64.00 MiB of which 36.00 MiB is free. Process 4242 has 8.00 MiB memory in \
                     use. Including non-PyTorch memory, this process has 20.00 MiB memory in use. \
                     Of the allocated memory 20.00 MiB is allocated by PyTorch, and 0 bytes is \
                     reserved by PyTorch but unallocated. If reserved but unallocated memory is \
                     large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid \
                     fragmentation.  See documentation for Memory Management  \
                     (https://docs.pytorch.org/docs/stable/notes/cuda.html#{})",
                    "optimizing-memory-usage-with-pytorch-cuda-alloc-conf"
                )
            );
            assert_eq!(api.stat("num_ooms"), 1);
            assert_eq!(fake.stat("nvmlInit_v2"), 1);
            assert_eq!(fake.stat("nvmlDeviceGetComputeRunningProcesses"), 1);

            // NVML failing leaves the sentences out, and the out-of-memory is still one.
            fake.fail_next("nvmlDeviceGetComputeRunningProcesses", 999);
            assert!(api.alloc(1 << 40, 0, 0).is_null());
            let message = api.last_error();
            assert!(
                message.contains("36.00 MiB is free. Of the allocated memory 20.00 MiB"),
                "{message}"
            );
            assert_eq!(api.stat("num_ooms"), 2);
            assert_eq!(api.free(block), 0);
        },
    );
}

/// One call of an out-of-memory observer: device, size, total (or limit), free, and whether the
/// allocator answered a snapshot from inside the observer.
type ObservedCall = (c_int, usize, usize, usize, bool);
type StringFreeFn = unsafe extern "C" fn(*mut c_char);

/// What the observer of `oom_observers_are_called_before_the_error_with_pytorchs_figures` saw.
static OBSERVED: std::sync::Mutex<Vec<ObservedCall>> = std::sync::Mutex::new(Vec::new());
/// `ferrocache_snapshot` and `ferrocache_string_free`, for the observer.
static SNAPSHOT_FUNCTIONS: std::sync::OnceLock<(OwnedStringFn, StringFreeFn)> =
    std::sync::OnceLock::new();

extern "C" fn record_out_of_memory(device: c_int, alloc_size: usize, total: usize, free: usize) {
    let (snapshot, string_free) = SNAPSHOT_FUNCTIONS.get().expect("set before the allocation");
    // Deadlocks if the device's lock were still held.
    // SAFETY: no arguments; the string is the library's and goes back to it.
    let answered = unsafe {
        let text = snapshot();
        let answered = !text.is_null();
        string_free(text);
        answered
    };
    OBSERVED
        .lock()
        .unwrap()
        .push((device, alloc_size, total, free, answered));
}

#[test]
fn oom_observers_are_called_before_the_error_with_pytorchs_figures() {
    let total = (64 * MIB).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", total.as_str())];
    in_own_process(
        "oom_observers_are_called_before_the_error_with_pytorchs_figures",
        &env,
        || {
            type ObserverFn =
                unsafe extern "C" fn(Option<extern "C" fn(c_int, usize, usize, usize)>) -> c_int;
            let api = Api::open();
            let _ = SNAPSHOT_FUNCTIONS.set((
                api.library.function("ferrocache_snapshot"),
                api.library.function("ferrocache_string_free"),
            ));
            let attach: ObserverFn = api.library.function("ferrocache_attach_oom_observer");
            let detach: ObserverFn = api.library.function("ferrocache_detach_oom_observer");
            // SAFETY: a NULL observer is refused; the observer stays callable for the process.
            unsafe {
                assert_eq!(attach(None), -1);
                assert!(api.last_error().contains("NULL"), "{}", api.last_error());
                assert_eq!(attach(Some(record_out_of_memory)), 0);
            }
            assert!(api.alloc(1 << 40, 0, 0).is_null());
            assert!(
                api.last_error().starts_with("CUDA out of memory."),
                "the observer's own calls leave the error alone: {}",
                api.last_error()
            );
            // With a memory fraction, PyTorch passes the limit in place of the total.
            assert_eq!(api.set_memory_fraction(0.5, 0), 0);
            assert!(api.alloc(40 * MIB, 0, 0).is_null());
            // SAFETY: as above.
            unsafe { assert_eq!(detach(Some(record_out_of_memory)), 0) };
            assert!(api.alloc(1 << 40, 0, 0).is_null());
            assert_eq!(
                *OBSERVED.lock().unwrap(),
                [
                    (0, 1 << 40, 64 * MIB, 64 * MIB, true),
                    (0, 40 * MIB, 32 * MIB, 64 * MIB, true),
                ],
                "called once per out of memory until detached"
            );
            assert_eq!(api.stat("num_ooms"), 3);
        },
    );
}

#[test]
fn statistics_of_a_device_never_used_open_nothing_there() {
    in_own_process(
        "statistics_of_a_device_never_used_open_nothing_there",
        &[("FAKE_LIBCUDA_DEVICE_COUNT", "2")],
        || {
            type InitFn = unsafe extern "C" fn(c_int);
            let api = Api::open();
            let fake = FakeCuda::open();
            let init: InitFn = api.library.function("rust_init");
            // SAFETY: a plain value, as PyTorch passes it at CUDA's lazy initialisation.
            unsafe { init(2) };
            let ptr = api.alloc(MIB, 0, 0);
            assert!(!ptr.is_null());
            let contexts = fake.stat("primary_context_refs");
            let other = api.stats(1).expect("statistics of device 1");
            assert_eq!(other["allocated_bytes.all.current"], 0);
            assert_eq!(other["reserved_bytes.all.peak"], 0);
            assert_eq!(api.device_call("ferrocache_reset_peak_stats", 1), 0);
            assert_eq!(
                fake.stat("primary_context_refs"),
                contexts,
                "asking about device 1 retained no context there"
            );
            assert_eq!(api.stat("allocated_bytes.all.current"), MIB as i64);
            assert!(api.stats(2).is_none(), "there is no device 2");
            assert!(
                api.last_error().contains("no CUDA device 2"),
                "{}",
                api.last_error()
            );
            assert_eq!(api.free(ptr), 0);
        },
    );
}

#[test]
fn a_driver_failure_is_reported_as_a_cuda_error() {
    in_own_process("a_driver_failure_is_reported_as_a_cuda_error", &[], || {
        let api = Api::open();
        let fake = FakeCuda::open();
        // The device is opened by the first allocation; fail the allocation after that.
        let first = api.alloc(4096, 0, 0);
        assert!(!first.is_null());
        fake.fail_next("cuMemAlloc_v2", 999);
        assert!(api.alloc(100 * MIB, 0, 0).is_null());
        assert_eq!(
            api.last_error(),
            "CUDA error: cuMemAlloc_v2 failed with error 999: unknown error"
        );
        assert_eq!(api.stat("num_ooms"), 0, "not an out-of-memory");
        assert!(!api.alloc(100 * MIB, 0, 0).is_null(), "the next one works");
    });
}

#[test]
fn after_a_sticky_error_every_allocation_fails_even_from_the_cache() {
    in_own_process(
        "after_a_sticky_error_every_allocation_fails_even_from_the_cache",
        &[],
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let cached = api.alloc(4096, 0, 0);
            assert!(!cached.is_null());
            api.rust_free(cached, 4096, 0);
            // An illegal address leaves the context unusable.
            fake.fail_next("cuMemAlloc_v2", 700);
            assert!(api.alloc(100 * MIB, 0, 0).is_null());
            let unusable = api.last_error();
            assert!(
                unusable.contains("CUDA is unusable in this process"),
                "{unusable}"
            );
            // The cached 4 KiB block would be a cache hit: it is refused too, without a call.
            let calls_before = fake.stat("cuCtxGetCurrent") + fake.stat("cuMemAlloc_v2");
            assert!(
                api.alloc(4096, 0, 0).is_null(),
                "a cache hit after a sticky error"
            );
            assert_eq!(api.last_error(), unusable);
            assert_eq!(
                fake.stat("cuCtxGetCurrent") + fake.stat("cuMemAlloc_v2"),
                calls_before
            );
        },
    );
}

#[test]
fn devices_that_do_not_exist_are_errors() {
    in_own_process("devices_that_do_not_exist_are_errors", &[], || {
        let api = Api::open();
        assert!(api.alloc(MIB, -1, 0).is_null());
        assert_eq!(api.last_error(), "invalid device ordinal -1");
        assert!(api.alloc(MIB, 1, 0).is_null());
        assert_eq!(
            api.last_error(),
            "there is no CUDA device 1: the driver reports 1 device(s)"
        );
        assert!(api.stats(1).is_none());
        assert!(!api.alloc(MIB, 0, 0).is_null(), "device 0 is fine");
    });
}

#[test]
fn settings_are_checked_with_pytorchs_words() {
    in_own_process("settings_are_checked_with_pytorchs_words", &[], || {
        let api = Api::open();
        assert_eq!(
            api.check_config(Some("max_split_size_mb:40,expandable_segments:True")),
            1
        );
        assert_eq!(api.last_error(), "");
        assert_eq!(api.check_config(Some("foo:1")), 0);
        assert_eq!(
            api.last_error(),
            "Unrecognized key 'foo' in Accelerator allocator config."
        );
        assert_eq!(api.check_config(None), 1, "the environment sets nothing");

        let described = api
            .describe_config("expandable_segments:True,pinned_use_background_threads:True")
            .expect("a valid setting");
        assert_eq!(
            described,
            "expandable_segments: True\nnot used by ferrocache: pinned_use_background_threads"
        );
        assert!(api.describe_config("max_split_size_mb:abc").is_none());
        assert!(!api.last_error().is_empty());
    });
}

#[test]
fn invalid_settings_fail_every_allocation() {
    let env = [("PYTORCH_CUDA_ALLOC_CONF", "foo:1")];
    in_own_process("invalid_settings_fail_every_allocation", &env, || {
        let api = Api::open();
        let expected = "PYTORCH_CUDA_ALLOC_CONF is invalid: Unrecognized key 'foo' in Accelerator allocator config.";
        for _ in 0..2 {
            assert!(api.alloc(MIB, 0, 0).is_null());
            assert_eq!(api.last_error(), expected);
        }
        assert!(api.stats(0).is_none());
        assert!(api.snapshot().is_none());
        assert_eq!(api.last_error(), expected);
        assert_eq!(api.check_config(None), 0);
    });
}

#[test]
fn without_libcuda_every_allocation_says_so() {
    if let Some(reason) = cdylib::real_driver_installed() {
        println!("skipped: {reason}, so a process cannot be without one");
        return;
    }
    in_own_process_without_libcuda("without_libcuda_every_allocation_says_so", || {
        let api = Api::open();
        for _ in 0..2 {
            assert!(api.alloc(MIB, 0, 0).is_null());
            let message = api.last_error();
            assert!(
                message.starts_with("ferrocache could not load the CUDA driver library libcuda.so"),
                "{message}"
            );
        }
        assert!(api.stats(0).is_none());
        let snapshot = api.snapshot().expect("a snapshot of nothing");
        assert_eq!(snapshot["segments"], Value::Array(vec![]));
    });
}

/// `expandable_segments:True` through the real driver path: pages are created, mapped and made
/// accessible by `CudaDevice` (on the fake, mmap'ed host memory), written through, and given
/// back by `empty_cache`, with nothing left mapped or reserved.
#[test]
fn expandable_segments_map_real_pages_and_give_them_back() {
    let env = [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")];
    in_own_process(
        "expandable_segments_map_real_pages_and_give_them_back",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let first = api.alloc(30 * MIB, 0, 0);
            assert!(!first.is_null(), "{}", api.last_error());
            // The next request grows the same range: it starts where the first ends.
            let second = api.alloc(30 * MIB, 0, 0);
            assert_eq!(second as usize, first as usize + 30 * MIB);
            assert!(fill_and_check(first, 30 * MIB, 0x11));
            assert!(fill_and_check(second, 30 * MIB, 0x22));
            assert!(fill_and_check(first, 30 * MIB, 0x11), "the blocks overlap");
            assert_eq!(fake.stat("cuMemAlloc_v2"), 0, "no cudaMalloc at all");
            assert_eq!(fake.stat("cuMemCreate"), 3, "three 20 MiB pages");
            assert_eq!(api.stat("reserved_bytes.all.current"), 60 * MIB as i64);
            assert_eq!(api.stat("segment.all.current"), 0);

            assert_eq!(api.free(first), 0);
            assert_eq!(api.empty_cache(), 0);
            // The first page lies wholly in the freed block; the second holds part of `second`.
            assert_eq!(api.stat("reserved_bytes.all.current"), 40 * MIB as i64);
            assert!(fill_and_check(second, 30 * MIB, 0x33));
            assert_eq!(api.free(second), 0);
            assert_eq!(api.empty_cache(), 0);
            assert_eq!(api.stat("reserved_bytes.all.current"), 0);
            assert_eq!(fake.stat("bytes_in_use"), 0);
            assert_eq!(fake.stat("live_mappings"), 0);
            assert_eq!(fake.stat("cuMemAddressFree"), 1, "the range is given back");
        },
    );
}

/// `cuMemAddressFree` failing once while `empty_cache` gives an expandable segment back: the
/// call reports the error, and the next `empty_cache` frees the range (issue 21: it stayed
/// reserved through every later `empty_cache`).
#[test]
fn an_address_range_the_driver_would_not_free_is_freed_by_the_next_empty_cache() {
    let env = [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")];
    in_own_process(
        "an_address_range_the_driver_would_not_free_is_freed_by_the_next_empty_cache",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let block = api.alloc(30 * MIB, 0, 0);
            assert!(!block.is_null(), "{}", api.last_error());
            assert_eq!(api.free(block), 0);
            assert_eq!(fake.stat("live_reservations"), 1);
            fake.fail_next("cuMemAddressFree", 999);
            assert_eq!(api.empty_cache(), -1);
            assert_eq!(
                api.last_error(),
                "device 0: cuMemAddressFree failed with error 999: unknown error"
            );
            assert_eq!(fake.stat("live_mappings"), 0, "the pages went back");
            assert_eq!(fake.stat("live_physical"), 0);
            assert_eq!(fake.stat("live_reservations"), 1);
            assert_eq!(api.stat("reserved_bytes.all.current"), 0);
            assert_eq!(api.empty_cache(), 0, "{}", api.last_error());
            assert_eq!(fake.stat("live_reservations"), 0);
            assert_eq!(fake.stat("cuMemAddressFree"), 2);
            assert_eq!(api.empty_cache(), 0);
            assert_eq!(fake.stat("cuMemAddressFree"), 2, "nothing left to retry");
            let check: unsafe extern "C" fn() -> c_int =
                api.library.function("ferrocache_check_invariants");
            // SAFETY: no arguments.
            assert_eq!(unsafe { check() }, 0, "{}", api.last_error());
        },
    );
}

#[test]
fn a_threads_private_pool_works_through_the_c_abi() {
    in_own_process(
        "a_threads_private_pool_works_through_the_c_abi",
        &[],
        || {
            let api = Api::open();
            let pool = (0, 42);
            let pool_of = |ptr: *mut c_void| {
                let snapshot = api.snapshot().expect("a snapshot");
                let segments = snapshot["segments"].as_array().expect("segments").clone();
                segments
                    .into_iter()
                    .find(|s| {
                        let start = s["address"].as_u64().unwrap();
                        let end = start + s["total_size"].as_u64().unwrap();
                        (start..end).contains(&(ptr.addr() as u64))
                    })
                    .map(|s| s["segment_pool_id"].clone())
            };
            // torch.cuda.MemPool(): one reference; use_mem_pool: another, for this thread.
            assert_eq!(api.pool_call("ferrocache_create_or_incref_pool", pool), 0);
            assert_eq!(api.pool_call("ferrocache_pool_use_count", pool), 1);
            assert_eq!(
                api.pool_call("ferrocache_begin_allocate_current_thread_to_pool", pool),
                0
            );
            assert_eq!(api.pool_call("ferrocache_pool_use_count", pool), 2);
            let mine = api.alloc(MIB, 0, 0);
            assert_eq!(pool_of(mine), Some(serde_json::json!([0, 42])));
            // Another thread's allocations stay ordinary.
            let theirs = std::thread::scope(|scope| {
                scope
                    .spawn(|| api.alloc(MIB, 0, 0).addr())
                    .join()
                    .expect("the thread ran")
            });
            let theirs = ptr::without_provenance_mut(theirs);
            assert_eq!(pool_of(theirs), Some(serde_json::json!([0, 0])));
            assert_eq!(
                api.pool_call("ferrocache_begin_allocate_current_thread_to_pool", pool),
                -1
            );
            assert_eq!(
                api.last_error(),
                "beginAllocateToPool: already recording to mempool_id (0, 42)"
            );
            assert_eq!(api.pool_call("ferrocache_end_allocate_to_pool", pool), 0);
            assert_eq!(api.pool_call("ferrocache_release_pool", pool), 0);
            let after = api.alloc(4096, 0, 0);
            assert_eq!(pool_of(after), Some(serde_json::json!([0, 0])));

            // The MemPool object still holds the pool: empty_cache keeps its memory.
            assert_eq!(api.free(mine), 0);
            assert_eq!(api.free(theirs), 0);
            assert_eq!(api.free(after), 0);
            api.rust_reset();
            assert_eq!(api.stat("reserved_bytes.all.current"), 2 * MIB as i64);
            assert_eq!(api.pool_call("ferrocache_release_pool", pool), 0);
            assert_eq!(api.pool_call("ferrocache_pool_use_count", pool), 0);
            api.rust_reset();
            assert_eq!(api.stat("reserved_bytes.all.current"), 0);
            assert_eq!(api.pool_call("ferrocache_pool_use_count", pool), -1);
            assert_eq!(api.last_error(), "no private pool has mempool_id (0, 42)");
            assert_eq!(api.pool_call("ferrocache_release_pool", pool), -1);
            assert_eq!(api.pool_call("ferrocache_end_allocate_to_pool", pool), -1);
            assert_eq!(
                api.last_error(),
                "endAllocateToPool: not currently recording to mempool_id (0, 42)"
            );
        },
    );
}

/// With `expandable_segments:True` on two devices, device 0's memory is reachable from device
/// 1's context (a memset and copies there, as `tensor.to("cuda:1")` and back make them), both
/// pages mapped before peer access was enabled and pages mapped after. Before ferrocache granted
/// its peers access, device 1 took an illegal address (a sticky error on a GPU).
#[test]
fn expandable_memory_is_reachable_from_a_peer_device() {
    let env = [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("FAKE_LIBCUDA_DEVICE_COUNT", "2"),
    ];
    in_own_process(
        "expandable_memory_is_reachable_from_a_peer_device",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let size = 30 * MIB;
            let before = api.alloc(size, 0, 0);
            assert!(!before.is_null(), "{}", api.last_error());
            let on_peer = api.alloc(size, 1, 0);
            assert!(!on_peer.is_null(), "{}", api.last_error());
            let [before, on_peer] = [before, on_peer].map(|p| p as u64);

            fake.make_current(1);
            assert_eq!(fake.memset(before, 0x11, size), 0, "mapped before");
            assert_eq!(fake.enable_peer_access(0), 0);
            let after = api.alloc(size, 0, 0) as u64;
            assert_ne!(after, 0, "{}", api.last_error());
            assert_eq!(after, before + size as u64, "new pages of the same segment");
            assert_eq!(fake.memset(after, 0x22, size), 0, "mapped after");
            assert_eq!(fake.copy(on_peer, before, size), 0);
            assert_eq!(fake.copy(after, on_peer, size), 0);
            // Device 1's copies are asynchronous: done before device 0 writes there too.
            assert_eq!(fake.synchronize(), 0);
            fake.make_current(0);
            assert_eq!(fake.enable_peer_access(1), 0);
            assert_eq!(fake.copy(on_peer, after, size), 0, "and back");
            assert_eq!(fake.stat("cuMemAlloc_v2"), 0, "all of it expandable");
            for block in [before, after, on_peer] {
                assert_eq!(api.free(block as *mut c_void), 0);
            }
        },
    );
}

/// `expandable_segments:True` on a device without virtual memory management: every allocation
/// is served from plain segments (`cudaMalloc`), and one WARN line says why, instead of every
/// allocation failing at `cuMemCreate`.
#[test]
fn expandable_segments_fall_back_to_plain_segments_without_virtual_memory() {
    let env = [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("FAKE_LIBCUDA_VMM", "0"),
        ("TORCH_CUDA_ALLOC_LOG_LEVEL", "WARN"),
    ];
    let stderr = in_own_process_stderr(
        "expandable_segments_fall_back_to_plain_segments_without_virtual_memory",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            for size in [4096, 30 * MIB] {
                let block = api.alloc(size, 0, 0);
                assert!(!block.is_null(), "{}", api.last_error());
                assert_eq!(api.free(block), 0);
            }
            assert_eq!(fake.stat("cuMemAlloc_v2"), 2);
            assert_eq!(fake.stat("cuMemCreate"), 0);
            assert_eq!(fake.stat("cuMemAddressReserve"), 0);
        },
    );
    if let Some(stderr) = stderr {
        let warnings: Vec<&str> = stderr
            .lines()
            .filter(|line| line.contains("does not support virtual memory management"))
            .collect();
        assert_eq!(warnings.len(), 1, "{stderr}");
        assert!(
            warnings[0].starts_with("[WARN] Allocator: CUDA device 0 (")
                && warnings[0].contains("expandable_segments:True is ignored on it"),
            "{stderr}"
        );
    }
}

/// `max_split_size_mb:30,max_non_split_rounding_mb:40` from the environment, then
/// `max_split_size_mb:30` at run time under PyTorch `version`: a cached 100 MiB block serves
/// 70 MiB only while the rounding limit is still 40 MiB (`reset_before_each_parse`).
fn rounding_after_a_runtime_parse(test: &str, version: &str, device_allocs: i64) {
    let total = (256 * MIB).to_string();
    let env = [
        ("FAKE_LIBCUDA_TOTAL_MEM", total.as_str()),
        (
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size_mb:30,max_non_split_rounding_mb:40",
        ),
        ("FERROCACHE_PYTORCH_VERSION", version),
    ];
    in_own_process(test, &env, || {
        let api = Api::open();
        let set: ConfigFn = api.library.function("ferrocache_set_allocator_settings");
        let text = CString::new("max_split_size_mb:30").unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { set(text.as_ptr()) }, 0, "{}", api.last_error());
        let big = api.alloc(100 * MIB, 0, 0);
        assert_eq!(api.free(big), 0);
        let oversize = api.alloc(70 * MIB, 0, 0);
        assert_eq!(
            api.stat("num_device_alloc"),
            device_allocs,
            "torch {version}"
        );
        assert_eq!(api.free(oversize), 0);
    });
}

#[test]
fn a_runtime_parse_keeps_max_non_split_rounding_under_pytorch_2_10() {
    rounding_after_a_runtime_parse(
        "a_runtime_parse_keeps_max_non_split_rounding_under_pytorch_2_10",
        "2.10.0",
        1,
    );
}

#[test]
fn a_runtime_parse_puts_max_non_split_rounding_back_from_pytorch_2_11() {
    rounding_after_a_runtime_parse(
        "a_runtime_parse_puts_max_non_split_rounding_back_from_pytorch_2_11",
        "2.11.0+cu130",
        2,
    );
}

type FractionFn = unsafe extern "C" fn(c_int) -> c_double;
type EnableFn = unsafe extern "C" fn(c_int) -> c_int;

#[test]
fn settings_fraction_metadata_and_caching_off_through_the_c_abi() {
    let total = (256 * MIB).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", total.as_str())];
    in_own_process(
        "settings_fraction_metadata_and_caching_off_through_the_c_abi",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            // Settings at run time: the next segment follows them; a refusal changes nothing.
            let set: ConfigFn = api.library.function("ferrocache_set_allocator_settings");
            let text = CString::new("max_split_size_mb:40").unwrap();
            // SAFETY: a NUL-terminated string.
            assert_eq!(unsafe { set(text.as_ptr()) }, 0, "{}", api.last_error());
            let bad = CString::new("max_split_size_mb:10").unwrap();
            // SAFETY: a NUL-terminated string.
            assert_eq!(unsafe { set(bad.as_ptr()) }, -1);
            assert_eq!(
                api.last_error(),
                "CachingAllocator option max_split_size_mb too small, must be >= 20"
            );
            // SAFETY: NULL, which the function refuses.
            assert_eq!(unsafe { set(ptr::null()) }, -1);
            let big = api.alloc(100 * MIB, 0, 0);
            assert_eq!(api.free(big), 0);
            let small = api.alloc(10 * MIB, 0, 0);
            assert_eq!(
                api.stat("num_device_alloc"),
                2,
                "max_split_size_mb:40 still holds"
            );
            assert_eq!(api.free(small), 0);
            assert_eq!(
                api.snapshot().unwrap()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"],
                "max_split_size_mb:40"
            );

            // The fraction, asked back.
            let fraction: FractionFn = api.library.function("ferrocache_get_memory_fraction");
            // SAFETY: plain values.
            assert_eq!(unsafe { fraction(0) }, 1.0);
            api.rust_memory_fraction(0.25, 0);
            // SAFETY: plain values.
            assert_eq!(unsafe { fraction(0) }, 0.25);
            // SAFETY: plain values (a device that cannot be).
            assert_eq!(unsafe { fraction(-3) }, -1.0);
            api.rust_memory_fraction(1.0, 0);

            // Metadata on this thread's trace entries only.
            let set_metadata: ConfigFn = api.library.function("ferrocache_set_memory_metadata");
            let get_metadata: OwnedStringFn =
                api.library.function("ferrocache_get_memory_metadata");
            api.record_history(true, 100);
            let phase = CString::new("phase 2").unwrap();
            // SAFETY: a NUL-terminated string; the returned one is freed by take_string.
            assert_eq!(unsafe { set_metadata(phase.as_ptr()) }, 0);
            // SAFETY: no arguments; the string is given back by take_string.
            assert_eq!(
                api.take_string(unsafe { get_metadata() }).unwrap(),
                "phase 2"
            );
            let tagged = api.alloc(4096, 0, 0);
            let other = std::thread::spawn(|| {
                let api = Api::open();
                let untagged = api.alloc(4096, 0, 0);
                assert_eq!(api.free(untagged), 0);
            });
            other.join().unwrap();
            assert_eq!(api.free(tagged), 0);
            let entries = api.snapshot().unwrap()["device_traces"][0].clone();
            let metadata: Vec<&str> = entries
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["action"] == "alloc")
                .map(|e| e["user_metadata"].as_str().unwrap())
                .collect();
            assert_eq!(
                metadata,
                ["phase 2", ""],
                "the other thread's allocation has none"
            );

            // Caching off: straight to the driver and back, outside the statistics.
            let enable: EnableFn = api.library.function("ferrocache_set_caching_enabled");
            let allocs = api.stat("num_device_alloc");
            let calls = fake.stat("cuMemAlloc_v2");
            // SAFETY: plain values.
            assert_eq!(unsafe { enable(0) }, 0);
            let raw = api.alloc(1000, 0, 0);
            assert_eq!(fake.stat("cuMemAlloc_v2"), calls + 1);
            assert_eq!(api.free(raw), 0);
            assert_eq!(api.stat("num_device_alloc"), allocs);
            // SAFETY: plain values.
            assert_eq!(unsafe { enable(1) }, 0);
        },
    );
}

/// Arms the debug build's one-shot fault: the next reserve-class lookup the allocator makes
/// (under its lock, part-way through an operation) panics.
#[cfg(debug_assertions)]
fn panic_at_next_reserve_class_lookup(api: &Api) {
    let arm: unsafe extern "C" fn() = api
        .library
        .function("ferrocache_debug_panic_at_next_reserve_class_lookup");
    // SAFETY: no arguments.
    unsafe { arm() }
}

/// A panic inside a device's allocator is caught at the C ABI, and that allocator, which may be
/// half-updated (here: an out of memory counted but not reported), never serves again: each
/// later call on the device fails with an ERROR line that says why, a free included, while the
/// other devices go on. The fault exists in debug builds only.
#[cfg(debug_assertions)]
#[test]
fn a_panic_inside_the_allocator_puts_its_device_out_of_service() {
    let test = "a_panic_inside_the_allocator_puts_its_device_out_of_service";
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2")];
    let stderr = in_own_process_stderr(test, &env, || {
        let api = Api::open();
        let kept = api.alloc(MIB, 0, 0);
        assert!(!kept.is_null(), "{}", api.last_error());
        panic_at_next_reserve_class_lookup(&api);
        // Out of memory: the allocator asks the stream's reserve class for its message.
        assert!(api.alloc(1 << 50, 0, 0).is_null());
        let panicked = api.last_error();
        assert!(
            panicked.starts_with("ferrocache: internal error in ferrocache_alloc"),
            "{panicked}"
        );

        assert!(
            api.alloc(4096, 0, 0).is_null(),
            "a cache hit after the panic"
        );
        let refused = api.last_error();
        assert!(refused.contains("device 0"), "{refused}");
        assert!(refused.contains("out of service"), "{refused}");
        assert_eq!(api.free(kept), -1, "a free after the panic");
        assert_eq!(api.last_error(), refused);
        api.rust_free(kept, MIB, 0);
        assert!(api.stats(0).is_none(), "statistics from a broken allocator");
        assert_eq!(api.last_error(), refused);
        assert!(
            api.snapshot().is_none(),
            "a snapshot from a broken allocator"
        );
        assert_eq!(api.empty_cache(), -1);

        let elsewhere = api.alloc(MIB, 1, 0);
        assert!(!elsewhere.is_null(), "device 1: {}", api.last_error());
        assert_eq!(api.free(elsewhere), 0);
        assert!(api.stats(1).is_some(), "{}", api.last_error());
    });
    if let Some(stderr) = stderr {
        let refusals = stderr
            .lines()
            .filter(|l| l.contains("ERROR") && l.contains("out of service"))
            .count();
        assert!(refusals >= 3, "one ERROR line per refused call:\n{stderr}");
    }
}
