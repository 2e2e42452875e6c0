//! What NVML says of the processes on a GPU, for PyTorch's out-of-memory message
//! (`reportProcessMemoryInfo` in `c10/cuda/CUDACachingAllocator.cpp`).
//!
//! NVML is `libnvidia-ml.so.1`, which every NVIDIA driver installs beside `libcuda.so.1`. It is
//! opened and started (`nvmlInit_v2`) at the first out-of-memory of the process, never on the
//! allocation path, and kept for the life of the process, as PyTorch keeps it. A missing library
//! leaves the process sentences out silently, as in PyTorch; a call that fails leaves them out
//! with one WARN line per kind of failure, in PyTorch 2.14's words (2.13 and older fail an
//! internal assert there instead, which turns the out-of-memory into another error: ferrocache
//! never does).

use std::ffi::{CString, c_char, c_uint, c_ulonglong, c_void};
use std::ptr;
use std::sync::{Once, OnceLock};

use super::ProcessMemory;
use crate::logging;

/// `nvmlReturn_t`.
type NvmlReturn = c_uint;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

/// The name PyTorch opens (`DriverAPI::get_nvml_handle`), the one a driver installation provides.
const LIBRARY: &str = "libnvidia-ml.so.1";

/// The room PyTorch makes for the process list at first; NVML says how much it needs if more.
const FIRST_ROOM: usize = 8;
/// Asks for the list at most this often when NVML keeps asking for more room (processes
/// starting meanwhile); PyTorch asks until it fits.
const MAX_ASKS: usize = 8;

/// PyTorch 2.14's warnings, given once each when a call fails and the sentences are left out.
const INIT_FAILED: &str =
    "nvmlInit_v2 failed; omitting per-process memory info from CUDA out-of-memory messages.";
const HANDLE_FAILED: &str = "nvmlDeviceGetHandleByPciBusId failed; omitting per-process memory \
                             info from CUDA out-of-memory messages.";
const PROCESSES_FAILED: &str = "nvmlDeviceGetComputeRunningProcesses failed; omitting \
                                per-process memory info from CUDA out-of-memory messages. This \
                                is expected on platforms with partial NVML support such as \
                                Tegra/Jetson.";

/// `nvmlProcessInfo_v1_t`, what the unversioned `nvmlDeviceGetComputeRunningProcesses` fills
/// in: the function and layout PyTorch uses.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
}

type Init = unsafe extern "C" fn() -> NvmlReturn;
type HandleByPciBusId = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> NvmlReturn;
type ComputeRunningProcesses =
    unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut ProcessInfoV1) -> NvmlReturn;

/// NVML, opened and started.
struct Nvml {
    handle_by_pci_bus_id: HandleByPciBusId,
    compute_running_processes: ComputeRunningProcesses,
    /// Keeps the functions above loaded.
    _library: libloading::Library,
}

/// Where a GPU sits on the PCI bus, as `cudaDeviceProp` (and the driver's attributes) say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PciLocation {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
}

impl PciLocation {
    /// The bus id NVML looks devices up by, as PyTorch writes it (`NVML_DEVICE_PCI_BUS_ID_FMT`).
    fn nvml_bus_id(self) -> String {
        format!("{:08X}:{:02X}:{:02X}.0", self.domain, self.bus, self.device)
    }
}

