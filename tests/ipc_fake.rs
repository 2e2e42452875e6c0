//! CUDA IPC between processes on the fake driver (tests/fake-cuda/README.md, "CUDA IPC"): memory
//! exported with `cuIpcGetMemHandle` and opened in another process is the same memory, events
//! exported with `cuIpcGetEventHandle` share their completion state, physical memory exported
//! as a file descriptor maps the same pages, and what the driver refuses, the fake refuses.
//!
//! Each scenario runs in a process of its own (the exporter), which starts the importer: this
//! test binary again, filtered to the same test, with `IPC_ROLE` saying what to do. The importer
//! says where it is on stdout (`IPC: ...` lines) and waits for a line on stdin where the
//! exporter must act in between.

mod support;

use std::ffi::{c_int, c_uint, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use support::{FakeCuda, in_own_process, is_child_for, new_stream};

const CUDA_SUCCESS: u32 = 0;
const CUDA_ERROR_INVALID_VALUE: u32 = 1;
const CUDA_ERROR_INVALID_CONTEXT: u32 = 201;
const CUDA_ERROR_INVALID_HANDLE: u32 = 400;
const CUDA_ERROR_NOT_READY: u32 = 600;
const CUDA_ERROR_ILLEGAL_ADDRESS: u32 = 700;
const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const EVENT_DISABLE_TIMING: c_uint = 0x2;
const EVENT_INTERPROCESS: c_uint = 0x4;
const HANDLE_TYPE_NONE: u32 = 0;
const HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: u32 = 1;
const HANDLE_TYPE_FABRIC: u32 = 8;
const GRANULARITY: usize = 2 << 20;
const ROLE: &str = "IPC_ROLE";
const HANDLE: &str = "IPC_HANDLE";

/// `CUipcMemHandle` / `CUipcEventHandle`.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct IpcHandle([u8; 64]);

impl IpcHandle {
    fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn from_hex(text: &str) -> IpcHandle {
        let mut bytes = [0u8; 64];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("a hex handle");
        }
        IpcHandle(bytes)
    }
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AllocationProp {
    kind: u32,
    requested_handle_types: u32,
    location_kind: u32,
    location_id: c_int,
    win32_metadata: *mut c_void,
    compression: u8,
    rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

impl AllocationProp {
    fn on_device_0(handle_types: u32) -> AllocationProp {
        AllocationProp {
            kind: 1,
            requested_handle_types: handle_types,
            location_kind: 1,
            location_id: 0,
            win32_metadata: std::ptr::null_mut(),
            compression: 0,
            rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
struct AccessDesc {
    location_kind: u32,
    location_id: c_int,
    flags: u32,
}

/// The driver calls these tests make, on the fake the process loaded.
struct Driver {
    fake: FakeCuda,
}

impl Driver {
    /// The fake, with device 0's primary context current.
    fn open() -> Driver {
        let fake = FakeCuda::open();
        fake.make_current(0);
        Driver { fake }
    }

    fn alloc(&self, size: usize) -> u64 {
        let alloc: unsafe extern "C" fn(*mut u64, usize) -> u32 =
            self.fake.function("cuMemAlloc_v2");
        let mut ptr = 0;
        // SAFETY: a live out pointer.
        assert_eq!(unsafe { alloc(&mut ptr, size) }, CUDA_SUCCESS);
        ptr
    }

    fn free(&self, ptr: u64) -> u32 {
        let free: unsafe extern "C" fn(u64) -> u32 = self.fake.function("cuMemFree_v2");
        // SAFETY: the fake checks the pointer.
        unsafe { free(ptr) }
    }

    /// Writes `bytes` at device address `ptr` (a synchronous copy); the driver's code.
    fn write(&self, ptr: u64, bytes: &[u8]) -> u32 {
        let copy: unsafe extern "C" fn(u64, *const c_void, usize) -> u32 =
            self.fake.function("cuMemcpyHtoD_v2");
        // SAFETY: a live host buffer of that length; the fake checks the device side.
        unsafe { copy(ptr, bytes.as_ptr().cast(), bytes.len()) }
    }

    /// `len` bytes read from device address `ptr`, or the driver's code.
    fn read(&self, ptr: u64, len: usize) -> Result<Vec<u8>, u32> {
        let copy: unsafe extern "C" fn(*mut c_void, u64, usize) -> u32 =
            self.fake.function("cuMemcpyDtoH_v2");
        let mut bytes = vec![0u8; len];
        // SAFETY: a live host buffer of that length; the fake checks the device side.
        match unsafe { copy(bytes.as_mut_ptr().cast(), ptr, len) } {
            CUDA_SUCCESS => Ok(bytes),
            code => Err(code),
        }
    }

    fn mem_handle(&self, ptr: u64) -> Result<IpcHandle, u32> {
        let get: unsafe extern "C" fn(*mut IpcHandle, u64) -> u32 =
            self.fake.function("cuIpcGetMemHandle");
        let mut handle = IpcHandle([0; 64]);
        // SAFETY: a live out pointer.
        match unsafe { get(&mut handle, ptr) } {
            CUDA_SUCCESS => Ok(handle),
            code => Err(code),
        }
    }

    fn open_mem(&self, handle: IpcHandle, flags: c_uint) -> Result<u64, u32> {
        let open: unsafe extern "C" fn(*mut u64, IpcHandle, c_uint) -> u32 =
            self.fake.function("cuIpcOpenMemHandle_v2");
        let mut ptr = 0;
        // SAFETY: a live out pointer; the handle by value, as the driver takes it.
        match unsafe { open(&mut ptr, handle, flags) } {
            CUDA_SUCCESS => Ok(ptr),
            code => Err(code),
        }
    }

    fn close_mem(&self, ptr: u64) -> u32 {
        let close: unsafe extern "C" fn(u64) -> u32 = self.fake.function("cuIpcCloseMemHandle");
        // SAFETY: the fake checks the pointer.
        unsafe { close(ptr) }
    }

    fn create_event(&self, flags: c_uint) -> Result<u64, u32> {
        let create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> u32 =
            self.fake.function("cuEventCreate");
        let mut event = std::ptr::null_mut();
        // SAFETY: a live out pointer.
        match unsafe { create(&mut event, flags) } {
            CUDA_SUCCESS => Ok(event as u64),
            code => Err(code),
        }
    }

    fn record(&self, event: u64, stream: u64) -> u32 {
        let record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> u32 =
            self.fake.function("cuEventRecord");
        // SAFETY: plain handles; the fake checks them.
        unsafe {
            record(
                event as usize as *mut c_void,
                stream as usize as *mut c_void,
            )
        }
    }

    /// A driver function that takes one handle (`cuEventQuery`, ...); its code.
    fn call(&self, name: &str, handle: u64) -> u32 {
        self.fake.call_with_handle(name, handle) as u32
    }

    fn event_handle(&self, event: u64) -> Result<IpcHandle, u32> {
        let get: unsafe extern "C" fn(*mut IpcHandle, *mut c_void) -> u32 =
            self.fake.function("cuIpcGetEventHandle");
        let mut handle = IpcHandle([0; 64]);
        // SAFETY: a live out pointer; the fake checks the event.
        match unsafe { get(&mut handle, event as usize as *mut c_void) } {
            CUDA_SUCCESS => Ok(handle),
            code => Err(code),
        }
    }

    fn open_event(&self, handle: IpcHandle) -> Result<u64, u32> {
        let open: unsafe extern "C" fn(*mut *mut c_void, IpcHandle) -> u32 =
            self.fake.function("cuIpcOpenEventHandle");
        let mut event = std::ptr::null_mut();
        // SAFETY: a live out pointer; the handle by value.
        match unsafe { open(&mut event, handle) } {
            CUDA_SUCCESS => Ok(event as u64),
            code => Err(code),
        }
    }

    fn wait_event(&self, stream: u64, event: u64) -> u32 {
        let wait: unsafe extern "C" fn(*mut c_void, *mut c_void, c_uint) -> u32 =
            self.fake.function("cuStreamWaitEvent");
        // SAFETY: plain handles; the fake checks them.
        unsafe {
            wait(
                stream as usize as *mut c_void,
                event as usize as *mut c_void,
                0,
            )
        }
    }

    fn create_physical(&self, size: usize, handle_types: u32) -> Result<u64, u32> {
        let create: unsafe extern "C" fn(*mut u64, usize, *const AllocationProp, u64) -> u32 =
            self.fake.function("cuMemCreate");
        let prop = AllocationProp::on_device_0(handle_types);
        let mut handle = 0;
        // SAFETY: live pointers.
        match unsafe { create(&mut handle, size, &prop, 0) } {
            CUDA_SUCCESS => Ok(handle),
            code => Err(code),
        }
    }

    fn release(&self, handle: u64) -> u32 {
        let release: unsafe extern "C" fn(u64) -> u32 = self.fake.function("cuMemRelease");
        // SAFETY: the fake checks the handle.
        unsafe { release(handle) }
    }

    /// Reserves `size` bytes, maps `handle` there and grants device 0 access: the address.
    fn map(&self, handle: u64, size: usize) -> u64 {
        let reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> u32 =
            self.fake.function("cuMemAddressReserve");
        let map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> u32 =
            self.fake.function("cuMemMap");
        let set_access: unsafe extern "C" fn(u64, usize, *const AccessDesc, usize) -> u32 =
            self.fake.function("cuMemSetAccess");
        let mut ptr = 0;
        let access = AccessDesc {
            location_kind: 1,
            location_id: 0,
            flags: 3,
        };
        // SAFETY: live pointers; the fake checks the rest.
        unsafe {
            assert_eq!(reserve(&mut ptr, size, 0, 0, 0), CUDA_SUCCESS);
            assert_eq!(map(ptr, size, 0, handle, 0), CUDA_SUCCESS);
            assert_eq!(set_access(ptr, size, &access, 1), CUDA_SUCCESS);
        }
        ptr
    }

    fn unmap(&self, ptr: u64, size: usize) {
        let unmap: unsafe extern "C" fn(u64, usize) -> u32 = self.fake.function("cuMemUnmap");
        let free: unsafe extern "C" fn(u64, usize) -> u32 = self.fake.function("cuMemAddressFree");
        // SAFETY: a range this test mapped.
        unsafe {
            assert_eq!(unmap(ptr, size), CUDA_SUCCESS);
            assert_eq!(free(ptr, size), CUDA_SUCCESS);
        }
    }

    fn export_fd(&self, handle: u64, handle_type: u32) -> Result<c_int, u32> {
        let export: unsafe extern "C" fn(*mut c_void, u64, u32, u64) -> u32 =
            self.fake.function("cuMemExportToShareableHandle");
        let mut fd: c_int = -1;
        // SAFETY: room for an int, what the POSIX fd type writes.
        match unsafe { export((&raw mut fd).cast(), handle, handle_type, 0) } {
            CUDA_SUCCESS => Ok(fd),
            code => Err(code),
        }
    }

    fn import_fd(&self, fd: c_int) -> Result<u64, u32> {
        let import: unsafe extern "C" fn(*mut u64, *mut c_void, u32) -> u32 =
            self.fake.function("cuMemImportFromShareableHandle");
        let mut handle = 0;
        // SAFETY: a live out pointer; the fd travels in the pointer, as the driver takes it.
        match unsafe {
            import(
                &mut handle,
                fd as usize as *mut c_void,
                HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        } {
            CUDA_SUCCESS => Ok(handle),
            code => Err(code),
        }
    }
}

/// The importer, started by the exporter: this test binary again, running `test` with `role`.
struct Importer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Importer {
    fn start(test: &str, role: &str, env: &[(&str, String)]) -> Importer {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("FERROCACHE_TEST_CHILD", test)
            .env(ROLE, role)
            .envs(env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the importer");
        let stdin = child.stdin.take().expect("its stdin");
        let stdout = BufReader::new(child.stdout.take().expect("its stdout"));
        Importer {
            child,
            stdin,
            stdout,
        }
    }

    /// Waits until the importer says `what` (an `IPC: what` line).
    fn expect(&mut self, what: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            let read = self.stdout.read_line(&mut line).expect("read the importer");
            assert!(read > 0, "the importer ended before saying {what:?}");
            // The first follows libtest's "test NAME ... " on the same line.
            if line.trim_end().ends_with(&format!("IPC: {what}")) {
                return;
            }
        }
    }

    /// Lets the importer go on.
    fn resume(&mut self) {
        writeln!(self.stdin, "go").expect("write to the importer");
    }

    /// Waits for the importer to end; it must pass.
    fn finish(mut self) {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.stdout, &mut rest);
        let status = self.child.wait().expect("wait for the importer");
        assert!(
            status.success() && rest.contains("1 passed"),
            "the importer failed ({status}):\n{rest}"
        );
    }
}

/// In the importer: says where it is, then waits for the exporter.
fn say_and_wait(what: &str) {
    println!("IPC: {what}");
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("wait for the exporter");
}

fn role() -> String {
    std::env::var(ROLE).unwrap_or_default()
}

fn handle_from_env() -> IpcHandle {
    IpcHandle::from_hex(&std::env::var(HANDLE).expect("the handle"))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn a_byte_written_in_one_process_is_read_in_the_other_and_back() {
    const TEST: &str = "a_byte_written_in_one_process_is_read_in_the_other_and_back";
    // A small allocation that does not start on a page, and one of several granules.
    const SIZES: [usize; 2] = [1536, 3 * GRANULARITY];
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        if role() == "importer" {
            for (i, handle) in std::env::var(HANDLE)
                .expect("the handles")
                .split(',')
                .enumerate()
            {
                let size = SIZES[i];
                let ptr = driver
                    .open_mem(IpcHandle::from_hex(handle), LAZY_ENABLE_PEER_ACCESS)
                    .expect("open the exporter's memory");
                assert_eq!(driver.read(ptr, size), Ok(pattern(size, 1)));
                assert_eq!(driver.write(ptr + 512, &pattern(512, 2)), CUDA_SUCCESS);
                assert_eq!(driver.fake.stat("ipc_opened"), i as i64 + 1);
            }
            say_and_wait("written");
            // The exporter wrote again since: the same memory, not a copy made at the open.
            for (i, handle) in std::env::var(HANDLE)
                .expect("the handles")
                .split(',')
                .enumerate()
            {
                let ptr = driver
                    .open_mem(IpcHandle::from_hex(handle), LAZY_ENABLE_PEER_ACCESS)
                    .expect("the same handle again");
                assert_eq!(driver.read(ptr, 64), Ok(pattern(64, 3)));
                assert_eq!(driver.close_mem(ptr), CUDA_SUCCESS);
                assert_eq!(
                    driver.close_mem(ptr),
                    CUDA_SUCCESS,
                    "opened twice, closed twice"
                );
                assert_eq!(driver.fake.stat("ipc_opened"), 1 - i as i64);
            }
            return;
        }
        let _before = driver.alloc(512);
        let ptrs: Vec<u64> = SIZES.iter().map(|&size| driver.alloc(size)).collect();
        let mut handles = Vec::new();
        for (&ptr, &size) in ptrs.iter().zip(&SIZES) {
            assert_eq!(driver.write(ptr, &pattern(size, 1)), CUDA_SUCCESS);
            handles.push(driver.mem_handle(ptr).expect("export").to_hex());
        }
        let mut importer = Importer::start(TEST, "importer", &[(HANDLE, handles.join(","))]);
        importer.expect("written");
        for (&ptr, &size) in ptrs.iter().zip(&SIZES) {
            let bytes = driver.read(ptr, size).expect("read back");
            assert_eq!(bytes[512..1024], pattern(512, 2), "the importer's bytes");
            assert_eq!(bytes[..512], pattern(size, 1)[..512], "untouched bytes");
            assert_eq!(driver.write(ptr, &pattern(64, 3)), CUDA_SUCCESS);
        }
        importer.resume();
        importer.finish();
        assert_eq!(driver.fake.stat("ipc_exports"), 2);
        for ptr in ptrs {
            assert_eq!(driver.free(ptr), CUDA_SUCCESS);
        }
        assert_eq!(driver.fake.stat("ipc_exports"), 0);
        assert_eq!(driver.fake.stat("ipc_freed_while_open"), 0);
    });
}

#[test]
fn a_memory_handle_is_taken_only_for_the_base_of_an_allocation_made_by_cu_mem_alloc() {
    const TEST: &str =
        "a_memory_handle_is_taken_only_for_the_base_of_an_allocation_made_by_cu_mem_alloc";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        let ptr = driver.alloc(4096);
        let first = driver.mem_handle(ptr).expect("the base of an allocation");
        assert_eq!(
            driver.mem_handle(ptr),
            Ok(first),
            "\"may be called multiple times on an allocation without adverse effects\""
        );
        assert_eq!(driver.mem_handle(ptr + 512), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(driver.mem_handle(0x1234), Err(CUDA_ERROR_INVALID_VALUE));
        let physical = driver
            .create_physical(GRANULARITY, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            .expect("cuMemCreate");
        let mapped = driver.map(physical, GRANULARITY);
        assert_eq!(
            driver.mem_handle(mapped),
            Err(CUDA_ERROR_INVALID_VALUE),
            "VMM memory is shared with cuMemExportToShareableHandle"
        );
        driver.unmap(mapped, GRANULARITY);
        assert_eq!(driver.release(physical), CUDA_SUCCESS);
        // "If a region of memory is freed with cuMemFree and a subsequent call to cuMemAlloc
        // returns memory with the same device address, cuIpcGetMemHandle will return a unique
        // handle for the new memory."
        assert_eq!(driver.free(ptr), CUDA_SUCCESS);
        assert_eq!(driver.alloc(4096), ptr, "the same address again");
        assert_ne!(driver.mem_handle(ptr), Ok(first));
    });
}

#[test]
fn a_handle_is_refused_in_the_process_that_made_it_and_with_other_flags() {
    const TEST: &str = "a_handle_is_refused_in_the_process_that_made_it_and_with_other_flags";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        let ptr = driver.alloc(4096);
        let handle = driver.mem_handle(ptr).expect("export");
        assert_eq!(
            driver.open_mem(handle, LAZY_ENABLE_PEER_ACCESS),
            Err(CUDA_ERROR_INVALID_CONTEXT)
        );
        assert_eq!(driver.open_mem(handle, 0), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            driver.open_mem(IpcHandle([7; 64]), LAZY_ENABLE_PEER_ACCESS),
            Err(CUDA_ERROR_INVALID_HANDLE),
            "not a handle"
        );
        assert_eq!(
            driver.close_mem(ptr),
            CUDA_ERROR_INVALID_VALUE,
            "not opened"
        );
        let event = driver
            .create_event(EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
            .expect("an interprocess event");
        let event_handle = driver.event_handle(event).expect("export the event");
        assert_eq!(
            driver.open_event(event_handle),
            Err(CUDA_ERROR_INVALID_CONTEXT)
        );
        assert_eq!(
            driver.create_event(EVENT_INTERPROCESS),
            Err(CUDA_ERROR_INVALID_VALUE),
            "\"CU_EVENT_INTERPROCESS must be specified along with CU_EVENT_DISABLE_TIMING\""
        );
        let plain = driver
            .create_event(EVENT_DISABLE_TIMING)
            .expect("a plain event");
        assert_eq!(driver.event_handle(plain), Err(CUDA_ERROR_INVALID_HANDLE));
    });
}

#[test]
fn a_handle_of_freed_memory_is_stale_and_memory_freed_while_open_is_an_illegal_address() {
    const TEST: &str =
        "a_handle_of_freed_memory_is_stale_and_memory_freed_while_open_is_an_illegal_address";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        match role().as_str() {
            "stale" => {
                assert_eq!(
                    driver.open_mem(handle_from_env(), LAZY_ENABLE_PEER_ACCESS),
                    Err(CUDA_ERROR_INVALID_HANDLE)
                );
                return;
            }
            "open" => {
                let ptr = driver
                    .open_mem(handle_from_env(), LAZY_ENABLE_PEER_ACCESS)
                    .expect("open");
                assert_eq!(driver.read(ptr, 16).map(|b| b.len()), Ok(16));
                say_and_wait("opened");
                // The exporter freed it meanwhile: undefined behaviour, made an illegal address.
                assert_eq!(driver.read(ptr, 16), Err(CUDA_ERROR_ILLEGAL_ADDRESS));
                return;
            }
            _ => {}
        }
        let stale = driver.alloc(1 << 20);
        let handle = driver.mem_handle(stale).expect("export");
        assert_eq!(driver.free(stale), CUDA_SUCCESS);
        Importer::start(TEST, "stale", &[(HANDLE, handle.to_hex())]).finish();

        let ptr = driver.alloc(1 << 20);
        let handle = driver.mem_handle(ptr).expect("export");
        let mut importer = Importer::start(TEST, "open", &[(HANDLE, handle.to_hex())]);
        importer.expect("opened");
        assert_eq!(
            driver.free(ptr),
            CUDA_SUCCESS,
            "the driver does not refuse it"
        );
        assert_eq!(driver.fake.stat("ipc_freed_while_open"), 1);
        importer.resume();
        importer.finish();
    });
}

#[test]
fn an_event_shares_its_completion_state_with_the_process_that_opened_it() {
    const TEST: &str = "an_event_shares_its_completion_state_with_the_process_that_opened_it";
    // Each record answers "not ready" to its first two queries, whoever asks.
    let env = [("FAKE_LIBCUDA_EVENT_DELAY", "2")];
    in_own_process(TEST, &env, || {
        let driver = Driver::open();
        let stream = new_stream();
        if role() == "importer" {
            let event = driver
                .open_event(handle_from_env())
                .expect("open the event");
            assert_eq!(driver.call("cuEventQuery", event), CUDA_ERROR_NOT_READY);
            say_and_wait("queried once");
            assert_eq!(
                driver.call("cuEventQuery", event),
                CUDA_SUCCESS,
                "the exporter's query was the second"
            );
            assert_eq!(driver.wait_event(stream, event), CUDA_SUCCESS);
            assert_eq!(
                driver.record(event, stream),
                CUDA_SUCCESS,
                "either side records"
            );
            say_and_wait("recorded");
            assert_eq!(
                driver.call("cuEventQuery", event),
                CUDA_SUCCESS,
                "the exporter synchronized it"
            );
            assert_eq!(driver.call("cuEventDestroy_v2", event), CUDA_SUCCESS);
            say_and_wait("destroyed mine");
            let stale = driver.open_event(handle_from_env());
            assert_eq!(stale, Err(CUDA_ERROR_INVALID_HANDLE), "destroyed there");
            return;
        }
        let event = driver
            .create_event(EVENT_INTERPROCESS | EVENT_DISABLE_TIMING | 1)
            .expect("as PyTorch makes them, blocking sync too");
        assert_eq!(driver.record(event, stream), CUDA_SUCCESS);
        let handle = driver.event_handle(event).expect("export");
        assert_eq!(
            driver.event_handle(event),
            Ok(handle),
            "the same handle again"
        );
        let mut importer = Importer::start(TEST, "importer", &[(HANDLE, handle.to_hex())]);
        importer.expect("queried once");
        assert_eq!(driver.call("cuEventQuery", event), CUDA_ERROR_NOT_READY);
        importer.resume();
        importer.expect("recorded");
        assert_eq!(
            driver.call("cuEventQuery", event),
            CUDA_ERROR_NOT_READY,
            "recorded there"
        );
        assert_eq!(driver.call("cuEventSynchronize", event), CUDA_SUCCESS);
        importer.resume();
        importer.expect("destroyed mine");
        assert_eq!(
            driver.call("cuEventQuery", event),
            CUDA_SUCCESS,
            "destroying an opened event leaves the exporter's"
        );
        assert_eq!(driver.call("cuEventDestroy_v2", event), CUDA_SUCCESS);
        importer.resume();
        importer.finish();
    });
}

#[test]
fn physical_memory_exported_as_a_file_descriptor_is_the_same_memory_in_the_importer() {
    const TEST: &str =
        "physical_memory_exported_as_a_file_descriptor_is_the_same_memory_in_the_importer";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        if role() == "importer" {
            // As PyTorch's expandable segments fetch it: pidfd_open, then pidfd_getfd.
            let pid: c_int = std::env::var("IPC_PID").expect("pid").parse().expect("pid");
            let fd: c_int = std::env::var("IPC_FD").expect("fd").parse().expect("fd");
            // SAFETY: plain syscalls; the fds they return are ours.
            let mine = unsafe {
                let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0) as c_int;
                assert!(pidfd >= 0, "pidfd_open");
                let mine = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as c_int;
                libc::close(pidfd);
                mine
            };
            assert!(mine >= 0, "pidfd_getfd");
            let handle = driver.import_fd(mine).expect("import");
            // SAFETY: our fd; the driver keeps its own.
            unsafe { libc::close(mine) };
            assert_eq!(driver.fake.stat("bytes_in_use"), 0, "the exporter's memory");
            let ptr = driver.map(handle, GRANULARITY);
            assert_eq!(driver.read(ptr, 4096), Ok(pattern(4096, 5)));
            assert_eq!(driver.write(ptr + 100, &pattern(100, 6)), CUDA_SUCCESS);
            driver.unmap(ptr, GRANULARITY);
            assert_eq!(driver.release(handle), CUDA_SUCCESS);
            return;
        }
        let handle = driver
            .create_physical(GRANULARITY, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            .expect("cuMemCreate");
        let ptr = driver.map(handle, GRANULARITY);
        assert_eq!(driver.write(ptr, &pattern(4096, 5)), CUDA_SUCCESS);
        assert_eq!(
            driver.export_fd(handle, HANDLE_TYPE_FABRIC),
            Err(CUDA_ERROR_NOT_SUPPORTED)
        );
        let fd = driver
            .export_fd(handle, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            .expect("export");
        let env = [
            ("IPC_PID", std::process::id().to_string()),
            ("IPC_FD", fd.to_string()),
        ];
        Importer::start(TEST, "importer", &env).finish();
        assert_eq!(driver.read(ptr + 100, 100), Ok(pattern(100, 6)));
        // SAFETY: the exported fd is ours to close.
        unsafe { libc::close(fd) };
        driver.unmap(ptr, GRANULARITY);
        assert_eq!(driver.release(handle), CUDA_SUCCESS);
    });
}

