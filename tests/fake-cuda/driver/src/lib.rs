//! A fake CUDA driver on host memory: see README.md for what it models and why.
//!
//! Every exported driver function goes through [`call`], which takes the one global lock, counts
//! the call, applies an injected failure if a test asked for one, and turns a panic into
//! `CUDA_ERROR_UNKNOWN` (nothing may unwind into the caller). What is per thread in the real
//! driver (the context stack, the stream-capture mode) is thread-local here too.
//!
//! Handles are plain numbers: contexts, streams and events are never dereferenced by callers.

#![allow(
    non_snake_case,
    reason = "the exports carry the CUDA driver's symbol names"
)]
#![allow(
    clippy::missing_safety_doc,
    reason = "every export has the contract of the CUDA driver function of the same name"
)]

mod address_space;
mod call_log;
mod cubin;
mod device;
mod faults;
mod launch;
mod memory;
mod nvml;
mod peer;
mod shared_devices;
mod stubs;
mod sync;
mod vmm;
mod work;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{LazyLock, Mutex, MutexGuard};

/// `CUresult`.
pub type CuResult = u32;
pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub const CUDA_ERROR_STUB_LIBRARY: CuResult = 34;
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
pub const CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: CuResult = 217;
pub const CUDA_ERROR_INVALID_HANDLE: CuResult = 400;
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
pub const CUDA_ERROR_ILLEGAL_STATE: CuResult = 401;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CuResult = 700;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CuResult = 704;
pub const CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: CuResult = 705;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CuResult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: CuResult = 904;
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CuResult = 906;
pub const CUDA_ERROR_CAPTURED_EVENT: CuResult = 907;
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// Name and description of each code the fake returns, as the real driver spells them.
const ERROR_TEXTS: &[(CuResult, &CStr, &CStr)] = &[
    (CUDA_SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        c"CUDA_ERROR_OUT_OF_MEMORY",
        c"out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        CUDA_ERROR_STUB_LIBRARY,
        c"CUDA_ERROR_STUB_LIBRARY",
        c"CUDA driver is a stub library",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        c"peer access is not supported between these two devices",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        CUDA_ERROR_NOT_READY,
        c"CUDA_ERROR_NOT_READY",
        c"device not ready",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        c"peer access is already enabled",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        c"CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        c"peer access has not been enabled",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
        c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        c"capture was not joined to the origin stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        c"CUDA_ERROR_CAPTURED_EVENT",
        c"operation not permitted on an event last recorded in a capturing stream",
    ),
    (CUDA_ERROR_UNKNOWN, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// Physical pages, address reservations and mappings all come in this size.
pub const GRANULARITY: u64 = 2 << 20;

/// What a driver function body returns: `Err` carries the failure code.
type Outcome = Result<(), CuResult>;

/// The whole state of the fake driver behind one lock.
#[derive(Default)]
pub struct Driver {
    initialized: bool,
    driver_version: i32,
    device_count: i32,
    /// Bytes of device memory per device (accounting only; host memory backs what is used).
    capacity: u64,
    /// What every device reports and allows (`FAKE_LIBCUDA_VMM`, ...; see `peer.rs`).
    features: peer::Features,
    /// Peer access enabled with `cuCtxEnablePeerAccess`: (accessing device, owning device).
    peer_links: std::collections::BTreeSet<(i32, i32)>,
    /// Per device: bytes held by `cuMemAlloc` allocations and not yet freed physical handles.
    bytes_in_use: Vec<u64>,
    /// Other processes on the GPUs (`FAKE_NVML_OTHER_PROCESSES`): NVML lists them, and their
    /// memory is not free for this one.
    other_processes: Vec<nvml::OtherProcess>,
    /// Where the processes of one machine book their device memory
    /// (`FAKE_LIBCUDA_SHARED_DEVICES`), if they share it.
    shared: Option<shared_devices::SharedDevices>,
    /// The error every later call returns, once work took an illegal address: "This leaves the
    /// process in an inconsistent state and any further CUDA work will return the same error."
    sticky_error: Option<CuResult>,
    /// `nvmlInit_v2` calls not yet undone by `nvmlShutdown`.
    nvml_starts: u32,
    /// Where device addresses come from (None if the kernel refused the address space).
    address_space: Option<address_space::AddressSpace>,
    /// Retain count of each device's primary context.
    primary_context_refs: Vec<u32>,
    allocations: BTreeMap<u64, memory::Allocation>,
    reservations: BTreeMap<u64, u64>,
    physical: HashMap<u64, vmm::Physical>,
    mappings: BTreeMap<u64, vmm::Mapping>,
    streams: HashMap<usize, sync::Stream>,
    events: HashMap<usize, sync::Event>,
    /// Captures under way, by id (`sync.rs`).
    captures: HashMap<u64, sync::Capture>,
    /// Captured graphs and their instantiations: the work each holds.
    graphs: HashMap<usize, Vec<sync::Step>>,
    graph_execs: HashMap<usize, Vec<sync::Step>>,
    /// Modules, functions and what is known of kernels' parameters (`launch.rs`).
    kernels: launch::Kernels,
    /// How many queries a newly recorded event answers with `CUDA_ERROR_NOT_READY`.
    event_delay: u32,
    timed_events: u64,
    next_handle: u64,
    calls: HashMap<&'static str, u64>,
    injected_failures: HashMap<String, CuResult>,
    sweep: faults::Sweep,
    /// Pending work on every stream, and the ordering check (`work.rs`).
    timeline: work::Timeline,
}

impl Driver {
    fn from_environment() -> Driver {
        fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(default)
        }
        let device_count = env_or("FAKE_LIBCUDA_DEVICE_COUNT", 1);
        let capacity = env_or("FAKE_LIBCUDA_TOTAL_MEM", 16 << 30);
        let hint = std::env::var("FAKE_LIBCUDA_ADDRESS_HINT")
            .ok()
            .and_then(|v| parse_number(&v))
            .unwrap_or(address_space::BASE_HINT);
        let devices = u32::try_from(device_count).unwrap_or(0);
        let address_space = address_space::AddressSpace::reserve(devices, capacity, hint);
        if address_space.is_none() {
            eprintln!("fake-cuda: could not reserve address space for device memory");
        }
        // SAFETY: registers a plain function with no arguments to run at exit.
        unsafe { libc::atexit(report_at_exit) };
        Driver {
            driver_version: env_or("FAKE_LIBCUDA_DRIVER_VERSION", 13020),
            device_count,
            capacity,
            features: peer::Features::from_environment(),
            bytes_in_use: vec![0; usize::try_from(device_count).unwrap_or(0)],
            other_processes: std::env::var("FAKE_NVML_OTHER_PROCESSES")
                .map(|list| nvml::OtherProcess::parse_list(&list))
                .unwrap_or_default(),
            shared: shared_devices::SharedDevices::from_environment(),
            address_space,
            event_delay: env_or("FAKE_LIBCUDA_EVENT_DELAY", 0),
            next_handle: 1,
            ..Driver::default()
        }
    }

    /// A fresh number for a stream, event or physical handle; never 0 (NULL).
    fn new_handle(&mut self) -> u64 {
        let handle = self.next_handle;
        self.next_handle += 1;
        // Spread the numbers out so that a handle of one kind is never mistaken for another.
        handle << 8
    }

    fn valid_device(&self, device: i32) -> Outcome {
        if (0..self.device_count).contains(&device) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_DEVICE)
        }
    }

    /// The other processes (`FAKE_NVML_OTHER_PROCESSES`) that hold memory on `device`.
    fn others_on(&self, device: i32) -> impl Iterator<Item = &nvml::OtherProcess> {
        self.other_processes
            .iter()
            .filter(move |other| other.device == device)
    }

    /// Bytes the processes of `FAKE_NVML_OTHER_PROCESSES` hold on `device`.
    fn listed_others_bytes(&self, device: i32) -> u64 {
        self.others_on(device).map(|other| other.bytes).sum()
    }

    /// The other live processes that share the machine's devices
    /// (`FAKE_LIBCUDA_SHARED_DEVICES`) and hold memory on `device`, with their bytes.
    fn sharing_processes(&self, device: i32) -> Vec<(u32, u64)> {
        self.shared
            .as_ref()
            .map(|shared| shared.others(device))
            .unwrap_or_default()
    }

    /// What `cuMemGetInfo` calls free on `device`: its capacity less what this process and the
    /// other processes hold there.
    fn free_bytes(&self, device: i32) -> u64 {
        let sharing: u64 = self
            .sharing_processes(device)
            .iter()
            .map(|&(_, bytes)| bytes)
            .sum();
        self.capacity
            .saturating_sub(self.bytes_in_use[device as usize])
            .saturating_sub(self.listed_others_bytes(device))
            .saturating_sub(sharing)
    }

    /// Claims `size` bytes of `device`'s free memory (each device has `capacity` bytes, shared
    /// with the other processes of the machine under `FAKE_LIBCUDA_SHARED_DEVICES`).
    fn charge(&mut self, device: i32, size: u64) -> Outcome {
        let ours = self.bytes_in_use[device as usize];
        let fits = match &self.shared {
            Some(shared) => shared.try_book(
                device,
                ours,
                size,
                self.listed_others_bytes(device),
                self.capacity,
            ),
            None => self.free_bytes(device) >= size,
        };
        if !fits {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        self.bytes_in_use[device as usize] += size;
        Ok(())
    }

    /// Gives back what [`Driver::charge`] claimed.
    fn uncharge(&mut self, device: i32, size: u64) {
        self.bytes_in_use[device as usize] -= size;
        if let Some(shared) = &self.shared {
            shared.book(device, self.bytes_in_use[device as usize]);
        }
    }
}

