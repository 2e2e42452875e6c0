//! The C ABI: what PyTorch's `CUDAPluggableAllocator` and the Python package call.
//!
//! - `rust_malloc` lives in `src/oom.cpp`: it calls [`ferrocache_internal_malloc`] and throws a
//!   `std::runtime_error` with the message when that returns NULL, because PyTorch does not check
//!   the pointer `alloc` returns. Every decision is made here; the C++ only throws.
//! - [`rust_free`] and the hooks PyTorch can set with `_allocator.set_*_fn`: [`rust_init`],
//!   [`rust_reset`] (empty cache), [`rust_memory_fraction`], [`rust_record_stream`],
//!   [`rust_base_alloc`].
//! - The CUDA graph pool hooks (`set_begin_allocate_to_pool`, `set_end_allocate_to_pool_fn`,
//!   `set_release_pool`) take C++ types, so they live in `src/pool_hooks.cpp`, which hands
//!   everything to [`ferrocache_internal_begin_allocate_to_pool`] and its two siblings here.
//! - `ferrocache_*`: statistics, snapshot, history, config validation and a NULL-returning
//!   allocation for the Python package and C callers. Functions that can fail set this thread's
//!   last error ([`ferrocache_last_error`]), which every such call clears on entry.
//!
//! One [`DeviceAllocator`] per device, created on first use with `Config::from_env()` and kept for
//! the life of the process, each behind its own lock. Every function catches panics, so nothing
//! unwinds into C. No allocation policy here: this module only routes calls and reports errors.

use std::cell::{Cell, RefCell};
use std::ffi::{CStr, CString, OsStr, OsString, c_char, c_double, c_int, c_ulonglong, c_void};
use std::os::unix::ffi::OsStrExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::allocator::history::{MemorySnapshot, StackId};
use crate::allocator::private_pool::{MempoolId, StreamFilter};
use crate::allocator::sleep::{SleepReport, Tags};
use crate::allocator::stats::DeviceStats;
use crate::allocator::{
    AllocError, AllocationInfo, DeviceAllocator, OutOfMemoryError, PointerError,
};
use crate::config::{ALLOC_CONF_VARS, Config, selected_alloc_conf};
use crate::device::cuda::CudaDevice;
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::lock::SpinNapMutex;
use crate::logging;
use crate::policy::TieRule;
use crate::tune;

/// A CUDA stream handle as PyTorch passes it; 0 is the legacy default stream.
#[allow(
    non_camel_case_types,
    reason = "the CUDA runtime's name, as the header shows it"
)]
pub type cudaStream_t = *mut c_void;

/// PyTorch's `c10::DeviceIndex` is an `int8_t`, so there are never more devices than this.
const MAX_DEVICES: usize = 128;

/// A cache hit holds this lock for tens of nanoseconds; see `lock` for why it is not
/// parking_lot's.
type LockedAllocator = SpinNapMutex<DeviceAllocator<CudaDevice>>;

/// Per device: its allocator once created, or why it could not be (kept, so that a missing
/// driver is reported once and not retried on every allocation).
static DEVICES: [OnceLock<Result<LockedAllocator, String>>; MAX_DEVICES] =
    [const { OnceLock::new() }; MAX_DEVICES];

/// Held while a device allocator is created and while the history setting changes, so that a
/// device created meanwhile cannot miss the new setting.
static CREATION: Mutex<HistorySetting> = Mutex::new(HistorySetting {
    enabled: false,
    max_entries: 0,
});

/// The device count PyTorch gave to `rust_init`, or -1 before it did.
static DEVICE_COUNT: AtomicI32 = AtomicI32::new(-1);

/// What `ferrocache_record_history` asked for; applied to devices created later too.
struct HistorySetting {
    enabled: bool,
    max_entries: usize,
}

/// The settings, read from the environment once, on the library's first use, and replaced by
/// `ferrocache_set_allocator_settings`; devices created later are made with the settings in
/// effect then.
struct Settings {
    config: Result<Mutex<Config>, String>,
}

fn settings() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        logging::init();
        let config = match Config::from_env() {
            Ok(config) => {
                logging::configuration(&config);
                Ok(Mutex::new(config))
            }
            Err(err) => {
                let variable = selected_alloc_conf(|name| {
                    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
                })
                .map_or(ALLOC_CONF_VARS[0], |(name, _)| name);
                logging::configuration_invalid(variable, &err.message);
                Err(format!("{variable} is invalid: {}", err.message))
            }
        };
        Settings { config }
    })
}

/// The settings in effect.
fn config() -> Result<Config, String> {
    match &settings().config {
        Ok(config) => Ok(config.lock().clone()),
        Err(why) => Err(why.clone()),
    }
}

/// `torch.cuda.memory._set_allocator_settings(text)`: the settings in effect become
/// [`Config::with_runtime_settings`]'s, on every device created so far and those created
/// later. A refused `text` changes nothing.
fn set_allocator_settings(text: &str) -> Result<(), String> {
    let settings = settings().config.as_ref().map_err(String::clone)?;
    // Under the creation lock, so that no device is made meanwhile with the old settings.
    let _creation = CREATION.lock();
    let mut current = settings.lock();
    let updated = current
        .with_runtime_settings(text)
        .map_err(|err| err.message)?;
    for (_, allocator) in created_allocators() {
        let mut allocator = allocator.lock();
        let config = settings_for_device(allocator.device(), &updated);
        allocator.replace_config(config);
    }
    logging::settings_changed(&updated);
    *current = updated;
    Ok(())
}

fn device_slot(
    device: c_int,
) -> Result<&'static OnceLock<Result<LockedAllocator, String>>, String> {
    usize::try_from(device)
        .ok()
        .and_then(|index| DEVICES.get(index))
        .ok_or_else(|| format!("invalid device ordinal {device}"))
}

/// The allocator of `device`, created on first use. A device number out of range is bad input,
/// logged at ERROR.
#[inline]
fn allocator(device: c_int) -> Result<&'static LockedAllocator, String> {
    // Every allocation comes here: the created allocator is one load away.
    if let Ok(slot) = device_slot(device)
        && let Some(Ok(created)) = slot.get()
    {
        return Ok(created);
    }
    first_use_of(device)
}

/// [`allocator`] when `device` has no usable allocator yet: creates it, or says why not.
#[cold]
#[inline(never)]
fn first_use_of(device: c_int) -> Result<&'static LockedAllocator, String> {
    // The settings (and logging) are read on the library's first use, before anything is
    // logged; a created allocator implies they were.
    settings();
    let slot = device_slot(device).inspect_err(|why| logging::invalid_device(why))?;
    if let Some(created) = slot.get() {
        return created.as_ref().map_err(String::clone);
    }
    let config = config()?;
    let history = CREATION.lock();
    if let Some(created) = slot.get() {
        // Another thread opened it while this one waited for the lock.
        return created.as_ref().map_err(String::clone);
    }
    match CudaDevice::new(device) {
        Ok(cuda) => {
            let config = settings_for_device(&cuda, &config);
            let mut allocator = DeviceAllocator::new(cuda, device, config);
            allocator.set_reserve_class_lookup(Box::new(reserve_class_of));
            allocator.set_sleepable(sleep_ability_requested());
            if history.enabled {
                allocator.record_history(true, history.max_entries);
            }
            let _ = slot.set(Ok(SpinNapMutex::new(allocator)));
        }
        Err(err) => {
            let why = unavailable_message(device, &err);
            if !open_failure_is_permanent(&err) {
                logging::call_failed(&format!("opening CUDA device {device}"), &why);
                return Err(why);
            }
            logging::device_unavailable(device, &why);
            let _ = slot.set(Err(why));
        }
    }
    slot.get()
        .expect("set above, under the creation lock")
        .as_ref()
        .map_err(String::clone)
}

/// The settings for one device: `expandable_segments:True` needs virtual memory management,
/// and a device without it gets plain segments and one WARN line, rather than a failure of
/// every allocation (PyTorch 2.15 fails each one at `cuMemAddressReserve`).
fn settings_for_device(cuda: &CudaDevice, config: &Config) -> Config {
    let mut config = config.clone();
    if config.expandable_segments && !cuda.supports_virtual_memory() {
        logging::expandable_segments_unsupported(cuda.ordinal(), cuda.name());
        config.expandable_segments = false;
    }
    config
}

/// Whether a failure to open a device stays for the life of the process, and is kept so that
/// it is reported once and not retried: no usable driver or device, or CUDA unusable. A driver
/// call that failed otherwise (out of memory, ...) is retried at the device's next use.
fn open_failure_is_permanent(err: &DeviceError) -> bool {
    matches!(err, DeviceError::Unavailable(_) | DeviceError::Unusable(_))
}

fn unavailable_message(device: c_int, err: &DeviceError) -> String {
    match err {
        // Already a whole sentence that names the library or the device.
        DeviceError::Unavailable(why) | DeviceError::Unusable(why) => why.clone(),
        other => format!("CUDA device {device} could not be opened: {other}"),
    }
}

