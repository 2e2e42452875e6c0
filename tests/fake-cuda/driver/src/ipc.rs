//! CUDA IPC between processes: device memory (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle`,
//! `cuIpcCloseMemHandle`) and events (`cuIpcGetEventHandle`, `cuIpcOpenEventHandle`), as the
//! driver documents them.
//!
//! Memory: each device's `cuMemAlloc` arena is a memfd mapped over the arena
//! (`address_space.rs`), so an allocation is a range of that file. A handle names the exporting
//! process, the number of its arena's fd, the allocation's offset and size, and a slot of the
//! exporter's registry with the allocation's generation. The importer takes the fd with
//! `pidfd_getfd` (or opens `/proc/PID/fd/N`), maps the allocation's pages `MAP_SHARED` at an
//! address of its own arena, and returns that address: both processes see the same bytes.
//!
//! The registry is a small memfd of this process, shared by mapping: one slot per exported
//! allocation (its generation, the number of processes that have it open, its offset and size)
//! and one per exported event (its generation, how often it was recorded, how many queries still
//! answer "not ready"). A slot's generation is 0 once the allocation is freed or the event
//! destroyed, so a stale handle is refused, and a process that still has freed memory open finds
//! out at its next use: an illegal address, since using it is undefined behaviour.
//!
//! Events: an event created with `CU_EVENT_INTERPROCESS` gets a slot when its handle is taken;
//! from then on its completion state (the "not ready" answers left, `FAKE_LIBCUDA_EVENT_DELAY`)
//! lives in the slot, so a record in one process and a query, a synchronization or a wait in
//! another agree. The ordering check (`work.rs`) stays per process: another process's work is
//! not in this process's books.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::address_space::{map_file, page_size, sized_memfd};
use crate::sync::Event;
use crate::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
    CuResult, DRIVER, Driver, GRANULARITY, Outcome, call, current_context, put,
};

/// `CUipcMemHandle` and `CUipcEventHandle`: 64 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    reserved: [u8; 64],
}

/// The only flag `cuIpcOpenMemHandle` takes: "Must be specified as
/// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS".
const LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const MEM_MAGIC: &[u8; 8] = b"fkIPCmem";
const EVENT_MAGIC: &[u8; 8] = b"fkIPCevt";
const MEM_SLOTS: u32 = 1 << 16;
const EVENT_SLOTS: u32 = 1 << 16;
const SLOT_BYTES: u64 = 32;
const REGISTRY_BYTES: u64 = (MEM_SLOTS as u64 + EVENT_SLOTS as u64) * SLOT_BYTES;
const ARENA_NAME: &str = "/memfd:fake-cuda-device-memory";
const REGISTRY_NAME: &str = "/memfd:fake-cuda-ipc-registry";

/// An exported allocation, as the registry shares it.
#[repr(C)]
struct MemSlot {
    /// The export's generation; 0 once the allocation is freed.
    generation: AtomicU64,
    /// How many processes have it open.
    opens: AtomicU64,
    offset: AtomicU64,
    size: AtomicU64,
}

/// An exported event, as the registry shares it.
#[repr(C)]
struct EventSlot {
    /// The export's generation; 0 once the event is destroyed.
    generation: AtomicU64,
    /// How many times it was recorded, in any process.
    epoch: AtomicU64,
    /// Queries still to be answered "not ready" after the last record.
    busy: AtomicU64,
    spare: AtomicU64,
}

/// A registry mapped into this process (its own, or another process's).
#[derive(Clone, Copy)]
struct Registry {
    /// Where it is mapped (an address, so that the driver's state stays `Send`).
    base: usize,
}

