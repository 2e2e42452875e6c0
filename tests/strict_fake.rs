//! The fake CUDA as strict as the driver's documentation (tests/fake-cuda/README.md, "Rules"),
//! and ferrocache on it through the C ABI: contexts own their streams and events, work stays
//! pending until the host learns it finished, and the ordering check counts every use of memory
//! that work of another stream may still touch. Each scenario runs in a process of its own.

mod cdylib;
mod support;

use std::ffi::{c_int, c_void};
use std::ptr;

use cdylib::Ferrocache;
use support::{FakeCuda, in_own_process, new_stream_on};

const MIB: usize = 1 << 20;
const CUDA_ERROR_INVALID_CONTEXT: c_int = 201;
const CUDA_ERROR_INVALID_HANDLE: c_int = 400;
const CUDA_ERROR_NOT_READY: c_int = 600;
const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: c_int = 900;
const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: c_int = 901;
const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: c_int = 906;
const CUDA_ERROR_CAPTURED_EVENT: c_int = 907;
/// For the tests of the check itself: violations counted, not fatal, and left out of the
/// suite's report (they are made on purpose).
const COUNT_VIOLATIONS: [(&str, &str); 2] = [
    ("FAKE_CUDA_ORDER_FATAL", "0"),
    ("FAKE_CUDA_ORDER_REPORT", ""),
];
/// PyTorch makes its streams with `cudaStreamNonBlocking`.
const NON_BLOCKING: u32 = 1;

/// The C ABI as PyTorch calls it.
struct Api {
    library: Ferrocache,
}

impl Api {
    fn open() -> Api {
        Api {
            library: Ferrocache::open(),
        }
    }

    fn malloc(&self, size: usize, device: c_int, stream: u64) -> u64 {
        let malloc: unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void =
            self.library.function("rust_malloc");
        // SAFETY: plain values; a stream handle is only passed on.
        let ptr = unsafe { malloc(size, device, ptr::without_provenance_mut(stream as usize)) };
        assert!(!ptr.is_null(), "{}", self.last_error());
        ptr as u64
    }

    fn free(&self, ptr: u64, size: usize, device: c_int, stream: u64) {
        let free: unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void) =
            self.library.function("rust_free");
        // SAFETY: a pointer ferrocache handed out; the stream is only passed on.
        unsafe {
            free(
                ptr as usize as *mut c_void,
                size,
                device,
                ptr::without_provenance_mut(stream as usize),
            )
        }
    }

    fn record_stream(&self, ptr: u64, stream: u64) {
        let record: unsafe extern "C" fn(*mut c_void, *mut c_void) =
            self.library.function("rust_record_stream");
        // SAFETY: ferrocache checks the pointer; the stream is only passed on.
        unsafe {
            record(
                ptr as usize as *mut c_void,
                ptr::without_provenance_mut(stream as usize),
            )
        }
    }

    fn empty_cache(&self) {
        let empty_cache: unsafe extern "C" fn() -> c_int =
            self.library.function("ferrocache_empty_cache");
        // SAFETY: no arguments.
        assert_eq!(unsafe { empty_cache() }, 0, "{}", self.last_error());
    }

    fn last_error(&self) -> String {
        self.library.last_error()
    }
}

/// An event made in the current context.
fn new_event(fake: &FakeCuda) -> u64 {
    let create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int =
        fake.function("cuEventCreate");
    let mut event = ptr::null_mut();
    // SAFETY: a live out pointer.
    assert_eq!(unsafe { create(&mut event, 2) }, 0);
    event as u64
}

fn record(fake: &FakeCuda, event: u64, stream: u64) -> c_int {
    let record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int =
        fake.function("cuEventRecord");
    // SAFETY: plain handles; the fake checks them.
    unsafe {
        record(
            event as usize as *mut c_void,
            stream as usize as *mut c_void,
        )
    }
}

fn wait(fake: &FakeCuda, stream: u64, event: u64) -> c_int {
    let wait: unsafe extern "C" fn(*mut c_void, *mut c_void, u32) -> c_int =
        fake.function("cuStreamWaitEvent");
    // SAFETY: plain handles; the fake checks them.
    unsafe {
        wait(
            stream as usize as *mut c_void,
            event as usize as *mut c_void,
            0,
        )
    }
}

fn device_alloc(fake: &FakeCuda, size: usize) -> u64 {
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int = fake.function("cuMemAlloc_v2");
    let mut ptr = 0;
    // SAFETY: a live out pointer.
    assert_eq!(unsafe { alloc(&mut ptr, size) }, 0);
    ptr
}

