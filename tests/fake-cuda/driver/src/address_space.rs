//! Device addresses that depend only on the sequence of driver calls.
//!
//! PyTorch's caching allocator breaks ties between equal free blocks by address, so two
//! processes that make the same CUDA calls must get device addresses in the same order, or a
//! comparison of two allocators (the oracle) would depend on the host heap. So every device
//! address the fake hands out lies in one block of host address space, reserved once per
//! process as `PROT_NONE` + `MAP_NORESERVE` (it costs no memory until pages are opened and
//! written):
//!
//! ```text
//! base: [cuMemAlloc arena, device 0][device 1]...[VMM arena: cuMemAddressReserve, all devices]
//! ```
//!
//! Each arena places by lowest-address first fit, so an address is `base + offset` with an
//! offset that only the calls made so far decide. The base is asked for at a fixed address
//! ([`BASE_HINT`], with `MAP_FIXED_NOREPLACE`), so that absolute addresses, too, are the same in
//! every process; should something else already sit there, the kernel chooses the base, and
//! offsets and order still agree (`FAKE_LIBCUDA_ADDRESS_HINT=0` asks for that).
//!
//! Each device's `cuMemAlloc` arena is backed by a memfd as large as the arena (sparse: a page
//! costs memory only once written), mapped over it `MAP_SHARED`: the offset of an address in the
//! arena is its offset in the file, so another process can map the same pages (CUDA IPC,
//! `ipc.rs`). Freed pages are punched out of the file and made inaccessible again. In a child
//! forked after the driver started the arena becomes private memory again (`after_fork`).

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};

use crate::GRANULARITY;

/// Where the block of device addresses is asked for: 32 TiB, above AddressSanitizer's shadow
/// memory (which ends below 16 TiB + 2 GiB), far below where the kernel puts PIE executables
/// and their heap (about 85 TiB) and `mmap`s (below the stack, near 128 TiB).
pub const BASE_HINT: u64 = 0x2000_0000_0000;
/// The most address space the block takes (the arenas shrink to fit beneath it).
const LIMIT: u64 = 32 << 40;
/// A device's `cuMemAlloc` arena is this many times its capacity: room for fragmentation, since
/// the capacity is charged separately and only bytes in use count against it.
const ALLOC_ARENA_FACTOR: u64 = 8;
/// The VMM arena per device, in capacities: each of PyTorch's expandable segments reserves
/// 1 1/8 of the device's memory, one per stream and pool.
const VMM_ARENA_FACTOR: u64 = 32;

/// One range of device addresses, carved by lowest-address first fit.
pub struct Arena {
    start: u64,
    size: u64,
    /// The free ranges: start -> end, disjoint, never adjacent (merged on release).
    free: BTreeMap<u64, u64>,
    /// The memfd mapped over the whole arena (`cuMemAlloc` arenas), at offset `address -
    /// start`; None where the arena is anonymous memory (the VMM arena, or no memfd could be
    /// made).
    backing: Option<c_int>,
}

impl Arena {
    fn new(start: u64, size: u64) -> Arena {
        let free = if size > 0 {
            BTreeMap::from([(start, start + size)])
        } else {
            BTreeMap::new()
        };
        Arena {
            start,
            size,
            free,
            backing: None,
        }
    }

    /// Puts a memfd as large as the arena under it, `PROT_NONE` as the arena is. Said on stderr
    /// if it cannot: the arena stays anonymous memory, which no other process can map.
    fn back_with_memfd(&mut self) {
        let Some(fd) = sized_memfd(c"fake-cuda-device-memory", self.size) else {
            eprintln!("fake-cuda: no memfd for device memory; CUDA IPC cannot share it");
            return;
        };
        if map_file(self.start, self.size, libc::PROT_NONE, fd, 0) {
            self.backing = Some(fd);
        } else {
            eprintln!(
                "fake-cuda: could not map a memfd over device memory; CUDA IPC cannot share it"
            );
            // SAFETY: our own fd, closed once.
            unsafe { libc::close(fd) };
        }
    }

    /// The memfd behind the arena, whose offsets are `address - start`, if it has one.
    pub fn backing(&self) -> Option<c_int> {
        self.backing
    }

