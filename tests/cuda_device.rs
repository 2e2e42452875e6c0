//! `device::cuda::CudaDevice` against the fake libcuda in `tests/fake-cuda/driver`.
//!
//! Each test runs its scenario in a child process of its own (see `support`), because cudarc
//! loads libcuda once per process and the fake's settings are read from the environment.

mod support;

use std::ptr;

use cudarc::driver::sys;
use ferrocache::device::cuda::CudaDevice;
use ferrocache::device::{Device, DeviceError, ProcessMemory};
use support::{
    FakeCuda, in_own_process, in_own_process_stderr, in_own_process_with_library_path,
    in_own_process_without_libcuda, in_own_process_without_nvml, stub_libcuda_dir,
};

const MIB: usize = 1 << 20;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
const CUDA_ERROR_UNKNOWN: u32 = 999;

fn open_device() -> CudaDevice {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("CudaDevice::new(0) failed: {e}"))
}

/// The `len` bytes at device address `ptr`, which on the fake is host memory.
///
/// # Safety
/// `ptr..ptr + len` is live, accessible memory that nothing else uses meanwhile.
unsafe fn device_bytes<'a>(ptr: u64, len: usize) -> &'a mut [u8] {
    // SAFETY: promised by the caller.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

fn current_context() -> sys::CUcontext {
    let mut context = ptr::null_mut();
    // SAFETY: the out pointer is a live local.
    let result = unsafe { sys::cuCtxGetCurrent(&mut context) };
    assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
    context
}

fn set_current_context(context: sys::CUcontext) {
    // SAFETY: a context handle from the driver, or NULL.
    let result = unsafe { sys::cuCtxSetCurrent(context) };
    assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
}

/// Retains device 0's primary context for the test itself, as PyTorch would.
fn retain_primary_context() -> sys::CUcontext {
    let mut context = ptr::null_mut();
    // SAFETY: the out pointer is a live local; the device exists (CudaDevice::new checked).
    let result = unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, 0) };
    assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
    context
}

#[test]
fn cuda_device_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<CudaDevice>();
}

#[test]
fn malloc_and_free_round_trip_through_the_pointer() {
    in_own_process(
        "malloc_and_free_round_trip_through_the_pointer",
        &[],
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            assert_eq!(device.ordinal(), 0);
            assert!(
                device.name().contains("Fake CUDA Device"),
                "{}",
                device.name()
            );
            assert_eq!(device.driver_version(), 13020);

            let first = device.malloc(MIB, 0).expect("malloc");
            let second = device.malloc(3 * MIB, 0).expect("malloc");
            assert_eq!(first % 512, 0);
            assert!(first + MIB as u64 <= second || second + 3 * MIB as u64 <= first);

            // SAFETY: both allocations are live and only this test touches them.
            let (a, b) = unsafe { (device_bytes(first, MIB), device_bytes(second, 3 * MIB)) };
            a.fill(0xa5);
            b.fill(0x5a);
            assert!(
                a.iter().all(|&x| x == 0xa5),
                "the second allocation overlaps the first"
            );

            assert_eq!(fake.stat("cuMemAlloc_v2"), 2);
            assert_eq!(fake.stat("bytes_in_use"), 4 * MIB as i64);
            let info = device.mem_get_info().expect("mem_get_info");
            assert_eq!(info.total, 16 << 30);
            assert_eq!(info.free, info.total - 4 * MIB);

            device.free(first).expect("free");
            device.free(second).expect("free");
            assert_eq!(fake.stat("bytes_in_use"), 0);

            match device.free(first) {
                Err(DeviceError::Driver {
                    call,
                    code,
                    message,
                }) => {
                    assert_eq!(call, "cuMemFree_v2");
                    assert_eq!(code, CUDA_ERROR_INVALID_VALUE);
                    assert_eq!(message, "invalid argument");
                }
                other => panic!("a double free should be a driver error, got {other:?}"),
            }
        },
    );
}

#[test]
fn out_of_memory_is_reported_as_out_of_memory() {
    let four_mib = (4 * MIB).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", four_mib.as_str())];
    in_own_process("out_of_memory_is_reported_as_out_of_memory", &env, || {
        let mut device = open_device();
        let held = device.malloc(3 * MIB, 0).expect("3 MiB of 4 fit");
        assert_eq!(device.malloc(2 * MIB, 0), Err(DeviceError::OutOfMemory));
        // Physical pages for expandable segments count against the same memory.
        assert_eq!(
            device.create_physical(2 * MIB),
            Err(DeviceError::OutOfMemory)
        );
        device.free(held).expect("free");
        let again = device
            .malloc(2 * MIB, 0)
            .expect("fits once the 3 MiB are freed");
        device.free(again).expect("free");
    });
}

/// The processes NVML lists on device 0, as `CudaDevice` reports them (this process last).
fn this_process(used_bytes: usize) -> ProcessMemory {
    ProcessMemory {
        pid: std::process::id(),
        used_bytes: used_bytes as u64,
    }
}

const NVML_ERROR_UNKNOWN: u32 = 999;