/// The allocators created so far, with their device numbers.
fn created_allocators() -> impl Iterator<Item = (c_int, &'static LockedAllocator)> {
    DEVICES
        .iter()
        .enumerate()
        .filter_map(|(index, slot)| match slot.get() {
            Some(Ok(allocator)) => Some((index as c_int, allocator)),
            _ => None,
        })
}

/// The allocator of `device` if it has been created (and could be).
fn created_allocator(device: c_int) -> Option<&'static LockedAllocator> {
    device_slot(device).ok()?.get()?.as_ref().ok()
}

/// Runs `action` under the lock of each created allocator in turn, `preferred` first, until one
/// knows the pointer `action` is about; with that allocator's device and answer, or `None` when
/// none knows it. `action` is the look-up itself: every `DeviceAllocator` method that takes a
/// pointer changes nothing for one it did not hand out. So the usual call costs one lock and one
/// hash-map look-up, and another thread cannot free the pointer between look-up and action.
fn with_owner<R>(
    preferred: Option<c_int>,
    mut action: impl FnMut(&mut DeviceAllocator<CudaDevice>) -> Result<R, PointerError>,
) -> Option<(c_int, R)> {
    let first = preferred.and_then(|device| Some((device, created_allocator(device)?)));
    let others = created_allocators().filter(|(device, _)| Some(*device) != preferred);
    for (device, allocator) in first.into_iter().chain(others) {
        let answer = action(&mut allocator.lock());
        match answer {
            Ok(found) => return Some((device, found)),
            Err(PointerError::Unknown(_)) => {}
        }
    }
    None
}

// ------------------------------------------------------------------------------------------------
// The last error, per thread
// ------------------------------------------------------------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A NUL inside would cut the message short in C; none of ours has one, but be sure.
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = message);
}

fn clear_last_error() {
    let _ = LAST_ERROR.try_with(|last| {
        if !last.borrow().is_empty() {
            *last.borrow_mut() = CString::default();
        }
    });
}

/// This thread's last error, as a pointer that stays valid until the next call on this thread.
fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

// ------------------------------------------------------------------------------------------------
// Panics
// ------------------------------------------------------------------------------------------------

/// Runs `body`; a panic becomes an ERROR line, this thread's last error and `on_panic`.
fn guarded<R>(function: &str, on_panic: R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => {
            let why = panic_message(&*payload);
            // Even reporting must not unwind into C.
            let _ = catch_unwind(|| {
                logging::internal_error(function, &why);
                set_last_error(&format!("ferrocache: internal error in {function}: {why}"));
            });
            on_panic
        }
    }
}

/// What a caught panic said.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// [`guarded`] for the `ferrocache_*` functions that report through the last error: clears it,
/// runs `body`, and on `Err` sets it. Logging, where wanted, is `body`'s business.
fn with_last_error<T: Copy>(
    function: &str,
    on_error: T,
    body: impl FnOnce() -> Result<T, String>,
) -> T {
    reporting_errors(function, on_error, || {
        settings();
        body()
    })
}

/// [`with_last_error`] for calls that must not read the process's settings for good (checking
/// a configuration string before it is put in the environment).
fn reporting_errors<T: Copy>(
    function: &str,
    on_error: T,
    body: impl FnOnce() -> Result<T, String>,
) -> T {
    guarded(function, on_error, || {
        clear_last_error();
        body().unwrap_or_else(|message| {
            set_last_error(&message);
            on_error
        })
    })
}

// ------------------------------------------------------------------------------------------------
// Allocation and free
// ------------------------------------------------------------------------------------------------

fn stream_id(stream: cudaStream_t) -> StreamId {
    stream.addr() as StreamId
}

fn device_pointer(ptr: DevicePtr) -> *mut c_void {
    // The address is the driver's; Rust never dereferences it.
    ptr::without_provenance_mut(ptr as usize)
}

/// Allocates, or says why not (the message the C++ exception or the last error carries).
#[inline(always)]
fn allocate(size: usize, device: c_int, stream: cudaStream_t) -> Result<*mut c_void, AllocFailure> {
    if size == 0 {
        return Ok(ptr::null_mut());
    }
    let allocator = allocator(device)?;
    if let Some(why) = crate::device::cuda::unusable() {
        // Memory from the cache would be as unusable, and a capture's stream filter (PyTorch's
        // code, which asks CUDA) must not be asked either: the allocation fails at once.
        logging::call_failed("allocation", &why);
        return Err(AllocFailure::Other(why.to_string()));
    }
    if !CACHING_ENABLED.load(Ordering::Relaxed) {
        return allocate_uncached(size, device, stream, allocator);
    }
    // Before the lock: the gatherer takes the GIL, which a thread waiting for the lock may hold.
    let stack = gather_stack(StackEvent::Alloc);
    // A thread being torn down allocates untagged.
    let tag = THREAD_TAG.try_with(Cell::get).ok().flatten();
    let result = with_user_metadata(&mut allocator.lock(), |allocator| {
        allocator.malloc_tagged_with_stack(size, stream_id(stream), tag, stack)
    });
    match result {
        Ok(ptr) => Ok(device_pointer(ptr)),
        // A preemptive rejection (throw_on_cudamalloc_oom) is the user's own limit: PyTorch calls
        // no out-of-memory observer for it, and no setting would have served it better.
        Err(AllocError::OutOfMemory(oom)) if oom.preemptively_rejected => {
            Err(AllocFailure::OutOfMemory(oom.message))
        }
        // The allocator has logged it, with the same message. The lock is released by now:
        // PyTorch's observers first (they may dump a snapshot), then the advice line.
        Err(AllocError::OutOfMemory(oom)) => {
            notify_oom_observers(&oom);
            advise_after_out_of_memory(device, allocator, &oom);
            Err(AllocFailure::OutOfMemory(oom.message))
        }
        Err(err) => {
            let message = err.to_string();
            logging::call_failed("allocation", &message);
            Err(AllocFailure::Other(message))
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Caching turned off (`torch.cuda.memory.caching_allocator_disabled()`)
// ------------------------------------------------------------------------------------------------

/// PyTorch's `enable(false)` turns this off: allocations then go to the driver and back, at
/// their exact size, outside the cache and its statistics (PyTorch's `uncached_allocate` and
/// `uncached_delete`).
static CACHING_ENABLED: AtomicBool = AtomicBool::new(true);
/// The live allocations made while caching was off, with their devices.
static UNCACHED: Mutex<Vec<(DevicePtr, c_int)>> = Mutex::new(Vec::new());
/// How many there are: a free looks in [`UNCACHED`] only when some are live.
static UNCACHED_LIVE: AtomicUsize = AtomicUsize::new(0);

/// `uncached_allocate`: straight from the driver, at the size asked.
#[cold]
#[inline(never)]
fn allocate_uncached(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
    allocator: &LockedAllocator,
) -> Result<*mut c_void, AllocFailure> {
    let ptr = allocator
        .lock()
        .device_mut()
        .malloc(size, stream_id(stream))
        .map_err(|err| {
            let message = format!("CUDA error while caching is disabled: {err}");
            logging::call_failed("allocation", &message);
            AllocFailure::Other(message)
        })?;
    UNCACHED.lock().push((ptr, device));
    UNCACHED_LIVE.fetch_add(1, Ordering::Relaxed);
    Ok(device_pointer(ptr))
}

/// The device of `ptr` if it was allocated while caching was off; it is forgotten.
#[cold]
#[inline(never)]
fn take_uncached(ptr: DevicePtr) -> Option<c_int> {
    let mut live = UNCACHED.lock();
    let index = live.iter().position(|&(p, _)| p == ptr)?;
    let (_, device) = live.swap_remove(index);
    UNCACHED_LIVE.fetch_sub(1, Ordering::Relaxed);
    Some(device)
}

/// `uncached_delete`: straight back to the driver.
#[cold]
#[inline(never)]
fn free_uncached(ptr: DevicePtr, device: c_int) -> Result<(), String> {
    allocator(device)?
        .lock()
        .device_mut()
        .free(ptr)
        .map_err(|err| err.to_string())
}

/// `torch.cuda.memory.caching_allocator_enable(enabled)` (PyTorch's `enable`): with 0, the
/// allocations made from now on go to the driver at their exact size and back at their free,
/// outside the cache and its statistics; with non-zero, caching resumes (allocations made
/// meanwhile still go back to the driver). Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_caching_enabled(enabled: c_int) -> c_int {
    guarded("ferrocache_set_caching_enabled", -1, || {
        CACHING_ENABLED.store(enabled != 0, Ordering::Relaxed);
        0
    })
}

/// Whether caching is on (PyTorch's `isEnabled`): 1 or 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_caching_enabled() -> c_int {
    c_int::from(CACHING_ENABLED.load(Ordering::Relaxed))
}

/// After an out-of-memory (with the allocator's lock released): one ERROR line naming the
/// setting that would have served the program so far within the memory it could use, from the
/// recorded history (`tune::live`); without history, once per process, how to get that line.
/// The search runs only here, never on the allocation path, and never fails the allocation
/// further: an error in it is logged and dropped.
#[cold]
#[inline(never)]
fn advise_after_out_of_memory(device: c_int, allocator: &LockedAllocator, oom: &OutOfMemoryError) {
    if !logging::errors_enabled() {
        // TORCH_CUDA_ALLOC_LOG_LEVEL=OFF: nobody would read the line.
        return;
    }
    let capacity = tune::live::oom_capacity(
        oom.reserved as u64,
        oom.device_free as u64,
        oom.allowed.map(|a| a as u64),
    );
    let live = (oom.allocated as u64).saturating_add(oom.allocation_size as u64);
    let recorded = {
        let allocator = allocator.lock();
        allocator
            .is_recording_history()
            .then(|| (allocator.history_snapshot(), allocator.config().clone()))
    };
    let Some((snapshot, config)) = recorded else {
        logging::oom_advice_needs_history();
        return;
    };
    let advice = catch_unwind(AssertUnwindSafe(|| {
        tune::live::oom_advice(&snapshot, &config, device, capacity, live)
    }));
    match advice {
        Ok(Ok(advice)) => logging::oom_advice(&advice.line(device)),
        Ok(Err(why)) => logging::oom_advice(&format!("advice: none ({why})")),
        Err(panic) => logging::internal_error("the out-of-memory advice", &panic_message(&*panic)),
    }
}

/// Why an allocation failed: out of memory (PyTorch's message) or anything else.
enum AllocFailure {
    OutOfMemory(String),
    Other(String),
}

impl AllocFailure {
    fn into_message(self) -> String {
        match self {
            AllocFailure::OutOfMemory(message) | AllocFailure::Other(message) => message,
        }
    }
}

impl From<String> for AllocFailure {
    fn from(message: String) -> AllocFailure {
        AllocFailure::Other(message)
    }
}

// ------------------------------------------------------------------------------------------------
// Stack traces and the out-of-memory exception, supplied by the Python package
// ------------------------------------------------------------------------------------------------

/// Returns an id for the calling thread's stack (0: none); see [`ferrocache_set_stack_gatherer`].
/// `event` is 0 for an allocation, 1 for a free.
pub type StackGatherer = extern "C" fn(event: c_int) -> u64;
/// Throws the C++ exception for an out-of-memory message; never returns normally. See
/// [`ferrocache_set_oom_thrower`].
pub type OomThrower = extern "C" fn(message: *const c_char);
/// A [`StackGatherer`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_stack_gatherer = Option<StackGatherer>;
/// An [`OomThrower`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_oom_thrower = Option<OomThrower>;
/// Returns the reserve class PyTorch's C++ API gave `stream`
/// (`setExpandableSegmentReserveClassForStream`), as a NUL-terminated string that stays valid
/// until the next call on the same thread; NULL or empty: none. See
/// [`ferrocache_set_reserve_class_lookup`].
pub type ReserveClassLookup = extern "C" fn(stream: cudaStream_t) -> *const c_char;
/// A [`ReserveClassLookup`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_reserve_class_lookup = Option<ReserveClassLookup>;

/// What a [`StackGatherer`] is asked about.
#[repr(i32)]
#[derive(Clone, Copy)]
enum StackEvent {
    Alloc = 0,
    Free = 1,
}

thread_local! {
    /// What `torch.cuda.memory._set_memory_metadata` set on this thread (PyTorch keeps it per
    /// thread too); `None` when empty.
    static USER_METADATA: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// Runs `action` with this thread's metadata given to the trace entries it records.
#[inline(always)]
fn with_user_metadata<R>(
    allocator: &mut DeviceAllocator<CudaDevice>,
    action: impl FnOnce(&mut DeviceAllocator<CudaDevice>) -> R,
) -> R {
    let metadata = USER_METADATA.with_borrow(Clone::clone);
    if metadata.is_none() {
        return action(allocator);
    }
    let previous = allocator.set_user_metadata(metadata);
    let result = action(allocator);
    allocator.set_user_metadata(previous);
    result
}

/// `torch.cuda.memory._set_memory_metadata(text)`: the trace entries that this thread's
/// allocations and frees record from now on carry `text` as `user_metadata`; an empty `text`
/// clears it. Returns 0, or -1 (last error set) for a NULL or non-UTF-8 `text`.
///
/// # Safety
/// `text` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_memory_metadata(text: *const c_char) -> c_int {
    reporting_errors("ferrocache_set_memory_metadata", -1, || {
        // SAFETY: passed on from our caller, who promises the same.
        let text = unsafe { text_argument(text, "the metadata") }?;
        let metadata = (!text.is_empty()).then(|| Arc::<str>::from(text));
        USER_METADATA.set(metadata);
        Ok(0)
    })
}

/// `torch.cuda.memory._get_memory_metadata()`: this thread's metadata ("" when none). Returns
/// a string to free with `ferrocache_string_free`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_get_memory_metadata() -> *mut c_char {
    reporting_errors("ferrocache_get_memory_metadata", ptr::null_mut(), || {
        let text = USER_METADATA.with_borrow(|m| m.as_deref().unwrap_or("").to_string());
        Ok(into_c_string(text))
    })
}