/// The compute processes on the GPU at `pci` and the memory each uses, in NVML's order; empty
/// where NVML is missing or a call fails.
pub(super) fn compute_processes(pci: PciLocation) -> Vec<ProcessMemory> {
    let Some(nvml) = started_nvml() else {
        return Vec::new();
    };
    let Ok(bus_id) = CString::new(pci.nvml_bus_id()) else {
        return Vec::new();
    };
    let mut device: *mut c_void = ptr::null_mut();
    // SAFETY: a NUL-terminated string and a live out pointer, as the function takes them.
    if unsafe { (nvml.handle_by_pci_bus_id)(bus_id.as_ptr(), &mut device) } != NVML_SUCCESS {
        warn_once(&HANDLE_WARNED, HANDLE_FAILED);
        return Vec::new();
    }
    let mut infos = vec![ProcessInfoV1::default(); FIRST_ROOM];
    for _ in 0..MAX_ASKS {
        let mut count = c_uint::try_from(infos.len()).unwrap_or(c_uint::MAX);
        // SAFETY: `infos` has room for `count` entries; `device` is NVML's handle.
        let answer =
            unsafe { (nvml.compute_running_processes)(device, &mut count, infos.as_mut_ptr()) };
        match answer {
            NVML_SUCCESS => {
                infos.truncate(count as usize);
                return infos
                    .iter()
                    .map(|info| ProcessMemory {
                        pid: info.pid,
                        used_bytes: info.used_gpu_memory,
                    })
                    .collect();
            }
            // `count` is the room needed now.
            NVML_ERROR_INSUFFICIENT_SIZE => {
                let needed = (count as usize).max(infos.len() + 1);
                infos.resize(needed, ProcessInfoV1::default());
            }
            _ => break,
        }
    }
    warn_once(&PROCESSES_WARNED, PROCESSES_FAILED);
    Vec::new()
}

static INIT_WARNED: Once = Once::new();
static HANDLE_WARNED: Once = Once::new();
static PROCESSES_WARNED: Once = Once::new();

fn warn_once(once: &Once, warning: &str) {
    once.call_once(|| logging::warning(warning));
}

/// NVML, opened and started at the first call; `None` for good where it is missing or does not
/// start (PyTorch too tries `nvmlInit_v2` once per process).
fn started_nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(open_and_start).as_ref()
}

fn open_and_start() -> Option<Nvml> {
    // SAFETY: opening NVML runs its initialisers, as PyTorch's dlopen of it does.
    let library = unsafe { libloading::Library::new(LIBRARY) }.ok()?;
    // SAFETY: each name is looked up with the signature NVML's header gives it.
    let functions = unsafe {
        (
            library.get::<Init>(b"nvmlInit_v2").map(|f| *f),
            library
                .get::<HandleByPciBusId>(b"nvmlDeviceGetHandleByPciBusId_v2")
                .map(|f| *f),
            library
                .get::<ComputeRunningProcesses>(b"nvmlDeviceGetComputeRunningProcesses")
                .map(|f| *f),
        )
    };
    let (Ok(init), Ok(handle_by_pci_bus_id), Ok(compute_running_processes)) = functions else {
        // A driver too old for PyTorch too (its NVML lacks a function PyTorch looks up).
        logging::warning(&format!(
            "{LIBRARY} lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2 or \
             nvmlDeviceGetComputeRunningProcesses; omitting per-process memory info from CUDA \
             out-of-memory messages."
        ));
        return None;
    };
    // SAFETY: takes nothing; NVML counts its starts, so PyTorch's own start does not matter.
    if unsafe { init() } != NVML_SUCCESS {
        warn_once(&INIT_WARNED, INIT_FAILED);
        return None;
    }
    Some(Nvml {
        handle_by_pci_bus_id,
        compute_running_processes,
        _library: library,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bus_id_is_written_as_nvml_and_pytorch_write_it() {
        let pci = PciLocation {
            domain: 0,
            bus: 0x1b,
            device: 0,
        };
        assert_eq!(pci.nvml_bus_id(), "00000000:1B:00.0");
        let pci = PciLocation {
            domain: 0x10,
            bus: 0xa,
            device: 0x1f,
        };
        assert_eq!(pci.nvml_bus_id(), "00000010:0A:1F.0");
    }

    #[test]
    fn the_process_list_has_nvmls_v1_layout() {
        // pid, 4 bytes of padding, then the 64-bit byte count: 16 bytes a process.
        assert_eq!(std::mem::size_of::<ProcessInfoV1>(), 16);
        assert_eq!(std::mem::offset_of!(ProcessInfoV1, used_gpu_memory), 8);
    }
}