#[test]
fn nvml_lists_the_processes_on_the_gpu_with_their_memory() {
    // Ten other processes, one of them on device 1: more than the room PyTorch makes at first
    // (8), so the list is asked for again with the room NVML says it needs.
    let others: Vec<String> = (1..=10)
        .map(|i| {
            format!(
                "{}:{}{}",
                1000 + i,
                i * MIB,
                if i == 10 { ":1" } else { "" }
            )
        })
        .collect();
    let others = others.join(",");
    let env = [
        ("FAKE_NVML_OTHER_PROCESSES", others.as_str()),
        ("FAKE_LIBCUDA_DEVICE_COUNT", "2"),
    ];
    in_own_process(
        "nvml_lists_the_processes_on_the_gpu_with_their_memory",
        &env,
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            let held = device.malloc(3 * MIB, 0).expect("malloc");
            assert_eq!(fake.stat("nvmlInit_v2"), 0, "NVML is not asked before");
            let mut expected: Vec<ProcessMemory> = (1..=9)
                .map(|i| ProcessMemory {
                    pid: 1000 + i,
                    used_bytes: (i as usize * MIB) as u64,
                })
                .collect();
            expected.push(this_process(3 * MIB));
            assert_eq!(device.compute_processes(), expected);
            assert_eq!(fake.stat("nvmlInit_v2"), 1);
            assert_eq!(fake.stat("nvmlDeviceGetHandleByPciBusId_v2"), 1);
            assert_eq!(fake.stat("nvmlDeviceGetComputeRunningProcesses"), 2);
            // Their memory is not free for this process: 45 MiB on device 0.
            let info = device.mem_get_info().expect("mem_get_info");
            assert_eq!(info.total - info.free, 48 * MIB);

            // A call that fails leaves the list empty that time only; NVML starts once.
            fake.fail_next("nvmlDeviceGetComputeRunningProcesses", NVML_ERROR_UNKNOWN);
            assert_eq!(device.compute_processes(), []);
            fake.fail_next("nvmlDeviceGetHandleByPciBusId_v2", NVML_ERROR_UNKNOWN);
            assert_eq!(device.compute_processes(), []);
            device.free(held).expect("free");
            *expected.last_mut().expect("this process") = this_process(0);
            assert_eq!(device.compute_processes(), expected);
            assert_eq!(fake.stat("nvmlInit_v2"), 1);

            // Device 1's list: its other process, and this one once it has a context there.
            let mut second = CudaDevice::new(1).expect("device 1");
            let on_second = ProcessMemory {
                pid: 1010,
                used_bytes: (10 * MIB) as u64,
            };
            assert_eq!(second.compute_processes(), [on_second, this_process(0)]);
        },
    );
}

#[test]
fn nvml_that_does_not_start_is_not_asked_again() {
    in_own_process("nvml_that_does_not_start_is_not_asked_again", &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        fake.fail_next("nvmlInit_v2", NVML_ERROR_UNKNOWN);
        assert_eq!(device.compute_processes(), []);
        assert_eq!(device.compute_processes(), []);
        assert_eq!(fake.stat("nvmlInit_v2"), 1);
        assert_eq!(fake.stat("nvmlDeviceGetComputeRunningProcesses"), 0);
    });
}

#[test]
fn without_nvml_nobody_is_listed() {
    in_own_process_without_nvml("without_nvml_nobody_is_listed", &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        let held = device
            .malloc(MIB, 0)
            .expect("the driver works without NVML");
        let listed = device.compute_processes();
        // SAFETY: only asks whether the system's own NVML (found outside the search path, on
        // a machine with a driver installed) loads; nothing of it is called.
        if unsafe { libloading::Library::new("libnvidia-ml.so.1") }.is_err() {
            assert_eq!(listed, []);
        }
        assert_eq!(
            fake.stat("nvmlInit_v2"),
            0,
            "the fake's NVML is not reached"
        );
        device.free(held).expect("free");
    });
}

#[test]
fn other_driver_errors_carry_the_call_code_and_message() {
    in_own_process(
        "other_driver_errors_carry_the_call_code_and_message",
        &[],
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            fake.fail_next("cuMemAlloc_v2", CUDA_ERROR_UNKNOWN);
            let error = device.malloc(MIB, 0).expect_err("the injected failure");
            assert_eq!(
                error,
                DeviceError::Driver {
                    call: "cuMemAlloc_v2",
                    code: CUDA_ERROR_UNKNOWN as i32,
                    message: "unknown error".to_string(),
                }
            );
            assert_eq!(
                error.to_string(),
                "cuMemAlloc_v2 failed with error 999: unknown error"
            );
            assert_eq!(
                current_context(),
                ptr::null_mut(),
                "context restored after a failure"
            );
        },
    );
}

#[test]
fn expandable_segment_pages_map_and_read_back() {
    in_own_process("expandable_segment_pages_map_and_read_back", &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        assert!(device.supports_virtual_memory());
        let page = device.page_granularity().expect("granularity");
        assert_eq!(page, 2 * MIB);
        let page64 = page as u64;

        let base = device.reserve_address_range(4 * page).expect("reserve");
        assert_eq!(base % page64, 0);
        let first = device.create_physical(page).expect("create");
        let second = device.create_physical(page).expect("create");
        assert_eq!(fake.stat("bytes_in_use"), 2 * page as i64);
        for (offset, handle) in [(0, first), (page64, second)] {
            device.map(base + offset, page, handle).expect("map");
        }
        device.set_access(base, 2 * page).expect("set_access");

        // Write across the boundary between the two pages, as one segment would be used.
        // SAFETY: both pages are mapped read/write and only this test touches them.
        let segment = unsafe { device_bytes(base, 2 * page) };
        for (i, byte) in segment.iter_mut().enumerate() {
            *byte = (i % 251) as u8;
        }
        assert!(
            segment
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i % 251) as u8)
        );

        // The second page's contents live in its physical handle: mapped elsewhere, they follow.
        device.unmap(base + page64, page).expect("unmap");
        device
            .map(base + 3 * page64, page, second)
            .expect("map again");
        device
            .set_access(base + 3 * page64, page)
            .expect("set_access");
        // SAFETY: the page is mapped read/write and only this test touches it.
        let moved = unsafe { device_bytes(base + 3 * page64, page) };
        assert!(
            moved
                .iter()
                .enumerate()
                .all(|(i, &b)| b == ((i + page) % 251) as u8)
        );

        device.unmap(base, page).expect("unmap");
        device.unmap(base + 3 * page64, page).expect("unmap");
        device.release_physical(first).expect("release");
        device.release_physical(second).expect("release");
        device
            .free_address_range(base, 4 * page)
            .expect("free range");
        for counter in [
            "live_mappings",
            "live_physical",
            "live_reservations",
            "bytes_in_use",
        ] {
            assert_eq!(fake.stat(counter), 0, "{counter}");
        }
        assert_eq!(fake.stat("cuMemMap"), 3);
        assert_eq!(fake.stat("cuMemSetAccess"), 2);
        assert_eq!(fake.stat("cuMemGetAllocationGranularity"), 1);
        assert_eq!(device.page_granularity(), Ok(page), "cached");
    });
}