impl Registry {
    fn map(fd: c_int) -> Option<Registry> {
        // SAFETY: a fresh shared mapping of a registry memfd; failure is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                REGISTRY_BYTES as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        (base != libc::MAP_FAILED).then_some(Registry {
            base: base as usize,
        })
    }

    fn mem_slot(self, slot: u32) -> Option<&'static MemSlot> {
        let offset = u64::from(slot) * SLOT_BYTES;
        // SAFETY: inside the mapping, which stays mapped while anything refers to it (a
        // registry is unmapped only in a forked child that drops every reference first);
        // atomics make the sharing with other processes sound.
        (slot < MEM_SLOTS).then(|| unsafe { &*((self.base + offset as usize) as *const MemSlot) })
    }

    fn event_slot(self, slot: u32) -> Option<&'static EventSlot> {
        let offset = (u64::from(MEM_SLOTS) + u64::from(slot)) * SLOT_BYTES;
        // SAFETY: as for `mem_slot`.
        (slot < EVENT_SLOTS)
            .then(|| unsafe { &*((self.base + offset as usize) as *const EventSlot) })
    }
}

/// This process's registry.
struct OwnRegistry {
    fd: c_int,
    mapped: Registry,
}

/// Slot numbers: handed out lowest first, given back for reuse.
#[derive(Default)]
struct SlotPool {
    next: u32,
    free: Vec<u32>,
}

impl SlotPool {
    fn take(&mut self, limit: u32) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        (self.next < limit).then(|| {
            self.next += 1;
            self.next - 1
        })
    }
}

/// An allocation of this process exported with `cuIpcGetMemHandle`.
struct Export {
    slot: u32,
    generation: u64,
}

/// Memory of another process opened here with `cuIpcOpenMemHandle`, by where its pages are
/// mapped.
struct Opened {
    /// The address `cuIpcOpenMemHandle` returned (inside the first page when the exporter's
    /// allocation does not start on a page).
    pointer: u64,
    size: u64,
    /// Bytes mapped from the page that holds `pointer`.
    mapped: u64,
    /// The device whose memory it is.
    device: i32,
    /// The device whose context opened it.
    opener: i32,
    exporter: i32,
    generation: u64,
    slot: &'static MemSlot,
    /// Opens of the same handle not yet closed: "the reference count on the handle is
    /// incremented by 1 and the existing device pointer is returned".
    references: u32,
}

/// An event whose completion state lives in a registry slot (`cuIpcGetEventHandle` made it so
/// here, or `cuIpcOpenEventHandle` opened it from another process).
pub struct SharedEvent {
    slot: &'static EventSlot,
    index: u32,
    generation: u64,
    /// The epoch of this process's last record of it (0: none), if it is still the last one.
    own_epoch: u64,
    /// Made here (the slot is ours to give back), rather than opened.
    exported: bool,
    exporter: i32,
}

impl SharedEvent {
    /// The slot, unless the event was destroyed in the process that made it: "Performing
    /// operations on the imported event after the exported event has been freed with
    /// cuEventDestroy will result in undefined behavior"; the fake refuses.
    fn live_slot(&self) -> Result<&'static EventSlot, CuResult> {
        if self.slot.generation.load(Ordering::Acquire) == self.generation {
            return Ok(self.slot);
        }
        eprintln!(
            "fake-cuda: an event opened with cuIpcOpenEventHandle was destroyed by process {} \
             that made it: using it is undefined behaviour; refused with \
             CUDA_ERROR_INVALID_HANDLE",
            self.exporter
        );
        Err(CUDA_ERROR_INVALID_HANDLE)
    }

    /// A record, here: it answers "not ready" to its next `busy_queries` queries, wherever
    /// they come from.
    pub fn record(&mut self, busy_queries: u32) -> Outcome {
        let slot = self.live_slot()?;
        slot.busy.store(u64::from(busy_queries), Ordering::Release);
        self.own_epoch = slot.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        Ok(())
    }

    /// A query: `Ok(false)` while the last record, of any process, is not done.
    pub fn query(&self) -> Result<bool, CuResult> {
        let slot = self.live_slot()?;
        let busy = slot
            .busy
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        Ok(busy.is_err())
    }

    /// A synchronization: the last record, of any process, is done.
    pub fn synchronize(&self) -> Outcome {
        self.live_slot()?.busy.store(0, Ordering::Release);
        Ok(())
    }

    /// Whether the last record was this process's own (so what it follows is in this process's
    /// books and now known to be done).
    pub fn recorded_here(&self) -> bool {
        self.slot.epoch.load(Ordering::Acquire) == self.own_epoch
    }

    /// Made here: the slot goes back to the registry when the event is destroyed.
    pub fn exported(&self) -> bool {
        self.exported
    }
}

