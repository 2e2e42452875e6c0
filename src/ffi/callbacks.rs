//! Functions that C registers for the allocator to call: the stack gatherer (Python stacks in
//! traces), the out-of-memory thrower and observers (PyTorch's exception and
//! `_cuda_attach_out_of_memory_observer`), and the reserve-class lookup (PyTorch's C++ API).

use std::ffi::{CStr, c_char, c_int};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use parking_lot::Mutex;

use super::guard::{guarded, reporting_errors};
use super::{cudaStream_t, stream_handle};
use crate::allocator::OutOfMemoryError;
use crate::allocator::history::StackId;
use crate::device::StreamId;

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
/// Called at an out of memory, PyTorch's `OutOfMemoryObserver`: the device, the size that
/// could not be had, the device's total memory (or the memory-fraction limit, when one is set)
/// and its free memory. See [`ferrocache_attach_oom_observer`].
pub type OomObserver =
    extern "C" fn(device: c_int, alloc_size: usize, device_total: usize, device_free: usize);
/// An [`OomObserver`] or NULL, as the C ABI takes it.
#[allow(non_camel_case_types, reason = "a C type of the header")]
pub type ferrocache_oom_observer = Option<OomObserver>;

/// What a [`StackGatherer`] is asked about.
#[repr(i32)]
#[derive(Clone, Copy)]
pub(crate) enum StackEvent {
    Alloc = 0,
    Free = 1,
}

/// The registered gatherer (NULL: none; recording stacks costs one atomic load then).
static STACK_GATHERER: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());
/// Whether frees ask the gatherer too (PyTorch's `context="all"`).
static GATHER_ON_FREE: AtomicBool = AtomicBool::new(false);
/// The registered thrower (NULL: `rust_malloc` throws `std::runtime_error`).
static OOM_THROWER: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());
/// The registered reserve-class lookup (NULL: every stream is untagged).
static RESERVE_CLASS_LOOKUP: AtomicPtr<()> = AtomicPtr::new(ptr::null_mut());
/// The attached observers, in the order attached.
static OOM_OBSERVERS: Mutex<Vec<OomObserver>> = Mutex::new(Vec::new());

/// The calling thread's stack id from the registered gatherer, or 0. Call it with no allocator
/// lock held: the gatherer takes the GIL, which a thread waiting for the lock may hold.
#[inline(always)]
pub(crate) fn gather_stack(event: StackEvent) -> StackId {
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

/// The registered thrower, if any.
pub(crate) fn oom_thrower() -> Option<OomThrower> {
    let thrower = OOM_THROWER.load(Ordering::Acquire);
    if thrower.is_null() {
        return None;
    }
    // SAFETY: only ferrocache_set_oom_thrower stores here, and only an OomThrower.
    Some(unsafe { std::mem::transmute::<*mut (), OomThrower>(thrower) })
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

/// Armed by [`ferrocache_debug_panic_at_next_reserve_class_lookup`].
#[cfg(debug_assertions)]
static PANIC_AT_NEXT_RESERVE_CLASS_LOOKUP: AtomicBool = AtomicBool::new(false);

/// Debug builds only, for tests (`tests/ffi.rs`): the next reserve-class lookup the allocator
/// makes, under its lock and part-way through an operation, panics.
#[cfg(debug_assertions)]
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_debug_panic_at_next_reserve_class_lookup() {
    PANIC_AT_NEXT_RESERVE_CLASS_LOOKUP.store(true, Ordering::Relaxed);
}

/// The reserve class of `stream` from the registered lookup; empty without one.
pub(crate) fn reserve_class_of(stream: StreamId) -> String {
    #[cfg(debug_assertions)]
    if PANIC_AT_NEXT_RESERVE_CLASS_LOOKUP.swap(false, Ordering::Relaxed) {
        panic!("the debug build's fault: a panic in the reserve-class lookup");
    }
    let lookup = RESERVE_CLASS_LOOKUP.load(Ordering::Acquire);
    if lookup.is_null() {
        return String::new();
    }
    // SAFETY: only ferrocache_set_reserve_class_lookup stores here, and only a
    // ReserveClassLookup, whose owner promises it stays callable.
    let lookup: ReserveClassLookup =
        unsafe { std::mem::transmute::<*mut (), ReserveClassLookup>(lookup) };
    let answer = lookup(stream_handle(stream));
    if answer.is_null() {
        return String::new();
    }
    // SAFETY: the lookup returns a NUL-terminated string valid until its next call on this
    // thread, which cannot come before this copy.
    unsafe { CStr::from_ptr(answer) }
        .to_string_lossy()
        .into_owned()
}

/// PyTorch's rule (`DeviceCachingAllocator::malloc`): at an out of memory, with the device's
/// lock released (an observer may take the GIL, which another thread waiting for that lock may
/// hold, and may ask the allocator for a snapshot), each observer is called in turn, before
/// the exception is thrown. Observers attached meanwhile are called from the next one on.
pub(crate) fn notify_oom_observers(oom: &OutOfMemoryError) {
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