/// Stirs the host heap from `seed`: blocks of 1 KiB to 48 MiB (the large ones `mmap`ed by
/// glibc), half of them freed again, the rest kept until the process ends.
fn stir_the_host_heap(seed: u64) {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    let mut kept = Vec::new();
    for _ in 0..(seed % 97) {
        let size = 1024usize << (next() % 16);
        let mut block = vec![0u8; size + (next() % 4096) as usize];
        block[0] = 1;
        if next() % 2 == 0 {
            kept.push(block);
        }
    }
    std::mem::forget(kept);
}

/// The same driver calls, after `stir_the_host_heap(FAKE_TEST_HEAP_SEED)`: writes the fake's
/// base address and every address the calls got, less that base, to `FAKE_TEST_ADDRESSES`.
fn record_device_addresses() {
    let seed = std::env::var("FAKE_TEST_HEAP_SEED").expect("a heap seed");
    stir_the_host_heap(seed.parse().expect("a number"));
    let fake = FakeCuda::open();
    let mut device = open_device();
    let base = fake.address_base();
    assert_ne!(base, 0, "the fake reserved its device addresses");
    let mut addresses = Vec::new();
    // Small blocks (512-byte aligned, several to a host page), then segments (2 MiB aligned).
    for size in [
        512,
        700,
        4096,
        1000,
        2 * MIB,
        20 * MIB,
        3 * MIB + 5,
        128 * 1024,
    ] {
        addresses.push(device.malloc(size, 0).expect("malloc"));
    }
    // Frees make holes that first fit fills again, lowest address first.
    for index in [1, 4, 6] {
        device.free(addresses[index]).expect("free");
    }
    for size in [600, 2 * MIB, MIB, 40 * MIB] {
        addresses.push(device.malloc(size, 0).expect("malloc"));
    }
    assert_eq!(
        addresses[8], addresses[1],
        "the 600 bytes go into the 700-byte hole"
    );
    assert_eq!(addresses[9], addresses[4], "2 MiB into the freed 2 MiB");
    // Device memory is host memory: the bytes written are read back.
    // SAFETY: live allocations of these sizes that only this test touches.
    unsafe {
        device_bytes(addresses[0], 512).fill(7);
        device_bytes(addresses[2], 4096).fill(9);
        assert!(device_bytes(addresses[0], 512).iter().all(|&b| b == 7));
    }
    // VMM reservations come from their own arena, placed the same way.
    let first = device.reserve_address_range(64 * MIB).expect("reserve");
    let second = device.reserve_address_range(32 * MIB).expect("reserve");
    device
        .free_address_range(first, 64 * MIB)
        .expect("free range");
    let third = device.reserve_address_range(8 * MIB).expect("reserve");
    assert_eq!(third, first, "the lowest free range again");
    addresses.extend([first, second, third]);
    let lines: Vec<String> = std::iter::once(format!("base {base:#x}"))
        .chain(addresses.iter().map(|a| format!("{:#x}", a - base)))
        .collect();
    let out = std::env::var("FAKE_TEST_ADDRESSES").expect("an output path");
    std::fs::write(out, lines.join("\n")).expect("write the addresses");
}

#[test]
fn device_addresses_do_not_depend_on_the_host_heap() {
    const TEST: &str = "device_addresses_do_not_depend_on_the_host_heap";
    if support::is_child_for(TEST) {
        in_own_process(TEST, &[], record_device_addresses);
        return;
    }
    let scratch = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(TEST);
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    // Three processes whose host heaps differ; the last lets the kernel choose the base.
    let runs = [("0", None), ("61", None), ("95", Some("0"))];
    let mut outputs = Vec::new();
    for (seed, hint) in runs {
        let out = scratch.join(format!("addresses-{seed}"));
        let out_text = out.display().to_string();
        let mut env = vec![
            ("FAKE_TEST_HEAP_SEED", seed),
            ("FAKE_TEST_ADDRESSES", out_text.as_str()),
        ];
        if let Some(hint) = hint {
            env.push(("FAKE_LIBCUDA_ADDRESS_HINT", hint));
        }
        in_own_process(TEST, &env, || {});
        outputs.push(std::fs::read_to_string(&out).expect("the child's addresses"));
    }
    let (bases, offsets): (Vec<&str>, Vec<&str>) = outputs
        .iter()
        .map(|text| text.split_once('\n').expect("a base, then addresses"))
        .unzip();
    assert_eq!(offsets[0], offsets[1], "the same calls, the same offsets");
    assert_eq!(offsets[0], offsets[2], "wherever the base lies");
    // At the fixed hint, absolute addresses agree too.
    assert_eq!(bases[0], "base 0x200000000000");
    assert_eq!(bases[1], bases[0]);
}