/// The driver's CUDA IPC state.
#[derive(Default)]
pub struct Ipc {
    registry: Option<OwnRegistry>,
    mem_slots: SlotPool,
    event_slots: SlotPool,
    next_generation: u64,
    /// This process's exported allocations, by address.
    exports: HashMap<u64, Export>,
    /// Other processes' registries mapped here, by (pid, fd number there).
    remote: HashMap<(i32, c_int), Registry>,
    /// Other processes' memory opened here, by the start of its pages.
    opened: BTreeMap<u64, Opened>,
    /// Where each open handle, (exporter, generation), is mapped.
    by_handle: HashMap<(i32, u64), u64>,
    /// `cuMemFree` calls of exported memory that another process still had open.
    pub freed_while_open: u64,
}

impl Ipc {
    fn own_registry(&mut self) -> Result<Registry, CuResult> {
        if let Some(own) = &self.registry {
            return Ok(own.mapped);
        }
        let fd = sized_memfd(c"fake-cuda-ipc-registry", REGISTRY_BYTES)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let Some(mapped) = Registry::map(fd) else {
            // SAFETY: our own fd, closed once.
            unsafe { libc::close(fd) };
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        self.registry = Some(OwnRegistry { fd, mapped });
        Ok(mapped)
    }

    fn own_registry_fd(&self) -> c_int {
        self.registry.as_ref().map_or(-1, |own| own.fd)
    }

    fn new_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    /// Another process's registry, mapped here once; None if that process or fd is gone.
    fn remote_registry(&mut self, pid: i32, fd: c_int) -> Option<Registry> {
        if let Some(&registry) = self.remote.get(&(pid, fd)) {
            return Some(registry);
        }
        let ours = fetch_fd(pid, fd, REGISTRY_NAME)?;
        let registry = Registry::map(ours);
        // SAFETY: the fd just fetched; the mapping keeps the file.
        unsafe { libc::close(ours) };
        let registry = registry?;
        self.remote.insert((pid, fd), registry);
        Some(registry)
    }

    pub fn live_exports(&self) -> u64 {
        self.exports.len() as u64
    }

    pub fn live_opened(&self) -> u64 {
        self.opened.len() as u64
    }

    /// Gives an exported event's slot back: its handles go stale.
    pub fn event_destroyed(&mut self, shared: &SharedEvent) {
        if shared.exported {
            shared.slot.generation.store(0, Ordering::Release);
            self.event_slots.free.push(shared.index);
        }
    }
}

/// The fields of a memory handle.
struct MemHandle {
    pid: i32,
    arena_fd: c_int,
    registry_fd: c_int,
    slot: u32,
    generation: u64,
    offset: u64,
    size: u64,
    device: i32,
}

impl MemHandle {
    fn encode(&self) -> IpcHandle {
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(MEM_MAGIC);
        bytes[8..12].copy_from_slice(&self.pid.to_le_bytes());
        bytes[12..16].copy_from_slice(&self.arena_fd.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.registry_fd.to_le_bytes());
        bytes[20..24].copy_from_slice(&self.slot.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.generation.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.offset.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.size.to_le_bytes());
        bytes[48..52].copy_from_slice(&self.device.to_le_bytes());
        IpcHandle { reserved: bytes }
    }

