//! CUDA IPC for ferrocache's own `CUDAAllocator` object: `shareIpcHandle` and `getIpcDevPtr`,
//! in PyTorch's own handle format ([`handle`]), so that a CUDA tensor travels between a
//! ferrocache process and one on PyTorch's allocator, either way, and between two ferrocache
//! processes.
//!
//! - Sharing: the core says what holds the allocation ([`Shareable`]): a plain segment is
//!   shared by `cuIpcGetMemHandle` of its base, pages (expandable and VMM-backed segments) by
//!   one POSIX file descriptor each, which the device keeps open until the page's release.
//!   The offset of the allocation in what is shared goes back with the bytes. Whether the
//!   receiver still uses the memory is PyTorch's reference counting (`CudaIPCTypes.h`): the
//!   sender's storage keeps the block allocated until the count falls to zero.
//! - Opening: a memory handle with `cuIpcOpenMemHandle`; pages by taking the sender's
//!   descriptors with `pidfd_open` and `pidfd_getfd` (or fabric handles as they are),
//!   importing them, and mapping them in a range reserved for them, as PyTorch's
//!   `ExpandableSegment::fromShared`. A handle already open is not opened again: it counts one
//!   more user ([`OPENED`], PyTorch's `ipcMemHandle_to_devptr`), and the last close unmaps.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

use parking_lot::Mutex;

use super::guard::guarded;
use super::registry::{self, with_last_error};
use super::{device_address, device_pointer, unknown_pointer};
use crate::allocator::ipc_handle::{self as handle, PageHandle, SharedMemory};
use crate::allocator::shareable::{ShareError, Shareable};
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, SharedPhysical};
use crate::logging;

/// `CUDAAllocator::shareIpcHandle`: the handle of the allocation that starts at `ptr`, in the
/// format of PyTorch `version` (3 for 2.13 and later, 2 before), as a buffer of `*len` bytes
/// that `ferrocache_ipc_bytes_free` gives back; the allocation's offset in the shared memory
/// in `*offset`. NULL when it cannot be shared, with the reason in the last error.
///
/// # Safety
/// `len` and `offset` are valid for one write each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_ipc_share(
    ptr: *mut c_void,
    version: c_int,
    len: *mut usize,
    offset: *mut i64,
) -> *mut u8 {
    with_last_error("ferrocache_ipc_share", std::ptr::null_mut(), || {
        let version = u8::try_from(version)
            .ok()
            .filter(|v| (handle::UNTYPED_VERSION..=handle::CURRENT_VERSION).contains(v))
            .ok_or_else(|| format!("no shareable handle version {version}"))?;
        let (bytes, at) = share(device_address(ptr), version)?;
        // SAFETY: the caller promises both are valid for a write.
        unsafe {
            len.write(bytes.len());
            offset.write(at as i64);
        }
        Ok(Box::into_raw(bytes.into_boxed_slice()).cast::<u8>())
    })
}

/// Gives back a buffer of `len` bytes that `ferrocache_ipc_share` returned.
///
/// # Safety
/// `bytes` came from `ferrocache_ipc_share` with this `len`, and is given back once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_ipc_bytes_free(bytes: *mut u8, len: usize) {
    guarded("ferrocache_ipc_bytes_free", (), || {
        if !bytes.is_null() {
            // SAFETY: the caller promises a buffer `ferrocache_ipc_share` made of `len` bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(bytes, len)) });
        }
    });
}

/// `CUDAAllocator::getIpcDevPtr`: maps the memory that the `len` bytes of `handle` name (from
/// ferrocache or PyTorch's allocator) on `device`, or finds it mapped already. Returns where
/// it starts, with `*token` for `ferrocache_ipc_close`; NULL with the reason in the last error.
///
/// # Safety
/// `handle` is valid for `len` bytes; `token` for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_ipc_open(
    handle: *const u8,
    len: usize,
    device: c_int,
    token: *mut u64,
) -> *mut c_void {
    let opened = with_last_error("ferrocache_ipc_open", None, || {
        // SAFETY: the caller promises `len` readable bytes.
        let bytes = unsafe { std::slice::from_raw_parts(handle, len) };
        open(bytes, device).map(Some)
    });
    let Some((ptr, id)) = opened else {
        return std::ptr::null_mut();
    };
    // SAFETY: the caller promises it is valid for a write.
    unsafe { token.write(id) };
    device_pointer(ptr)
}

/// The end of one `ferrocache_ipc_open`'s use: the last user of a mapping unmaps it (after
/// the device's work is done, as PyTorch). 0, or -1 with the reason in the last error (logged:
/// it runs in a deleter, which must not throw).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_ipc_close(token: u64) -> c_int {
    with_last_error("ferrocache_ipc_close", -1, || {
        close(token)
            .map(|()| 0)
            .inspect_err(|why| logging::call_failed("ferrocache_ipc_close", why))
    })
}

