//! The NVML functions PyTorch's allocator and ferrocache call, exported by the fake driver and
//! reached as `libnvidia-ml.so.1` (a link to the driver, made by build.py and the test
//! harnesses), so that NVML and the driver share one state, as on a real machine.
//!
//! - PyTorch's expandable segments ask NVML whether the GPU has fabric memory before they map
//!   pages, and call through a NULL pointer when no NVML library loads; a real driver always
//!   ships one. Here there is no fabric and no NVLink ("not supported").
//! - The out-of-memory message (PyTorch's `reportProcessMemoryInfo`, ferrocache's
//!   `device::nvml`) lists the processes on the GPU with the memory each uses: NVML is started
//!   (`nvmlInit_v2`, counted, undone by `nvmlShutdown`; the device calls answer "uninitialized"
//!   before), the device is found by its PCI bus id, and its compute processes are the other
//!   processes `FAKE_NVML_OTHER_PROCESSES` names, then the other live processes that share the
//!   device (`FAKE_LIBCUDA_SHARED_DEVICES`, `shared_devices.rs`), then this one once it has
//!   retained the device's primary context, with the bytes it holds there (`cuMemAlloc` and
//!   `cuMemCreate`).
//!
//! The calls are counted (`fake_cuda_stat`) and fail on request (`fake_cuda_fail_next`) like the
//! driver's, with the NVML code given; fault sweeps leave them out.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};

use crate::{Driver, counted_call, device, parse_number};

/// `nvmlReturn_t`.
type NvmlReturn = c_uint;
const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

/// Device handles are this plus the ordinal; never dereferenced by callers.
const DEVICE_HANDLE_BASE: usize = 0x4e56_4d00;

/// A process that `FAKE_NVML_OTHER_PROCESSES` puts on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OtherProcess {
    pub pid: u32,
    pub bytes: u64,
    pub device: i32,
}

impl OtherProcess {
    /// `PID:BYTES[:DEVICE],...` (bytes in decimal or 0x hex; device 0 unless given). A malformed
    /// entry is said on stderr and skipped.
    pub fn parse_list(list: &str) -> Vec<OtherProcess> {
        list.split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .filter_map(|entry| {
                let parsed = OtherProcess::parse(entry);
                if parsed.is_none() {
                    eprintln!(
                        "fake-cuda: FAKE_NVML_OTHER_PROCESSES: {entry:?} is not PID:BYTES[:DEVICE]; skipped"
                    );
                }
                parsed
            })
            .collect()
    }

    fn parse(entry: &str) -> Option<OtherProcess> {
        let mut fields = entry.split(':');
        let pid = fields.next()?.trim().parse().ok()?;
        let bytes = parse_number(fields.next()?)?;
        let device = match fields.next() {
            Some(device) => device.trim().parse().ok()?,
            None => 0,
        };
        fields
            .next()
            .is_none()
            .then_some(OtherProcess { pid, bytes, device })
    }
}

/// `nvmlProcessInfo_v1_t`, what the unversioned `nvmlDeviceGetComputeRunningProcesses` fills.
#[repr(C)]
struct ProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
}

/// Runs the body of the NVML function `name` as the driver's are run (counted, failing on
/// request), but outside fault sweeps.
fn nvml_call(
    name: &'static str,
    body: impl FnOnce(&mut Driver) -> Result<(), NvmlReturn>,
) -> NvmlReturn {
    counted_call(name, false, body)
}

/// [`nvml_call`] for the functions that need NVML started.
fn started_nvml_call(
    name: &'static str,
    body: impl FnOnce(&mut Driver) -> Result<(), NvmlReturn>,
) -> NvmlReturn {
    nvml_call(name, |driver| {
        if driver.nvml_starts == 0 {
            return Err(NVML_ERROR_UNINITIALIZED);
        }
        body(driver)
    })
}

/// Writes through an out pointer, refusing NULL as NVML does (the driver's [`crate::put`], with
/// NVML's error).
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), NvmlReturn> {
    // SAFETY: the caller's promise, passed on.
    unsafe { crate::put(out, value) }.map_err(|_| NVML_ERROR_INVALID_ARGUMENT)
}

/// Reads a PCI bus id as NVML accepts it: `[domain:]bus:device[.function]`, in hex.
fn parse_bus_id(text: &str) -> Option<(i32, i32, i32)> {
    let address = text.split('.').next()?;
    let fields = address
        .split(':')
        .map(|field| i32::from_str_radix(field, 16).ok())
        .collect::<Option<Vec<_>>>()?;
    match fields[..] {
        [domain, bus, device] => Some((domain, bus, device)),
        [bus, device] => Some((0, bus, device)),
        _ => None,
    }
}

