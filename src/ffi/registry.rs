//! The process-wide registry of device allocators, the only global state the allocator has
//! (compare RMM's `per_device_resource.hpp`): one [`Device`] per CUDA device, created on first
//! use with the settings in effect then and kept for the life of the process, each behind its
//! own lock. What applies to every device, those created later included, is kept here too: the
//! settings (read on the library's first use), history recording, caching on or off.
//!
//! A device whose lock a panic poisoned is out of service: [`Device::lock`] refuses it from
//! then on, so nothing is served from an allocator that may be half-updated.

use std::ffi::c_int;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::callbacks;
use super::guard::reporting_errors;
use crate::allocator::DeviceAllocator;
use crate::allocator::tracker::TraceTracker;
use crate::allocator::uncached::DeviceMemory;
use crate::config::Config;
use crate::device::DeviceError;
use crate::device::cuda::CudaDevice;
use crate::lock::{SpinNapGuard, SpinNapMutex};
use crate::logging;

/// The settings in effect, or why the environment's are invalid (then every allocation fails
/// with that message).
pub(crate) type Settings = Result<Mutex<Config>, String>;

pub(crate) fn settings() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        logging::init();
        match Config::from_env() {
            Ok(config) => {
                logging::configuration(&config);
                Ok(Mutex::new(config))
            }
            Err(err) => {
                let variable = crate::config::alloc_conf_variable_in_env();
                logging::configuration_invalid(variable, &err.message);
                Err(format!("{variable} is invalid: {}", err.message))
            }
        }
    })
}

/// Reads the settings and sets up logging, on the library's first use; later calls do nothing.
pub(crate) fn read_once() {
    settings();
}

/// The settings in effect.
pub(crate) fn config() -> Result<Config, String> {
    match settings() {
        Ok(config) => Ok(config.lock().clone()),
        Err(why) => Err(why.clone()),
    }
}

/// [`reporting_errors`] for the `ferrocache_*` functions that read the settings: reads them on
/// the library's first use (with logging), clears the last error, runs `body`, and on `Err`
/// sets it. Logging, where wanted, is `body`'s business.
pub(crate) fn with_last_error<T: Copy>(
    function: &str,
    on_error: T,
    body: impl FnOnce() -> Result<T, String>,
) -> T {
    reporting_errors(function, on_error, || {
        read_once();
        body()
    })
}

/// PyTorch's `c10::DeviceIndex` is an `int8_t`, so there are never more devices than this.
const MAX_DEVICES: usize = 128;

/// What a device's lock guards.
pub(crate) type Memory = DeviceMemory<CudaDevice>;

/// One device's allocator, behind its lock. A cache hit holds the lock for tens of nanoseconds;
/// see `lock` for why it is not parking_lot's.
pub(crate) struct Device {
    index: c_int,
    memory: SpinNapMutex<Memory>,
}

impl Device {
    /// The device's allocator, locked; an error once a panic put it out of service.
    #[inline]
    pub(crate) fn lock(&self) -> Result<SpinNapGuard<'_, Memory>, String> {
        self.memory.lock().map_err(|_| self.out_of_service())
    }

    pub(crate) fn index(&self) -> c_int {
        self.index
    }

    #[cold]
    #[inline(never)]
    fn out_of_service(&self) -> String {
        format!(
            "device {}'s allocator is out of service: an internal error (a panic, logged when it \
             happened) interrupted it part-way, so it serves nothing more; its memory stays \
             held until the process ends",
            self.index
        )
    }
}

/// Per device: its allocator once created, or why it could not be (kept, so that a missing
/// driver is reported once and not retried on every allocation).
static DEVICES: [OnceLock<Result<Device, String>>; MAX_DEVICES] =
    [const { OnceLock::new() }; MAX_DEVICES];

/// What every device gets, those created later included.
pub(crate) struct ProcessWide {
    /// `ferrocache_record_history`'s maximum of entries while recording; `None`: not recording.
    pub(crate) history: Option<usize>,
    /// PyTorch's `enable`: whether new allocations are cached.
    pub(crate) caching_enabled: bool,
    /// The allocator trace tracker attached (`attachAllocatorTraceTracker`), if any.
    pub(crate) trace_tracker: Option<TraceTracker>,
    /// Whether PyTorch's free-memory callbacks are registered (`ferrocache_set_free_memory_callbacks`).
    pub(crate) free_memory_callbacks: bool,
}

/// Held while a device is created and while a process-wide setting changes, so that a device
/// created meanwhile cannot miss the new setting.
static PROCESS_WIDE: Mutex<ProcessWide> = Mutex::new(ProcessWide {
    history: None,
    caching_enabled: true,
    trace_tracker: None,
    free_memory_callbacks: false,
});

/// The device count PyTorch gave to `rust_init`, or -1 before it did.
static DEVICE_COUNT: AtomicI32 = AtomicI32::new(-1);

pub(crate) fn set_device_count(count: c_int) {
    DEVICE_COUNT.store(count, Ordering::Relaxed);
}

/// The device count PyTorch reported (0 before it did).
pub(crate) fn reported_device_count() -> usize {
    usize::try_from(DEVICE_COUNT.load(Ordering::Relaxed)).unwrap_or(0)
}

