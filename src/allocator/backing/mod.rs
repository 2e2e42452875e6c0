//! What a segment's memory is made of, one module per kind, each with obtain, release, sleep
//! and wake:
//! - [`plain`]: one device allocation (`cudaMalloc`); it cannot sleep;
//! - [`vmm`]: a reserved range with one physical allocation mapped into it, so that the
//!   memory can sleep while the addresses stay;
//! - [`expandable`]: a reserved range with pages mapped on demand (PyTorch's
//!   `ExpandableSegment`).
//!
//! [`Memory`] is the backing a segment owns (the segment table, `allocator/segments.rs`, holds
//! it). What the device refuses to take back becomes a leftover ([`Leftovers`]), retried by
//! every `empty_cache`, so that one failed driver call leaks nothing for good.
//!
//! The backings only talk to the device; the guard (`allocator/guard.rs`) decides beforehand
//! whether a device allocation may happen, and the ledger (`allocator/ledger.rs`) counts what
//! it changed.

pub(crate) mod expandable;
pub(crate) mod plain;
pub(crate) mod vmm;

use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};
use crate::logging;
use expandable::ExpandableSegment;
use vmm::VmmSegment;

/// What the log says when the device refuses to take memory back.
const LEFTOVER: &str = "the device refused to take memory back; empty_cache retries it";

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
}

/// What putting a segment's memory to sleep did.
#[derive(Debug, Default)]
pub(crate) struct Slept {
    /// Bytes given back now (0: nothing was awake, or the first step failed).
    pub(crate) bytes: usize,
    pub(crate) copied_bytes: usize,
    /// The driver failure that stopped it part-way (what slept before it stays asleep).
    pub(crate) error: Option<DeviceError>,
}

impl Memory {
    #[inline(always)]
    pub(crate) fn is_expandable(&self) -> bool {
        matches!(self, Memory::Expandable(_))
    }

    /// Whether the memory can sleep at all (`cudaMalloc`'d memory cannot).
    pub(crate) fn can_sleep(&self) -> bool {
        !matches!(self, Memory::Plain)
    }

    /// Bytes asleep now.
    pub(crate) fn sleeping_bytes(&self) -> usize {
        match self {
            Memory::Plain => 0,
            Memory::Expandable(segment) => segment.sleeping_bytes(),
            Memory::Vmm(segment) => segment.sleeping_bytes(),
        }
    }

    /// Gives the physical memory back, keeping the addresses (see each backing's `sleep`). A
    /// VMM-backed segment's backup is made beforehand ([`VmmSegment::copy_out`]) and handed to
    /// its `sleep` directly, so `backup` is for expandable segments only.
    pub(crate) fn sleep<D: Device>(
        &mut self,
        device: &mut D,
        backup: bool,
        leftovers: &mut Leftovers,
    ) -> Slept {
        match self {
            Memory::Plain => Slept::default(),
            Memory::Vmm(segment) => segment.sleep(device, None, leftovers),
            Memory::Expandable(segment) => {
                let slept = segment.sleep_pages(device, backup, leftovers);
                Slept {
                    bytes: slept.pages * segment.page_size(),
                    copied_bytes: slept.copied_bytes,
                    error: slept.error,
                }
            }
        }
    }

    /// Takes physical memory again at the same addresses, all or nothing: the bytes woken, the
    /// bytes copied back synchronously (expandable pages), and the pinned backup whose copies
    /// were queued on `stream` (VMM-backed segments; see [`VmmSegment::wake`]).
    pub(crate) fn wake<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Leftovers,
        stream: Option<StreamId>,
        waits: &mut usize,
    ) -> Result<(usize, usize, Option<vmm::Backup>), DeviceError> {
        match self {
            Memory::Plain => Ok((0, 0, None)),
            Memory::Vmm(segment) => {
                let (bytes, backup) = segment.wake(device, leftovers, stream, waits)?;
                Ok((bytes, 0, backup))
            }
            Memory::Expandable(segment) => {
                let (pages, copied) = segment.wake_pages(device, leftovers)?;
                Ok((pages * segment.page_size(), copied, None))
            }
        }
    }
}