// ---- The fake's rules ----------------------------------------------------------------------

#[test]
fn an_event_is_recorded_only_on_a_stream_of_its_own_context() {
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2")];
    in_own_process(
        "an_event_is_recorded_only_on_a_stream_of_its_own_context",
        &env,
        || {
            let fake = FakeCuda::open();
            let on_device_1 = new_stream_on(1, NON_BLOCKING);
            let on_device_0 = new_stream_on(0, NON_BLOCKING);
            let event = new_event(&fake); // device 0's context is current
            assert_eq!(record(&fake, event, on_device_1), CUDA_ERROR_INVALID_HANDLE);
            assert_eq!(record(&fake, event, on_device_0), 0);
            // Waiting on an event of another context is allowed.
            assert_eq!(wait(&fake, on_device_1, event), 0);
        },
    );
}

#[test]
fn calls_that_need_a_current_context_refuse_without_one() {
    in_own_process(
        "calls_that_need_a_current_context_refuse_without_one",
        &[],
        || {
            let fake = FakeCuda::open();
            fake.make_current(0);
            let ptr = device_alloc(&fake, MIB);
            let set_current: unsafe extern "C" fn(*mut c_void) -> c_int =
                fake.function("cuCtxSetCurrent");
            // SAFETY: NULL makes no context current.
            assert_eq!(unsafe { set_current(ptr::null_mut()) }, 0);
            assert_eq!(
                fake.call_with_handle("cuStreamSynchronize", 0),
                CUDA_ERROR_INVALID_CONTEXT,
                "the legacy stream is the current context's"
            );
            assert_eq!(fake.memset_async(ptr, MIB, 0), CUDA_ERROR_INVALID_CONTEXT);
            assert_eq!(
                fake.call_with_handle("cuMemFree_v2", ptr),
                CUDA_ERROR_INVALID_CONTEXT
            );
        },
    );
}

#[test]
fn work_of_one_stream_is_pending_for_another_until_something_orders_them() {
    in_own_process(
        "work_of_one_stream_is_pending_for_another_until_something_orders_them",
        &COUNT_VIOLATIONS,
        || {
            let fake = FakeCuda::open();
            let a = new_stream_on(0, NON_BLOCKING);
            let b = new_stream_on(0, NON_BLOCKING);
            let ptr = device_alloc(&fake, MIB);
            assert_eq!(fake.memset_async(ptr, MIB, a), 0);
            assert_eq!(fake.stat("order_pending_uses"), 1);
            // B writes what A may still be writing: nothing orders the two.
            assert_eq!(fake.memset_async(ptr, 4096, b), 0);
            assert_eq!(fake.stat("order_violations"), 1);

            // Both finished: the host synchronized them.
            assert_eq!(fake.call_with_handle("cuStreamSynchronize", a), 0);
            assert_eq!(fake.call_with_handle("cuStreamSynchronize", b), 0);
            assert_eq!(fake.stat("order_pending_uses"), 0);

            // An event recorded on A and waited for by B orders them.
            let event = new_event(&fake);
            assert_eq!(fake.memset_async(ptr, MIB, a), 0);
            assert_eq!(record(&fake, event, a), 0);
            assert_eq!(wait(&fake, b, event), 0);
            assert_eq!(fake.memset_async(ptr, MIB, b), 0);
            assert_eq!(fake.stat("order_violations"), 1);

            // So does the host learning that B finished: a query that says done, not one that
            // says "not ready".
            fake.set_event_delay(1);
            assert_eq!(record(&fake, event, b), 0);
            assert_eq!(
                fake.call_with_handle("cuEventQuery", event),
                CUDA_ERROR_NOT_READY
            );
            assert_eq!(fake.memset_async(ptr, 8, a), 0);
            assert_eq!(fake.stat("order_violations"), 2, "not ready is no answer");
            assert_eq!(fake.call_with_handle("cuStreamSynchronize", a), 0);
            assert_eq!(record(&fake, event, b), 0);
            assert_eq!(
                fake.call_with_handle("cuEventQuery", event),
                CUDA_ERROR_NOT_READY
            );
            assert_eq!(fake.call_with_handle("cuEventQuery", event), 0);
            assert_eq!(fake.memset_async(ptr, MIB, a), 0);
            assert_eq!(fake.stat("order_violations"), 2);
            assert_eq!(fake.stat("order_handoffs_checked"), 3);
        },
    );
}