#[test]
fn device_memory_is_committed_when_written_and_given_back_when_freed() {
    let capacity = (80u64 << 30).to_string();
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", capacity.as_str())];
    let test = "device_memory_is_committed_when_written_and_given_back_when_freed";
    in_own_process(test, &env, || {
        fn resident_mib() -> u64 {
            let status = std::fs::read_to_string("/proc/self/status").expect("status");
            let line = status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .expect("VmRSS");
            let kib: u64 = line
                .split_whitespace()
                .nth(1)
                .expect("a number")
                .parse()
                .expect("kB");
            kib >> 10
        }
        let mut device = open_device();
        let before = resident_mib();
        // 60 GiB of an 80 GiB fake GPU, touched at both ends: two host pages.
        let huge = device.malloc(60 << 30, 0).expect("60 GiB");
        // SAFETY: a live allocation of 60 GiB that only this test touches.
        unsafe {
            device_bytes(huge, 1)[0] = 1;
            device_bytes(huge + (60 << 30) - 1, 1)[0] = 1;
        }
        assert!(
            resident_mib() < before + 16,
            "only the written pages are committed"
        );
        let written = device.malloc(256 * MIB, 0).expect("256 MiB");
        // SAFETY: a live allocation of 256 MiB that only this test touches.
        unsafe { device_bytes(written, 256 * MIB).fill(0x5a) };
        assert!(
            resident_mib() >= before + 250,
            "written pages are committed"
        );
        device.free(written).expect("free");
        device.free(huge).expect("free");
        assert!(
            resident_mib() < before + 16,
            "freed device memory gives its host pages back"
        );
    });
}

#[test]
fn events_are_not_ready_then_ready() {
    in_own_process("events_are_not_ready_then_ready", &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        fake.set_event_delay(2);
        let event = device.record_event(0).expect("record");
        assert_eq!(device.query_event(event), Ok(false));
        assert_eq!(device.query_event(event), Ok(false));
        assert_eq!(device.query_event(event), Ok(true));
        device.release_event(event);

        // Released events are recorded again rather than created anew.
        let again = device.record_event(0).expect("record");
        assert_eq!(again, event);
        assert_eq!(device.query_event(again), Ok(false));
        device.synchronize_event(again).expect("synchronize");
        assert_eq!(device.query_event(again), Ok(true));
        device.release_event(again);
        assert_eq!(fake.stat("cuEventCreate"), 1);
        assert_eq!(
            fake.stat("timed_events"),
            0,
            "events are created without timing"
        );

        device
            .synchronize_stream(0)
            .expect("synchronize the legacy stream");
        // The stream's context is asked first, and the driver refuses the unknown handle.
        match device.record_event(0xdead_0000) {
            Err(DeviceError::Driver { call, code, .. }) => {
                assert_eq!((call, code), ("cuStreamGetCtx", CUDA_ERROR_INVALID_HANDLE));
            }
            other => panic!("recording on an unknown stream should fail, got {other:?}"),
        }
        drop(device);
        assert_eq!(
            fake.stat("live_events"),
            0,
            "dropping the device destroys its events"
        );
    });
}

#[test]
fn the_callers_context_is_restored() {
    in_own_process("the_callers_context_is_restored", &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();

        // No context current: ours is pushed for the call, and popped again.
        let ptr = device
            .malloc(MIB, 0)
            .expect("malloc with no context current");
        assert_eq!(current_context(), ptr::null_mut());

        // Another library's context current: it is current again afterwards. (The fake refuses
        // memory calls under that context, so the malloc succeeding proves the switch.)
        let foreign: sys::CUcontext = fake.foreign_context().cast();
        set_current_context(foreign);
        device.free(ptr).expect("free under a foreign context");
        fake.fail_next("cuMemGetInfo_v2", CUDA_ERROR_UNKNOWN);
        assert!(device.mem_get_info().is_err());
        assert_eq!(
            current_context(),
            foreign,
            "restored after success and failure"
        );

        // The primary context already current: no switch at all.
        let primary = retain_primary_context();
        set_current_context(primary);
        let pushes = fake.stat("cuCtxPushCurrent_v2");
        let ptr = device.malloc(MIB, 0).expect("malloc");
        device.free(ptr).expect("free");
        assert_eq!(fake.stat("cuCtxPushCurrent_v2"), pushes);
        assert_eq!(current_context(), primary);
        assert_eq!(
            fake.stat("cuCtxPushCurrent_v2"),
            fake.stat("cuCtxPopCurrent_v2")
        );

        // The device holds one reference to the primary context and gives it back on drop.
        assert_eq!(fake.stat("primary_context_refs"), 2);
        drop(device);
        assert_eq!(fake.stat("primary_context_refs"), 1);
        set_current_context(ptr::null_mut());
    });
}

#[test]
fn malloc_during_graph_capture_relaxes_the_capture_mode() {
    in_own_process(
        "malloc_during_graph_capture_relaxes_the_capture_mode",
        &[],
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            set_current_context(retain_primary_context());
            let mut stream = ptr::null_mut();
            // SAFETY: the out pointer is a live local; a context is current.
            let created = unsafe { sys::cuStreamCreate(&mut stream, 0) };
            assert_eq!(created, sys::CUresult::CUDA_SUCCESS);
            let stream = stream as u64;

            let ptr = device
                .malloc(MIB, stream)
                .expect("no capture, plain malloc");
            assert_eq!(fake.stat("cuThreadExchangeStreamCaptureMode"), 0);
            device.free(ptr).expect("free");

            fake.set_capturing(stream, true);
            let mut raw = 0;
            // SAFETY: the out pointer is a live local; a context is current.
            let refused = unsafe { sys::cuMemAlloc_v2(&mut raw, MIB) };
            assert_eq!(
                refused,
                sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "the fake refuses a plain malloc during capture, as the driver does"
            );
            let ptr = device.malloc(MIB, stream).expect("malloc during capture");
            assert_eq!(fake.stat("cuThreadExchangeStreamCaptureMode"), 2);
            assert_eq!(
                fake.capture_mode(),
                0,
                "the thread's capture mode is global again"
            );
            fake.set_capturing(stream, false);
            device.free(ptr).expect("free");
        },
    );
}