/// The registered gatherer (NULL: none; recording stacks costs one atomic load then).
static STACK_GATHERER: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());
/// Whether frees ask the gatherer too (PyTorch's `context="all"`).
static GATHER_ON_FREE: AtomicBool = AtomicBool::new(false);
/// The registered thrower (NULL: `rust_malloc` throws `std::runtime_error`).
static OOM_THROWER: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());
/// The registered reserve-class lookup (NULL: every stream is untagged).
static RESERVE_CLASS_LOOKUP: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());

/// The calling thread's stack id from the registered gatherer, or 0. Call it with no allocator
/// lock held.
fn gather_stack(event: StackEvent) -> StackId {
    if matches!(event, StackEvent::Free) && !GATHER_ON_FREE.load(Ordering::Relaxed) {
        return 0;
    }
    let gatherer = STACK_GATHERER.load(Ordering::Acquire);
    if gatherer.is_null() {
        return 0;
    }
    // SAFETY: only ferrocache_set_stack_gatherer stores here, and only a StackGatherer, whose
    // owner promises it stays callable for the life of the process.
    let gatherer: StackGatherer =
        unsafe { std::mem::transmute::<*mut (), StackGatherer>(gatherer) };
    gatherer(event as c_int)
}

/// Registers `gatherer` (NULL: none), which every allocation (and every free too when
/// `on_free` is non-zero) calls before it takes any lock; the id it returns is kept with the
/// block and the trace entries, and `ferrocache_snapshot` reports it as `stack_id`. The Python
/// package uses it to record Python stacks. `gatherer` must stay callable for the life of the
/// process, be callable from any thread and never unwind. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_stack_gatherer(
    gatherer: ferrocache_stack_gatherer,
    on_free: c_int,
) -> c_int {
    guarded("ferrocache_set_stack_gatherer", -1, || {
        let pointer = gatherer.map_or(ptr::null_mut(), |f| f as *mut ());
        GATHER_ON_FREE.store(on_free != 0 && gatherer.is_some(), Ordering::Relaxed);
        STACK_GATHERER.store(pointer, Ordering::Release);
        0
    })
}

/// Registers `thrower` (NULL: none), which `rust_malloc` calls with PyTorch's message when an
/// allocation fails for lack of memory. It must throw a C++ exception (the Python package's
/// shim throws `c10::OutOfMemoryError`, which PyTorch raises as `torch.OutOfMemoryError`); if
/// it returns, `rust_malloc` throws `std::runtime_error`. It must stay callable for the life of
/// the process. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_oom_thrower(thrower: ferrocache_oom_thrower) -> c_int {
    guarded("ferrocache_set_oom_thrower", -1, || {
        let pointer = thrower.map_or(ptr::null_mut(), |f| f as *mut ());
        OOM_THROWER.store(pointer, Ordering::Release);
        0
    })
}

/// Registers `lookup` (NULL: none), which the allocator asks for a stream's reserve class when
/// it makes an expandable segment for the stream or reports an out of memory on it, so that
/// `expandable_segments_reserve_by_class` applies to the streams PyTorch's C++ API tagged (the
/// Python package's shim asks PyTorch 2.15's `getExpandableSegmentReserveClassForStream`). It is
/// called with an allocator lock held: it must not call ferrocache, must stay callable for the
/// life of the process and never unwind. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_reserve_class_lookup(
    lookup: ferrocache_reserve_class_lookup,
) -> c_int {
    guarded("ferrocache_set_reserve_class_lookup", -1, || {
        let pointer = lookup.map_or(ptr::null_mut(), |f| f as *mut ());
        RESERVE_CLASS_LOOKUP.store(pointer, Ordering::Release);
        0
    })
}