#[test]
fn the_legacy_stream_orders_itself_with_blocking_streams_only() {
    in_own_process(
        "the_legacy_stream_orders_itself_with_blocking_streams_only",
        &COUNT_VIOLATIONS,
        || {
            let fake = FakeCuda::open();
            let blocking = new_stream_on(0, 0);
            let non_blocking = new_stream_on(0, NON_BLOCKING);
            let ptr = device_alloc(&fake, MIB);
            assert_eq!(fake.memset_async(ptr, MIB, blocking), 0);
            assert_eq!(fake.memset_async(ptr, MIB, 0), 0);
            assert_eq!(
                fake.stat("order_violations"),
                0,
                "legacy waits for blocking"
            );
            assert_eq!(fake.memset_async(ptr, MIB, non_blocking), 0);
            assert_eq!(
                fake.stat("order_violations"),
                1,
                "non-blocking waits for nothing"
            );
        },
    );
}

#[test]
fn a_capture_is_invalidated_by_what_it_forbids() {
    in_own_process("a_capture_is_invalidated_by_what_it_forbids", &[], || {
        let fake = FakeCuda::open();
        let blocking = new_stream_on(0, 0);
        let side = new_stream_on(0, NON_BLOCKING);
        let ptr = device_alloc(&fake, MIB);

        // Synchronizing the capturing stream.
        fake.set_capturing(side, true);
        assert_eq!(
            fake.call_with_handle("cuStreamSynchronize", side),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(
            fake.memset_async(ptr, MIB, side),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        fake.set_capturing(side, false);

        // Querying an event recorded in a capture.
        fake.set_capturing(side, true);
        let event = new_event(&fake);
        assert_eq!(record(&fake, event, side), 0);
        assert_eq!(
            fake.call_with_handle("cuEventQuery", event),
            CUDA_ERROR_CAPTURED_EVENT
        );
        fake.set_capturing(side, false);

        // Freeing while a global-mode capture is under way.
        fake.set_capturing(side, true);
        assert_eq!(
            fake.call_with_handle("cuMemFree_v2", ptr),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(
            fake.memset_async(ptr, MIB, side),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        fake.set_capturing(side, false);

        // The legacy stream while a blocking stream captures.
        fake.set_capturing(blocking, true);
        assert_eq!(
            fake.memset_async(ptr, MIB, 0),
            CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        );
        fake.set_capturing(blocking, false);
        // Work on a capturing stream is captured, not run: nothing pending.
        fake.set_capturing(side, true);
        assert_eq!(fake.memset_async(ptr, MIB, side), 0);
        assert_eq!(fake.stat("order_pending_uses"), 0);
        fake.set_capturing(side, false);
        assert_eq!(fake.call_with_handle("cuMemFree_v2", ptr), 0);
    });
}

// ---- ferrocache on the strict fake -----------------------------------------------------------

#[test]
fn record_stream_with_another_devices_stream_records_the_event_in_that_context() {
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2")];
    in_own_process(
        "record_stream_with_another_devices_stream_records_the_event_in_that_context",
        &env,
        || {
            let api = Api::open();
            let fake = FakeCuda::open();
            let on_device_1 = new_stream_on(1, NON_BLOCKING);
            let block = api.malloc(MIB, 0, 0);
            // Device 1 reads the block (a peer copy), then it is freed on device 0.
            fake.make_current(1);
            assert_eq!(fake.memset_async(block, MIB, on_device_1), 0);
            fake.set_event_delay(1_000);
            api.record_stream(block, on_device_1);
            api.free(block, MIB, 0, 0);
            assert_eq!(api.last_error(), "");
            assert_eq!(
                fake.stat("cuStreamSynchronize"),
                0,
                "no host stall: the event was recorded on device 1's stream"
            );
            let other = api.malloc(MIB, 0, 0);
            assert_ne!(other, block, "held back while device 1 may still use it");
            fake.set_event_delay(0);
            api.free(other, MIB, 0, 0);
            // Once its event says done, the block is reused, and the fake agrees it is safe.
            fake.make_current(0);
            assert_eq!(fake.synchronize(), 0);
            api.empty_cache();
            assert_eq!(fake.stat("order_violations"), 0);
        },
    );
}

/// One program through the C ABI that hands blocks between streams every way ferrocache does:
/// per-stream reuse, `record_stream`, cross-stream reuse and expandable segments, with work
/// pending on each block; the fake checks every hand-over and unmap.
fn hand_blocks_between_streams(api: &Api, fake: &FakeCuda) {
    let a = new_stream_on(0, NON_BLOCKING);
    let b = new_stream_on(0, NON_BLOCKING);
    fake.make_current(0);
    let event = new_event(fake);
    for round in 0..4 {
        let size = (round + 1) * MIB;
        let on_a = api.malloc(size, 0, a);
        assert_eq!(fake.memset_async(on_a, size, a), 0);
        // Used on B too (after B waits for A, as `Tensor.record_stream`'s users do), then freed
        // on A: B's use must be done before A's pool hands the block out again.
        assert_eq!(record(fake, event, a), 0);
        assert_eq!(wait(fake, b, event), 0);
        assert_eq!(fake.memset_async(on_a, 4096, b), 0);
        api.record_stream(on_a, b);
        api.free(on_a, size, 0, a);
        let again = api.malloc(size, 0, a);
        assert_eq!(fake.memset_async(again, size, a), 0);
        api.free(again, size, 0, a);
        // A block cached on A, asked for on B.
        let on_b = api.malloc(size, 0, b);
        assert_eq!(fake.memset_async(on_b, size, b), 0);
        api.free(on_b, size, 0, b);
    }
    api.empty_cache();
    assert_eq!(api.last_error(), "");
}

/// Runs [`hand_blocks_between_streams`] under `conf` (and cross-stream reuse when asked), with
/// events that answer "not ready" twice and every violation fatal.
fn check_hand_overs(test: &str, conf: &str, cross_stream: bool) {
    check_hand_overs_with(test, conf, cross_stream, false);
}

/// [`check_hand_overs`], with sleep-ability on (`FERROCACHE_SLEEP=1`: ordinary segments are
/// VMM-backed, so `empty_cache` unmaps them) when `sleep_ability`.
fn check_hand_overs_with(test: &str, conf: &str, cross_stream: bool, sleep_ability: bool) {
    let env = [
        ("PYTORCH_CUDA_ALLOC_CONF", conf),
        (
            "FERROCACHE_CROSS_STREAM",
            if cross_stream { "1" } else { "0" },
        ),
        ("FERROCACHE_SLEEP", if sleep_ability { "1" } else { "0" }),
        ("FAKE_LIBCUDA_EVENT_DELAY", "2"),
        ("FAKE_CUDA_ORDER_FATAL", "1"),
    ];
    in_own_process(test, &env, || {
        let api = Api::open();
        let fake = FakeCuda::open();
        hand_blocks_between_streams(&api, &fake);
        assert_eq!(fake.stat("order_violations"), 0);
        assert!(fake.stat("order_handoffs_checked") > 0);
        if conf.is_empty() && !sleep_ability {
            assert!(fake.stat("order_frees_checked") > 0);
        } else {
            assert!(fake.stat("order_unmaps_checked") > 0);
        }
    });
}

#[test]
fn no_block_is_handed_over_while_work_may_touch_it() {
    check_hand_overs("no_block_is_handed_over_while_work_may_touch_it", "", false);
}

/// With sleep-ability on, a segment's release is an unmap, which (unlike `cudaFree`) does not
/// wait for the device: ferrocache waits for the segment's stream first.
#[test]
fn no_sleepable_segment_is_unmapped_while_work_may_touch_it() {
    check_hand_overs_with(
        "no_sleepable_segment_is_unmapped_while_work_may_touch_it",
        "",
        false,
        true,
    );
}

#[test]
fn no_expandable_block_is_handed_over_or_unmapped_while_work_may_touch_it() {
    check_hand_overs(
        "no_expandable_block_is_handed_over_or_unmapped_while_work_may_touch_it",
        "expandable_segments:True",
        false,
    );
}

#[test]
fn no_block_is_handed_to_another_stream_while_work_may_touch_it() {
    check_hand_overs(
        "no_block_is_handed_to_another_stream_while_work_may_touch_it",
        "",
        true,
    );
}

#[test]
fn no_expandable_block_is_handed_to_another_stream_while_work_may_touch_it() {
    check_hand_overs(
        "no_expandable_block_is_handed_to_another_stream_while_work_may_touch_it",
        "expandable_segments:True",
        true,
    );
}

// ---- Device memory shared by the processes of one machine --------------------------------

const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;

/// `cuMemGetInfo`'s free bytes on the current context's device.
fn free_memory(fake: &FakeCuda) -> usize {
    let info: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int =
        fake.function("cuMemGetInfo_v2");
    let (mut free, mut total) = (0, 0);
    // SAFETY: two live out pointers.
    assert_eq!(unsafe { info(&mut free, &mut total) }, 0);
    free
}

/// `cuMemAlloc` of `size` bytes: the address, or the driver's code.
fn try_device_alloc(fake: &FakeCuda, size: usize) -> Result<u64, c_int> {
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int = fake.function("cuMemAlloc_v2");
    let mut ptr = 0;
    // SAFETY: a live out pointer.
    match unsafe { alloc(&mut ptr, size) } {
        0 => Ok(ptr),
        code => Err(code),
    }
}

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NvmlProcess {
    pid: u32,
    used_gpu_memory: u64,
}

/// What NVML lists on device 0 (PCI bus 1): each compute process and the bytes it uses.
fn nvml_processes(fake: &FakeCuda) -> Vec<(u32, u64)> {
    let init: unsafe extern "C" fn() -> u32 = fake.function("nvmlInit_v2");
    let by_bus: unsafe extern "C" fn(*const std::ffi::c_char, *mut usize) -> u32 =
        fake.function("nvmlDeviceGetHandleByPciBusId_v2");
    let processes: unsafe extern "C" fn(usize, *mut u32, *mut NvmlProcess) -> u32 =
        fake.function("nvmlDeviceGetComputeRunningProcesses");
    let mut handle = 0;
    let mut infos = [NvmlProcess::default(); 8];
    let mut count = infos.len() as u32;
    // SAFETY: NVML's signatures; live out pointers, room for `count` entries.
    unsafe {
        assert_eq!(init(), 0);
        assert_eq!(by_bus(c"0000:01:00.0".as_ptr(), &mut handle), 0);
        assert_eq!(processes(handle, &mut count, infos.as_mut_ptr()), 0);
    }
    infos[..count as usize]
        .iter()
        .map(|p| (p.pid, p.used_gpu_memory))
        .collect()
}

/// With `FAKE_LIBCUDA_SHARED_DEVICES`, two processes draw on one capacity, as on one GPU: each
/// sees the other's memory as used (`cuMemGetInfo`, out of memory, NVML's list), and what a
/// process that crashed held is free again.
#[test]
fn device_memory_is_shared_by_the_processes_of_one_machine() {
    let test = "device_memory_is_shared_by_the_processes_of_one_machine";
    let table = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("shared-devices-{}", std::process::id()));
    if !support::is_child_for(test) {
        let _ = std::fs::remove_file(&table);
    }
    let table_text = table.display().to_string();
    let env = [
        ("FAKE_LIBCUDA_SHARED_DEVICES", table_text.as_str()),
        ("FAKE_LIBCUDA_TOTAL_MEM", "268435456"),
    ];
    in_own_process(test, &env, || {
        let fake = FakeCuda::open();
        fake.make_current(0);
        if std::env::var("FAKE_TEST_ROLE").as_deref() == Ok("second") {
            second_process_on_a_shared_device(&fake);
        }
        let held = device_alloc(&fake, 192 * MIB);
        assert_eq!(free_memory(&fake), 64 * MIB);
        let mut second = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("FAKE_TEST_ROLE", "second")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the second process");
        let mut said =
            std::io::BufRead::lines(std::io::BufReader::new(second.stdout.take().unwrap()));
        assert!(
            said.any(|line| line.is_ok_and(|l| l.ends_with("second: holding 64 MiB"))),
            "the second process failed: {:?}",
            second.wait()
        );
        assert_eq!(free_memory(&fake), 0, "the second process holds the rest");
        assert_eq!(try_device_alloc(&fake, MIB), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(
            nvml_processes(&fake),
            [(second.id(), 64 << 20), (std::process::id(), 192 << 20)]
        );
        std::io::Write::write_all(&mut second.stdin.take().unwrap(), b"go\n").unwrap();
        let status = second.wait().unwrap();
        assert!(!status.success(), "the second process crashes on purpose");
        assert_eq!(
            free_memory(&fake),
            64 * MIB,
            "a crashed process holds nothing"
        );
        assert_eq!(nvml_processes(&fake), [(std::process::id(), 192 << 20)]);
        assert_eq!(fake.call_with_handle("cuMemFree_v2", held), 0);
        assert_eq!(free_memory(&fake), 256 * MIB);
    });
    let _ = std::fs::remove_file(&table);
}

/// The second process of the test above: finds 64 MiB free, takes them, says so, and crashes
/// (abort: no exit handler removes its line from the table) once told to.
fn second_process_on_a_shared_device(fake: &FakeCuda) -> ! {
    assert_eq!(
        free_memory(fake),
        64 * MIB,
        "the first process holds 192 MiB"
    );
    assert_eq!(
        try_device_alloc(fake, 128 * MIB),
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    );
    try_device_alloc(fake, 64 * MIB).expect("the 64 MiB left");
    println!("second: holding 64 MiB");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    std::process::abort();
}