/// The handle bytes and the offset of the allocation at `ptr`, from the device that holds it.
fn share(ptr: DevicePtr, version: u8) -> Result<(Vec<u8>, usize), String> {
    let (_, shared) = registry::with_owner(
        None,
        || unknown_pointer(ptr),
        |memory| {
            let shareable = match memory.shareable(ptr) {
                Err(ShareError::Pointer(_)) => return None,
                Err(asleep) => return Some(Err(asleep.to_string())),
                Ok(shareable) => shareable,
            };
            let device = memory.allocator_mut().device_mut();
            Some(describe(device, shareable).map_err(|err| err.to_string()))
        },
    )?;
    let (memory, offset) = shared;
    Ok((handle::write(&memory, version), offset))
}

/// The handle's contents for `shareable`, asked of the device that holds it.
fn describe<D: Device>(
    device: &mut D,
    shareable: Shareable,
) -> Result<(SharedMemory, usize), DeviceError> {
    match shareable {
        Shareable::Plain { base, offset } => Ok((
            SharedMemory::Allocation(device.ipc_memory_handle(base)?),
            offset,
        )),
        Shareable::Pages {
            page_size,
            handles,
            offset,
        } => {
            let pages = handles
                .into_iter()
                .map(|page| device.export_physical(page).map(PageHandle::FileDescriptor))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((
                SharedMemory::Pages {
                    pid: std::process::id() as i32,
                    page_size: page_size as u64,
                    pages,
                },
                offset,
            ))
        }
    }
}

/// Memory of another process mapped here.
#[derive(Debug)]
enum Mapping {
    /// By `cuIpcOpenMemHandle`.
    Allocation(DevicePtr),
    /// Imported pages mapped from `base` on, in a range reserved for them.
    Pages {
        base: DevicePtr,
        page_size: usize,
        handles: Vec<PhysicalHandle>,
    },
}

impl Mapping {
    fn ptr(&self) -> DevicePtr {
        match self {
            Mapping::Allocation(ptr) => *ptr,
            Mapping::Pages { base, .. } => *base,
        }
    }
}

#[derive(Debug)]
struct Opened {
    handle: Vec<u8>,
    device: c_int,
    mapping: Mapping,
    users: usize,
}

/// What is open, by token, and the token of each handle.
#[derive(Debug, Default)]
struct OpenedTable {
    by_token: HashMap<u64, Opened>,
    by_handle: HashMap<Vec<u8>, u64>,
    next_token: u64,
}

/// Held while a handle is opened, as PyTorch's `IpcMutex`, so that two threads opening the
/// same handle map it once. Taken before a device's lock, never after.
static OPENED: Mutex<Option<OpenedTable>> = Mutex::new(None);

fn open(bytes: &[u8], device: c_int) -> Result<(DevicePtr, u64), String> {
    let mut table = OPENED.lock();
    let table = table.get_or_insert_with(OpenedTable::default);
    if let Some(&token) = table.by_handle.get(bytes) {
        let opened = table
            .by_token
            .get_mut(&token)
            .expect("every handle's token is open");
        opened.users += 1;
        return Ok((opened.mapping.ptr(), token));
    }
    // PyTorch's receiver reads an old handle's pages as its own handle type: POSIX descriptors
    // unless fabric handles were configured, which ferrocache does not do.
    let memory = handle::parse(bytes, false)?;
    let allocator = registry::device(device)?;
    let mapping = {
        let mut locked = allocator.lock()?;
        map_shared(locked.allocator_mut().device_mut(), &memory)?
    };
    table.next_token += 1;
    let token = table.next_token;
    let ptr = mapping.ptr();
    table.by_handle.insert(bytes.to_vec(), token);
    table.by_token.insert(
        token,
        Opened {
            handle: bytes.to_vec(),
            device,
            mapping,
            users: 1,
        },
    );
    Ok((ptr, token))
}

fn close(token: u64) -> Result<(), String> {
    let last = {
        let mut table = OPENED.lock();
        let table = table.get_or_insert_with(OpenedTable::default);
        let opened = table
            .by_token
            .get_mut(&token)
            .ok_or_else(|| format!("no CUDA IPC mapping is open as {token}"))?;
        opened.users -= 1;
        if opened.users > 0 {
            return Ok(());
        }
        let opened = table.by_token.remove(&token).expect("found above");
        table.by_handle.remove(&opened.handle);
        opened
    };
    // The device lock only: unmapping waits for the device, and another open need not wait.
    let allocator = registry::device(last.device)?;
    let mut locked = allocator.lock()?;
    unmap_shared(locked.allocator_mut().device_mut(), last.mapping)
        .map_err(|err| format!("closing memory of another process: {err}"))
}

/// Maps what `memory` names on `device`; all or nothing.
fn map_shared<D: Device>(device: &mut D, memory: &SharedMemory) -> Result<Mapping, String> {
    match memory {
        SharedMemory::Allocation(handle) => device
            .open_ipc_memory(handle)
            .map(Mapping::Allocation)
            .map_err(|err| err.to_string()),
        SharedMemory::Pages {
            pid,
            page_size,
            pages,
        } => {
            let page_size = usize::try_from(*page_size).map_err(|err| err.to_string())?;
            let shared = physical_of(*pid, pages)?;
            let mut handles = Vec::with_capacity(shared.len());
            for page in &shared {
                match device.import_physical(&page.physical) {
                    Ok(handle) => handles.push(handle),
                    Err(err) => {
                        release_all(device, &handles);
                        return Err(err.to_string());
                    }
                }
            }
            drop(shared); // the imports hold the memory; the descriptors are no longer needed
            map_pages(device, page_size, handles).map_err(|err| err.to_string())
        }
    }
}

