//! Initialisation, devices and contexts.
//!
//! Each device has one primary context, a fixed handle that is usable while retained. There is
//! also one "foreign" context, standing for a context another library created: it can be made
//! current, but memory calls made under it fail, so a caller that forgets to switch to the
//! primary context is caught.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::{
    CONTEXT_STACK, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
    CuResult, Driver, call, call_before_init, current_context, put,
};

const PRIMARY_CONTEXT_BASE: usize = 0xc0de_0000;
pub const FOREIGN_CONTEXT: usize = 0xf0e1_0000;
const DEVICE_NAME: &[u8] = b"Fake CUDA Device (ferrocache tests)";

const ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTRIBUTE_PCI_BUS_ID: c_int = 33;
const ATTRIBUTE_PCI_DEVICE_ID: c_int = 34;
const ATTRIBUTE_PCI_DOMAIN_ID: c_int = 50;
const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
const ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
const ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
const ATTRIBUTE_MULTICAST_SUPPORTED: c_int = 132;

thread_local! {
    /// Per device, how many times the calling thread retained its primary context or made it
    /// current (`fake_cuda_thread_context_entries`): a process-wide count cannot tell what one
    /// thread did from what the process's other threads did meanwhile (PyTorch's gloo workers,
    /// for one, make device 0 current when they destroy an event; README "Contexts").
    static CONTEXT_ENTRIES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Counts an entry of the calling thread into `device`'s primary context. After the thread's
/// destructors ran (an exit handler calling the driver) nothing is counted.
fn count_context_entry(device: i32) {
    let Ok(index) = usize::try_from(device) else {
        return;
    };
    let _ = CONTEXT_ENTRIES.try_with(|entries| {
        let mut entries = entries.borrow_mut();
        if entries.len() <= index {
            entries.resize(index + 1, 0);
        }
        entries[index] += 1;
    });
}

/// How many times the calling thread retained `device`'s primary context
/// (`cuDevicePrimaryCtxRetain`) or made it current (`cuCtxSetCurrent`, `cuCtxPushCurrent`);
/// -1 for a device that is not one.
#[unsafe(no_mangle)]
pub extern "C" fn fake_cuda_thread_context_entries(device: c_int) -> i64 {
    if !(0..crate::lock().device_count).contains(&device) {
        return -1;
    }
    CONTEXT_ENTRIES
        .try_with(|entries| entries.borrow().get(device as usize).copied().unwrap_or(0))
        .map_or(0, |count| i64::try_from(count).unwrap_or(i64::MAX))
}

pub fn primary_context(device: i32) -> usize {
    PRIMARY_CONTEXT_BASE + device as usize
}

/// Where `device` sits on the PCI bus, as (domain, bus, device): each GPU on a bus of its own,
/// numbered from 1 (what `cuDeviceGetAttribute`, the runtime's properties and NVML say).
pub fn pci_location(device: i32) -> (i32, i32, i32) {
    (0, device + 1, 0)
}

impl Driver {
    /// The device whose primary context `context` is, if it is one.
    fn primary_context_device(&self, context: usize) -> Option<i32> {
        let device = i32::try_from(context.checked_sub(PRIMARY_CONTEXT_BASE)?).ok()?;
        (device < self.device_count).then_some(device)
    }

    /// The device whose primary context `context` is, if it is one and retained.
    pub fn retained_primary_context_device(&self, context: usize) -> Option<i32> {
        self.primary_context_device(context)
            .filter(|&device| self.primary_context_refs[device as usize] > 0)
    }

    /// A context may be made current if it is the foreign one or a retained primary context.
    fn usable_context(&self, context: usize) -> bool {
        context == FOREIGN_CONTEXT || self.retained_primary_context_device(context).is_some()
    }

    /// The device of the calling thread's current context, which must be a retained primary
    /// context: what every memory, stream and event call needs.
    pub fn require_primary_context(&self) -> Result<i32, CuResult> {
        let context = current_context();
        match self.primary_context_device(context) {
            Some(device) if self.primary_context_refs[device as usize] > 0 => Ok(device),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    call_before_init("cuInit", |driver| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if driver.device_count <= 0 {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        // Idempotent, as the real one: the runtime and ferrocache both call it.
        if !driver.initialized {
            driver.initialized = true;
            driver.primary_context_refs = vec![0; driver.device_count as usize];
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    call_before_init("cuDriverGetVersion", |driver| {
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(version, driver.driver_version) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    call("cuDeviceGetCount", |driver| {
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(count, driver.device_count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    call("cuDeviceGet", |driver| {
        driver.valid_device(ordinal)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: c_int,
) -> CuResult {
    call("cuDeviceGetAttribute", |driver| {
        driver.valid_device(device)?;
        let (pci_domain, pci_bus, pci_device) = pci_location(device);
        let answer = match attribute {
            ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
            ATTRIBUTE_PCI_BUS_ID => pci_bus,
            ATTRIBUTE_PCI_DEVICE_ID => pci_device,
            ATTRIBUTE_PCI_DOMAIN_ID => pci_domain,
            ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
            ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
            ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => c_int::from(driver.features.vmm),
            ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => {
                c_int::from(driver.features.posix_fd_handles)
            }
            ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED => {
                c_int::from(driver.features.rdma_with_vmm)
            }
            ATTRIBUTE_MULTICAST_SUPPORTED => c_int::from(driver.features.multicast),
            // An H100's limits, which compilers (Triton) size kernels by.
            other => crate::launch::device_limit(other).unwrap_or(0),
        };
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(value, answer) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> CuResult {
    call("cuDeviceTotalMem_v2", |driver| {
        driver.valid_device(device)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(bytes, driver.capacity as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    length: c_int,
    device: c_int,
) -> CuResult {
    call("cuDeviceGetName", |driver| {
        driver.valid_device(device)?;
        if name.is_null() || length <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Truncated to fit, always NUL-terminated, as the driver does.
        let copied = DEVICE_NAME.len().min(length as usize - 1);
        // SAFETY: the caller provides `length` writable bytes at `name`; we write `copied + 1`.
        unsafe {
            std::ptr::copy_nonoverlapping(DEVICE_NAME.as_ptr(), name.cast::<u8>(), copied);
            name.add(copied).write(0);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut *mut c_void,
    device: c_int,
) -> CuResult {
    call("cuDevicePrimaryCtxRetain", |driver| {
        driver.valid_device(device)?;
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(context, primary_context(device) as *mut c_void) }?;
        driver.primary_context_refs[device as usize] += 1;
        count_context_entry(device);
        Ok(())
    })
}

/// Whether the primary context is active (retained); its flags are always 0 here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    device: c_int,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CuResult {
    call("cuDevicePrimaryCtxGetState", |driver| {
        driver.valid_device(device)?;
        let retained = driver.primary_context_refs[device as usize] > 0;
        // SAFETY: out pointers from the caller, valid for writes by the driver API contract.
        unsafe {
            put(flags, 0)?;
            put(active, c_int::from(retained))
        }
    })
}

fn release_primary_context(driver: &mut Driver, device: c_int) -> Result<(), CuResult> {
    driver.valid_device(device)?;
    let refs = &mut driver.primary_context_refs[device as usize];
    if *refs == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    *refs -= 1;
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease(device: c_int) -> CuResult {
    call("cuDevicePrimaryCtxRelease", |driver| {
        release_primary_context(driver, device)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(device: c_int) -> CuResult {
    call("cuDevicePrimaryCtxRelease_v2", |driver| {
        release_primary_context(driver, device)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut *mut c_void) -> CuResult {
    call("cuCtxGetCurrent", |_| {
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(context, current_context() as *mut c_void) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(context: *mut c_void) -> CuResult {
    call("cuCtxSetCurrent", |driver| {
        let context = context as usize;
        if context != 0 && !driver.usable_context(context) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        // Replaces the top of the stack; NULL pops it (a no-op on an empty stack).
        with_context_stack(|stack| {
            stack.pop();
            if context != 0 {
                stack.push(context);
            }
        })?;
        if let Some(device) = driver.primary_context_device(context) {
            count_context_entry(device);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(context: *mut c_void) -> CuResult {
    call("cuCtxPushCurrent_v2", |driver| {
        let context = context as usize;
        if !driver.usable_context(context) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        with_context_stack(|stack| stack.push(context))?;
        if let Some(device) = driver.primary_context_device(context) {
            count_context_entry(device);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(context: *mut *mut c_void) -> CuResult {
    call("cuCtxPopCurrent_v2", |_| {
        let popped = with_context_stack(|stack| stack.pop())?.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        // The out parameter is optional here.
        if !context.is_null() {
            // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
            unsafe { put(context, popped as *mut c_void) }?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> CuResult {
    call("cuCtxGetDevice", |driver| {
        let context = current_context();
        let ordinal = match driver.primary_context_device(context) {
            Some(ordinal) => ordinal,
            None if context == FOREIGN_CONTEXT => 0,
            None => return Err(CUDA_ERROR_INVALID_CONTEXT),
        };
        // SAFETY: an out pointer from the caller, valid for writes by the driver API contract.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    call("cuCtxSynchronize", crate::sync::synchronize_context)
}

/// The calling thread's context stack; after the thread's destructors ran (an exit handler
/// calling the driver) there is none, and the call answers `CUDA_ERROR_INVALID_CONTEXT`.
fn with_context_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> Result<T, CuResult> {
    CONTEXT_STACK
        .try_with(|stack| f(&mut stack.borrow_mut()))
        .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)
}