/// The process-wide settings, locked: change them and apply them to [`created_devices`] while
/// holding the guard.
pub(crate) fn process_wide() -> MutexGuard<'static, ProcessWide> {
    PROCESS_WIDE.lock()
}

fn slot(device: c_int) -> Result<&'static OnceLock<Result<Device, String>>, String> {
    usize::try_from(device)
        .ok()
        .and_then(|index| DEVICES.get(index))
        .ok_or_else(|| format!("invalid device ordinal {device}"))
}

/// The allocator of `device`, created on first use. A device number out of range is bad input,
/// logged at ERROR.
#[inline]
pub(crate) fn device(device: c_int) -> Result<&'static Device, String> {
    // Every allocation comes here: the created allocator is one load away. No `Result` with a
    // message is built on this path (`slot`'s): its drop was a branch and stack traffic on every
    // call.
    if let Some(created) = created(device) {
        return Ok(created);
    }
    first_use_of(device)
}

/// [`device`] when `device` has no usable allocator yet: creates it, or says why not.
#[cold]
#[inline(never)]
fn first_use_of(device: c_int) -> Result<&'static Device, String> {
    // The settings (and logging) are read on the library's first use, before anything is
    // logged; a created allocator implies they were.
    read_once();
    let slot = slot(device).inspect_err(|why| logging::invalid_device(why))?;
    if let Some(created) = slot.get() {
        return created.as_ref().map_err(String::clone);
    }
    let config = config()?;
    let process_wide = PROCESS_WIDE.lock();
    if let Some(created) = slot.get() {
        // Another thread opened it while this one waited for the lock.
        return created.as_ref().map_err(String::clone);
    }
    match CudaDevice::new(device) {
        Ok(cuda) => {
            let config = settings_for_device(&cuda, &config);
            let mut allocator = DeviceAllocator::new(cuda, device, config);
            allocator.set_reserve_class_lookup(Box::new(callbacks::reserve_class_of));
            allocator.set_sleepable(crate::config::sleep_ability_from_env());
            if let Some(max_entries) = process_wide.history {
                allocator.record_history(true, max_entries);
            }
            allocator.set_trace_tracker(process_wide.trace_tracker.clone());
            allocator.set_free_memory_callbacks(process_wide.free_memory_callbacks);
            let memory = DeviceMemory::new(allocator, process_wide.caching_enabled);
            let _ = slot.set(Ok(Device {
                index: device,
                memory: SpinNapMutex::new(memory),
            }));
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
pub(crate) fn settings_for_device(cuda: &CudaDevice, config: &Config) -> Config {
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

/// The devices created so far, in order.
pub(crate) fn created_devices() -> impl Iterator<Item = &'static Device> {
    DEVICES.iter().filter_map(|slot| slot.get()?.as_ref().ok())
}

/// The allocator of `device` if it has been created (and could be).
#[inline(always)]
pub(crate) fn created(device: c_int) -> Option<&'static Device> {
    DEVICES
        .get(usize::try_from(device).ok()?)?
        .get()?
        .as_ref()
        .ok()
}

/// The allocator of `device` for a question about its statistics, or `None` for a device that
/// exists but that this process has not allocated on: its statistics are all zero, and asking
/// must not open it. PyTorch keeps statistics for every device from the start, so asking about
/// another GPU costs nothing there; opening the device would retain its primary context, which
/// on a real GPU takes hundreds of MiB on it (under `torchrun`, every rank asking about every
/// device would put a context of each rank on each GPU). The device count is PyTorch's (from
/// `rust_init`); without it, the device is opened to learn whether it exists.
pub(crate) fn if_used(device: c_int) -> Result<Option<&'static Device>, String> {
    let slot = slot(device).inspect_err(|why| logging::invalid_device(why))?;
    if let Some(created) = slot.get() {
        return created.as_ref().map(Some).map_err(String::clone);
    }
    if device < DEVICE_COUNT.load(Ordering::Relaxed) {
        return Ok(None);
    }
    self::device(device).map(Some)
}

/// What `action` found out about a pointer on one device: not this device's (`None`), or its
/// answer.
pub(crate) type Found<R> = Option<Result<R, String>>;

/// Runs `action` under the lock of each created allocator in turn, `preferred` first, until one
/// knows the pointer `action` is about; with that device's number and answer. `action` is the
/// look-up itself: every method that takes a pointer changes nothing for one it did not hand
/// out. So the usual call costs one lock and one hash-map look-up, and another thread cannot
/// free the pointer between look-up and action. No device knowing it gives `unknown`, or why a
/// device that might have known it is out of service.
pub(crate) fn with_owner<R>(
    preferred: Option<c_int>,
    unknown: impl FnOnce() -> String,
    mut action: impl FnMut(&mut Memory) -> Found<R>,
) -> Result<(c_int, R), String> {
    let first = preferred.and_then(created);
    let others = created_devices().filter(|device| Some(device.index()) != preferred);
    let mut out_of_service = None;
    for device in first.into_iter().chain(others) {
        let mut memory = match device.lock() {
            Ok(memory) => memory,
            Err(why) => {
                out_of_service.get_or_insert(why);
                continue;
            }
        };
        if let Some(answer) = action(&mut memory) {
            return answer.map(|found| (device.index(), found));
        }
    }
    Err(out_of_service.unwrap_or_else(unknown))
}