/// The reserve class of `stream` from the registered lookup; empty without one.
fn reserve_class_of(stream: StreamId) -> String {
    let lookup = RESERVE_CLASS_LOOKUP.load(Ordering::Acquire);
    if lookup.is_null() {
        return String::new();
    }
    // SAFETY: only ferrocache_set_reserve_class_lookup stores here, and only a
    // ReserveClassLookup, whose owner promises it stays callable.
    let lookup: ReserveClassLookup =
        unsafe { std::mem::transmute::<*mut (), ReserveClassLookup>(lookup) };
    let answer = lookup(ptr::without_provenance_mut(stream as usize));
    if answer.is_null() {
        return String::new();
    }
    // SAFETY: the lookup returns a NUL-terminated string valid until its next call on this
    // thread, which cannot come before this copy.
    unsafe { CStr::from_ptr(answer) }
        .to_string_lossy()
        .into_owned()
}

/// Called at an out of memory, PyTorch's `OutOfMemoryObserver`: the device, the size that
/// could not be had, the device's total memory (or the memory-fraction limit, when one is set)
/// and its free memory. See [`ferrocache_attach_oom_observer`].
pub type OomObserver =
    extern "C" fn(device: c_int, alloc_size: usize, device_total: usize, device_free: usize);
/// An [`OomObserver`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_oom_observer = Option<OomObserver>;

/// The attached observers, in the order attached.
static OOM_OBSERVERS: Mutex<Vec<OomObserver>> = Mutex::new(Vec::new());

/// PyTorch's rule (`DeviceCachingAllocator::malloc`): at an out of memory, with the device's
/// lock released (an observer may take the GIL, which another thread waiting for that lock may
/// hold, and may ask the allocator for a snapshot), each observer is called in turn, before
/// the exception is thrown. Observers attached meanwhile are called from the next one on.
fn notify_oom_observers(oom: &OutOfMemoryError) {
    let observers = OOM_OBSERVERS.lock().clone();
    if observers.is_empty() {
        return;
    }
    let limit = oom.allowed.unwrap_or(oom.device_total);
    for observer in observers {
        observer(oom.device, oom.allocation_size, limit, oom.device_free);
    }
}

/// Attaches `observer`, PyTorch's out-of-memory observer
/// (`torch._C._cuda_attach_out_of_memory_observer`): at each out of memory, before the
/// exception reaches the caller, every attached observer is called on the allocating thread
/// with the device, the size that could not be allocated, the device's total memory (or the
/// limit `set_per_process_memory_fraction` set) and its free memory. No allocator lock is held
/// then, so it may call any `ferrocache_*` function (take a snapshot); an allocation it makes
/// can run out of memory again and call it again. It must stay callable for the life of the
/// process (or until detached) and never unwind. Returns 0; -1 for NULL (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_attach_oom_observer(observer: ferrocache_oom_observer) -> c_int {
    reporting_errors("ferrocache_attach_oom_observer", -1, || {
        let observer = observer
            .ok_or_else(|| "ferrocache_attach_oom_observer: the observer is NULL".to_string())?;
        OOM_OBSERVERS.lock().push(observer);
        Ok(0)
    })
}

/// Detaches every attachment of `observer`; an observer not attached is no error. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_detach_oom_observer(observer: ferrocache_oom_observer) -> c_int {
    reporting_errors("ferrocache_detach_oom_observer", -1, || {
        if let Some(observer) = observer {
            OOM_OBSERVERS
                .lock()
                .retain(|attached| !std::ptr::fn_addr_eq(*attached, observer));
        }
        Ok(0)
    })
}

fn oom_thrower() -> Option<OomThrower> {
    let thrower = OOM_THROWER.load(Ordering::Acquire);
    if thrower.is_null() {
        return None;
    }
    // SAFETY: only ferrocache_set_oom_thrower stores here, and only an OomThrower.
    Some(unsafe { std::mem::transmute::<*mut (), OomThrower>(thrower) })
}

/// What the caller of a free says about the allocation; `None` where it says nothing.
struct FreeClaims {
    size: Option<usize>,
    device: Option<c_int>,
    stream: Option<StreamId>,
}

/// Frees `ptr`. Wrong claims about it are logged at WARN and the recorded values used; a pointer
/// no allocator knows is refused (logged at ERROR by the caller) and nothing changes.
///
/// The device the caller names is tried first, and the free itself is the look-up: one lock and
/// one hash-map removal on the usual path.
#[inline]
fn release(ptr: DevicePtr, claims: &FreeClaims) -> Result<(), String> {
    if UNCACHED_LIVE.load(Ordering::Relaxed) > 0
        && let Some(device) = take_uncached(ptr)
    {
        return free_uncached(ptr, device);
    }
    // Before any lock, as in `allocate`.
    let stack = gather_stack(StackEvent::Free);
    if let Some(device) = claims.device
        && let Some(allocator) = created_allocator(device)
    {
        // The guard goes at the end of this statement: a warning never holds up other threads.
        let freed = with_user_metadata(&mut allocator.lock(), |allocator| {
            allocator.free_with_stack(ptr, stack)
        });
        if let Ok(recorded) = freed {
            report_wrong_claims(claims, device, &recorded);
            return Ok(());
        }
    }
    release_elsewhere(ptr, claims, stack)
}

/// [`release`] when the device the caller named (if any) did not hand `ptr` out: every device
/// is asked (the named one again, which costs only on this rare path).
#[cold]
#[inline(never)]
fn release_elsewhere(ptr: DevicePtr, claims: &FreeClaims, stack: StackId) -> Result<(), String> {
    settings();
    match with_owner(claims.device, |allocator| {
        with_user_metadata(allocator, |allocator| allocator.free_with_stack(ptr, stack))
    }) {
        Some((device, recorded)) => {
            report_wrong_claims(claims, device, &recorded);
            Ok(())
        }
        None => Err(unknown_pointer(ptr)),
    }
}

/// Logs at WARN each claim of a free that differs from what the allocation recorded.
#[inline(always)]
fn report_wrong_claims(claims: &FreeClaims, device: c_int, recorded: &AllocationInfo) {
    let all_right = claims.device.is_none_or(|claimed| claimed == device)
        && claims
            .size
            .is_none_or(|size| size == recorded.requested_size)
        && claims.stream.is_none_or(|stream| stream == recorded.stream);
    if !all_right {
        log_wrong_claims(claims, device, recorded);
    }
}

/// [`report_wrong_claims`] once a claim differs (out of line: PyTorch's wrapper always passes
/// what the allocation recorded).
#[cold]
#[inline(never)]
fn log_wrong_claims(claims: &FreeClaims, device: c_int, recorded: &AllocationInfo) {
    let ptr = recorded.ptr;
    if let Some(claimed) = claims.device
        && claimed != device
    {
        logging::free_argument_mismatch(ptr, "device", &claimed, &device);
    }
    if let Some(size) = claims.size
        && size != recorded.requested_size
    {
        logging::free_argument_mismatch(ptr, "size", &size, &recorded.requested_size);
    }
    if let Some(stream) = claims.stream
        && stream != recorded.stream
    {
        logging::free_argument_mismatch(
            ptr,
            "stream",
            &logging::StreamName(stream),
            &logging::StreamName(recorded.stream),
        );
    }
}

/// For `rust_malloc` in `oom.cpp` only (not exported from the library): allocates `size` bytes
/// on `device` for `stream`. Returns the pointer with `*error` set to NULL, or NULL with `*error`
/// pointing at the reason (this thread's last error, valid until the next call on this thread).
/// Size 0 gives NULL with no error. `*thrower` is the registered [`OomThrower`] when the
/// allocation failed for lack of memory and one is registered, else NULL: what `rust_malloc`
/// throws is decided here.
///
/// # Safety
/// `error` and `thrower` are NULL or valid for one pointer write each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_internal_malloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
    error: *mut *const c_char,
    thrower: *mut ferrocache_oom_thrower,
) -> *mut c_void {
    let failure = guarded("rust_malloc", Err(None), || {
        allocate(size, device, stream).map_err(|failure| {
            let throw_with = match &failure {
                AllocFailure::OutOfMemory(_) => oom_thrower(),
                AllocFailure::Other(_) => None,
            };
            set_last_error(&failure.into_message());
            throw_with
        })
    });
    let (ptr, reason, throw_with) = match failure {
        Ok(ptr) => (ptr, ptr::null(), None),
        Err(throw_with) => (ptr::null_mut(), last_error_ptr(), throw_with),
    };
    if !error.is_null() {
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { error.write(reason) };
    }
    if !thrower.is_null() {
        // SAFETY: non-NULL, and the caller promises it is valid for a write.
        unsafe { thrower.write(throw_with) };
    }
    ptr
}

/// `CUDAPluggableAllocator`'s free function. NULL does nothing. A pointer ferrocache did not give
/// out, or one already freed, is logged at ERROR and nothing changes. A `size`, `device` or
/// `stream` that differs from what the allocation recorded is logged at WARN and the recorded
/// value is used.
#[unsafe(no_mangle)]
pub extern "C" fn rust_free(ptr: *mut c_void, size: usize, device: c_int, stream: cudaStream_t) {
    if ptr.is_null() {
        return;
    }
    guarded("rust_free", (), || {
        let claims = FreeClaims {
            size: Some(size),
            device: Some(device),
            stream: Some(stream_id(stream)),
        };
        if let Err(why) = release(ptr.addr() as DevicePtr, &claims) {
            logging::call_refused("rust_free", &why);
        }
    });
}