/// A number in decimal or, with `0x`, in hex.
fn parse_number(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// Writes the ordering check's counts (`FAKE_CUDA_ORDER_REPORT`) as the process exits.
extern "C" fn report_at_exit() {
    fake_cuda_write_order_report();
    // What this process holds on the shared devices goes with it (a reader would drop its
    // lines anyway once the pid is gone).
    if let Ok(driver) = DRIVER.try_lock()
        && let Some(shared) = &driver.shared
    {
        shared.leave();
    }
}

/// Writes the ordering check's counts now: for a process that ends with `_exit`, which runs no
/// exit handlers (the oracle's forked children).
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_write_order_report() {
    // A thread that still holds the lock at exit would make `lock` wait forever.
    let counts = match DRIVER.try_lock() {
        Ok(driver) => driver.timeline.counts,
        Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner().timeline.counts,
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    work::write_report(counts);
}

static DRIVER: LazyLock<Mutex<Driver>> = LazyLock::new(|| Mutex::new(Driver::from_environment()));

thread_local! {
    /// The calling thread's context stack; the top is the current context.
    static CONTEXT_STACK: RefCell<ContextStack> = const { RefCell::new(ContextStack::new()) };
    /// The calling thread's `CUstreamCaptureMode` (0 = global, the default).
    static CAPTURE_MODE: Cell<u32> = const { Cell::new(0) };
}

/// A thread's context stack, of fixed room and without a destructor, so that the driver still
/// answers from exit handlers that run after the thread's destructors (PyTorch's NCCL
/// communicator manager synchronizes the device from one).
pub struct ContextStack {
    contexts: [usize; 32],
    len: usize,
}

impl ContextStack {
    const fn new() -> ContextStack {
        ContextStack {
            contexts: [0; 32],
            len: 0,
        }
    }

    /// Pushes `context`; a stack already 32 deep keeps its top replaced instead.
    fn push(&mut self, context: usize) {
        if self.len == self.contexts.len() {
            self.len -= 1;
        }
        self.contexts[self.len] = context;
        self.len += 1;
    }

    fn pop(&mut self) -> Option<usize> {
        self.len = self.len.checked_sub(1)?;
        Some(self.contexts[self.len])
    }

    fn last(&self) -> Option<&usize> {
        self.contexts[..self.len].last()
    }
}

fn lock() -> MutexGuard<'static, Driver> {
    // A panic inside a call leaves the state as consistent as any error return does.
    DRIVER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs the body of the driver function `name` once `cuInit` has been called.
fn call(name: &'static str, body: impl FnOnce(&mut Driver) -> Outcome) -> CuResult {
    call_before_init(name, |driver| {
        if !driver.initialized {
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        body(driver)
    })
}

/// Runs the body of the driver function `name`, which works without `cuInit`. After work took
/// an illegal address, every call but the error-text look-ups returns that error; a body that
/// takes one (a copy or memset touching memory it may not) makes it so.
fn call_before_init(name: &'static str, body: impl FnOnce(&mut Driver) -> Outcome) -> CuResult {
    counted_call(name, true, |driver| {
        let answers_anyway = matches!(name, "cuGetErrorString" | "cuGetErrorName");
        if let Some(code) = driver.sticky_error
            && !answers_anyway
        {
            return Err(code);
        }
        let outcome = body(driver);
        if outcome == Err(CUDA_ERROR_ILLEGAL_ADDRESS) {
            driver.sticky_error = Some(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        outcome
    })
}

/// Runs the body of the exported function `name` (the driver's or NVML's, whose codes agree on
/// 0 for success and 999 for unknown) under the one lock: counts the call, applies an injected
/// failure and, `in_sweep`, the fault sweep, and turns a panic into the unknown error.
fn counted_call(
    name: &'static str,
    in_sweep: bool,
    body: impl FnOnce(&mut Driver) -> Outcome,
) -> CuResult {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let mut driver = lock();
        *driver.calls.entry(name).or_default() += 1;
        if let Some(code) = driver.injected_failures.remove(name) {
            return Err(code);
        }
        if in_sweep && let Some(code) = driver.sweep.on_call(name) {
            return Err(code);
        }
        body(&mut driver)
    }));
    match outcome {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes a result through an out parameter, refusing NULL as the driver does.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Outcome {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: not NULL, and the caller promises it is valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

/// Reads an input parameter passed by pointer, refusing NULL as the driver does.
///
/// # Safety
/// `input` is NULL or valid for a read of `T`.
unsafe fn get<T: Copy>(input: *const T) -> Result<T, CuResult> {
    if input.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: not NULL, and the caller promises it is valid for reads.
    Ok(unsafe { input.read() })
}

/// The current context of the calling thread, or 0.
fn current_context() -> usize {
    CONTEXT_STACK.with_borrow(|stack| stack.last().copied().unwrap_or(0))
}

fn error_text(code: CuResult) -> Option<(&'static CStr, &'static CStr)> {
    ERROR_TEXTS
        .iter()
        .find(|(known, _, _)| *known == code)
        .map(|(_, name, text)| (*name, *text))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, text: *mut *const c_char) -> CuResult {
    call_before_init("cuGetErrorString", |_| {
        let found = error_text(code);
        let pointer = found.map_or(std::ptr::null(), |(_, text)| text.as_ptr());
        // SAFETY: `text` comes from the caller, who promises a writable `const char*`.
        unsafe { put(text, pointer) }?;
        found.map(drop).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, name: *mut *const c_char) -> CuResult {
    call_before_init("cuGetErrorName", |_| {
        let found = error_text(code);
        let pointer = found.map_or(std::ptr::null(), |(name, _)| name.as_ptr());
        // SAFETY: `name` comes from the caller, who promises a writable `const char*`.
        unsafe { put(name, pointer) }?;
        found.map(drop).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
}

// ---- Test-only exports ---------------------------------------------------------------------

/// Reads one counter: the number of calls made to the driver function `name` (its symbol name,
/// e.g. `cuMemAlloc_v2`), or one of the state counters listed in README.md. -1 if unknown.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_stat(name: *const c_char) -> i64 {
    if name.is_null() {
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
        return -1;
    };
    let driver = lock();
    let value = match name {
        "bytes_in_use" => driver.bytes_in_use.iter().sum(),
        "live_allocations" => driver.allocations.len() as u64,
        "live_reservations" => driver.reservations.len() as u64,
        "live_physical" => driver.physical.len() as u64,
        "live_mappings" => driver.mappings.len() as u64,
        "live_events" => driver.events.len() as u64,
        "primary_context_refs" => driver
            .primary_context_refs
            .iter()
            .map(|&r| u64::from(r))
            .sum(),
        "timed_events" => driver.timed_events,
        "order_work" => driver.timeline.counts.work,
        "order_handoffs_checked" => driver.timeline.counts.handoffs_checked,
        "order_frees_checked" => driver.timeline.counts.frees_checked,
        "order_unmaps_checked" => driver.timeline.counts.unmaps_checked,
        "order_violations" => driver.timeline.counts.violations,
        "order_pending_uses" => driver.timeline.pending_uses(),
        "peer_links" => driver.peer_links.len() as u64,
        "order_kernels" => driver.timeline.counts.kernels,
        "kernel_launches" => driver.kernels.launches,
        "kernel_pointer_arguments" => driver.kernels.pointer_arguments,
        "kernels_without_parameter_info" => driver.kernels.without_parameter_info,
        "rdma_capable_physical" => driver.rdma_capable_physical(),
        symbol if symbol.starts_with("cu") || symbol.starts_with("nvml") => {
            driver.calls.get(symbol).copied().unwrap_or(0)
        }
        _ => return -1,
    };
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Each event recorded from now on answers `CUDA_ERROR_NOT_READY` to its first `queries` queries.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_set_event_delay(queries: u32) {
    lock().event_delay = queries;
}

/// Makes the next call of the driver function `name` fail with `code`, doing nothing else.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cuda_fail_next(name: *const c_char, code: CuResult) {
    if name.is_null() {
        return;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    lock().injected_failures.insert(name, code);
}

/// A valid context that is not a primary context, like one another library created.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_foreign_context() -> *mut c_void {
    device::FOREIGN_CONTEXT as *mut c_void
}

/// The start of the block of host address space that every device address lies in (see
/// `address_space.rs`), or 0 if none could be reserved: an address minus this is the same in
/// every process that made the same driver calls.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_address_base() -> u64 {
    lock()
        .address_space
        .as_ref()
        .map_or(0, |space| space.base())
}

/// The start of the arena of `cuMemAddressReserve` ranges (see `address_space.rs`), or 0: a
/// reserved address minus this is its offset in the call log, the same in every process that
/// made the same reservations.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_reservation_base() -> u64 {
    lock()
        .address_space
        .as_ref()
        .map_or(0, |space| space.reservations.start())
}
