//! What a segment's memory is made of, one module per kind, each with obtain, release, sleep
//! and wake:
//! - [`plain`]: one device allocation (`cudaMalloc`); it cannot sleep;
//! - [`vmm`]: a reserved range with one physical allocation mapped into it, so that the
//!   memory can sleep while the addresses stay;
//! - [`expandable`]: a reserved range with pages mapped on demand (PyTorch's
//!   `ExpandableSegment`);
//! - [`external`]: memory from a private pool's own allocator (`MemPool(allocator=...)`); it
//!   cannot sleep either.
//!
//! Sleep with a backup goes the same way for every backing that can sleep ([`Memory`]'s
//! `backup_ranges`, `copy_out`, `sleep`, `wake`): the sleep loop (`allocator/sleep.rs`) picks
//! the live bytes, the backing says which of them its awake memory holds, queues their copies
//! into pinned host memory ([`Backup`]), and, once they completed, gives its physical memory back
//! keeping the backup; its wake maps again and queues the copies back.
//!
//! [`Memory`] is the backing a segment owns (the segment table, `allocator/segments.rs`, holds
//! it). What the device refuses to take back becomes a leftover ([`Leftovers`]), retried by
//! every `empty_cache`, so that one failed driver call leaks nothing for good.
//!
//! The backings only talk to the device; the guard (`allocator/guard.rs`) decides beforehand
//! whether a device allocation may happen, and the ledger (`allocator/ledger.rs`) counts what
//! it changed.

pub(crate) mod expandable;
pub(crate) mod external;
pub(crate) mod plain;
pub(crate) mod vmm;

use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, PinnedHostBuffer, StreamId};
use crate::logging;
use expandable::ExpandableSegment;
use vmm::VmmSegment;

/// What the log says when the device refuses to take memory back.
const LEFTOVER: &str = "the device refused to take memory back; empty_cache retries it";

/// The most one asynchronous copy moves: a long range goes in several, so that the copy engine
/// starts on the first while the next are queued, and an expandable segment's wake copies into
/// the pages it mapped while it maps the next ones.
pub(crate) const COPY_CHUNK: usize = 64 << 20;

/// A sleeping segment's live bytes, kept in pinned host memory: the ranges (offset in the
/// segment, length; in order, not overlapping) packed one after another in `buffer` from
/// `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Backup {
    pub(crate) buffer: PinnedHostBuffer,
    pub(crate) offset: usize,
    pub(crate) ranges: Vec<(usize, usize)>,
}

impl Backup {
    /// The bytes it holds.
    pub(crate) fn len(&self) -> usize {
        self.ranges.iter().map(|&(_, len)| len).sum()
    }

    /// Each copy of the bytes at segment offsets `[from, to)`, in chunks of at most
    /// [`COPY_CHUNK`]: (device address, offset in the buffer, length).
    pub(crate) fn copies_within(
        &self,
        base: DevicePtr,
        from: usize,
        to: usize,
    ) -> impl Iterator<Item = (DevicePtr, usize, usize)> + '_ {
        let mut at = self.offset;
        self.ranges.iter().flat_map(move |&(start, len)| {
            let packed = at;
            at += len;
            let (first, last) = (start.max(from), (start + len).min(to));
            (first..last.max(first))
                .step_by(COPY_CHUNK)
                .map(move |done| {
                    let piece = COPY_CHUNK.min(last - done);
                    (base + done as u64, packed + (done - start), piece)
                })
        })
    }

    /// Every copy, in chunks (see [`Backup::copies_within`]).
    pub(crate) fn copies(
        &self,
        base: DevicePtr,
    ) -> impl Iterator<Item = (DevicePtr, usize, usize)> + '_ {
        self.copies_within(base, 0, usize::MAX)
    }

    /// The part of the backup below segment offset `at` (`None` when nothing lies there): what
    /// an expandable segment keeps of it when its sleep stops at the page starting at `at`.
    pub(crate) fn below(&self, at: usize) -> Option<Backup> {
        let ranges: Vec<(usize, usize)> = self
            .ranges
            .iter()
            .filter(|&&(start, _)| start < at)
            .map(|&(start, len)| (start, len.min(at - start)))
            .collect();
        (!ranges.is_empty()).then_some(Backup {
            buffer: self.buffer,
            offset: self.offset,
            ranges,
        })
    }
}

/// A mapped or unmapped range, as `SegmentRange` in PyTorch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    pub ptr: DevicePtr,
    pub size: usize,
}

/// A physical page that left its segment but that the device did not take back: its unmap or
/// its release failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftoverPage {
    /// Where it is still mapped, when its unmap failed.
    pub mapped_at: Option<(DevicePtr, usize)>,
    pub handle: PhysicalHandle,
}

/// What the device refused to take back: physical pages, and address ranges whose
/// `cuMemAddressFree` failed. Retried by every `empty_cache` ([`Leftovers::retry`]).
#[derive(Debug, Default)]
pub(crate) struct Leftovers {
    pages: Vec<LeftoverPage>,
    ranges: Vec<PageRange>,
}