/// Allocates `size` bytes on `device` for `stream` (0 is the default stream). Returns NULL when
/// `size` is 0 (last error empty) or on failure (last error set: PyTorch's out-of-memory
/// message, a driver error, or why the device or the settings are unusable). Never throws.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_alloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) -> *mut c_void {
    with_last_error("ferrocache_alloc", ptr::null_mut(), || {
        allocate(size, device, stream).map_err(AllocFailure::into_message)
    })
}

/// Frees an allocation from `ferrocache_alloc` or `rust_malloc`, on whichever device it is.
/// Returns 0, or -1 (last error set, logged at ERROR, nothing changed) for a pointer ferrocache
/// did not give out or already freed. NULL returns 0 and does nothing.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_free(ptr: *mut c_void) -> c_int {
    with_last_error("ferrocache_free", -1, || {
        if ptr.is_null() {
            return Ok(0);
        }
        let claims = FreeClaims {
            size: None,
            device: None,
            stream: None,
        };
        release(ptr.addr() as DevicePtr, &claims)
            .map(|()| 0)
            .inspect_err(|why| logging::call_refused("ferrocache_free", why))
    })
}

/// This thread's last error: empty when the latest `ferrocache_*` call that can fail succeeded.
/// Never NULL. Owned by ferrocache; valid until the next ferrocache call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_last_error() -> *const c_char {
    guarded("ferrocache_last_error", c"".as_ptr(), last_error_ptr)
}

// ------------------------------------------------------------------------------------------------
// PyTorch's hooks (`CUDAPluggableAllocator._allocator.set_*_fn`)
// ------------------------------------------------------------------------------------------------

/// `set_init_fn`: PyTorch tells the device count. Reads the settings and sets up logging; device
/// allocators are still created on first use.
#[unsafe(no_mangle)]
pub extern "C" fn rust_init(device_count: c_int) {
    guarded("rust_init", (), || {
        settings();
        DEVICE_COUNT.store(device_count, Ordering::Relaxed);
        logging::library_initialised(env!("CARGO_PKG_VERSION"), device_count);
    });
}

/// `set_reset_fn`, which PyTorch calls for `torch.cuda.empty_cache()`: gives every wholly free
/// cached segment of every device back to the driver. Errors are logged.
#[unsafe(no_mangle)]
pub extern "C" fn rust_reset() {
    guarded("rust_reset", (), || {
        settings();
        if let Err(why) = empty_all_caches() {
            logging::call_failed("rust_reset", &why);
        }
    });
}

/// `set_memory_fraction_fn`: `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
/// Errors (a fraction outside [0, 1], an unusable device) are logged.
#[unsafe(no_mangle)]
pub extern "C" fn rust_memory_fraction(fraction: c_double, device: c_int) {
    guarded("rust_memory_fraction", (), || {
        settings();
        if let Err(why) = set_memory_fraction(fraction, device) {
            logging::call_refused("rust_memory_fraction", &why);
        }
    });
}

/// `set_record_stream_fn`: `Tensor.record_stream(stream)`. The allocation at `ptr` is not reused
/// after its free until the work queued on `stream` by then has completed. An unknown pointer is
/// logged at ERROR.
#[unsafe(no_mangle)]
pub extern "C" fn rust_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    guarded("rust_record_stream", (), || {
        settings();
        let address = ptr.addr() as DevicePtr;
        let recorded = with_owner(None, |allocator| {
            allocator.record_stream(address, stream_id(stream))
        });
        if recorded.is_none() {
            logging::call_refused("rust_record_stream", &unknown_pointer(address));
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
        settings();
        let address = ptr.addr() as DevicePtr;
        match with_owner(None, |allocator| allocator.base_allocation(address)) {
            Some((_, (base, base_size))) => (device_pointer(base), base_size),
            None => {
                logging::call_refused("rust_base_alloc", &unknown_pointer(address));
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

fn unknown_pointer(ptr: DevicePtr) -> String {
    format!("invalid device pointer: {ptr:#x} (never allocated by ferrocache, or already freed)")
}

fn empty_all_caches() -> Result<(), String> {
    let mut failures = Vec::new();
    for (device, allocator) in created_allocators() {
        if let Err(err) = allocator.lock().empty_cache() {
            failures.push(format!("device {device}: {err}"));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

fn set_memory_fraction(fraction: f64, device: c_int) -> Result<(), String> {
    let result = allocator(device)?.lock().set_memory_fraction(fraction);
    result.map_err(|err| err.to_string())
}

// ------------------------------------------------------------------------------------------------
// CUDA graphs: private pools (`set_begin_allocate_to_pool`, `set_end_allocate_to_pool_fn`,
// `set_release_pool`, through src/pool_hooks.cpp)
// ------------------------------------------------------------------------------------------------

/// How `pool_hooks.cpp` asks a `std::function<bool(cudaStream_t)>`: 1 yes, 0 no, -1 it threw
/// (with what it said in `*error`).
type FilterAcceptsFn =
    unsafe extern "C" fn(*const c_void, cudaStream_t, *mut *const c_char) -> c_int;
/// How `pool_hooks.cpp` destroys the filter.
type FilterDropFn = unsafe extern "C" fn(*mut c_void);

/// A capture's stream filter: PyTorch's `std::function`, kept on the C++ heap and called
/// through `pool_hooks.cpp`. Destroyed when dropped.
struct CppStreamFilter {
    filter: *mut c_void,
    accepts: FilterAcceptsFn,
    drop: FilterDropFn,
}

// SAFETY: the allocator calls the filter only under its lock, one call at a time, from whichever
// thread allocates, as PyTorch's own allocator does; PyTorch's filter only asks the CUDA runtime
// about a stream's capture.
unsafe impl Send for CppStreamFilter {}

impl CppStreamFilter {
    fn accepts(&self, stream: StreamId) -> Result<bool, String> {
        let mut error: *const c_char = ptr::null();
        // SAFETY: `filter` is the live std::function pool_hooks.cpp gave us with `accepts`; the
        // stream handle is only passed on; `error` is valid for one write.
        let answer = unsafe { (self.accepts)(self.filter, stream_handle(stream), &mut error) };
        match answer {
            1 => Ok(true),
            0 => Ok(false),
            _ if error.is_null() => Err("it failed without saying why".to_string()),
            // SAFETY: on failure `error` points at a NUL-terminated string that stays valid
            // until this thread's next filter call.
            _ => Err(unsafe { CStr::from_ptr(error) }
                .to_string_lossy()
                .into_owned()),
        }
    }
}

impl Drop for CppStreamFilter {
    fn drop(&mut self) {
        // SAFETY: the filter was made by pool_hooks.cpp, with this `drop`, and is dropped once.
        unsafe { (self.drop)(self.filter) };
    }
}

fn stream_handle(stream: StreamId) -> cudaStream_t {
    ptr::without_provenance_mut(stream as usize)
}

fn pool_id(first: c_ulonglong, second: c_ulonglong) -> MempoolId {
    (first, second)
}

fn begin_allocate_to_pool(
    device: c_int,
    id: MempoolId,
    filter: StreamFilter,
) -> Result<(), String> {
    let result = allocator(device)?.lock().begin_allocate_to_pool(id, filter);
    result.map_err(|err| err.to_string())
}

fn end_allocate_to_pool(device: c_int, id: MempoolId) -> Result<(), String> {
    let result = allocator(device)?.lock().end_allocate_to_pool(id);
    result.map_err(|err| err.to_string())
}

fn release_pool(device: c_int, id: MempoolId) -> Result<(), String> {
    let result = allocator(device)?.lock().release_pool(id);
    result.map_err(|err| err.to_string())
}

/// For `rust_begin_allocate_to_pool` in `pool_hooks.cpp` only (not exported): PyTorch's
/// `beginAllocateToPool`. From now until the end hook, allocations on `device` whose stream
/// `filter` accepts come from the private pool `(pool_first, pool_second)`. Takes ownership of
/// `filter` (NULL: the C++ side could not copy it), asked through `accepts` and destroyed
/// through `drop`. Returns NULL, or why the capture is refused (logged at ERROR; this thread's
/// last error), which the C++ side throws: a capture ferrocache cannot serve from its own pool
/// must not start.
///
/// # Safety
/// `filter` is NULL or an object that `accepts` and `drop` work on, not used by the caller
/// afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_internal_begin_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    filter: *mut c_void,
    accepts: FilterAcceptsFn,
    drop: FilterDropFn,
) -> *const c_char {
    // Owned from the first line, so that it is destroyed on every path, a panic included.
    let filter = (!filter.is_null()).then_some(CppStreamFilter {
        filter,
        accepts,
        drop,
    });
    let id = pool_id(pool_first, pool_second);
    let outcome = guarded("rust_begin_allocate_to_pool", Err(()), || {
        settings();
        let result = match filter {
            Some(filter) => {
                begin_allocate_to_pool(device, id, Box::new(move |stream| filter.accepts(stream)))
            }
            None => Err(
                "the capture's stream filter could not be copied (out of host memory)".to_string(),
            ),
        };
        result.map_err(|why| {
            logging::call_refused("rust_begin_allocate_to_pool", &why);
            set_last_error(&why);
        })
    });
    match outcome {
        Ok(()) => ptr::null(),
        Err(()) => last_error_ptr(),
    }
}

/// For `rust_end_allocate_to_pool` in `pool_hooks.cpp` only (not exported): PyTorch's
/// `endAllocateToPool`. A pool no capture records into is logged at ERROR; nothing changes.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_internal_end_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) {
    guarded("rust_end_allocate_to_pool", (), || {
        settings();
        if let Err(why) = end_allocate_to_pool(device, pool_id(pool_first, pool_second)) {
            logging::call_refused("rust_end_allocate_to_pool", &why);
        }
    });
}

/// For `rust_release_pool` in `pool_hooks.cpp` only (not exported): PyTorch's `releasePool`
/// (`g.reset()`, or a graph's deletion). An unknown pool, or one with no reference left, is
/// logged at ERROR; nothing changes.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_internal_release_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) {
    guarded("rust_release_pool", (), || {
        settings();
        if let Err(why) = release_pool(device, pool_id(pool_first, pool_second)) {
            logging::call_refused("rust_release_pool", &why);
        }
    });
}

/// PyTorch's `_cuda_beginAllocateCurrentThreadToPool` (what `torch.cuda.use_mem_pool` calls):
/// allocations this thread makes on `device` come from the private pool `(pool_first,
/// pool_second)` (created, or given one more reference) until
/// `ferrocache_end_allocate_to_pool`. Returns 0, or -1 (last error set) when a capture already
/// records into that pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_begin_allocate_current_thread_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error(
        "ferrocache_begin_allocate_current_thread_to_pool",
        -1,
        || {
            let thread = std::thread::current().id();
            let filter: StreamFilter = Box::new(move |_| Ok(std::thread::current().id() == thread));
            begin_allocate_to_pool(device, pool_id(pool_first, pool_second), filter).map(|()| 0)
        },
    )
}

/// PyTorch's `_cuda_endAllocateToPool`: allocations stop going to the pool; it keeps its
/// memory and references. Returns 0, or -1 (last error set) when nothing records into it.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_end_allocate_to_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_end_allocate_to_pool", -1, || {
        end_allocate_to_pool(device, pool_id(pool_first, pool_second)).map(|()| 0)
    })
}