    fn decode(handle: &IpcHandle) -> Option<MemHandle> {
        let bytes = &handle.reserved;
        (&bytes[..8] == MEM_MAGIC).then(|| MemHandle {
            pid: i32_at(bytes, 8),
            arena_fd: i32_at(bytes, 12),
            registry_fd: i32_at(bytes, 16),
            slot: u32_at(bytes, 20),
            generation: u64_at(bytes, 24),
            offset: u64_at(bytes, 32),
            size: u64_at(bytes, 40),
            device: i32_at(bytes, 48),
        })
    }
}

/// The fields of an event handle.
struct EventHandle {
    pid: i32,
    registry_fd: c_int,
    slot: u32,
    generation: u64,
}

impl EventHandle {
    fn encode(&self) -> IpcHandle {
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(EVENT_MAGIC);
        bytes[8..12].copy_from_slice(&self.pid.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.registry_fd.to_le_bytes());
        bytes[20..24].copy_from_slice(&self.slot.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.generation.to_le_bytes());
        IpcHandle { reserved: bytes }
    }

    fn decode(handle: &IpcHandle) -> Option<EventHandle> {
        let bytes = &handle.reserved;
        (&bytes[..8] == EVENT_MAGIC).then(|| EventHandle {
            pid: i32_at(bytes, 8),
            registry_fd: i32_at(bytes, 16),
            slot: u32_at(bytes, 20),
            generation: u64_at(bytes, 24),
        })
    }
}

fn i32_at(bytes: &[u8; 64], at: usize) -> i32 {
    i32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default())
}

fn u32_at(bytes: &[u8; 64], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default())
}

fn u64_at(bytes: &[u8; 64], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default())
}

fn this_process() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::getpid() }
}

/// A duplicate, in this process, of fd `fd` of process `pid`, if it is one of the fake's memfds
/// named `name` (so a reused pid or fd number is not taken for the exporter's): `pidfd_getfd`,
/// as PyTorch fetches expandable segments' fds, or else `/proc/PID/fd/N`.
fn fetch_fd(pid: i32, fd: c_int, name: &str) -> Option<c_int> {
    // SAFETY: plain syscalls; every fd they return is ours and closed below or returned.
    let fetched = unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0) as c_int;
        let mut fetched = -1;
        if pidfd >= 0 {
            fetched = libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) as c_int;
            libc::close(pidfd);
        }
        if fetched < 0 {
            let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).ok()?;
            fetched = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        }
        fetched
    };
    if fetched < 0 {
        return None;
    }
    let link = std::fs::read_link(format!("/proc/self/fd/{fetched}")).ok();
    if link.is_some_and(|link| link.to_string_lossy().starts_with(name)) {
        Some(fetched)
    } else {
        // SAFETY: the fd just fetched, closed once.
        unsafe { libc::close(fetched) };
        None
    }
}

/// Whether `FAKE_LIBCUDA_IPC_PRIVATE_COPY=1` asks for a broken IPC: the importer gets a private
/// copy of the bytes instead of the exporter's memory, from `cuIpcOpenMemHandle` and
/// `cuMemImportFromShareableHandle` alike (to show that the tests notice).
pub fn private_copies() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FAKE_LIBCUDA_IPC_PRIVATE_COPY").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// Replaces the shared pages `[ptr, ptr + len)` by private memory holding the same bytes.
fn make_private(ptr: u64, len: u64) -> bool {
    // SAFETY: the pages were just mapped readable by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) }.to_vec();
    // SAFETY: MAP_FIXED over the pages just mapped, which nothing else refers to yet.
    let result = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if result == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: the private pages just mapped, `len` bytes, readable and writable.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as *mut u8, bytes.len()) };
    true
}

impl Driver {
    /// When `[ptr, end)` lies in memory of another process opened here: whether it may be
    /// touched (not if its exporter freed it since: undefined behaviour, made an illegal
    /// address). None for any other range.
    pub fn check_opened_ipc_range(&self, ptr: u64, end: u64) -> Option<Outcome> {
        let (_, opened) = self.ipc.opened.range(..=ptr).next_back()?;
        if ptr < opened.pointer || end > opened.pointer + opened.size {
            return None;
        }
        if opened.slot.generation.load(Ordering::Acquire) == opened.generation {
            return Some(Ok(()));
        }
        let why = format!(
            "memory of process {} opened with cuIpcOpenMemHandle and freed there since \
             (undefined behaviour)",
            opened.exporter
        );
        Some(Err(crate::vmm::illegal_address(ptr, end - ptr, &why)))
    }

