//! Expandable backing: one reserved virtual address range per (stream, pool), with physical
//! pages mapped into it as it grows and unmapped when they are free (PyTorch's
//! `ExpandableSegment`).
//!
//! - obtain: [`ExpandableSegment::reserve`] reserves the range, nothing mapped;
//! - grow and shrink: [`ExpandableSegment::map`] and [`ExpandableSegment::unmap`], whole pages;
//! - sleep and wake: [`ExpandableSegment::sleep_pages`] and [`ExpandableSegment::wake_pages`],
//!   every mapped page at its address, the backup (the live bytes, copied into pinned host
//!   memory beforehand by `Memory::copy_out`) kept aside and copied back as the pages are
//!   mapped again;
//! - release: [`ExpandableSegment::release`] gives the range back once nothing is mapped.
//!
//! This type only manages address space and pages; the allocator keeps the blocks that tile
//! the range (`allocator/expandable.rs`).

use super::{Backup, COPY_CHUNK, LeftoverPage, Leftovers, PageRange, Slept, Woken, no_copy_stream};
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};
use crate::logging;
use std::collections::BTreeSet;

/// One expandable segment.
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    base: DevicePtr,
    page_size: usize,
    max_pages: usize,
    stream: StreamId,
    /// The physical page mapped at each page index, if any; trimmed of trailing `None`s.
    pages: Vec<Option<PhysicalHandle>>,
    /// Pages asleep (see [`sleep`](crate::allocator::sleep)), by index: unmapped and released.
    /// Their blocks stay mapped in the allocator's books; they come back at the same addresses
    /// when the segment wakes.
    asleep: BTreeSet<usize>,
    /// The live bytes of the sleeping pages, in pinned host memory: one backup per sleep that
    /// put pages to sleep with one (two when a sleep stopped part-way and a later one finished).
    backups: Vec<Backup>,
}

/// `numSegments`: pages needed to hold `size` bytes.
fn pages_for(size: usize, page_size: usize) -> usize {
    size.div_ceil(page_size)
}

/// The address range an expandable segment reserves: `reserve` bytes
/// ([`policy::expandable_segment_reserve`](crate::policy::expandable_segment_reserve)) in
/// whole pages. A reserve of 0 bytes (`expandable_segments_reserve:1e-300`) asks the device for
/// 0 bytes, which it refuses, as under PyTorch.
pub(crate) fn reservation_size(reserve: usize, page_size: usize) -> usize {
    pages_for(reserve, page_size) * page_size
}

impl ExpandableSegment {
    /// Reserves the address range of a new segment for `stream` in `pool`: `reserve` bytes,
    /// rounded up to whole pages.
    pub(crate) fn reserve<D: Device>(
        device: &mut D,
        stream: StreamId,
        page_size: usize,
        reserve: usize,
    ) -> Result<ExpandableSegment, DeviceError> {
        let size = reservation_size(reserve, page_size);
        let base = device.reserve_address_range(size)?;
        Ok(ExpandableSegment {
            base,
            page_size,
            max_pages: size / page_size,
            stream,
            pages: Vec::new(),
            asleep: BTreeSet::new(),
            backups: Vec::new(),
        })
    }

    pub(crate) fn base(&self) -> DevicePtr {
        self.base
    }

    /// The whole reserved size.
    pub(crate) fn size(&self) -> usize {
        self.max_pages * self.page_size
    }