/// A page's shareable handle as this process holds it; a descriptor taken from the sender is
/// closed when this is dropped.
struct TakenPage {
    physical: SharedPhysical,
    _descriptor: Option<OwnedFd>,
}

/// Each page's shareable handle, the sender's descriptors taken with `pidfd_getfd`.
fn physical_of(pid: i32, pages: &[PageHandle]) -> Result<Vec<TakenPage>, String> {
    let mut pidfd = None;
    let mut taken = Vec::with_capacity(pages.len());
    for page in pages {
        match page {
            PageHandle::Fabric(bytes) => taken.push(TakenPage {
                physical: SharedPhysical::Fabric(*bytes),
                _descriptor: None,
            }),
            PageHandle::FileDescriptor(fd) => {
                if pidfd.is_none() {
                    pidfd = Some(pidfd_open(pid)?);
                }
                let from = pidfd.as_ref().expect("opened above");
                let mine = pidfd_getfd(from, *fd, pid)?;
                taken.push(TakenPage {
                    physical: SharedPhysical::FileDescriptor(raw(&mine)),
                    _descriptor: Some(mine),
                });
            }
        }
    }
    Ok(taken)
}

fn raw(fd: &OwnedFd) -> i32 {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

fn pidfd_open(pid: i32) -> Result<OwnedFd, String> {
    // SAFETY: a plain system call with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    owned(fd).map_err(|err| {
        format!(
            "pidfd_open of the sending process {pid}: {err}{}",
            kernel_hint(&err)
        )
    })
}

fn pidfd_getfd(pidfd: &OwnedFd, fd: i32, pid: i32) -> Result<OwnedFd, String> {
    // SAFETY: a plain system call with integer arguments; `pidfd` is open.
    let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, raw(pidfd), fd, 0) };
    owned(mine).map_err(|err| {
        format!(
            "pidfd_getfd of descriptor {fd} of the sending process {pid}: {err}{}",
            kernel_hint(&err)
        )
    })
}

/// A system call's new descriptor, or its error.
fn owned(fd: libc::c_long) -> Result<OwnedFd, std::io::Error> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the call just made, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// What PyTorch says beside a refused `pidfd_*` call.
fn kernel_hint(err: &std::io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::ENOSYS) => {
            " (the kernel lacks the system call that CUDA IPC with expandable segments needs; \
             share from a process with expandable_segments:False)"
        }
        Some(libc::EPERM) => {
            " (taking another process's descriptor needs ptrace access to it: same user, and \
             kernel.yama.ptrace_scope allowing it)"
        }
        _ => "",
    }
}

/// Reserves a range for `handles` and maps each, readable and writable on the device and its
/// peers; on a failure, gives back everything (the imported handles included).
fn map_pages<D: Device>(
    device: &mut D,
    page_size: usize,
    handles: Vec<PhysicalHandle>,
) -> Result<Mapping, DeviceError> {
    let size = page_size * handles.len();
    let base = match device.reserve_address_range(size) {
        Ok(base) => base,
        Err(err) => {
            release_all(device, &handles);
            return Err(err);
        }
    };
    let mut mapped = 0;
    let outcome = (|| {
        for (i, &handle) in handles.iter().enumerate() {
            device.map(base + (i * page_size) as u64, page_size, handle)?;
            mapped += 1;
        }
        device.set_access(base, size)
    })();
    if let Err(err) = outcome {
        for i in 0..mapped {
            let _ = device.unmap(base + (i * page_size) as u64, page_size);
        }
        release_all(device, &handles);
        let _ = device.free_address_range(base, size);
        return Err(err);
    }
    Ok(Mapping::Pages {
        base,
        page_size,
        handles,
    })
}

fn release_all<D: Device>(device: &mut D, handles: &[PhysicalHandle]) {
    for &handle in handles {
        if let Err(err) = device.release_physical(handle) {
            logging::device_error("releasing memory imported from another process", &err);
        }
    }
}

/// Unmaps memory of another process, after the device's work that may use it is done.
fn unmap_shared<D: Device>(device: &mut D, mapping: Mapping) -> Result<(), DeviceError> {
    match mapping {
        Mapping::Allocation(ptr) => device.close_ipc_memory(ptr),
        Mapping::Pages {
            base,
            page_size,
            handles,
        } => {
            device.synchronize_device()?;
            let mut first_error = None;
            for (i, &handle) in handles.iter().enumerate() {
                let outcome = device
                    .unmap(base + (i * page_size) as u64, page_size)
                    .and_then(|()| device.release_physical(handle));
                if let Err(err) = outcome {
                    first_error.get_or_insert(err);
                }
            }
            if let Err(err) = device.free_address_range(base, page_size * handles.len()) {
                first_error.get_or_insert(err);
            }
            first_error.map_or(Ok(()), Err)
        }
    }
}