    /// The device whose memory, opened from another process, lies at `ptr`.
    pub fn opened_ipc_device(&self, ptr: u64) -> Option<i32> {
        let (_, opened) = self.ipc.opened.range(..=ptr).next_back()?;
        (opened.pointer <= ptr && ptr < opened.pointer + opened.size).then_some(opened.device)
    }

    /// `cuMemFree` of `address`: its handles go stale. Freeing memory that another process
    /// still has open is undefined behaviour ("Calling cuMemFree on an exported memory region
    /// before calling cuIpcCloseMemHandle in the importing context will result in undefined
    /// behavior"): said on stderr and counted; that process's next use of it is an illegal
    /// address.
    pub fn forget_ipc_export(&mut self, address: u64) {
        let Some(export) = self.ipc.exports.remove(&address) else {
            return;
        };
        let Some(slot) = self
            .ipc
            .registry
            .as_ref()
            .and_then(|own| own.mapped.mem_slot(export.slot))
        else {
            return;
        };
        slot.generation.store(0, Ordering::Release);
        let opens = slot.opens.swap(0, Ordering::AcqRel);
        if opens > 0 {
            self.ipc.freed_while_open += 1;
            eprintln!(
                "fake-cuda: cuMemFree of memory at {address:#x} that {opens} other process(es) \
                 still have open through cuIpcOpenMemHandle: undefined behaviour"
            );
        }
        self.ipc.mem_slots.free.push(export.slot);
    }

    /// In a child forked after the driver started: device memory of its own (a copy of the
    /// parent's), and nothing exported (the parent's handles are the parent's).
    fn after_fork(&mut self) {
        let foreign: Vec<(u64, u64)> = self
            .ipc
            .opened
            .iter()
            .map(|(&start, opened)| (start, opened.mapped))
            .collect();
        let page = page_size();
        let live: Vec<(i32, u64, u64)> = self
            .allocations
            .iter()
            .map(|(&start, allocation)| {
                let first = start / page * page;
                let end = (start + allocation.size).next_multiple_of(page);
                (allocation.device, first, end - first)
            })
            .collect();
        if let Some(space) = self.address_space.as_mut() {
            for (device, arena) in space.allocations.iter_mut().enumerate() {
                let open: Vec<(u64, u64)> = live
                    .iter()
                    .filter(|(owner, _, _)| *owner as usize == device)
                    .map(|&(_, start, len)| (start, len))
                    .collect();
                arena.after_fork(&foreign, &open);
            }
        }
        if let Some(own) = self.ipc.registry.take() {
            // SAFETY: the child's copies of the parent's registry fd and mapping; every
            // reference to them goes below.
            unsafe {
                libc::munmap(own.mapped.base as *mut c_void, REGISTRY_BYTES as usize);
                libc::close(own.fd);
            }
        }
        self.ipc.exports.clear();
        self.ipc.mem_slots = SlotPool::default();
        self.ipc.event_slots = SlotPool::default();
        for event in self.events.values_mut() {
            if event.shared.as_ref().is_some_and(SharedEvent::exported) {
                event.shared = None;
            }
        }
    }
}

/// Registered with `pthread_atfork`: runs in the child of every `fork`.
pub extern "C" fn after_fork_in_child() {
    match DRIVER.try_lock() {
        Ok(mut driver) => driver.after_fork(),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner().after_fork(),
        // Another thread held the driver at the fork: the child cannot use it anyway.
        Err(std::sync::TryLockError::WouldBlock) => {}
    }
}

// ---- Memory --------------------------------------------------------------------------------