impl Leftovers {
    pub(crate) fn push(&mut self, page: LeftoverPage) {
        self.pages.push(page);
    }

    pub(crate) fn push_range(&mut self, range: PageRange) {
        self.ranges.push(range);
    }

    /// Releases physical memory; what the device refuses is kept.
    pub(crate) fn release_or_keep<D: Device>(&mut self, device: &mut D, handle: PhysicalHandle) {
        if let Err(err) = device.release_physical(handle) {
            logging::device_error(LEFTOVER, &err);
            self.push(LeftoverPage {
                mapped_at: None,
                handle,
            });
        }
    }

    /// Unmaps and releases physical memory; what the device refuses is kept.
    pub(crate) fn unmap_and_release_or_keep<D: Device>(
        &mut self,
        device: &mut D,
        base: DevicePtr,
        size: usize,
        handle: PhysicalHandle,
    ) {
        if let Err(err) = device.unmap(base, size) {
            logging::device_error(LEFTOVER, &err);
            self.push(LeftoverPage {
                mapped_at: Some((base, size)),
                handle,
            });
        } else {
            self.release_or_keep(device, handle);
        }
    }

    /// Frees an address range; what the device refuses is kept.
    pub(crate) fn free_range_or_keep<D: Device>(
        &mut self,
        device: &mut D,
        ptr: DevicePtr,
        size: usize,
    ) {
        if let Err(err) = device.free_address_range(ptr, size) {
            logging::device_error(LEFTOVER, &err);
            self.push_range(PageRange { ptr, size });
        }
    }

    /// Retries what the device refused to take back: unmaps and releases the leftover pages,
    /// then frees the leftover address ranges (after the pages: a range with a page still
    /// mapped in it cannot be freed). What the device still refuses stays, and the first
    /// refusal is returned.
    pub(crate) fn retry<D: Device>(&mut self, device: &mut D) -> Result<(), DeviceError> {
        let mut outcome = Ok(());
        for mut page in std::mem::take(&mut self.pages) {
            let mut result = Ok(());
            if let Some((ptr, size)) = page.mapped_at {
                result = device.unmap(ptr, size);
                if result.is_ok() {
                    page.mapped_at = None;
                }
            }
            result = result.and_then(|()| device.release_physical(page.handle));
            if let Err(err) = result {
                self.pages.push(page);
                if outcome.is_ok() {
                    outcome = Err(err);
                }
            }
        }
        for range in std::mem::take(&mut self.ranges) {
            if let Err(err) = device.free_address_range(range.ptr, range.size) {
                self.ranges.push(range);
                if outcome.is_ok() {
                    outcome = Err(err);
                }
            }
        }
        outcome
    }
}

/// The memory a segment owns.
#[derive(Debug)]
pub(crate) enum Memory {
    /// One device allocation (`cudaMalloc`).
    Plain,
    /// An expandable segment's range, pages mapped on demand.
    Expandable(ExpandableSegment),
    /// A reserved range with one physical allocation mapped into it.
    Vmm(VmmSegment),
    /// One allocation from the owning private pool's own allocator (`raw_alloc`).
    External,
}

/// What putting a segment's memory to sleep did.
#[derive(Debug, Default)]
pub(crate) struct Slept {
    /// Bytes given back now (0: nothing was awake, or the first step failed).
    pub(crate) bytes: usize,
    pub(crate) copied_bytes: usize,
    /// The pinned buffer that now holds (part of) the segment's backup.
    pub(crate) held: Option<PinnedHostBuffer>,
    /// The driver failure that stopped it part-way (what slept before it stays asleep).
    pub(crate) error: Option<DeviceError>,
}

/// What waking a segment's memory did.
#[derive(Debug, Default)]
pub(crate) struct Woken {
    /// Bytes taken again.
    pub(crate) bytes: usize,
    /// The backups whose copies back were queued: their bytes are back, and their buffers
    /// free, once the copy stream is synchronized.
    pub(crate) backups: Vec<Backup>,
}

impl Memory {
    #[inline(always)]
    pub(crate) fn is_expandable(&self) -> bool {
        matches!(self, Memory::Expandable(_))
    }

    /// Whether the memory can sleep at all (`cudaMalloc`'d memory and another allocator's
    /// cannot).
    pub(crate) fn can_sleep(&self) -> bool {
        !matches!(self, Memory::Plain | Memory::External)
    }

    /// Bytes asleep now.
    pub(crate) fn sleeping_bytes(&self) -> usize {
        match self {
            Memory::Plain | Memory::External => 0,
            Memory::Expandable(segment) => segment.sleeping_bytes(),
            Memory::Vmm(segment) => segment.sleeping_bytes(),
        }
    }

    /// Whether some of the memory is mapped and could sleep now (a VMM-backed segment awake, an
    /// expandable one with pages mapped).
    pub(crate) fn has_awake_memory(&self) -> bool {
        match self {
            Memory::Plain | Memory::External => false,
            Memory::Expandable(segment) => segment.awake_bytes() > 0,
            Memory::Vmm(segment) => segment.is_awake(),
        }
    }