    pub(crate) fn stream(&self) -> StreamId {
        self.stream
    }

    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    /// Bytes of the pages that the segment's mapped blocks cover: backed by physical pages, or
    /// asleep.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.awake_bytes() + self.sleeping_bytes()
    }

    /// Bytes currently backed by physical pages.
    pub(crate) fn awake_bytes(&self) -> usize {
        self.pages.iter().flatten().count() * self.page_size
    }

    /// Bytes of the pages asleep.
    pub(crate) fn sleeping_bytes(&self) -> usize {
        self.asleep.len() * self.page_size
    }

    /// Whether any page is asleep. Such a segment does not grow, and its free blocks serve
    /// nobody, until it wakes.
    pub(crate) fn is_asleep(&self) -> bool {
        !self.asleep.is_empty()
    }

    fn page_left(&self, ptr: DevicePtr) -> usize {
        ((ptr - self.base) as usize) / self.page_size
    }

    fn page_right(&self, ptr: DevicePtr) -> usize {
        pages_for((ptr - self.base) as usize, self.page_size)
    }

    fn range_of_pages(&self, begin: usize, end: usize) -> PageRange {
        PageRange {
            ptr: self.base + (begin * self.page_size) as u64,
            size: (end - begin) * self.page_size,
        }
    }

    fn page_ptr(&self, index: usize) -> DevicePtr {
        self.base + (index * self.page_size) as u64
    }

    /// The physical pages under `[ptr, ptr + size)`, whole pages as PyTorch's `share` takes
    /// them (for CUDA IPC): the address of the first, and each page's handle in order; `None`
    /// when one of them is not mapped (asleep).
    pub(crate) fn pages_under(
        &self,
        ptr: DevicePtr,
        size: usize,
    ) -> Option<(DevicePtr, Vec<PhysicalHandle>)> {
        let begin = self.page_left(ptr);
        let end = self.page_right(ptr + size as u64);
        let handles = (begin..end)
            .map(|i| self.pages.get(i).copied().flatten())
            .collect::<Option<Vec<_>>>()?;
        Some((self.page_ptr(begin), handles))
    }

    /// Maps physical pages under `[ptr, ptr + size)`; `ptr` is page aligned. Returns the range
    /// mapped (whole pages, so possibly more than asked).
    ///
    /// All or nothing: if creating, mapping or granting access to any page fails, every page this
    /// call created is unmapped and released again before the error is returned, so a failure
    /// in the middle of growing leaks nothing and leaves no half-mapped range.
    pub(crate) fn map<D: Device>(
        &mut self,
        device: &mut D,
        ptr: DevicePtr,
        size: usize,
        leftovers: &mut Leftovers,
    ) -> Result<PageRange, DeviceError> {
        let begin = self.page_left(ptr);
        let end = self.page_right(ptr + size as u64);
        debug_assert_eq!(self.page_ptr(begin), ptr, "map must start on a page");
        if begin == end {
            return Ok(self.range_of_pages(begin, end));
        }
        if self.pages.len() < end {
            self.pages.resize(end, None);
        }
        let mut created: Vec<PhysicalHandle> = Vec::with_capacity(end - begin);
        let mut mapped = 0;
        let outcome = (|| {
            for _ in begin..end {
                created.push(device.create_physical(self.page_size)?);
            }
            for (i, &handle) in created.iter().enumerate() {
                device.map(self.page_ptr(begin + i), self.page_size, handle)?;
                mapped += 1;
            }
            device.set_access(ptr, (end - begin) * self.page_size)
        })();
        match outcome {
            Ok(()) => {
                for (i, handle) in created.into_iter().enumerate() {
                    debug_assert!(self.pages[begin + i].is_none());
                    self.pages[begin + i] = Some(handle);
                }
                Ok(self.range_of_pages(begin, end))
            }
            Err(err) => {
                let pages = (begin..end).map(|i| self.page_ptr(i));
                give_back(
                    device,
                    pages.zip(created),
                    mapped,
                    self.page_size,
                    leftovers,
                );
                self.trim();
                Err(err)
            }
        }
    }

    /// Unmaps and releases every page lying entirely inside `[ptr, ptr + size)`, after waiting
    /// for the segment's stream (unmapping does not wait for kernels still using the memory).
    /// Returns the range unmapped, possibly empty; on a failure part-way, the pages unmapped so
    /// far (a range starting at the first page) together with the error.
    pub(crate) fn unmap<D: Device>(
        &mut self,
        device: &mut D,
        ptr: DevicePtr,
        size: usize,
        leftovers: &mut Leftovers,
    ) -> (PageRange, Option<DeviceError>) {
        let begin = self.page_right(ptr);
        let end = self.page_left(ptr + size as u64);
        if begin >= end {
            return (PageRange { ptr, size: 0 }, None);
        }
        if let Err(err) = device.synchronize_stream(self.stream) {
            return (self.range_of_pages(begin, begin), Some(err));
        }
        for i in begin..end {
            let Some(handle) = self.pages.get(i).copied().flatten() else {
                continue;
            };
            if let Err(err) = device.unmap(self.page_ptr(i), self.page_size) {
                self.trim();
                return (self.range_of_pages(begin, i), Some(err));
            }
            self.pages[i] = None;
            if let Err(err) = device.release_physical(handle) {
                // Unmapped already: the range is gone from the segment either way, and the
                // page is a leftover until the device takes it back.
                leftovers.push(LeftoverPage {
                    mapped_at: None,
                    handle,
                });
                self.trim();
                return (self.range_of_pages(begin, i + 1), Some(err));
            }
        }
        self.trim();
        (self.range_of_pages(begin, end), None)
    }

    /// Of `live` (segment offsets and lengths, in order), the parts that lie in mapped pages,
    /// adjacent ones merged: what a backup copies now (a page asleep holds nothing to copy).
    pub(crate) fn awake_parts(&self, live: &[(usize, usize)]) -> Vec<(usize, usize)> {
        let mut parts: Vec<(usize, usize)> = Vec::new();
        for &(start, len) in live {
            let end = start + len;
            let mut at = start;
            while at < end {
                let page = at / self.page_size;
                let page_end = ((page + 1) * self.page_size).min(end);
                if self.pages.get(page).copied().flatten().is_some() {
                    match parts.last_mut() {
                        Some((from, n)) if *from + *n == at => *n += page_end - at,
                        _ => parts.push((at, page_end - at)),
                    }
                }
                at = page_end;
            }
        }
        parts
    }

    /// Puts every mapped page to sleep: unmaps it and releases its physical memory, keeping
    /// `backup` (the live bytes of those pages, whose copies have completed; `None`: dropped).
    /// Each page is all or nothing: an unmap that fails stops the call with the pages before
    /// it asleep, the part of the backup that lies in them kept, and the rest mapped as they
    /// were. A release the device refuses after the unmap leaves the page asleep and its memory
    /// a leftover.
    pub(crate) fn sleep_pages<D: Device>(
        &mut self,
        device: &mut D,
        backup: Option<Backup>,
        leftovers: &mut Leftovers,
    ) -> Slept {
        let mapped: Vec<(usize, PhysicalHandle)> = self
            .pages
            .iter()
            .enumerate()
            .filter_map(|(i, page)| page.map(|handle| (i, handle)))
            .collect();
        let mut slept = Slept::default();
        let mut stopped_at = None;
        for (i, handle) in mapped {
            if let Err(err) = device.unmap(self.page_ptr(i), self.page_size) {
                slept.error = Some(err);
                stopped_at = Some(i * self.page_size);
                break;
            }
            self.pages[i] = None;
            self.asleep.insert(i);
            slept.bytes += self.page_size;
            if let Err(err) = device.release_physical(handle) {
                // The page sleeps either way; its memory is held until `empty_cache` retries.
                logging::device_error(
                    "the device refused to take a sleeping page back; empty_cache retries it",
                    &err,
                );
                leftovers.push(LeftoverPage {
                    mapped_at: None,
                    handle,
                });
            }
        }
        self.trim();
        let kept = match (backup, stopped_at) {
            (Some(backup), None) => Some(backup),
            (Some(backup), Some(at)) => backup.below(at),
            (None, _) => None,
        };
        if let Some(kept) = kept.filter(|b| slept.bytes > 0 && !b.ranges.is_empty()) {
            slept.copied_bytes = kept.len();
            slept.held = Some(kept.buffer);
            self.backups.push(kept);
        }
        slept
    }

    /// Wakes every sleeping page at its address and copies the backups back: creates physical
    /// memory, maps it, grants access (to the devices [`Device::set_access`] grants, peers
    /// included) and queues on `stream` the copies into those pages, a group of pages of at
    /// least [`COPY_CHUNK`] bytes at a time, so that the next group's creation and mapping
    /// overlap the copies of the one before (without backups, a run of pages at a time). Returns the bytes woken and the backups (their bytes are
    /// back, and their buffers free, once `stream` is synchronized).
    ///
    /// All or nothing for the segment: on any failure the copies queued are waited for (one
    /// more host synchronization, counted in `waits`), every page this call created is unmapped
    /// and released again (what the device refuses becomes a leftover), and every page stays
    /// asleep with its backups, as in [`map`](Self::map).
    pub(crate) fn wake_pages<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Leftovers,
        stream: Option<StreamId>,
        waits: &mut usize,
    ) -> Result<Woken, DeviceError> {
        let indices: Vec<usize> = self.asleep.iter().copied().collect();
        let mut created: Vec<PhysicalHandle> = Vec::with_capacity(indices.len());
        let mut mapped = 0;
        let mut queued = false;
        // Without copies to overlap, one group per run of pages: one grant each.
        let pages_per_group = if self.backups.is_empty() {
            usize::MAX
        } else {
            COPY_CHUNK.div_ceil(self.page_size).max(1)
        };
        let outcome = (|| {
            // Groups of consecutive pages: one grant each, as `map` grants a range.
            let runs = indices.chunk_by(|a, b| a + 1 == *b);
            for group in runs.flat_map(|run| run.chunks(pages_per_group)) {
                for &i in group {
                    let handle = device.create_physical(self.page_size)?;
                    created.push(handle);
                    device.map(self.page_ptr(i), self.page_size, handle)?;
                    mapped += 1;
                }
                let (first, end) = (group[0], group[group.len() - 1] + 1);
                device.set_access(self.page_ptr(first), (end - first) * self.page_size)?;
                let (from, to) = (first * self.page_size, end * self.page_size);
                for backup in &self.backups {
                    let stream = stream.ok_or_else(no_copy_stream)?;
                    for (ptr, at, len) in backup.copies_within(self.base, from, to) {
                        device.copy_from_pinned_async(ptr, backup.buffer, at, len, stream)?;
                        queued = true;
                    }
                }
            }
            Ok(())
        })();
        if let Err(err) = outcome {
            // The pages may not go back while a copy into them is pending.
            if queued && let Some(stream) = stream {
                *waits += 1;
                if let Err(wait) = device.synchronize_stream(stream) {
                    // Copies may still write into the pages: they stay mapped, as leftovers
                    // that empty_cache retries, and the segment stays asleep with its backups.
                    logging::device_error("could not wait for the copies of a failed wake", &wait);
                    for (n, (&i, handle)) in indices.iter().zip(created).enumerate() {
                        let mapped_at = (n < mapped).then(|| (self.page_ptr(i), self.page_size));
                        leftovers.push(LeftoverPage { mapped_at, handle });
                    }
                    return Err(err);
                }
            }
            let pages = indices.iter().map(|&i| self.page_ptr(i));
            give_back(
                device,
                pages.zip(created),
                mapped,
                self.page_size,
                leftovers,
            );
            return Err(err);
        }
        let end = indices.last().map_or(0, |last| last + 1);
        if self.pages.len() < end {
            self.pages.resize(end, None);
        }
        for (i, handle) in indices.into_iter().zip(created) {
            debug_assert!(self.pages[i].is_none());
            self.pages[i] = Some(handle);
        }
        self.asleep.clear();
        Ok(Woken {
            bytes: mapped * self.page_size,
            backups: std::mem::take(&mut self.backups),
        })
    }

    /// Gives the address range back. Every page must have been unmapped.
    pub(crate) fn release<D: Device>(&self, device: &mut D) -> Result<(), DeviceError> {
        debug_assert_eq!(self.mapped_bytes(), 0);
        device.free_address_range(self.base, self.size())
    }

    fn trim(&mut self) {
        while matches!(self.pages.last(), Some(None)) {
            self.pages.pop();
        }
    }
}