    /// Gives the host memory of whole pages `[ptr, ptr + len)` back and makes them inaccessible:
    /// punched out of the memfd (in every process that maps them) or, for anonymous memory,
    /// replaced by fresh `PROT_NONE` memory.
    pub fn give_back_pages(&self, ptr: u64, len: u64) -> bool {
        let Some(fd) = self.backing else {
            return put_back_inaccessible(ptr, len);
        };
        // SAFETY: whole pages of this arena, which only the driver maps; then a plain syscall on
        // our own fd over the same range of the file.
        unsafe {
            libc::mprotect(ptr as *mut c_void, len as usize, libc::PROT_NONE) == 0
                && libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    (ptr - self.start) as libc::off_t,
                    len as libc::off_t,
                ) == 0
        }
    }

    /// Puts the arena's own backing, `PROT_NONE`, back over whole pages `[ptr, ptr + len)` that
    /// something else was mapped over (another process's memory opened with CUDA IPC).
    pub fn restore_backing(&self, ptr: u64, len: u64) -> bool {
        match self.backing {
            Some(fd) => map_file(ptr, len, libc::PROT_NONE, fd, ptr - self.start),
            None => put_back_inaccessible(ptr, len),
        }
    }

    /// In a child forked after the driver started: the arena becomes the child's own, as a
    /// fork's copy of private memory is. The parent's memfd is mapped privately (copy on write:
    /// nothing is copied now; a page the child has not written shows the parent's bytes), but
    /// for the `foreign` ranges (other processes' memory, left as they are), with the `open`
    /// ranges (live allocations) readable and writable again. From then on the arena is
    /// anonymous memory, which no other process can map (CUDA itself does not work in such a
    /// child).
    pub fn after_fork(&mut self, foreign: &[(u64, u64)], open: &[(u64, u64)]) {
        let Some(parents) = self.backing.take() else {
            return;
        };
        let mut from = self.start;
        let end = self.start + self.size;
        for &(start, len) in foreign.iter().chain([&(end, 0)]) {
            if start > from {
                // SAFETY: MAP_FIXED over whole pages of this arena, which only the driver maps.
                unsafe {
                    libc::mmap(
                        from as *mut c_void,
                        (start - from) as usize,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                        parents,
                        (from - self.start) as libc::off_t,
                    )
                };
            }
            from = from.max(start + len);
        }
        // SAFETY: the child's copy of the parent's fd; the private mapping keeps the file.
        unsafe { libc::close(parents) };
        for &(start, len) in open {
            open_pages(start, len);
        }
    }

    /// The lowest `alignment`-aligned address at which `size` bytes are free, now taken; None
    /// when no free range holds them.
    pub fn place(&mut self, size: u64, alignment: u64) -> Option<u64> {
        let (range_start, range_end, placed) = self.free.iter().find_map(|(&start, &end)| {
            let placed = start.checked_next_multiple_of(alignment)?;
            (placed.checked_add(size)? <= end).then_some((start, end, placed))
        })?;
        self.free.remove(&range_start);
        if placed > range_start {
            self.free.insert(range_start, placed);
        }
        if placed + size < range_end {
            self.free.insert(placed + size, range_end);
        }
        Some(placed)
    }

    /// Gives back `[start, start + size)`, which [`Arena::place`] handed out.
    pub fn release(&mut self, start: u64, size: u64) {
        let mut start = start;
        let mut end = start + size;
        if let Some((&before, &before_end)) = self.free.range(..start).next_back()
            && before_end == start
        {
            self.free.remove(&before);
            start = before;
        }
        if let Some(&after_end) = self.free.get(&end) {
            self.free.remove(&end);
            end = after_end;
        }
        self.free.insert(start, end);
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    /// The address's distance from the arena's start (what the call log writes).
    pub fn offset(&self, address: u64) -> u64 {
        address - self.start
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

/// The process's block of device addresses and its arenas.
pub struct AddressSpace {
    base: u64,
    /// `cuMemAlloc` memory, per device.
    pub allocations: Vec<Arena>,
    /// `cuMemAddressReserve` ranges, for every device.
    pub reservations: Arena,
}

impl AddressSpace {
    /// Reserves the block for `devices` devices of `capacity` bytes each, at `hint` if that is
    /// free (0: wherever the kernel likes). None if the kernel refuses the address space.
    pub fn reserve(devices: u32, capacity: u64, hint: u64) -> Option<AddressSpace> {
        let devices = u64::from(devices.max(1));
        let mut alloc_arena = capacity.saturating_mul(ALLOC_ARENA_FACTOR);
        let mut vmm_arena = capacity
            .saturating_mul(VMM_ARENA_FACTOR)
            .saturating_mul(devices);
        let wanted = alloc_arena
            .saturating_mul(devices)
            .saturating_add(vmm_arena);
        if wanted > LIMIT {
            // Huge fake GPUs: share the limit in the same proportions.
            alloc_arena =
                LIMIT / (ALLOC_ARENA_FACTOR + VMM_ARENA_FACTOR) / devices * ALLOC_ARENA_FACTOR;
            vmm_arena = LIMIT - alloc_arena * devices;
        }
        let alloc_arena = alloc_arena.next_multiple_of(GRANULARITY).max(GRANULARITY);
        let vmm_arena = vmm_arena.next_multiple_of(GRANULARITY).max(GRANULARITY);
        let length = alloc_arena * devices + vmm_arena;
        let base = map_block(length, hint)?;
        let allocations = (0..devices)
            .map(|device| {
                let mut arena = Arena::new(base + device * alloc_arena, alloc_arena);
                arena.back_with_memfd();
                arena
            })
            .collect();
        let reservations = Arena::new(base + devices * alloc_arena, vmm_arena);
        Some(AddressSpace {
            base,
            allocations,
            reservations,
        })
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    /// Whether `address` lies in the block: device address space, never host memory.
    pub fn contains(&self, address: u64) -> bool {
        (self.base..self.reservations.start + self.reservations.size).contains(&address)
    }
}

/// `length` bytes of inaccessible address space, aligned to the granularity, at `hint` when
/// it is free there, else where the kernel puts it.
fn map_block(length: u64, hint: u64) -> Option<u64> {
    if hint != 0 && hint.is_multiple_of(GRANULARITY) {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping: it fails instead.
        let at = unsafe {
            libc::mmap(
                hint as *mut c_void,
                length as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_NORESERVE
                    | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if at != libc::MAP_FAILED {
            if at as u64 == hint {
                return Some(hint);
            }
            // A kernel older than 4.17 takes the flag for a plain hint and may map elsewhere.
            // SAFETY: the mapping just made, which nothing else knows of.
            unsafe { libc::munmap(at, length as usize) };
        }
    }
    // Over-reserve by one granule, then trim to an aligned block.
    let padded = length + GRANULARITY;
    // SAFETY: a fresh anonymous mapping; failure is checked.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            padded as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return None;
    }
    let at = at as u64;
    let start = at.next_multiple_of(GRANULARITY);
    // SAFETY: both pieces lie inside the mapping just made and are not used by anyone.
    unsafe {
        if start > at {
            libc::munmap(at as *mut c_void, (start - at) as usize);
        }
        let end = start + length;
        if at + padded > end {
            libc::munmap(end as *mut c_void, (at + padded - end) as usize);
        }
    }
    Some(start)
}

/// A memfd of `size` bytes (sparse), close-on-exec; None if the kernel refuses.
pub fn sized_memfd(name: &std::ffi::CStr, size: u64) -> Option<c_int> {
    // SAFETY: plain syscalls on a fresh fd we own; failure is checked.
    unsafe {
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return None;
        }
        if libc::ftruncate(fd, size as libc::off_t) != 0 {
            libc::close(fd);
            return None;
        }
        Some(fd)
    }
}

/// Maps `len` bytes of the file `fd` from `offset` at `ptr`, shared, replacing what was there.
pub fn map_file(ptr: u64, len: u64, protection: c_int, fd: c_int, offset: u64) -> bool {
    // SAFETY: MAP_FIXED over whole pages inside the block of device addresses, which only the
    // driver maps; the caller has forgotten what was mapped there.
    let result = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            len as usize,
            protection,
            libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_NORESERVE,
            fd,
            offset as libc::off_t,
        )
    };
    result != libc::MAP_FAILED
}

/// The host page size (the unit of protection).
pub fn page_size() -> u64 {
    // SAFETY: a plain query without side effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096).max(1)
}

/// Makes `[ptr, ptr + len)` readable and writable (whole pages; pages are committed only when
/// written).
pub fn open_pages(ptr: u64, len: u64) -> bool {
    // SAFETY: the range lies inside the block of device addresses, which only the driver maps.
    unsafe {
        libc::mprotect(
            ptr as *mut c_void,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
        ) == 0
    }
}

/// Fresh `PROT_NONE` anonymous memory at `[ptr, ptr + len)`, replacing whatever was mapped
/// there: the pages' host memory goes back to the system, and a stray access traps.
pub fn put_back_inaccessible(ptr: u64, len: u64) -> bool {
    // SAFETY: MAP_FIXED over whole pages inside the block of device addresses: only the
    // driver's own mappings are replaced, and the caller has already forgotten them.
    let result = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    result != libc::MAP_FAILED
}