/// PyTorch's `_cuda_releasePool`: drops one reference to the pool. Once none is left and no
/// block in it is live, `empty_cache` gives its memory back to the driver. Returns 0, or -1
/// (last error set) for an unknown pool, one without references, or the last reference of a
/// pool that something still records into.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_release_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_release_pool", -1, || {
        release_pool(device, pool_id(pool_first, pool_second)).map(|()| 0)
    })
}

/// PyTorch's `createOrIncrefPool` (what `torch.cuda.MemPool()` calls): creates the private
/// pool with one reference, or gives an existing one another. Returns 0, or -1 (last error set)
/// when the device is unusable or the id is `(0, 0)` (the ordinary pools').
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_create_or_incref_pool(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_create_or_incref_pool", -1, || {
        let result = allocator(device)?
            .lock()
            .create_or_incref_pool(pool_id(pool_first, pool_second));
        result.map(|_| 0).map_err(|err| err.to_string())
    })
}

/// PyTorch's `setUseOnOOM` and `setNoSplit`, as `torch.cuda.MemPool(use_on_oom=...,
/// no_split=...)` calls them: with `use_on_oom` non-zero, an allocation outside every private
/// pool that would run out of memory may take one of the pool's cached blocks; with `no_split`
/// non-zero, the pool's blocks are handed out whole. Returns 0, or -1 (last error set) when
/// there is no such pool.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_pool_options(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
    use_on_oom: c_int,
    no_split: c_int,
) -> c_int {
    with_last_error("ferrocache_set_pool_options", -1, || {
        let id = pool_id(pool_first, pool_second);
        let result = allocator(device)?
            .lock()
            .set_pool_options(id, use_on_oom != 0, no_split != 0);
        result.map(|()| 0).map_err(|err| err.to_string())
    })
}

/// PyTorch's `emptyCache(mempool_id)`, as `torch.cuda.MemPool`'s destructor calls it: the
/// private pool's cached memory goes back to the device once nothing refers to the pool and
/// none of its blocks is live. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_empty_pool_cache(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_empty_pool_cache", -1, || {
        let Some(allocator) = created_allocator(device) else {
            return Ok(0);
        };
        let result = allocator
            .lock()
            .empty_pool_cache(pool_id(pool_first, pool_second));
        result.map(|()| 0).map_err(|err| err.to_string())
    })
}

/// PyTorch's `getPoolUseCount`: the references the private pool holds. Returns -1 (last error
/// set) when there is no such pool (never created, or gone after `empty_cache`).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_pool_use_count(
    device: c_int,
    pool_first: c_ulonglong,
    pool_second: c_ulonglong,
) -> c_int {
    with_last_error("ferrocache_pool_use_count", -1, || {
        let id = pool_id(pool_first, pool_second);
        let count = allocator(device)?.lock().pool_use_count(id);
        count
            .map(|count| c_int::try_from(count).unwrap_or(c_int::MAX))
            .ok_or_else(|| crate::allocator::private_pool::PoolError::Unknown(id).to_string())
    })
}

// ------------------------------------------------------------------------------------------------
// The Python package's functions
// ------------------------------------------------------------------------------------------------

/// Hands a string to C; the caller gives it back with [`ferrocache_string_free`].
fn into_c_string(text: String) -> *mut c_char {
    CString::new(text.replace('\0', " "))
        .unwrap_or_default()
        .into_raw()
}

/// Frees a string that a `ferrocache_*` function returned. NULL does nothing. Never pass it
/// anything else (in particular not `ferrocache_last_error`'s pointer), nor free those with
/// `free()`.
///
/// # Safety
/// `text` is NULL or a string returned by a `ferrocache_*` function and not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_string_free(text: *mut c_char) {
    if text.is_null() {
        return;
    }
    guarded("ferrocache_string_free", (), || {
        // SAFETY: the caller promises `text` came from `into_c_string` (CString::into_raw) and
        // has not been freed.
        drop(unsafe { CString::from_raw(text) });
    });
}

/// `torch.cuda.memory_stats(device)`: one JSON object with PyTorch's flat keys
/// (`allocated_bytes.all.current`, `num_ooms`, ...). Returns a string to free with
/// `ferrocache_string_free`, or NULL (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_memory_stats(device: c_int) -> *mut c_char {
    with_last_error("ferrocache_memory_stats", ptr::null_mut(), || {
        let json = match allocator_if_used(device)? {
            Some(allocator) => allocator.lock().stats().to_json(),
            None => DeviceStats::new(config()?.max_split_size).to_json(),
        };
        Ok(into_c_string(json))
    })
}

// ------------------------------------------------------------------------------------------------
// Sleep and wake
// ------------------------------------------------------------------------------------------------

/// Set to `1`, every segment is made so that it can sleep from the start, so that
/// `ferrocache_sleep` with no tag gives back all memory. Without it, only memory allocated
/// after the first tag was set (a `region`) can sleep.
const SLEEP_VARIABLE: &str = "FERROCACHE_SLEEP";

fn sleep_ability_requested() -> bool {
    std::env::var_os(SLEEP_VARIABLE).is_some_and(|v| v == "1")
}

/// Tag names, interned: a tag's id is its index plus one.
static TAG_NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// The tag this thread's allocations are made under (`ferrocache.region`).
    static THREAD_TAG: Cell<Option<u32>> = const { Cell::new(None) };
}

fn tag_id(name: &str) -> u32 {
    let mut names = TAG_NAMES.lock();
    let index = match names.iter().position(|n| n == name) {
        Some(index) => index,
        None => {
            names.push(name.to_owned());
            names.len() - 1
        }
    };
    index as u32 + 1
}

/// Reads a C string argument as UTF-8.
///
/// # Safety
/// `text` is a NUL-terminated string.
unsafe fn utf8_argument<'a>(text: *const c_char, what: &str) -> Result<&'a str, String> {
    // SAFETY: the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| format!("the {what} is not valid UTF-8"))
}

/// Makes this thread's allocations from now on go under tag `tag` (NULL: no tag), on every
/// device. The first tag makes every device's new segments sleep-able. Returns 0, or -1 (last
/// error set).
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_thread_tag(tag: *const c_char) -> c_int {
    with_last_error("ferrocache_set_thread_tag", -1, || {
        let id = if tag.is_null() {
            None
        } else {
            // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
            let name = unsafe { utf8_argument(tag, "tag") }?;
            if name.is_empty() {
                return Err("a tag must not be empty".to_string());
            }
            Some(tag_id(name))
        };
        THREAD_TAG.with(|current| current.set(id));
        Ok(0)
    })
}