/// "Takes a pointer to the base of an existing device memory allocation created with cuMemAlloc
/// and exports it for use in another process. This is a lightweight operation and may be called
/// multiple times on an allocation without adverse effects": the same handle each time. Any
/// other pointer (not a base, VMM memory, memory opened from another process) is
/// `CUDA_ERROR_INVALID_VALUE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut IpcHandle, dptr: u64) -> CuResult {
    call("cuIpcGetMemHandle", |driver| {
        driver.require_primary_context()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let allocation = driver
            .allocations
            .get(&dptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (device, size) = (allocation.device, allocation.size);
        let (arena_fd, offset) = driver
            .address_space
            .as_ref()
            .and_then(|space| space.allocations.get(device as usize))
            .and_then(|arena| Some((arena.backing()?, arena.offset(dptr))))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let registry = driver.ipc.own_registry()?;
        let (slot, generation) = match driver.ipc.exports.get(&dptr) {
            Some(export) => (export.slot, export.generation),
            None => {
                let slot = driver
                    .ipc
                    .mem_slots
                    .take(MEM_SLOTS)
                    .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
                let generation = driver.ipc.new_generation();
                if let Some(shared) = registry.mem_slot(slot) {
                    shared.opens.store(0, Ordering::Release);
                    shared.offset.store(offset, Ordering::Release);
                    shared.size.store(size, Ordering::Release);
                    shared.generation.store(generation, Ordering::Release);
                }
                driver.ipc.exports.insert(dptr, Export { slot, generation });
                (slot, generation)
            }
        };
        let encoded = MemHandle {
            pid: this_process(),
            arena_fd,
            registry_fd: driver.ipc.own_registry_fd(),
            slot,
            generation,
            offset,
            size,
            device,
        }
        .encode();
        // SAFETY: checked non-NULL; the caller promises room for a handle.
        unsafe { put(handle, encoded) }
    })
}

/// Maps another process's exported allocation here, in the arena of the device whose memory it
/// is, and returns its address. Refused: a handle made in this process
/// (`CUDA_ERROR_INVALID_CONTEXT`, as the driver answers), flags other than
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, a handle that is not one or is stale (the exporter
/// freed the memory or is gone: `CUDA_ERROR_INVALID_HANDLE`), another device's memory that this
/// device cannot reach (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`). A second open of the same handle
/// returns the same address and counts a reference.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut u64,
    handle: IpcHandle,
    flags: c_uint,
) -> CuResult {
    call("cuIpcOpenMemHandle_v2", |driver| {
        // SAFETY: forwarded from the caller.
        unsafe { open_mem_handle(driver, pdptr, &handle, flags) }
    })
}

/// The original name of `cuIpcOpenMemHandle_v2`, which the driver still exports.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle(
    pdptr: *mut u64,
    handle: IpcHandle,
    flags: c_uint,
) -> CuResult {
    call("cuIpcOpenMemHandle", |driver| {
        // SAFETY: forwarded from the caller.
        unsafe { open_mem_handle(driver, pdptr, &handle, flags) }
    })
}