    /// Of `live` (ranges of the segment's live blocks: offset, length, in order), the parts
    /// that awake memory holds: what a backup copies now.
    pub(crate) fn backup_ranges(&self, live: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
        match self {
            Memory::Plain | Memory::External => Vec::new(),
            Memory::Vmm(segment) if segment.is_awake() => live,
            Memory::Vmm(_) => Vec::new(),
            Memory::Expandable(segment) => segment.awake_parts(&live),
        }
    }

    /// Queues the copies of `backup`'s ranges into its pinned buffer on `stream`. A failure
    /// leaves the memory as it was (awake); copies queued before it may still be running.
    pub(crate) fn copy_out<D: Device>(
        &self,
        device: &mut D,
        backup: &Backup,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let base = match self {
            Memory::Plain | Memory::External => return Ok(()),
            Memory::Vmm(segment) => segment.base(),
            Memory::Expandable(segment) => segment.base(),
        };
        backup.copies(base).try_for_each(|(ptr, at, len)| {
            device.copy_to_pinned_async(ptr, backup.buffer, at, len, stream)
        })
    }

    /// Gives the physical memory back, keeping the addresses and `backup` (whose copies have
    /// completed; `None`: the contents are dropped). See each backing's `sleep`.
    pub(crate) fn sleep<D: Device>(
        &mut self,
        device: &mut D,
        backup: Option<Backup>,
        leftovers: &mut Leftovers,
    ) -> Slept {
        match self {
            Memory::Plain | Memory::External => Slept::default(),
            Memory::Vmm(segment) => segment.sleep(device, backup, leftovers),
            Memory::Expandable(segment) => segment.sleep_pages(device, backup, leftovers),
        }
    }

    /// Takes physical memory again at the same addresses and queues the copies of its backups
    /// back on `stream`, all or nothing (see each backing's `wake`; `waits` counts the host
    /// synchronizations a failure part-way needs).
    pub(crate) fn wake<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Leftovers,
        stream: Option<StreamId>,
        waits: &mut usize,
    ) -> Result<Woken, DeviceError> {
        match self {
            Memory::Plain | Memory::External => Ok(Woken::default()),
            Memory::Vmm(segment) => {
                let (bytes, backup) = segment.wake(device, leftovers, stream, waits)?;
                Ok(Woken {
                    bytes,
                    backups: backup.into_iter().collect(),
                })
            }
            Memory::Expandable(segment) => segment.wake_pages(device, leftovers, stream, waits),
        }
    }
}

/// A backup without the stream that made it: cannot happen (the stream lives as long as the
/// allocator), answered as an error rather than a panic.
pub(crate) fn no_copy_stream() -> DeviceError {
    DeviceError::Driver {
        call: "cuMemcpyHtoDAsync_v2",
        code: 1,
        message: "no copy stream for a backup".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn backup() -> Backup {
        // 10 MiB at 2 MiB, 100 MiB at 20 MiB: packed from 4 MiB in the buffer.
        Backup {
            buffer: 1,
            offset: 4 * MIB,
            ranges: vec![(2 * MIB, 10 * MIB), (20 * MIB, 100 * MIB)],
        }
    }

    #[test]
    fn a_backup_copies_its_ranges_in_chunks_of_at_most_64_mib_packed_in_its_buffer() {
        let copies: Vec<_> = backup().copies(0x1000_0000).collect();
        let base = 0x1000_0000u64;
        assert_eq!(
            copies,
            [
                (base + 2 * MIB as u64, 4 * MIB, 10 * MIB),
                (base + 20 * MIB as u64, 14 * MIB, 64 * MIB),
                (base + 84 * MIB as u64, 78 * MIB, 36 * MIB),
            ]
        );
        assert_eq!(backup().len(), 110 * MIB);
    }

    #[test]
    fn the_copies_within_a_window_are_the_pieces_of_the_ranges_inside_it() {
        // A window from 8 MiB to 40 MiB: the end of the first range, the start of the second.
        let copies: Vec<_> = backup().copies_within(0, 8 * MIB, 40 * MIB).collect();
        assert_eq!(
            copies,
            [
                (8 * MIB as u64, 10 * MIB, 4 * MIB),
                (20 * MIB as u64, 14 * MIB, 20 * MIB)
            ]
        );
        assert_eq!(backup().copies_within(0, 12 * MIB, 20 * MIB).count(), 0);
    }

    #[test]
    fn the_part_of_a_backup_below_a_page_keeps_its_place_in_the_buffer() {
        let below = backup().below(30 * MIB).unwrap();
        assert_eq!(below.ranges, [(2 * MIB, 10 * MIB), (20 * MIB, 10 * MIB)]);
        assert_eq!((below.buffer, below.offset), (1, 4 * MIB));
        assert_eq!(backup().below(2 * MIB), None);
    }
}