/// Undoes a growth or a wake that failed part-way: unmaps the first `mapped` of the pages just
/// created (each at its address) and releases them all. The original error is the one worth
/// reporting; a page the device will not take back becomes a leftover, retried later.
fn give_back<D: Device>(
    device: &mut D,
    created: impl Iterator<Item = (DevicePtr, PhysicalHandle)>,
    mapped: usize,
    page_size: usize,
    leftovers: &mut Leftovers,
) {
    for (i, (page, handle)) in created.enumerate() {
        if i < mapped && device.unmap(page, page_size).is_err() {
            leftovers.push(LeftoverPage {
                mapped_at: Some((page, page_size)),
                handle,
            });
        } else if device.release_physical(handle).is_err() {
            leftovers.push(LeftoverPage {
                mapped_at: None,
                handle,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::{SimDevice, SimOp};
    use crate::policy;

    const MIB: usize = 1 << 20;

    #[test]
    pub(super) fn reservation_is_nine_eighths_of_memory_in_whole_pages() {
        let config = crate::config::Config::default();
        let nine_eighths = |total| policy::expandable_segment_reserve(&config, total, "").bytes;
        assert_eq!(
            reservation_size(nine_eighths(80 << 30), 20 * MIB),
            4608 * 20 * MIB
        );
        assert_eq!(reservation_size(nine_eighths(8 * MIB), 2 * MIB), 10 * MIB);
        assert_eq!(reservation_size(0, 2 * MIB), 0);
        assert_eq!(reservation_size(1, 20 * MIB), 20 * MIB);
    }

    #[test]
    pub(super) fn maps_whole_pages_and_unmaps_only_whole_free_pages() {
        let mut d = SimDevice::new(1 << 30);
        let mut s = ExpandableSegment::reserve(&mut d, 0, 20 * MIB, 9 << 27).unwrap();
        let r = s
            .map(&mut d, s.base(), 30 * MIB, &mut Leftovers::default())
            .unwrap();
        assert_eq!(
            r,
            PageRange {
                ptr: s.base(),
                size: 40 * MIB
            }
        );
        assert!(d.is_accessible(s.base(), 40 * MIB));
        assert_eq!(s.mapped_bytes(), 40 * MIB);
        // Only the second page lies entirely inside [10 MiB, 40 MiB).
        let (r, err) = s.unmap(
            &mut d,
            s.base() + 10 * MIB as u64,
            30 * MIB,
            &mut Leftovers::default(),
        );
        assert!(err.is_none());
        assert_eq!(
            r,
            PageRange {
                ptr: s.base() + 20 * MIB as u64,
                size: 20 * MIB
            }
        );
        let (r, _) = s.unmap(&mut d, s.base(), 20 * MIB, &mut Leftovers::default());
        assert_eq!(r.size, 20 * MIB);
        assert_eq!(d.physical_in_use(), 0);
        s.release(&mut d).unwrap();
        assert_eq!(d.reserved_ranges(), 0);
    }

    #[test]
    pub(super) fn a_failure_while_growing_leaves_nothing_behind() {
        let fault = DeviceError::Driver {
            call: "test",
            code: 999,
            message: "injected".into(),
        };
        // Fail the second page's create or map, or the access grant after all maps.
        for (op, nth) in [
            (SimOp::CreatePhysical, 2),
            (SimOp::Map, 2),
            (SimOp::SetAccess, 1),
        ] {
            let mut d = SimDevice::new(1 << 30);
            let mut s = ExpandableSegment::reserve(&mut d, 0, 2 * MIB, 9 << 27).unwrap();
            s.map(&mut d, s.base(), 2 * MIB, &mut Leftovers::default())
                .unwrap();
            d.fail_nth(op, nth, fault.clone());
            let result = s.map(
                &mut d,
                s.base() + 2 * MIB as u64,
                6 * MIB,
                &mut Leftovers::default(),
            );
            assert_eq!(result, Err(fault.clone()), "{op:?}");
            assert_eq!(s.mapped_bytes(), 2 * MIB, "{op:?}");
            assert_eq!(d.live_physical_handles(), 1, "{op:?}");
            assert_eq!(d.mapped_bytes(), 2 * MIB, "{op:?}");
            assert_eq!(d.physical_in_use(), 2 * MIB, "{op:?}");
            // And the segment grows fine afterwards.
            s.map(
                &mut d,
                s.base() + 2 * MIB as u64,
                6 * MIB,
                &mut Leftovers::default(),
            )
            .unwrap();
            assert_eq!(s.mapped_bytes(), 8 * MIB);
        }
    }
}