#[test]
fn an_old_driver_is_unavailable() {
    let env = [("FAKE_LIBCUDA_DRIVER_VERSION", "11080")];
    in_own_process(
        "an_old_driver_is_unavailable",
        &env,
        || match CudaDevice::new(0) {
            Err(DeviceError::Unavailable(message)) => {
                assert!(message.contains("CUDA 12.0 or newer"), "{message}");
                assert!(message.contains("CUDA 11.8"), "{message}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        },
    );
}

#[test]
fn a_missing_device_is_unavailable() {
    in_own_process("a_missing_device_is_unavailable", &[], || {
        for ordinal in [1, -1] {
            match CudaDevice::new(ordinal) {
                Err(DeviceError::Unavailable(message)) => {
                    assert!(
                        message.contains(&format!("no CUDA device {ordinal}")),
                        "{message}"
                    );
                    assert!(message.contains("1 device(s)"), "{message}");
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        }
    });
}

#[test]
fn a_machine_without_devices_is_unavailable() {
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "0")];
    in_own_process(
        "a_machine_without_devices_is_unavailable",
        &env,
        || match CudaDevice::new(0) {
            Err(DeviceError::Unavailable(message)) => {
                assert!(message.contains("no CUDA-capable device"), "{message}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        },
    );
}

#[test]
fn no_libcuda_at_all_is_unavailable_without_a_panic() {
    in_own_process_without_libcuda("no_libcuda_at_all_is_unavailable_without_a_panic", || {
        for _ in 0..2 {
            match CudaDevice::new(0) {
                Err(DeviceError::Unavailable(message)) => {
                    assert!(
                        message.contains("could not load the CUDA driver library libcuda.so"),
                        "{message}"
                    );
                    assert!(message.contains("NVIDIA driver installed"), "{message}");
                }
                Ok(_) => {
                    // A machine with a real driver in the system library path: nothing to test.
                    eprintln!("skipped: this machine has a real libcuda");
                    return;
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        }
    });
}

/// What `real_gpu_smoke` checks, run here on the fake so that the check itself is known to work.
#[test]
fn the_real_gpu_smoke_test_passes_on_the_fake() {
    in_own_process("the_real_gpu_smoke_test_passes_on_the_fake", &[], smoke);
}

/// The same checks on a real GPU, with the system's libcuda:
/// `cargo test --test cuda_device -- --ignored real_gpu_smoke --nocapture`.
#[test]
#[ignore = "needs an NVIDIA GPU and driver"]
fn real_gpu_smoke() {
    smoke();
}

/// Every `Device` operation once, on whatever libcuda the process loads. Device memory is only
/// touched through the driver (memset and copy), so this runs on a real GPU as well.
fn smoke() {
    let mut device = open_device();
    eprintln!(
        "device 0: {}, driver {}",
        device.name(),
        device.driver_version()
    );
    assert_eq!(current_context(), ptr::null_mut());

    let info = device.mem_get_info().expect("mem_get_info");
    assert!(info.free <= info.total && info.total > 0, "{info:?}");
    let ptr = device.malloc(64 * MIB, 0).expect("malloc");
    assert_eq!(ptr % 512, 0);
    device.free(ptr).expect("free");
    assert_eq!(
        device.malloc(info.total.saturating_mul(2), 0),
        Err(DeviceError::OutOfMemory)
    );

    let event = device.record_event(0).expect("record_event");
    device.synchronize_event(event).expect("synchronize_event");
    assert_eq!(device.query_event(event), Ok(true));
    device.release_event(event);
    device.synchronize_stream(0).expect("synchronize_stream");
    assert_eq!(
        current_context(),
        ptr::null_mut(),
        "nothing left current behind"
    );

    if !device.supports_virtual_memory() {
        eprintln!("no virtual memory management on this device: expandable segments skipped");
        return;
    }
    let page = device.page_granularity().expect("page_granularity");
    let base = device.reserve_address_range(4 * page).expect("reserve");
    let handle = device.create_physical(2 * page).expect("create_physical");
    device
        .map(base + page as u64, 2 * page, handle)
        .expect("map");
    device
        .set_access(base + page as u64, 2 * page)
        .expect("set_access");

    // Write and read the mapped pages through the driver, in the primary context.
    set_current_context(retain_primary_context());
    let last_byte = base + 3 * page as u64 - 1;
    let mut read_back = [0u8; 1];
    // SAFETY: the range is mapped and accessible; the out buffer is a live local of one byte.
    let (set, copied) = unsafe {
        (
            sys::cuMemsetD8_v2(base + page as u64, 0x5a, 2 * page),
            sys::cuMemcpyDtoH_v2(read_back.as_mut_ptr().cast(), last_byte, 1),
        )
    };
    assert_eq!(
        (set, copied),
        (sys::CUresult::CUDA_SUCCESS, sys::CUresult::CUDA_SUCCESS)
    );
    assert_eq!(read_back, [0x5a]);

    device.unmap(base + page as u64, 2 * page).expect("unmap");
    device.release_physical(handle).expect("release_physical");
    device
        .free_address_range(base, 4 * page)
        .expect("free_address_range");
}

// ---- Peers, device features and the driver library ------------------------------------------

const CUDA_ERROR_ILLEGAL_ADDRESS: u32 = 700;
const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: u32 = 704;

/// Maps `pages` fresh pages of `device` at `base + offset` and grants access as ferrocache does.
fn map_pages(device: &mut CudaDevice, base: u64, offset: usize, pages: usize) -> Vec<u64> {
    let page = device.page_granularity().expect("granularity");
    let mut handles = Vec::new();
    for index in 0..pages {
        let handle = device.create_physical(page).expect("create");
        let at = base + (offset + index * page) as u64;
        device.map(at, page, handle).expect("map");
        handles.push(handle);
    }
    device
        .set_access(base + offset as u64, pages * page)
        .expect("set_access");
    handles
}

/// Pages an expandable segment of device 0 maps are reachable by device 1, both those mapped
/// before peer access was enabled and those mapped after: a memset and a copy made in device
/// 1's context touch them. Before ferrocache granted its peers access, the first memset failed
/// with an illegal address, as on a GPU.
#[test]
fn expandable_pages_are_reachable_from_a_peer_device() {
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2")];
    in_own_process(
        "expandable_pages_are_reachable_from_a_peer_device",
        &env,
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            let page = device.page_granularity().expect("granularity");
            assert_eq!(device.devices_with_access().collect::<Vec<_>>(), [0, 1]);
            let base = device.reserve_address_range(8 * page).expect("reserve");
            let mut handles = map_pages(&mut device, base, 0, 2);

            let mut peer = CudaDevice::new(1).expect("device 1");
            let on_peer = peer.malloc(2 * page, 0).expect("malloc on device 1");
            fake.make_current(1);
            assert_eq!(fake.memset(base, 0x5a, 2 * page), 0, "mapped before");
            assert_eq!(fake.copy(on_peer, base, 2 * page), 0);
            // Copies and memsets are asynchronous: done before the pages are unmapped.
            assert_eq!(fake.synchronize(), 0);
            assert_eq!(fake.enable_peer_access(0), 0);
            assert_eq!(
                fake.enable_peer_access(0),
                CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            );
            set_current_context(ptr::null_mut());

            handles.extend(map_pages(&mut device, base, 2 * page, 2));
            fake.make_current(1);
            assert_eq!(fake.memset(base, 0x6b, 4 * page), 0, "mapped after");
            assert_eq!(fake.copy(base + 2 * page as u64, on_peer, 2 * page), 0);
            assert_eq!(fake.synchronize(), 0);
            set_current_context(ptr::null_mut());

            device.unmap(base, 4 * page).expect("unmap");
            for handle in handles {
                device.release_physical(handle).expect("release");
            }
            device.free_address_range(base, 8 * page).expect("free");
            peer.free(on_peer).expect("free on device 1");
        },
    );
}

/// The fake's rule that the test above relies on: pages granted to device 0 alone are an
/// illegal address for device 1, enabled peer access or not, while memory from `cuMemAlloc`
/// is reachable. An illegal address is sticky (every later call of the process returns it),
/// so each case runs in a process of its own (`FAKE_TEST_CASE`).
#[test]
fn pages_granted_to_one_device_are_an_illegal_address_for_another() {
    let test = "pages_granted_to_one_device_are_an_illegal_address_for_another";
    for case in ["without peer access", "with peer access"] {
        let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2"), ("FAKE_TEST_CASE", case)];
        in_own_process(test, &env, || {
            if std::env::var("FAKE_TEST_CASE").as_deref() != Ok(case) {
                return;
            }
            let fake = FakeCuda::open();
            let mut device = open_device();
            let page = device.page_granularity().expect("granularity");
            let base = device.reserve_address_range(page).expect("reserve");
            let handle = device.create_physical(page).expect("create");
            device.map(base, page, handle).expect("map");
            // Access for device 0 only, as ferrocache granted it before.
            let location = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                __bindgen_anon_1: sys::CUmemLocation_st__bindgen_ty_1 { id: 0 },
            };
            let access = sys::CUmemAccessDesc {
                location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            fake.make_current(0);
            // SAFETY: one live descriptor.
            let result = unsafe { sys::cuMemSetAccess(base, page, &access, 1) };
            assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
            assert_eq!(fake.memset(base, 1, page), 0, "the owner reaches it");
            let plain = device.malloc(page, 0).expect("malloc");
            fake.make_current(1);
            if case == "with peer access" {
                assert_eq!(fake.enable_peer_access(0), 0);
                assert_eq!(
                    fake.memset(plain, 1, page),
                    0,
                    "it applies to cuMemAlloc memory"
                );
            }
            assert_eq!(
                fake.memset(base, 1, page),
                CUDA_ERROR_ILLEGAL_ADDRESS,
                "{case}: peer access does not apply to mapped pages"
            );
            assert_eq!(
                fake.synchronize(),
                CUDA_ERROR_ILLEGAL_ADDRESS as std::ffi::c_int,
                "sticky"
            );
        });
    }
}

/// Reserved address space with no pages mapped (never mapped, or unmapped since: memory that
/// sleeps) is an illegal address for a copy or memset, as a GPU's copy engine faults there,
/// whichever call reaches it; the fake says where on stderr, and the error is sticky: every
/// later call of the process returns it, but the error-text look-ups.
#[test]
fn touching_reserved_but_unmapped_memory_is_a_sticky_illegal_address() {
    let test = "touching_reserved_but_unmapped_memory_is_a_sticky_illegal_address";
    let stderr = in_own_process_stderr(test, &[], || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        let page = device.page_granularity().expect("granularity");
        let base = device.reserve_address_range(4 * page).expect("reserve");
        let handle = device.create_physical(page).expect("create");
        device.map(base, page, handle).expect("map");
        device.set_access(base, page).expect("set_access");
        fake.make_current(0);
        assert_eq!(fake.memset(base, 1, page), 0, "mapped and accessible");
        assert_eq!(fake.synchronize(), 0);
        // The unified copy would have taken the address for host memory before.
        let host = vec![7u8; 4096];
        let unified_copy: unsafe extern "C" fn(u64, u64, usize) -> u32 = fake.function("cuMemcpy");
        // SAFETY: the driver checks the device side; the host side is live.
        let copied = unsafe { unified_copy(base + 2 * page as u64, host.as_ptr() as u64, 4096) };
        assert_eq!(copied, CUDA_ERROR_ILLEGAL_ADDRESS);
        for (what, code) in [
            ("a memset of mapped pages", fake.memset(base, 1, page)),
            ("a synchronization", fake.synchronize() as u32),
        ] {
            assert_eq!(code, CUDA_ERROR_ILLEGAL_ADDRESS, "sticky: {what}");
        }
        let name: unsafe extern "C" fn(u32, *mut *const std::ffi::c_char) -> u32 =
            fake.function("cuGetErrorName");
        let mut text = ptr::null();
        // SAFETY: a live out pointer.
        assert_eq!(unsafe { name(CUDA_ERROR_ILLEGAL_ADDRESS, &mut text) }, 0);
        std::mem::forget(device); // its teardown would only meet the sticky error
    });
    if let Some(stderr) = stderr {
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("ILLEGAL ADDRESS"))
            .collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(lines[0].contains("is reserved but not mapped"), "{stderr}");
    }
}

/// Should the driver refuse to grant the peers access, they are dropped (with a WARN line) and
/// the device alone gets access: its own allocations go on.
#[test]
fn peers_the_driver_refuses_are_dropped() {
    let env = [("FAKE_LIBCUDA_DEVICE_COUNT", "2")];
    in_own_process("peers_the_driver_refuses_are_dropped", &env, || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        let page = device.page_granularity().expect("granularity");
        let base = device.reserve_address_range(2 * page).expect("reserve");
        fake.fail_next("cuMemSetAccess", CUDA_ERROR_INVALID_VALUE as u32);
        let mut handles = map_pages(&mut device, base, 0, 1);
        assert_eq!(device.devices_with_access().collect::<Vec<_>>(), [0]);
        assert_eq!(
            fake.stat("cuMemSetAccess"),
            2,
            "refused, then the device alone"
        );
        handles.extend(map_pages(&mut device, base, page, 1));
        assert_eq!(fake.stat("cuMemSetAccess"), 3);
        fake.make_current(0);
        assert_eq!(fake.memset(base, 1, 2 * page), 0);
        assert_eq!(fake.synchronize(), 0);
        set_current_context(ptr::null_mut());
        device.unmap(base, page).expect("unmap");
        device.unmap(base + page as u64, page).expect("unmap");
        for handle in handles {
            device.release_physical(handle).expect("release");
        }
        device
            .free_address_range(base, 2 * page)
            .expect("free range");
    });
}

/// Devices that cannot reach each other (`cuDeviceCanAccessPeer` = 0) are not peers: access is
/// granted to the owner alone (the driver refuses to name the other), and a copy between them,
/// which the driver stages through the host, still works.
#[test]
fn devices_that_cannot_reach_each_other_are_not_granted_access() {
    let env = [
        ("FAKE_LIBCUDA_DEVICE_COUNT", "2"),
        ("FAKE_LIBCUDA_PEER_ACCESS", "0"),
    ];
    in_own_process(
        "devices_that_cannot_reach_each_other_are_not_granted_access",
        &env,
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            assert_eq!(device.devices_with_access().collect::<Vec<_>>(), [0]);
            let page = device.page_granularity().expect("granularity");
            let base = device.reserve_address_range(page).expect("reserve");
            let handles = map_pages(&mut device, base, 0, 1);
            // A copy between them is staged through the host by the driver: it works.
            let mut other = CudaDevice::new(1).expect("device 1");
            let on_other = other.malloc(page, 0).expect("malloc on device 1");
            fake.make_current(1);
            assert_eq!(fake.copy(on_other, base, page), 0);
            set_current_context(ptr::null_mut());
            other.free(on_other).expect("free on device 1");
            device.unmap(base, page).expect("unmap");
            device.release_physical(handles[0]).expect("release");
            device.free_address_range(base, page).expect("free range");
        },
    );
}

/// Creates one physical page on device 0 under `env`: it must succeed, with `rdma_capable`
/// pages made GPUDirect RDMA capable.
fn physical_page_under(test: &str, env: &[(&str, &str)], rdma_capable: i64) {
    in_own_process(test, env, || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        let page = device.page_granularity().expect("granularity");
        let handle = device.create_physical(page).expect("cuMemCreate");
        assert_eq!(fake.stat("rdma_capable_physical"), rdma_capable);
        device.release_physical(handle).expect("release");
    });
}

/// Physical pages are GPUDirect RDMA capable where the device supports that with VMM, as
/// PyTorch makes them (NCCL's zero-copy across nodes needs it).
#[test]
fn physical_pages_are_rdma_capable_where_the_device_supports_it() {
    physical_page_under(
        "physical_pages_are_rdma_capable_where_the_device_supports_it",
        &[],
        1,
    );
}

/// ... and plain where it does not: the fake refuses the flag there, as the attribute says.
#[test]
fn physical_pages_are_plain_where_the_device_lacks_rdma_with_vmm() {
    physical_page_under(
        "physical_pages_are_plain_where_the_device_lacks_rdma_with_vmm",
        &[("FAKE_LIBCUDA_RDMA_WITH_VMM", "0")],
        0,
    );
}

/// Where the device has POSIX file descriptor handles, physical memory is created exportable
/// as one (as PyTorch creates it, for CUDA IPC); where it lacks them, none is asked for, so
/// that such a device works too (its memory cannot be shared).
#[test]
fn physical_pages_need_no_shareable_handle_type() {
    physical_page_under(
        "physical_pages_need_no_shareable_handle_type",
        &[("FAKE_LIBCUDA_POSIX_FD_HANDLES", "0")],
        1,
    );
}

/// A page exported for CUDA IPC: one descriptor, made once, another process's for the taking
/// until the page's release closes it.
#[test]
fn an_exported_page_keeps_one_descriptor_until_its_release() {
    in_own_process(
        "an_exported_page_keeps_one_descriptor_until_its_release",
        &[],
        || {
            let fake = FakeCuda::open();
            let mut device = open_device();
            let page = device.page_granularity().expect("granularity");
            let handle = device.create_physical(page).expect("cuMemCreate");
            let fd = device.export_physical(handle).expect("export");
            assert_eq!(device.export_physical(handle), Ok(fd), "made once");
            assert_eq!(fake.stat("cuMemExportToShareableHandle"), 1);
            let is_open = |fd| {
                // SAFETY: fcntl with F_GETFD only asks whether the descriptor is open.
                unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
            };
            assert!(is_open(fd), "open while shared");
            device.release_physical(handle).expect("release");
            assert!(!is_open(fd), "closed at release");
        },
    );
}

/// Without POSIX file descriptor handles, a page cannot be exported: the driver says why.
#[test]
fn a_page_of_a_device_without_descriptor_handles_is_not_exported() {
    in_own_process(
        "a_page_of_a_device_without_descriptor_handles_is_not_exported",
        &[("FAKE_LIBCUDA_POSIX_FD_HANDLES", "0")],
        || {
            let mut device = open_device();
            let page = device.page_granularity().expect("granularity");
            let handle = device.create_physical(page).expect("cuMemCreate");
            let refused = device.export_physical(handle).expect_err("refused");
            assert!(
                refused.to_string().contains("cuMemExportToShareableHandle"),
                "{refused}"
            );
            device.release_physical(handle).expect("release");
        },
    );
}

/// A device without virtual memory management: the calls behind expandable segments are
/// refused, and `page_granularity` says why without asking the driver.
#[test]
fn a_device_without_virtual_memory_says_so() {
    let env = [("FAKE_LIBCUDA_VMM", "0")];
    in_own_process("a_device_without_virtual_memory_says_so", &env, || {
        let fake = FakeCuda::open();
        let mut device = open_device();
        assert!(!device.supports_virtual_memory());
        match device.page_granularity() {
            Err(DeviceError::Unavailable(message)) => {
                assert!(
                    message.contains("does not support virtual memory"),
                    "{message}"
                );
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        assert_eq!(fake.stat("cuMemGetAllocationGranularity"), 0);
        assert!(matches!(
            device.reserve_address_range(2 * MIB),
            Err(DeviceError::Driver { code: 801, .. })
        ));
    });
}

/// A CUDA toolkit's `stubs/libcuda.so` ahead of the driver on the library path: ferrocache
/// opens `libcuda.so.1`, the driver, and never the stub (cudarc's loader took `libcuda.so`
/// first, and every call then failed with CUDA_ERROR_STUB_LIBRARY).
#[test]
fn a_stub_ahead_on_the_library_path_is_passed_over() {
    let dirs = [stub_libcuda_dir(), support::fake_libcuda_dir()];
    in_own_process_with_library_path(
        "a_stub_ahead_on_the_library_path_is_passed_over",
        &dirs,
        &[],
        || {
            let mut device = open_device();
            let ptr = device.malloc(MIB, 0).expect("malloc");
            device.free(ptr).expect("free");
            let fake = FakeCuda::open();
            assert_eq!(fake.stat("cuMemAlloc_v2"), 1, "the fake served it");
        },
    );
}

/// The driver PyTorch loaded is the one ferrocache uses, even when the library path would
/// yield only a stub.
#[test]
fn the_driver_already_loaded_is_used() {
    let dirs = [stub_libcuda_dir()];
    in_own_process_with_library_path("the_driver_already_loaded_is_used", &dirs, &[], || {
        let fake_path = support::fake_libcuda_dir().join("libcuda.so.1");
        // SAFETY: the fake has no initialisers; loaded as PyTorch's runtime would load it.
        let fake = unsafe { libloading::Library::new(&fake_path) }.expect("load the fake");
        let mut device = open_device();
        let ptr = device.malloc(MIB, 0).expect("malloc");
        device.free(ptr).expect("free");
        // SAFETY: the fake's `fake_cuda_stat(const char*)`.
        let stat = unsafe {
            fake.get::<unsafe extern "C" fn(*const std::ffi::c_char) -> i64>(b"fake_cuda_stat")
        }
        .expect("fake_cuda_stat");
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { stat(c"cuMemAlloc_v2".as_ptr()) }, 1);
    });
}

/// Only a stub to be found: one message that says what it is and what to do, each time.
#[test]
fn a_stub_alone_is_refused_with_one_clear_message() {
    let dirs = [stub_libcuda_dir()];
    in_own_process_with_library_path(
        "a_stub_alone_is_refused_with_one_clear_message",
        &dirs,
        &[],
        || {
            for _ in 0..2 {
                match CudaDevice::new(0) {
                    Err(DeviceError::Unavailable(message)) => {
                        assert!(message.contains("libcuda.so is a stub"), "{message}");
                        assert!(message.contains("CUDA_ERROR_STUB_LIBRARY"), "{message}");
                        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                    }
                    other => panic!("expected Unavailable, got {other:?}"),
                }
            }
        },
    );
}

/// Two different driver libraries loaded in the process: ferrocache cannot know which one
/// PyTorch uses, and says so, naming both.
#[test]
fn two_drivers_loaded_are_refused_with_one_clear_message() {
    let dirs = [support::fake_libcuda_dir()];
    in_own_process_with_library_path(
        "two_drivers_loaded_are_refused_with_one_clear_message",
        &dirs,
        &[],
        || {
            let stub_path = stub_libcuda_dir().join("libcuda.so");
            // SAFETY: both have no initialisers.
            let _fake = unsafe { libloading::Library::new("libcuda.so.1") }.expect("the fake");
            // SAFETY: as above.
            let _stub = unsafe { libloading::Library::new(&stub_path) }.expect("the stub");
            match CudaDevice::new(0) {
                Err(DeviceError::Unavailable(message)) => {
                    assert!(
                        message.contains("two different CUDA driver libraries are loaded"),
                        "{message}"
                    );
                    assert!(
                        message.contains(&stub_path.display().to_string()),
                        "{message}"
                    );
                    assert!(message.contains("libcuda.so.1"), "{message}");
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        },
    );
}