/// # Safety
/// `pdptr` is NULL or valid for a write.
unsafe fn open_mem_handle(
    driver: &mut Driver,
    pdptr: *mut u64,
    handle: &IpcHandle,
    flags: c_uint,
) -> Outcome {
    let here = driver.require_primary_context()?;
    if pdptr.is_null() || flags != LAZY_ENABLE_PEER_ACCESS {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let h = MemHandle::decode(handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if h.pid == this_process() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    driver
        .valid_device(h.device)
        .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    if h.device != here && !driver.can_access_peer(here, h.device) {
        return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    }
    if let Some(start) = driver.ipc.by_handle.get(&(h.pid, h.generation)).copied()
        && let Some(opened) = driver.ipc.opened.get_mut(&start)
    {
        opened.references += 1;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        return unsafe { put(pdptr, opened.pointer) };
    }
    let slot = driver
        .ipc
        .remote_registry(h.pid, h.registry_fd)
        .and_then(|registry| registry.mem_slot(h.slot))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let live = slot.generation.load(Ordering::Acquire) == h.generation
        && slot.offset.load(Ordering::Acquire) == h.offset
        && slot.size.load(Ordering::Acquire) == h.size;
    if !live {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let fd = fetch_fd(h.pid, h.arena_fd, ARENA_NAME).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let mapped = map_opened(driver, &h, fd);
    // SAFETY: the fd fetched above; the mapping, if any, keeps the file.
    unsafe { libc::close(fd) };
    let (start, pointer, len) = mapped?;
    slot.opens.fetch_add(1, Ordering::AcqRel);
    driver.ipc.opened.insert(
        start,
        Opened {
            pointer,
            size: h.size,
            mapped: len,
            device: h.device,
            opener: here,
            exporter: h.pid,
            generation: h.generation,
            slot,
            references: 1,
        },
    );
    driver.ipc.by_handle.insert((h.pid, h.generation), start);
    // SAFETY: checked non-NULL; the caller promises it is writable.
    unsafe { put(pdptr, pointer) }
}

/// Maps the pages of the handle's allocation from the exporter's arena file `fd` at a place of
/// this process's arena for the device: (start of the pages, the address of the allocation,
/// bytes mapped).
fn map_opened(driver: &mut Driver, h: &MemHandle, fd: c_int) -> Result<(u64, u64, u64), CuResult> {
    let page = page_size();
    let first = h.offset / page * page;
    let end = h
        .offset
        .checked_add(h.size)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .next_multiple_of(page);
    let len = end - first;
    let alignment = if h.size >= GRANULARITY {
        GRANULARITY
    } else {
        page
    };
    let arena = driver
        .address_space
        .as_mut()
        .and_then(|space| space.allocations.get_mut(h.device as usize))
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    let start = arena
        .place(len, alignment)
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    let protection = libc::PROT_READ | libc::PROT_WRITE;
    if !map_file(start, len, protection, fd, first)
        || (private_copies() && !make_private(start, len))
    {
        arena.restore_backing(start, len);
        arena.release(start, len);
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok((start, start + (h.offset - first), len))
}

/// "Unmaps memory returned by cuIpcOpenMemHandle. The original allocation in the exporting
/// process as well as imported mappings in other processes will be unaffected." Once every open
/// of the handle is closed; like `cuMemFree`, it synchronizes the device first (the
/// documentation does not say; PyTorch closes before it synchronizes the stream that used the
/// memory). A pointer not opened here is `CUDA_ERROR_INVALID_VALUE`.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(dptr: u64) -> CuResult {
    call("cuIpcCloseMemHandle", |driver| {
        driver.require_primary_context()?;
        let start = driver
            .ipc
            .opened
            .range(..=dptr)
            .next_back()
            .filter(|(_, opened)| opened.pointer == dptr)
            .map(|(&start, _)| start)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let Some(opened) = driver.ipc.opened.get_mut(&start) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        opened.references -= 1;
        if opened.references > 0 {
            return Ok(());
        }
        let Some(opened) = driver.ipc.opened.remove(&start) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        driver
            .ipc
            .by_handle
            .remove(&(opened.exporter, opened.generation));
        driver
            .timeline
            .context_finished(crate::device::primary_context(opened.opener));
        if opened.slot.generation.load(Ordering::Acquire) == opened.generation {
            let _ = opened
                .slot
                .opens
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        if let Some(arena) = driver
            .address_space
            .as_mut()
            .and_then(|space| space.allocations.get_mut(opened.device as usize))
        {
            if !arena.restore_backing(start, opened.mapped) {
                eprintln!("fake-cuda: cuIpcCloseMemHandle could not unmap {start:#x}");
            }
            arena.release(start, opened.mapped);
        }
        Ok(())
    })
}

// ---- Events --------------------------------------------------------------------------------

/// "This event must have been created with the CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING
/// flags set": another event is `CUDA_ERROR_INVALID_HANDLE` (what HIP's conformance tests,
/// written against CUDA, expect). From now on its state lives in a registry slot.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetEventHandle(
    handle: *mut IpcHandle,
    event: *mut c_void,
) -> CuResult {
    call("cuIpcGetEventHandle", |driver| {
        driver.require_primary_context()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let target = driver
            .events
            .get(&(event as usize))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !target.interprocess {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let shared = match &target.shared {
            Some(shared) => (shared.index, shared.generation),
            None => {
                let busy = target.busy_queries;
                let registry = driver.ipc.own_registry()?;
                let index = driver
                    .ipc
                    .event_slots
                    .take(EVENT_SLOTS)
                    .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
                let slot = registry.event_slot(index).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
                let generation = driver.ipc.new_generation();
                // Its state so far counts as this process's record.
                slot.epoch.store(1, Ordering::Release);
                slot.busy.store(u64::from(busy), Ordering::Release);
                slot.spare.store(0, Ordering::Release);
                slot.generation.store(generation, Ordering::Release);
                let shared = SharedEvent {
                    slot,
                    index,
                    generation,
                    own_epoch: 1,
                    exported: true,
                    exporter: this_process(),
                };
                if let Some(target) = driver.events.get_mut(&(event as usize)) {
                    target.shared = Some(shared);
                }
                (index, generation)
            }
        };
        let encoded = EventHandle {
            pid: this_process(),
            registry_fd: driver.ipc.own_registry_fd(),
            slot: shared.0,
            generation: shared.1,
        }
        .encode();
        // SAFETY: checked non-NULL; the caller promises room for a handle.
        unsafe { put(handle, encoded) }
    })
}

/// "Returns an event handle that can be used in the current process and behaves like a locally
/// created event with the CU_EVENT_DISABLE_TIMING flag specified", in the current context.
/// Refused: a handle made in this process (`CUDA_ERROR_INVALID_CONTEXT`), one that is not a
/// handle or whose event was destroyed (`CUDA_ERROR_INVALID_HANDLE`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenEventHandle(
    event: *mut *mut c_void,
    handle: IpcHandle,
) -> CuResult {
    call("cuIpcOpenEventHandle", |driver| {
        driver.require_primary_context()?;
        if event.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = EventHandle::decode(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if h.pid == this_process() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        let slot = driver
            .ipc
            .remote_registry(h.pid, h.registry_fd)
            .and_then(|registry| registry.event_slot(h.slot))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if slot.generation.load(Ordering::Acquire) != h.generation {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let shared = SharedEvent {
            slot,
            index: h.slot,
            generation: h.generation,
            own_epoch: 0,
            exported: false,
            exporter: h.pid,
        };
        let new_handle = driver.new_handle() as usize;
        driver
            .events
            .insert(new_handle, Event::opened(current_context(), shared));
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(event, new_handle as *mut c_void) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_handle_reads_back_as_written() {
        let handle = MemHandle {
            pid: 1234,
            arena_fd: 7,
            registry_fd: 9,
            slot: 3,
            generation: 42,
            offset: 1 << 30,
            size: 4096,
            device: 1,
        };
        let back = MemHandle::decode(&handle.encode()).expect("a memory handle");
        assert_eq!(
            (back.pid, back.arena_fd, back.registry_fd, back.slot),
            (1234, 7, 9, 3)
        );
        assert_eq!(
            (back.generation, back.offset, back.size, back.device),
            (42, 1 << 30, 4096, 1)
        );
        assert!(EventHandle::decode(&handle.encode()).is_none());
    }

    #[test]
    fn slots_are_reused_after_they_are_given_back() {
        let mut pool = SlotPool::default();
        assert_eq!(pool.take(2), Some(0));
        assert_eq!(pool.take(2), Some(1));
        assert_eq!(pool.take(2), None);
        pool.free.push(0);
        assert_eq!(pool.take(2), Some(0));
    }

    #[test]
    fn a_fetched_fd_is_taken_only_under_its_memfd_name() {
        let fd = sized_memfd(c"fake-cuda-ipc-registry", 4096).expect("a memfd");
        let fetched = fetch_fd(this_process(), fd, REGISTRY_NAME).expect("our own registry");
        assert!(fetch_fd(this_process(), fd, ARENA_NAME).is_none());
        // SAFETY: the two fds made here, each closed once.
        unsafe {
            libc::close(fetched);
            libc::close(fd);
        }
    }
}
