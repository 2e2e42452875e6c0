//! Expandable backing: one reserved virtual address range per (stream, pool), with physical
//! pages mapped into it as it grows and unmapped when they are free (PyTorch's
//! `ExpandableSegment`).
//!
//! - obtain: [`ExpandableSegment::reserve`] reserves the range, nothing mapped;
//! - grow and shrink: [`ExpandableSegment::map`] and [`ExpandableSegment::unmap`], whole pages;
//! - sleep and wake: [`ExpandableSegment::sleep_pages`] and [`ExpandableSegment::wake_pages`],
//!   every mapped page at its address;
//! - release: [`ExpandableSegment::release`] gives the range back once nothing is mapped.
//!
//! This type only manages address space and pages; the allocator keeps the blocks that tile
//! the range (`allocator/expandable.rs`).

use super::{LeftoverPage, Leftovers, PageRange};
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};
use crate::logging;
use std::collections::BTreeMap;

/// One expandable segment.
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    base: DevicePtr,
    page_size: usize,
    max_pages: usize,
    stream: StreamId,
    /// The physical page mapped at each page index, if any; trimmed of trailing `None`s.
    pages: Vec<Option<PhysicalHandle>>,
    /// Pages asleep (see [`sleep`](crate::allocator::sleep)), by index: unmapped and released, their bytes
    /// kept in host memory when they went to sleep with a backup. Their blocks stay mapped in
    /// the allocator's books; they come back at the same addresses when the segment wakes.
    asleep: BTreeMap<usize, Option<Vec<u8>>>,
}

/// What [`ExpandableSegment::sleep_pages`] did before it finished or failed.
#[derive(Debug, Default)]
pub(crate) struct PagesSlept {
    pub pages: usize,
    pub copied_bytes: usize,
    /// The driver failure that stopped it: the pages before it sleep, the rest stay mapped.
    pub error: Option<DeviceError>,
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
            asleep: BTreeMap::new(),
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

    /// Puts every mapped page to sleep: with `backup`, copies each to host memory first (a
    /// failed copy changes nothing); then unmaps each page and releases its physical memory.
    /// Each page is all or nothing: an unmap that fails stops the call with the pages before it
    /// asleep (with their backups) and the rest mapped as they were. A release the device
    /// refuses after the unmap leaves the page asleep and its memory a leftover.
    pub(crate) fn sleep_pages<D: Device>(
        &mut self,
        device: &mut D,
        backup: bool,
        leftovers: &mut Leftovers,
    ) -> PagesSlept {
        let mapped: Vec<(usize, PhysicalHandle)> = self
            .pages
            .iter()
            .enumerate()
            .filter_map(|(i, page)| page.map(|handle| (i, handle)))
            .collect();
        let mut backups: Vec<Option<Vec<u8>>> = Vec::with_capacity(mapped.len());
        let mut slept = PagesSlept::default();
        for &(i, _) in &mapped {
            if !backup {
                backups.push(None);
                continue;
            }
            let mut bytes = vec![0; self.page_size];
            if let Err(err) = device.copy_to_host(self.page_ptr(i), &mut bytes) {
                slept.error = Some(err);
                return slept;
            }
            backups.push(Some(bytes));
        }
        for ((i, handle), saved) in mapped.into_iter().zip(backups) {
            if let Err(err) = device.unmap(self.page_ptr(i), self.page_size) {
                slept.error = Some(err);
                break;
            }
            self.pages[i] = None;
            slept.pages += 1;
            slept.copied_bytes += saved.as_ref().map_or(0, Vec::len);
            self.asleep.insert(i, saved);
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
        slept
    }

    /// Wakes every sleeping page at its address: creates physical memory, maps it, grants
    /// access (to the devices [`Device::set_access`] grants, peers included) and copies the
    /// backups back. Returns the pages woken and the bytes copied.
    ///
    /// All or nothing for the segment: on any failure every page this call created is unmapped
    /// and released again (what the device refuses becomes a leftover), and every page stays
    /// asleep with its backup, as in [`map`](Self::map).
    pub(crate) fn wake_pages<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Leftovers,
    ) -> Result<(usize, usize), DeviceError> {
        let indices: Vec<usize> = self.asleep.keys().copied().collect();
        let mut created: Vec<PhysicalHandle> = Vec::with_capacity(indices.len());
        let mut mapped = 0;
        let mut copied = 0;
        let outcome = (|| {
            for _ in &indices {
                created.push(device.create_physical(self.page_size)?);
            }
            for (&i, &handle) in indices.iter().zip(&created) {
                device.map(self.page_ptr(i), self.page_size, handle)?;
                mapped += 1;
            }
            // One grant per run of consecutive pages, as `map` grants a range.
            for run in indices.chunk_by(|a, b| a + 1 == *b) {
                let first = run[0];
                device.set_access(self.page_ptr(first), run.len() * self.page_size)?;
            }
            for &i in &indices {
                if let Some(bytes) = &self.asleep[&i] {
                    device.copy_from_host(self.page_ptr(i), bytes)?;
                    copied += bytes.len();
                }
            }
            Ok(())
        })();
        if let Err(err) = outcome {
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
        Ok((mapped, copied))
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