/// The ids of the tags in `tags` (names separated by newlines; NULL: every tag), for
/// [`Tags`](crate::allocator::sleep::Tags). Unknown names are interned: they hold nothing.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
unsafe fn tag_ids(tags: *const c_char) -> Result<Option<Vec<u32>>, String> {
    if tags.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    let names = unsafe { utf8_argument(tags, "list of tags") }?;
    Ok(Some(
        names
            .lines()
            .filter(|n| !n.is_empty())
            .map(tag_id)
            .collect(),
    ))
}

/// A sleep or wake report as JSON, summed over devices, with the pinned host memory sleep
/// holds after the call.
fn report_json(total: &SleepReport, host_memory_bytes: usize) -> String {
    format!(
        "{{\"segments\": {}, \"bytes\": {}, \"blocks\": {}, \"copied_bytes\": {}, \"skipped_bytes\": {}, \"host_memory_pinned\": {}, \"host_allocations\": {}, \"host_synchronizations\": {}, \"host_memory_bytes\": {}, \"seconds\": {}}}",
        total.segments,
        total.bytes,
        total.blocks,
        total.copied_bytes,
        total.skipped_bytes,
        total.host_memory_pinned,
        total.host_allocations,
        total.host_synchronizations,
        host_memory_bytes,
        total.elapsed.as_secs_f64()
    )
}

fn add_report(total: &mut SleepReport, one: &SleepReport) {
    // Pinned when every device that copied did so through pinned memory.
    if one.copied_bytes > 0 {
        total.host_memory_pinned =
            one.host_memory_pinned && (total.copied_bytes == 0 || total.host_memory_pinned);
    }
    total.host_allocations += one.host_allocations;
    total.host_synchronizations += one.host_synchronizations;
    total.segments += one.segments;
    total.bytes += one.bytes;
    total.blocks += one.blocks;
    total.copied_bytes += one.copied_bytes;
    total.skipped_bytes += one.skipped_bytes;
    total.elapsed += one.elapsed;
}

/// Sleep (`wake` false, with `backup` or not) or wake the memory of `tags` on every device.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
unsafe fn sleep_or_wake(tags: *const c_char, wake: bool, backup: bool) -> Result<String, String> {
    // SAFETY: passed on from the caller.
    let ids = unsafe { tag_ids(tags) }?;
    let tags = match &ids {
        None => Tags::All,
        Some(ids) => Tags::Only(ids),
    };
    let mut total = SleepReport::default();
    let mut host_memory_bytes = 0;
    for (device, allocator) in created_allocators() {
        let mut allocator = allocator.lock();
        let result = if wake {
            allocator.wake(tags)
        } else {
            allocator.sleep(tags, backup)
        };
        match result {
            Ok(report) => add_report(&mut total, &report),
            Err(err) => return Err(format!("device {device}: {err}")),
        }
        host_memory_bytes += allocator.host_memory_bytes();
    }
    Ok(report_json(&total, host_memory_bytes))
}

/// `ferrocache.sleep`: gives back the physical memory of the tags in `tags` (names separated by
/// newlines; NULL: all memory that can sleep), copied to host memory first when `backup` is
/// non-zero. Returns a JSON report (segments, bytes, blocks, copied_bytes, skipped_bytes,
/// host_memory_pinned, host_allocations, host_synchronizations, host_memory_bytes, seconds;
/// docs/sleep.md) to free with `ferrocache_string_free`, or NULL (last error set; what slept stays
/// asleep, and the call can be repeated).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_sleep(tags: *const c_char, backup: c_int) -> *mut c_char {
    with_last_error("ferrocache_sleep", ptr::null_mut(), || {
        // SAFETY: passed on from the caller.
        unsafe { sleep_or_wake(tags, false, backup != 0) }.map(into_c_string)
    })
}

/// `ferrocache.wake`: maps the memory of `tags` (as for `ferrocache_sleep`) back at the same
/// addresses and restores its backup. Returns a JSON report as `ferrocache_sleep` does, or
/// NULL (last error set; what woke stays awake, and the call can be repeated).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_wake(tags: *const c_char) -> *mut c_char {
    with_last_error("ferrocache_wake", ptr::null_mut(), || {
        // SAFETY: passed on from the caller.
        unsafe { sleep_or_wake(tags, true, false) }.map(into_c_string)
    })
}

/// `ferrocache.release_host_memory`: gives back the pinned host memory that sleep keeps for its
/// backups on every device, except what holds the backup of memory still asleep. Returns the
/// bytes given back (what the driver refuses is logged and kept for the next try).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_release_host_memory() -> u64 {
    guarded("ferrocache_release_host_memory", 0, || {
        created_allocators()
            .map(|(_, allocator)| allocator.lock().release_host_memory() as u64)
            .sum()
    })
}

/// The allocator of `device` for a question about its statistics, or `None` for a device that
/// exists but that this process has not allocated on: its statistics are all zero, and asking
/// must not open it. PyTorch keeps statistics for every device from the start, so asking about
/// another GPU costs nothing there; opening the device would retain its primary context, which
/// on a real GPU takes hundreds of MiB on it (under `torchrun`, every rank asking about every
/// device would put a context of each rank on each GPU). The device count is PyTorch's (from
/// `rust_init`); without it, the device is opened to learn whether it exists.
fn allocator_if_used(device: c_int) -> Result<Option<&'static LockedAllocator>, String> {
    let slot = device_slot(device).inspect_err(|why| logging::invalid_device(why))?;
    if let Some(created) = slot.get() {
        return created.as_ref().map(Some).map_err(String::clone);
    }
    if device < DEVICE_COUNT.load(Ordering::Relaxed) {
        return Ok(None);
    }
    allocator(device).map(Some)
}

/// `torch.cuda.memory._snapshot()`: PyTorch's structure as JSON (`segments` of every device,
/// `device_traces` indexed by device, `allocator_settings`). Returns a string to free with
/// `ferrocache_string_free`, or NULL (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_snapshot() -> *mut c_char {
    with_last_error("ferrocache_snapshot", ptr::null_mut(), || {
        let config = config()?;
        let reported_devices = usize::try_from(DEVICE_COUNT.load(Ordering::Relaxed)).unwrap_or(0);
        let mut combined = MemorySnapshot {
            segments: Vec::new(),
            device_traces: Vec::new(),
            allocator_settings: config.to_pytorch_settings(),
        };
        for (device, allocator) in created_allocators() {
            let snapshot = allocator.lock().snapshot();
            combined.segments.extend(snapshot.segments);
            let index = device as usize;
            if combined.device_traces.len() <= index {
                combined.device_traces.resize_with(index + 1, Vec::new);
            }
            combined.device_traces[index] = snapshot.device_traces.into_iter().flatten().collect();
        }
        if combined.device_traces.len() < reported_devices {
            combined
                .device_traces
                .resize_with(reported_devices, Vec::new);
        }
        combined.segments.sort_by_key(|s| (s.device, s.address));
        serde_json::to_string(&combined)
            .map(into_c_string)
            .map_err(|err| format!("the snapshot could not be written as JSON: {err}"))
    })
}

/// `torch.cuda.memory._record_memory_history`: `enabled` non-zero starts recording allocator
/// events (at most `max_entries`, the newest kept) on every device, including devices used
/// later; zero stops and clears. Returns 0.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_record_history(enabled: c_int, max_entries: usize) -> c_int {
    with_last_error("ferrocache_record_history", -1, || {
        let mut setting = CREATION.lock();
        *setting = HistorySetting {
            enabled: enabled != 0,
            max_entries,
        };
        for (_, allocator) in created_allocators() {
            allocator.lock().record_history(enabled != 0, max_entries);
        }
        Ok(0)
    })
}

/// Which `PYTORCH_CUDA_ALLOC_CONF` to set (`ferrocache.advise()`): the settings space searched
/// with the replay engine, as `ferrocache tune` does, on a snapshot or on this process's
/// recorded history. Returns one JSON object (`ferrocache tune --json`'s keys, plus `table`: the
/// text the command prints) to free with `ferrocache_string_free`, or NULL (last error set: no
/// history recorded, with how to record it; a snapshot that cannot be read).
///
/// - `snapshot`, `length`: a snapshot's bytes (pickle or JSON, as `ferrocache tune` reads
///   them); NULL for this process's recorded history.
/// - `device`: the device whose history to search (required for the history); for a snapshot,
///   -1 searches every device in it.
/// - `capacity_bytes`: the GPU's memory to fit in; 0: for the history, the device's memory (or
///   the memory fraction's limit), for a snapshot what its out-of-memory entries tell, else
///   80 GiB. A capacity given also tries `garbage_collection_threshold`.
/// - `max_candidates`: try at most this many settings, the simplest first (0: all).
///
/// # Safety
/// `snapshot` is NULL or points to `length` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_advise(
    snapshot: *const c_char,
    length: usize,
    device: c_int,
    capacity_bytes: c_ulonglong,
    max_candidates: usize,
) -> *mut c_char {
    with_last_error("ferrocache_advise", ptr::null_mut(), || {
        let limit = (max_candidates > 0).then_some(max_candidates);
        let given = (capacity_bytes > 0).then_some(capacity_bytes);
        let tuning = if snapshot.is_null() {
            advise_on_history(device, given, limit)?
        } else {
            // SAFETY: non-NULL, and the caller promises `length` readable bytes.
            let bytes = unsafe { std::slice::from_raw_parts(snapshot.cast::<u8>(), length) };
            let only = usize::try_from(device).ok();
            tune::tune_snapshot(bytes, only, given, limit, TieRule::default())?
        };
        let mut value = tune::report::json(&tuning);
        let table = tune::report::text(&tuning, &tune::report::TextOptions::default());
        if let Some(object) = value.as_object_mut() {
            object.insert("table".to_string(), serde_json::Value::String(table));
        }
        Ok(into_c_string(value.to_string()))
    })
}

