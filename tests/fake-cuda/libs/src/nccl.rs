//! NCCL: communicators made without talking to the other ranks (each process knows its rank and
//! the number of ranks from its own call, which is all a communicator needs here), and
//! collectives and point-to-point calls as pending work on their stream.
//!
//! No rank hears from another: a collective's output is what it would be if every rank held
//! this rank's bytes. All-reduce, reduce and broadcast leave the receive buffer equal to the send
//! buffer (not the sum: values are not computed; a broadcast's non-root rank that names a send
//! buffer receives it); all-gather and gather repeat the send buffer
//! in every rank's slot; reduce-scatter takes this rank's slot; all-to-all keeps every slot; a
//! receive leaves its buffer as it was. The bytes move as copies on the stream
//! (`cuMemcpyAsync`), so they are booked, captured and replayed as copies are; each call also
//! books one piece of work that reads the send buffer and writes the receive buffer.
//!
//! `ncclCommSplit` assumes every rank chose the same color (the new communicator has the
//! parent's ranks), `NCCL_SPLIT_NOCOLOR` gives none, as documented.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Range, Registry, guard, put, work};

type Result = c_int;
const SUCCESS: Result = 0;
const UNHANDLED_CUDA_ERROR: Result = 1;
const INVALID_ARGUMENT: Result = 4;
const INVALID_USAGE: Result = 5;

/// NCCL 2.30.7, the version the installed PyTorch names (`nvidia-nccl-cu13==2.30.7`).
const VERSION_CODE: c_int = 23007;
const SPLIT_NOCOLOR: c_int = -1;