#[test]
fn physical_memory_is_exported_only_as_a_handle_type_it_was_created_with() {
    const TEST: &str = "physical_memory_is_exported_only_as_a_handle_type_it_was_created_with";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        let plain = driver
            .create_physical(GRANULARITY, HANDLE_TYPE_NONE)
            .expect("cuMemCreate without a handle type");
        assert_eq!(
            driver.export_fd(plain, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        let get_prop: unsafe extern "C" fn(*mut AllocationProp, u64) -> u32 = driver
            .fake
            .function("cuMemGetAllocationPropertiesFromHandle");
        let mut prop = AllocationProp::on_device_0(99);
        // SAFETY: a live out pointer.
        assert_eq!(unsafe { get_prop(&mut prop, plain) }, CUDA_SUCCESS);
        assert_eq!(prop.requested_handle_types, HANDLE_TYPE_NONE);
        // An fd that is not one of the driver's handles.
        // SAFETY: plain syscalls on a fresh pipe we own.
        let pipe = unsafe {
            let mut fds = [0; 2];
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            libc::close(fds[1]);
            fds[0]
        };
        assert_eq!(driver.import_fd(pipe), Err(CUDA_ERROR_INVALID_VALUE));
        // SAFETY: our pipe, closed once.
        unsafe { libc::close(pipe) };
        // A retained handle needs one more release before it goes.
        let ptr = driver.map(plain, GRANULARITY);
        let retain: unsafe extern "C" fn(*mut u64, *mut c_void) -> u32 =
            driver.fake.function("cuMemRetainAllocationHandle");
        let mut retained = 0;
        // SAFETY: a live out pointer; an address inside the mapping.
        let result = unsafe { retain(&mut retained, (ptr + 4096) as usize as *mut c_void) };
        assert_eq!(result, CUDA_SUCCESS);
        assert_eq!(retained, plain);
        driver.unmap(ptr, GRANULARITY);
        assert_eq!(driver.release(plain), CUDA_SUCCESS);
        assert_eq!(driver.fake.stat("live_physical"), 1, "retained once more");
        assert_eq!(driver.release(plain), CUDA_SUCCESS);
        assert_eq!(driver.fake.stat("live_physical"), 0);
        assert_eq!(driver.release(plain), CUDA_ERROR_INVALID_VALUE);
    });
}

#[test]
fn a_child_forked_after_the_driver_started_has_device_memory_of_its_own() {
    const TEST: &str = "a_child_forked_after_the_driver_started_has_device_memory_of_its_own";
    in_own_process(TEST, &[], || {
        let driver = Driver::open();
        let ptr = driver.alloc(1 << 20);
        assert_eq!(driver.write(ptr, &pattern(4096, 1)), CUDA_SUCCESS);
        // SAFETY: the child only makes driver calls and leaves with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let fine = driver.read(ptr, 4096) == Ok(pattern(4096, 1))
                && driver.write(ptr, &pattern(4096, 9)) == CUDA_SUCCESS
                && driver.read(ptr, 4096) == Ok(pattern(4096, 9))
                && driver.free(ptr) == CUDA_SUCCESS;
            // SAFETY: leaves the child at once.
            unsafe { libc::_exit(if fine { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child saw its copy"
        );
        assert_eq!(
            driver.read(ptr, 4096),
            Ok(pattern(4096, 1)),
            "the child's writes and free stay in the child"
        );
        assert!(is_child_for(TEST));
    });
}