/// The search on `device`'s recorded history (its lock held only to copy the history).
fn advise_on_history(
    device: c_int,
    capacity: Option<u64>,
    max_candidates: Option<usize>,
) -> Result<tune::Tuning, String> {
    let allocator = created_allocator(device).ok_or_else(|| {
        format!(
            "device {device} has allocated nothing through ferrocache in this process: {}",
            tune::live::HOW_TO_RECORD
        )
    })?;
    let (snapshot, config, device_memory) = {
        let mut allocator = allocator.lock();
        if !allocator.is_recording_history() {
            return Err(tune::live::HOW_TO_RECORD.to_string());
        }
        let device_memory = match allocator.allowed_memory_maximum() {
            Some(allowed) => allowed as u64,
            None => {
                allocator
                    .device_mut()
                    .mem_get_info()
                    .map_err(|err| format!("cudaMemGetInfo failed: {err}"))?
                    .total as u64
            }
        };
        (
            allocator.history_snapshot(),
            allocator.config().clone(),
            device_memory,
        )
    };
    let capacity = match capacity {
        Some(bytes) => (bytes, tune::CapacitySource::Given),
        None => (device_memory, tune::CapacitySource::Device),
    };
    tune::live::advise_live(&snapshot, &config, device, capacity, max_candidates)
}

/// `torch.cuda.reset_peak_memory_stats(device)`. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_reset_peak_stats(device: c_int) -> c_int {
    with_last_error("ferrocache_reset_peak_stats", -1, || {
        if let Some(allocator) = allocator_if_used(device)? {
            allocator.lock().reset_peak_stats();
        }
        Ok(0)
    })
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_reset_accumulated_stats(device: c_int) -> c_int {
    with_last_error("ferrocache_reset_accumulated_stats", -1, || {
        if let Some(allocator) = allocator_if_used(device)? {
            allocator.lock().reset_accumulated_stats();
        }
        Ok(0)
    })
}

/// `torch.cuda.empty_cache()`: gives every wholly free cached segment of every device back to
/// the driver. Returns 0, or -1 (last error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_empty_cache() -> c_int {
    with_last_error("ferrocache_empty_cache", -1, || {
        empty_all_caches().map(|()| 0)
    })
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`. Returns 0, or -1 (last error
/// set: a fraction outside [0, 1], an unusable device).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_set_memory_fraction(fraction: c_double, device: c_int) -> c_int {
    with_last_error("ferrocache_set_memory_fraction", -1, || {
        set_memory_fraction(fraction, device).map(|()| 0)
    })
}

/// `torch.cuda.memory._set_allocator_settings(text)`: parses `text` as PyTorch's
/// `setAllocatorSettings` does, over the settings in effect (a key not named keeps its value,
/// except `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold`,
/// which go back to their defaults), and applies the result from each device's next decision
/// on. Returns 0, or -1 with PyTorch's wording in the last error, nothing changed.
///
/// # Safety
/// `text` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_set_allocator_settings(text: *const c_char) -> c_int {
    with_last_error("ferrocache_set_allocator_settings", -1, || {
        // SAFETY: passed on from our caller, who promises the same.
        let text = unsafe { text_argument(text, "the allocator setting") }?;
        set_allocator_settings(text).map(|()| 0)
    })
}

/// `torch.cuda.get_per_process_memory_fraction(device)`: the limit
/// `set_per_process_memory_fraction` (or `per_process_memory_fraction`) set on `device`, as a
/// share of its memory; 1 when none was set. Returns -1 when the device cannot be used (last
/// error set).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_get_memory_fraction(device: c_int) -> c_double {
    with_last_error("ferrocache_get_memory_fraction", -1.0, || {
        allocator(device)?
            .lock()
            .memory_fraction()
            .map_err(|err| err.to_string())
    })
}

/// Checks every device allocator's structural invariants and recomputes its statistics from its
/// block table (a full walk: for tests and debugging). Returns 0, or -1 with what is wrong in
/// the last error.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_check_invariants() -> c_int {
    with_last_error("ferrocache_check_invariants", -1, || {
        for (device, allocator) in created_allocators() {
            allocator
                .lock()
                .check_invariants()
                .map_err(|why| format!("device {device}: {why}"))?;
        }
        Ok(0)
    })
}

/// A string argument, named `what` in the error for NULL or text that is not UTF-8.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that outlives the returned reference.
unsafe fn text_argument<'a>(text: *const c_char, what: &str) -> Result<&'a str, String> {
    if text.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| format!("{what} is not valid UTF-8"))
}

/// Reads a `PYTORCH_CUDA_ALLOC_CONF` value, or the process environment when `text` is NULL.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
unsafe fn read_config(text: *const c_char) -> Result<Config, String> {
    if text.is_null() {
        return Config::from_env().map_err(|err| err.message);
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    let text = text
        .to_str()
        .map_err(|_| "the setting is not valid UTF-8".to_string())?;
    Config::parse(text).map_err(|err| err.message)
}

/// Checks a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the one in the process environment, read as
/// PyTorch reads it). Returns 1 when PyTorch would accept it, 0 when not, with PyTorch's
/// wording in the last error.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_check_config(text: *const c_char) -> c_int {
    reporting_errors("ferrocache_check_config", 0, || {
        // SAFETY: passed on from our caller, who promises the same.
        unsafe { read_config(text) }.map(|_| 1)
    })
}

/// What a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the process environment's) sets: one line per
/// setting that differs from PyTorch's defaults, then the keys ferrocache does not use and the
/// warnings. Returns a string to free with `ferrocache_string_free`, or NULL when the value is
/// invalid (last error set, with PyTorch's wording).
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_describe_config(text: *const c_char) -> *mut c_char {
    reporting_errors("ferrocache_describe_config", ptr::null_mut(), || {
        // SAFETY: passed on from our caller, who promises the same.
        let config = unsafe { read_config(text) }?;
        let mut lines = vec![config.describe()];
        if !config.ignored_keys.is_empty() {
            lines.push(format!(
                "not used by ferrocache: {}",
                config.ignored_keys.join(", ")
            ));
        }
        lines.extend(config.warnings.iter().map(|w| format!("warning: {w}")));
        Ok(into_c_string(lines.join("\n")))
    })
}

/// The library's version, e.g. `0.1.0`. A static string; do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(version) => version,
            Err(_) => panic!("the package version has no NUL inside"),
        };
    guarded("ferrocache_version", c"".as_ptr(), || VERSION.as_ptr())
}

/// The exit status of the command when it panicked, as a Rust program's would be.
const CLI_PANIC_STATUS: c_int = 101;

/// The `ferrocache` command (`replay`, `check-config`; see `docs/replay.md`), run in this
/// process: `argv[0]` is the program's name, output goes to stdout and stderr, and the return
/// value is the exit status. It never exits the process. The `ferrocache` binary is this call
/// and nothing else, so that cargo's binary and the wheel's command are one program.
///
/// # Safety
/// `argv` is NULL (with `argc` 0) or points to `argc` pointers, each NULL or a NUL-terminated
/// string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_cli_main(argc: c_int, argv: *const *const c_char) -> c_int {
    guarded("ferrocache_cli_main", CLI_PANIC_STATUS, || {
        let count = usize::try_from(argc).unwrap_or(0);
        let mut args: Vec<OsString> = Vec::with_capacity(count);
        for index in 0..count {
            if argv.is_null() {
                break;
            }
            // SAFETY: the caller promises `argc` readable pointers behind a non-NULL `argv`.
            let arg = unsafe { *argv.add(index) };
            if arg.is_null() {
                // Like C's argv, the list ends at a NULL entry.
                break;
            }
            // SAFETY: the caller promises NUL-terminated strings.
            let bytes = unsafe { CStr::from_ptr(arg) }.to_bytes();
            args.push(OsStr::from_bytes(bytes).to_os_string());
        }
        if args.is_empty() {
            args.push("ferrocache".into());
        }
        c_int::from(crate::cli::run(args))
    })
}