unsafe extern "C" {
    fn cuMemcpyAsync(dst: u64, src: u64, count: usize, stream: *mut c_void) -> u32;
    fn cuCtxGetDevice(device: *mut c_int) -> u32;
    fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> u32;
    fn cuMemFree_v2(dptr: u64) -> u32;
    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: u64) -> u32;
}

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`: answered for live device memory only.
const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;

#[derive(Clone, Copy)]
struct Comm {
    ranks: c_int,
    rank: c_int,
    device: c_int,
}

static COMMS: Registry<Comm> = Registry::new(0x7cc1);
static REGISTRATIONS: Registry<Registration> = Registry::new(0x7cc2);

/// A buffer registered with a communicator (`ncclCommRegister`), until `ncclCommDeregister`.
#[derive(Clone, Copy)]
struct Registration {
    comm: usize,
    buffer: u64,
    size: u64,
}

/// Registrations made so far, and deregistrations of memory already freed (NCCL's "User Buffer
/// Registration" asks for the deregistration before the memory is freed): for the tests.
static REGISTERED: AtomicU64 = AtomicU64::new(0);
static DEREGISTERED_AFTER_FREE: AtomicU64 = AtomicU64::new(0);
/// `ncclMemAlloc` calls that gave memory, and `ncclMemFree` calls that took it back (for the
/// tests: NCCL's memory pool, `MemPool(backend.mem_allocator)`).
static MEM_ALLOCS: AtomicU64 = AtomicU64::new(0);
static MEM_FREES: AtomicU64 = AtomicU64::new(0);

/// Whether `address` is in live device memory, as the driver knows it.
fn is_device_memory(address: u64) -> bool {
    let mut memory_type = 0u32;
    // SAFETY: the attribute is a 32-bit value, written to a live local.
    let status = unsafe {
        cuPointerGetAttribute(
            (&mut memory_type as *mut u32).cast(),
            POINTER_ATTRIBUTE_MEMORY_TYPE,
            address,
        )
    };
    status == 0
}

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> Result {
    // SAFETY: an out pointer from the caller.
    guard(INVALID_ARGUMENT, || {
        if unsafe { put(version, VERSION_CODE) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

/// A fresh id: this process's pid and a counter (the other ranks get it from PyTorch's store).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> Result {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    guard(INVALID_ARGUMENT, || {
        let mut new = UniqueId { internal: [0; 128] };
        let words = [
            u64::from(std::process::id()),
            NEXT.fetch_add(1, Ordering::Relaxed),
        ];
        for (k, byte) in words.iter().flat_map(|w| w.to_le_bytes()).enumerate() {
            new.internal[k] = byte as c_char;
        }
        // SAFETY: an out pointer from the caller.
        if unsafe { put(id, new) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

fn current_device() -> c_int {
    let mut device = 0;
    // SAFETY: a valid out pointer.
    unsafe { cuCtxGetDevice(&mut device) };
    device
}

/// A communicator of `ranks` ranks in which this process is `rank`, on the current device.
///
/// # Safety
/// `comm` is NULL or writable.
unsafe fn init(comm: *mut *mut c_void, ranks: c_int, rank: c_int) -> Result {
    if ranks < 1 || !(0..ranks).contains(&rank) {
        return INVALID_ARGUMENT;
    }
    let new = Comm {
        ranks,
        rank,
        device: current_device(),
    };
    // SAFETY: the caller's out pointer.
    if unsafe { put(comm, COMMS.add(new)) } {
        SUCCESS
    } else {
        INVALID_ARGUMENT
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    ranks: c_int,
    _id: UniqueId,
    rank: c_int,
) -> Result {
    // SAFETY: the caller's out pointer.
    guard(INVALID_ARGUMENT, || unsafe { init(comm, ranks, rank) })
}

/// Blocking or not (`config->blocking`), the communicator is ready when this returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    ranks: c_int,
    _id: UniqueId,
    rank: c_int,
    _config: *mut c_void,
) -> Result {
    // SAFETY: the caller's out pointer.
    guard(INVALID_ARGUMENT, || unsafe { init(comm, ranks, rank) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    comm: *mut *mut c_void,
    ranks: c_int,
    rank: c_int,
    _id_count: c_int,
    _ids: *mut UniqueId,
    _config: *mut c_void,
) -> Result {
    // SAFETY: the caller's out pointer.
    guard(INVALID_ARGUMENT, || unsafe { init(comm, ranks, rank) })
}

/// One communicator per device of `devices` (or devices 0..count).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut *mut c_void,
    count: c_int,
    devices: *const c_int,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        if comms.is_null() || count < 1 {
            return INVALID_ARGUMENT;
        }
        for rank in 0..count {
            let device = if devices.is_null() {
                rank
            } else {
                // SAFETY: `count` devices, by the API contract.
                unsafe { *devices.add(rank as usize) }
            };
            let new = Comm {
                ranks: count,
                rank,
                device,
            };
            // SAFETY: `count` writable slots, by the API contract.
            unsafe { *comms.add(rank as usize) = COMMS.add(new) };
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    comm: *mut c_void,
    color: c_int,
    _key: c_int,
    new_comm: *mut *mut c_void,
    _config: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let Some(parent) = COMMS.with(comm, |c| *c) else {
            return INVALID_ARGUMENT;
        };
        let made = if color == SPLIT_NOCOLOR {
            std::ptr::null_mut()
        } else {
            COMMS.add(parent)
        };
        // SAFETY: the caller's out pointer.
        if unsafe { put(new_comm, made) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

/// The communicator without the ranks excluded; this rank's number shifts down past them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommShrink(
    comm: *mut c_void,
    excluded: *const c_int,
    excluded_count: c_int,
    new_comm: *mut *mut c_void,
    _config: *mut c_void,
    _flags: c_int,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let Some(parent) = COMMS.with(comm, |c| *c) else {
            return INVALID_ARGUMENT;
        };
        let excluded: &[c_int] = if excluded.is_null() || excluded_count <= 0 {
            &[]
        } else {
            // SAFETY: `excluded_count` ranks, by the API contract.
            unsafe { std::slice::from_raw_parts(excluded, excluded_count as usize) }
        };
        if excluded.contains(&parent.rank) {
            return INVALID_ARGUMENT;
        }
        let below = excluded.iter().filter(|&&r| r < parent.rank).count() as c_int;
        let new = Comm {
            ranks: parent.ranks - excluded.len() as c_int,
            rank: parent.rank - below,
            device: parent.device,
        };
        // SAFETY: the caller's out pointer.
        if unsafe { put(new_comm, COMMS.add(new)) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

/// Destroy and abort: the communicator's resources are freed, its buffer registrations with
/// them.
fn end_comm(comm: *mut c_void) -> Result {
    guard(INVALID_ARGUMENT, || {
        if COMMS.remove(comm).is_none() {
            return INVALID_ARGUMENT;
        }
        REGISTRATIONS.retain(|r| r.comm != comm as usize);
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDestroy(comm: *mut c_void) -> Result {
    end_comm(comm)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclCommAbort(comm: *mut c_void) -> Result {
    end_comm(comm)
}

/// Finishing the communicator's work: nothing is in flight between ranks here.
#[unsafe(no_mangle)]
pub extern "C" fn ncclCommFinalize(comm: *mut c_void) -> Result {
    guard(INVALID_ARGUMENT, || {
        if COMMS.contains(comm) {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: *mut c_void, error: *mut Result) -> Result {
    guard(INVALID_ARGUMENT, || {
        if !COMMS.contains(comm) {
            return INVALID_ARGUMENT;
        }
        // SAFETY: an out pointer from the caller.
        if unsafe { put(error, SUCCESS) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

fn answer(comm: *mut c_void, out: *mut c_int, pick: impl FnOnce(&Comm) -> c_int) -> Result {
    guard(INVALID_ARGUMENT, || {
        let Some(value) = COMMS.with(comm, |c| pick(c)) else {
            return INVALID_ARGUMENT;
        };
        // SAFETY: an out pointer from the caller.
        if unsafe { put(out, value) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, count: *mut c_int) -> Result {
    answer(comm, count, |c| c.ranks)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, rank: *mut c_int) -> Result {
    answer(comm, rank, |c| c.rank)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *mut c_void, device: *mut c_int) -> Result {
    answer(comm, device, |c| c.device)
}

/// A broadcast made inside a group (see `ncclBroadcast`).
struct GroupBroadcast {
    own: bool,
    send: u64,
    recv: u64,
    bytes: u64,
    stream: usize,
}

/// The calling thread's group: how deep, and its broadcasts (NCCL's groups are per thread).
#[derive(Default)]
struct Group {
    depth: u32,
    broadcasts: Vec<GroupBroadcast>,
}

thread_local! {
    static GROUP: std::cell::RefCell<Group> = std::cell::RefCell::default();
}

/// Calls between this and `ncclGroupEnd` are booked on their streams when made.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupStart() -> Result {
    guard(INVALID_USAGE, || {
        GROUP
            .try_with(|g| g.borrow_mut().depth += 1)
            .map_or(INVALID_USAGE, |()| SUCCESS)
    })
}

/// Ends a group; the outermost end fills the non-root receive buffers of its broadcasts from
/// this rank's own broadcast of the same size.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupEnd() -> Result {
    guard(INVALID_USAGE, || {
        let finished = GROUP.try_with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(INVALID_USAGE);
            }
            g.depth -= 1;
            Ok(if g.depth == 0 {
                std::mem::take(&mut g.broadcasts)
            } else {
                Vec::new()
            })
        });
        let broadcasts = match finished {
            Ok(Ok(list)) => list,
            Ok(Err(code)) => return code,
            Err(_) => return INVALID_USAGE,
        };
        for other in broadcasts.iter().filter(|b| !b.own) {
            let Some(own) = broadcasts.iter().find(|b| b.own && b.bytes == other.bytes) else {
                continue;
            };
            // SAFETY: device ranges of the caller's buffers; the driver checks them.
            if unsafe {
                cuMemcpyAsync(
                    other.recv,
                    own.send,
                    other.bytes as usize,
                    other.stream as *mut c_void,
                )
            } != 0
            {
                return UNHANDLED_CUDA_ERROR;
            }
        }
        SUCCESS
    })
}

/// A custom reduction: a number past the built-in ones (sum, prod, max, min, avg).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    _scalar: *mut c_void,
    _data_type: c_int,
    _residence: c_int,
    comm: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        if !COMMS.contains(comm) {
            return INVALID_ARGUMENT;
        }
        // SAFETY: an out pointer from the caller.
        if unsafe { put(op, 5) } {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclRedOpDestroy(_op: c_int, comm: *mut c_void) -> Result {
    guard(INVALID_ARGUMENT, || {
        if COMMS.contains(comm) {
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

/// Device memory from the driver, as NCCL's allocator gets it (`cuMem*` there; `cuMemAlloc`
/// here, which the ordering check and the memory figures see alike).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> Result {
    guard(INVALID_ARGUMENT, || {
        let mut address = 0u64;
        // SAFETY: a valid out pointer.
        if unsafe { cuMemAlloc_v2(&mut address, size) } != 0 {
            return UNHANDLED_CUDA_ERROR;
        }
        // SAFETY: an out pointer from the caller.
        if unsafe { put(ptr, address as *mut c_void) } {
            MEM_ALLOCS.fetch_add(1, Ordering::Relaxed);
            SUCCESS
        } else {
            INVALID_ARGUMENT
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclMemFree(ptr: *mut c_void) -> Result {
    // SAFETY: memory from ncclMemAlloc, by the API contract.
    guard(INVALID_ARGUMENT, || {
        if unsafe { cuMemFree_v2(ptr as u64) } == 0 {
            MEM_FREES.fetch_add(1, Ordering::Relaxed);
            SUCCESS
        } else {
            UNHANDLED_CUDA_ERROR
        }
    })
}

/// Keeps the buffer, its size and its communicator until `ncclCommDeregister`; a buffer that is
/// not device memory is `ncclInvalidArgument`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(
    comm: *mut c_void,
    buffer: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        if !COMMS.contains(comm) || handle.is_null() || !is_device_memory(buffer as u64) {
            return INVALID_ARGUMENT;
        }
        let registration = Registration {
            comm: comm as usize,
            buffer: buffer as u64,
            size: size as u64,
        };
        REGISTERED.fetch_add(1, Ordering::Relaxed);
        // SAFETY: an out pointer from the caller, checked above.
        unsafe { put(handle, REGISTRATIONS.add(registration)) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclCommDeregister(comm: *mut c_void, handle: *mut c_void) -> Result {
    guard(INVALID_ARGUMENT, || {
        if !COMMS.contains(comm) {
            return INVALID_ARGUMENT;
        }
        let Some(registration) = REGISTRATIONS.remove(handle) else {
            return INVALID_ARGUMENT;
        };
        if !is_device_memory(registration.buffer) {
            DEREGISTERED_AFTER_FREE.fetch_add(1, Ordering::Relaxed);
        }
        SUCCESS
    })
}

/// For the tests (not NCCL's): writes up to `capacity` live registrations to `out` as
/// (communicator, buffer, size) triples, by buffer, and returns how many are live.
///
/// # Safety
/// `out` is valid for `3 * capacity` writes (or `capacity` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_nccl_registrations(out: *mut u64, capacity: usize) -> i64 {
    guard(-1, || {
        let mut live = REGISTRATIONS.values();
        live.sort_by_key(|r| (r.buffer, r.comm));
        for (k, r) in live.iter().take(capacity).enumerate() {
            for (j, word) in [r.comm as u64, r.buffer, r.size].into_iter().enumerate() {
                // SAFETY: k < capacity, and the caller promises 3 * capacity writable words.
                unsafe { out.add(3 * k + j).write(word) };
            }
        }
        live.len() as i64
    })
}

/// For the tests (not NCCL's): registrations made so far (`which` 0), deregistrations of
/// memory already freed (1), `ncclMemAlloc` calls that gave memory (2), `ncclMemFree` calls that
/// took it back (3).
#[unsafe(no_mangle)]
pub extern "C" fn fake_nccl_registration_count(which: c_int) -> i64 {
    let counter = match which {
        0 => &REGISTERED,
        1 => &DEREGISTERED_AFTER_FREE,
        2 => &MEM_ALLOCS,
        _ => &MEM_FREES,
    };
    counter.load(Ordering::Relaxed) as i64
}

/// Bytes per element of an `ncclDataType_t`.
fn element_size(data_type: c_int) -> Option<u64> {
    match data_type {
        0 | 1 | 10 | 11 => Some(1),
        6 | 9 => Some(2),
        2 | 3 | 7 => Some(4),
        4 | 5 | 8 => Some(8),
        _ => None,
    }
}

/// One collective or point-to-point call: checks the communicator and the type, moves the
/// bytes that stand for its result (`copies`: destination, source, length) and books the call
/// itself as work on `stream` that reads `reads` and writes `writes`.
fn collective(
    comm: *mut c_void,
    stream: *mut c_void,
    reads: Option<(*const c_void, u64)>,
    writes: Option<(*const c_void, u64)>,
    copies: &[(u64, u64, u64)],
) -> Result {
    let mut ranges = Vec::new();
    if let Some((start, len)) = reads {
        ranges.push(Range::read(start, len));
    }
    if let Some((start, len)) = writes {
        ranges.push(Range::write(start, len));
    }
    if !COMMS.contains(comm) {
        return INVALID_ARGUMENT;
    }
    if work(stream, &ranges, c"an NCCL call") != 0 {
        return UNHANDLED_CUDA_ERROR;
    }
    for &(dst, src, len) in copies {
        // SAFETY: device ranges of the caller's buffers; the driver checks them.
        if dst != src && len > 0 && unsafe { cuMemcpyAsync(dst, src, len as usize, stream) } != 0 {
            return UNHANDLED_CUDA_ERROR;
        }
    }
    SUCCESS
}

fn ranks_of(comm: *mut c_void) -> Option<Comm> {
    COMMS.with(comm, |c| *c)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    _op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let Some(size) = element_size(data_type) else {
            return INVALID_ARGUMENT;
        };
        let bytes = count as u64 * size;
        collective(
            comm,
            stream,
            Some((send, bytes)),
            Some((recv, bytes)),
            &[(recv as u64, send as u64, bytes)],
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        if !(0..c.ranks).contains(&root) {
            return INVALID_ARGUMENT;
        }
        let bytes = count as u64 * size;
        // Only the root's send buffer counts. A non-root rank's receive buffer keeps its bytes,
        // unless the broadcast is one of a group in which this rank is the root of another of the
        // same size (PyTorch's all-gather into a list: a broadcast from each rank): it then
        // receives this rank's send buffer at `ncclGroupEnd`, as if every rank held this rank's
        // bytes.
        let (reads, copies) = if c.rank == root {
            (Some((send, bytes)), vec![(recv as u64, send as u64, bytes)])
        } else {
            (None, vec![])
        };
        // A thread that is exiting has no group any more: nothing to fill.
        let _ = GROUP.try_with(|g| {
            let mut g = g.borrow_mut();
            if g.depth > 0 {
                g.broadcasts.push(GroupBroadcast {
                    own: c.rank == root,
                    send: send as u64,
                    recv: recv as u64,
                    bytes,
                    stream: stream as usize,
                });
            }
        });
        collective(comm, stream, reads, Some((recv, bytes)), &copies)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclBcast(
    buffer: *mut c_void,
    count: usize,
    data_type: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    ncclBroadcast(buffer, buffer, count, data_type, root, comm, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    _op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        if !(0..c.ranks).contains(&root) {
            return INVALID_ARGUMENT;
        }
        let bytes = count as u64 * size;
        // Only the root's receive buffer is written.
        let (writes, copies) = if c.rank == root {
            (
                Some((recv.cast_const(), bytes)),
                vec![(recv as u64, send as u64, bytes)],
            )
        } else {
            (None, vec![])
        };
        collective(comm, stream, Some((send, bytes)), writes, &copies)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        let bytes = count as u64 * size;
        let copies: Vec<_> = (0..c.ranks as u64)
            .map(|slot| (recv as u64 + slot * bytes, send as u64, bytes))
            .collect();
        let all = bytes * c.ranks as u64;
        collective(
            comm,
            stream,
            Some((send, bytes)),
            Some((recv, all)),
            &copies,
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        if c.rank != root {
            let bytes = count as u64 * size;
            return collective(comm, stream, Some((send, bytes)), None, &[]);
        }
        ncclAllGather(send, recv, count, data_type, comm, stream)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    _op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        let bytes = count as u64 * size;
        let mine = send as u64 + c.rank as u64 * bytes;
        let all = bytes * c.ranks as u64;
        collective(
            comm,
            stream,
            Some((send, all)),
            Some((recv, bytes)),
            &[(recv as u64, mine, bytes)],
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclAlltoAll(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        let all = count as u64 * size * c.ranks as u64;
        collective(
            comm,
            stream,
            Some((send, all)),
            Some((recv, all)),
            &[(recv as u64, send as u64, all)],
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    data_type: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        if !(0..c.ranks).contains(&peer) {
            return INVALID_ARGUMENT;
        }
        collective(comm, stream, Some((send, count as u64 * size)), None, &[])
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    data_type: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> Result {
    guard(INVALID_ARGUMENT, || {
        let (Some(size), Some(c)) = (element_size(data_type), ranks_of(comm)) else {
            return INVALID_ARGUMENT;
        };
        if !(0..c.ranks).contains(&peer) {
            return INVALID_USAGE;
        }
        collective(comm, stream, None, Some((recv, count as u64 * size)), &[])
    })
}