impl Driver {
    /// The device behind an NVML handle.
    fn nvml_device(&self, handle: usize) -> Result<i32, NvmlReturn> {
        handle
            .checked_sub(DEVICE_HANDLE_BASE)
            .and_then(|ordinal| i32::try_from(ordinal).ok())
            .filter(|ordinal| (0..self.device_count).contains(ordinal))
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)
    }

    /// The compute processes on `device` and their memory, in the order NVML lists them here.
    fn compute_processes(&self, device: i32) -> Vec<(u32, u64)> {
        let others = self
            .others_on(device)
            .map(|other| (other.pid, other.bytes))
            .chain(self.sharing_processes(device));
        let has_context = self
            .primary_context_refs
            .get(device as usize)
            .is_some_and(|&refs| refs > 0);
        let this_process =
            has_context.then(|| (std::process::id(), self.bytes_in_use[device as usize]));
        others.chain(this_process).collect()
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    nvml_call("nvmlInit_v2", |driver| {
        driver.nvml_starts += 1;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    started_nvml_call("nvmlShutdown", |driver| {
        driver.nvml_starts -= 1;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    handle: *mut usize,
) -> NvmlReturn {
    started_nvml_call("nvmlDeviceGetHandleByPciBusId_v2", |driver| {
        if pci_bus_id.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: checked non-NULL; the caller passes a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(pci_bus_id) }.to_string_lossy();
        let wanted = parse_bus_id(&text).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let ordinal = (0..driver.device_count)
            .find(|&ordinal| device::pci_location(ordinal) == wanted)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: an out pointer from the caller, valid for writes by the NVML API contract.
        unsafe { put(handle, DEVICE_HANDLE_BASE + ordinal as usize) }
    })
}

/// Fills `infos` (room for `*count` entries) with the device's compute processes and sets
/// `*count` to their number; with too little room, sets `*count` to the room needed and answers
/// `NVML_ERROR_INSUFFICIENT_SIZE`, as NVML does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    handle: usize,
    count: *mut c_uint,
    infos: *mut c_void,
) -> NvmlReturn {
    started_nvml_call("nvmlDeviceGetComputeRunningProcesses", |driver| {
        let device = driver.nvml_device(handle)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let processes = driver.compute_processes(device);
        let found = c_uint::try_from(processes.len()).unwrap_or(c_uint::MAX);
        // SAFETY: checked non-NULL; the caller passes a readable and writable count.
        let room = unsafe { count.read() };
        // SAFETY: as above.
        unsafe { count.write(found) };
        if room < found {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        if found > 0 && infos.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let infos = infos.cast::<ProcessInfoV1>();
        for (i, (pid, bytes)) in processes.into_iter().enumerate() {
            // SAFETY: the caller gave room for `room` >= `found` entries at `infos`.
            unsafe {
                infos.add(i).write(ProcessInfoV1 {
                    pid,
                    used_gpu_memory: bytes,
                })
            };
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    nvml_call("nvmlSystemGetCudaDriverVersion_v2", |driver| {
        // SAFETY: an out pointer from the caller, valid for writes by the NVML API contract.
        unsafe { put(version, driver.driver_version) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetGpuFabricInfoV(_device: usize, _info: *mut c_void) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    _device: usize,
    _link: c_uint,
    _kind: *mut c_int,
) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    _device: usize,
    _link: c_uint,
    _pci: *mut c_void,
) -> NvmlReturn {
    NVML_ERROR_NOT_SUPPORTED
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_read_as_nvml_reads_them() {
        assert_eq!(parse_bus_id("00000000:01:00.0"), Some((0, 1, 0)));
        assert_eq!(parse_bus_id("0000:1B:00.0"), Some((0, 0x1b, 0)));
        assert_eq!(parse_bus_id("0a:1f.0"), Some((0, 0xa, 0x1f)));
        assert_eq!(parse_bus_id("not a bus"), None);
    }

    #[test]
    fn other_processes_are_read_from_the_knob() {
        assert_eq!(
            OtherProcess::parse_list("4242:1048576, 7:0x1000:1,bad,9:1:2:3"),
            vec![
                OtherProcess {
                    pid: 4242,
                    bytes: 1 << 20,
                    device: 0
                },
                OtherProcess {
                    pid: 7,
                    bytes: 0x1000,
                    device: 1
                },
            ]
        );
    }
}
