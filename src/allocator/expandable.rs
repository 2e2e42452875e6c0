//! Expandable segments: one reserved virtual address range per (stream, pool), with physical
//! pages mapped into it as it grows and unmapped when they are free (PyTorch's
//! `ExpandableSegment`).
//!
//! This type only manages address space and pages; the allocator keeps the blocks that tile the
//! range (mapped blocks in the free pool, unmapped ones in the pool's unmapped set).

use super::block::{Backing, Block, BlockId, ExpandableId};
use super::history::TraceAction;
use super::private_pool::Owner;
use super::{AllocError, DeviceAllocator, Request};
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};
use crate::logging;
use crate::policy::{self, PoolKind};
use std::collections::BTreeMap;

/// A mapped or unmapped range, as `SegmentRange` in PyTorch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    pub ptr: DevicePtr,
    pub size: usize,
}

/// One expandable segment.
#[derive(Debug)]
pub struct ExpandableSegment {
    base: DevicePtr,
    page_size: usize,
    max_pages: usize,
    stream: StreamId,
    pool: PoolKind,
    /// The physical page mapped at each page index, if any; trimmed of trailing `None`s.
    pages: Vec<Option<PhysicalHandle>>,
    /// Pages asleep (see [`sleep`](super::sleep)), by index: unmapped and released, their bytes
    /// kept in host memory when they went to sleep with a backup. Their blocks stay mapped in
    /// the allocator's books; they come back at the same addresses when the segment wakes.
    asleep: BTreeMap<usize, Option<Vec<u8>>>,
}

/// What [`ExpandableSegment::sleep_pages`] did before it finished or failed.
#[derive(Debug, Default)]
pub struct PagesSlept {
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
pub fn reservation_size(reserve: usize, page_size: usize) -> usize {
    pages_for(reserve, page_size) * page_size
}

impl ExpandableSegment {
    /// Reserves the address range of a new segment for `stream` in `pool`: `reserve` bytes,
    /// rounded up to whole pages.
    pub fn reserve<D: Device>(
        device: &mut D,
        stream: StreamId,
        pool: PoolKind,
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
            pool,
            pages: Vec::new(),
            asleep: BTreeMap::new(),
        })
    }

    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// The whole reserved size.
    pub fn size(&self) -> usize {
        self.max_pages * self.page_size
    }

    pub fn stream(&self) -> StreamId {
        self.stream
    }

    pub fn pool(&self) -> PoolKind {
        self.pool
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Bytes of the pages that the segment's mapped blocks cover: backed by physical pages, or
    /// asleep.
    pub fn mapped_bytes(&self) -> usize {
        self.awake_bytes() + self.sleeping_bytes()
    }

    /// Bytes currently backed by physical pages.
    pub fn awake_bytes(&self) -> usize {
        self.pages.iter().flatten().count() * self.page_size
    }

    /// Bytes of the pages asleep.
    pub fn sleeping_bytes(&self) -> usize {
        self.asleep.len() * self.page_size
    }

    /// Whether any page is asleep. Such a segment does not grow, and its free blocks serve
    /// nobody, until it wakes.
    pub fn is_asleep(&self) -> bool {
        !self.asleep.is_empty()
    }

    /// Whether every page under `[ptr, ptr + size)` is mapped.
    pub fn is_mapped(&self, ptr: DevicePtr, size: usize) -> bool {
        let first = self.page_left(ptr);
        let last = self.page_right(ptr + size as u64);
        (first..last).all(|i| self.pages.get(i).is_some_and(Option::is_some))
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

    /// Maps physical pages under `[ptr, ptr + size)`; `ptr` is page aligned. Returns the range
    /// mapped (whole pages, so possibly more than asked).
    ///
    /// All or nothing: if creating, mapping or granting access to any page fails, every page this
    /// call created is unmapped and released again before the error is returned, so a failure
    /// in the middle of growing leaks nothing and leaves no half-mapped range.
    pub fn map<D: Device>(
        &mut self,
        device: &mut D,
        ptr: DevicePtr,
        size: usize,
        leftovers: &mut Vec<LeftoverPage>,
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
    pub fn unmap<D: Device>(
        &mut self,
        device: &mut D,
        ptr: DevicePtr,
        size: usize,
        leftovers: &mut Vec<LeftoverPage>,
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
    pub fn sleep_pages<D: Device>(
        &mut self,
        device: &mut D,
        backup: bool,
        leftovers: &mut Vec<LeftoverPage>,
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
    pub fn wake_pages<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Vec<LeftoverPage>,
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
    pub fn release<D: Device>(&self, device: &mut D) -> Result<(), DeviceError> {
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
    leftovers: &mut Vec<LeftoverPage>,
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

/// A physical page that left its segment but that the device did not take back: its unmap or
/// its release failed. Kept, and retried by every `empty_cache`, so that one failed driver call
/// leaks nothing for good (address ranges whose `cuMemAddressFree` failed are kept the same
/// way, as `PageRange`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftoverPage {
    /// Where it is still mapped, when its unmap failed.
    pub mapped_at: Option<(DevicePtr, usize)>,
    pub handle: PhysicalHandle,
}

/// The allocator's side of expandable segments: finding room, mapping pages into blocks,
/// unmapping free pages, releasing empty ranges.
impl<D: Device> DeviceAllocator<D> {
    pub(super) fn segment(&self, id: ExpandableId) -> &ExpandableSegment {
        self.expandable_segments[id as usize]
            .as_ref()
            .expect("live expandable segment")
    }

    /// `try_allocate_expandable_block`: finds (or reserves) address space for the request in
    /// the stream's expandable segment and maps pages until a free block covers it.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let candidate = self.find_expandable_block(request)?;
        let fresh = self.arena.get(candidate);
        if !fresh.mapped && !fresh.is_split() && fresh.size < request.size {
            // A new segment's whole range cannot hold the request (larger than 9/8 of the
            // device, or than `expandable_segments_reserve`): as PyTorch does, the range goes
            // back at once and nothing is mapped.
            self.release_expandable_segment(candidate)?;
            return Ok(None);
        }
        self.grow_expandable_block(candidate, request)
    }

    /// Maps pages from `candidate` (a free or unmapped block that, with the free and unmapped
    /// space after it, holds the request) until one free block covers the request; takes it out
    /// of its pool. `Ok(None)` when the device is out of memory.
    ///
    /// The pages mapped take `candidate`'s stream, so that they merge with it into one block:
    /// with cross-stream reuse the unmapped space after it may carry another stream (that of
    /// the block unmapped there last, or of the segment), which would otherwise come back
    /// mapped as a block of that stream and be handed to the request.
    pub(super) fn grow_expandable_block(
        &mut self,
        mut candidate: BlockId,
        request: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let stream = self.arena.get(candidate).stream;
        if !self.arena.get(candidate).mapped {
            let size = self.arena.get(candidate).size.min(request.size);
            if !self.map_block(candidate, size, stream)? {
                return Ok(None);
            }
        }
        while self.arena.get(candidate).size < request.size {
            let remaining = request.size - self.arena.get(candidate).size;
            let next = self
                .arena
                .get(candidate)
                .next
                .expect("find_expandable_block checked the space after the candidate");
            let size = self.arena.get(next).size.min(remaining);
            if !self.map_block(next, size, stream)? {
                return Ok(None);
            }
            candidate = next;
        }
        let block = self.arena.get(candidate);
        self.pools.of_block_mut(block).remove(candidate, block);
        Ok(Some(candidate))
    }

    /// `find_expandable_block`: the lowest address where free and unmapped space together hold
    /// the request, in an existing segment of the stream, or else a newly reserved segment.
    pub(super) fn find_expandable_block(
        &mut self,
        request: &Request,
    ) -> Result<BlockId, AllocError> {
        let arena = &self.arena;
        // Mapped blocks join only if they will merge with the pages mapped for the request
        // (with cross-stream reuse, a neighbour may belong to another stream).
        let available = |id: Option<BlockId>| {
            id.filter(|&id| {
                let b = arena.get(id);
                b.is_available() && (!b.mapped || b.stream == request.stream)
            })
        };
        let has_room = |start: BlockId| {
            let mut bytes = 0;
            let mut cursor = Some(start);
            while bytes < request.size {
                match available(cursor) {
                    Some(id) => {
                        bytes += arena.get(id).size;
                        cursor = arena.get(id).next;
                    }
                    None => break,
                }
            }
            bytes >= request.size
        };
        let pool = self.pools.get(request.owner, request.pool);
        // A sleeping segment does not grow (its pages come back only at wake): the request
        // looks further, or reserves a new segment.
        for unmapped in pool
            .unmapped_of(request.stream)
            .filter(|&id| !arena.get(id).asleep)
        {
            // A free mapped block just before the unmapped space extends it downwards.
            let start = available(arena.get(unmapped).prev).unwrap_or(unmapped);
            if has_room(start) {
                return Ok(start);
            }
        }
        self.new_expandable_segment(request.stream, request.pool, request.owner)
    }

    /// Reserves the address range of a new expandable segment for `stream` in `pool` (of a
    /// private pool, or the ordinary one); returns its one block, unmapped, spanning the range.
    pub(super) fn new_expandable_segment(
        &mut self,
        stream: StreamId,
        pool: PoolKind,
        owner: Owner,
    ) -> Result<BlockId, AllocError> {
        let total = self.device.mem_get_info()?.total;
        let reserve_class = self.reserve_class_of(stream);
        let reserve = policy::expandable_segment_reserve(&self.config, total, &reserve_class);
        if !reserve_class.is_empty()
            && !reserve.class_known
            && self.warned_reserve_classes.insert(reserve_class.clone())
        {
            logging::warning(&policy::unknown_reserve_class_warning(&reserve_class));
        }
        let page_size = pool.expandable_page_size(&self.config);
        let segment =
            ExpandableSegment::reserve(&mut self.device, stream, pool, page_size, reserve.bytes)?;
        let mut block = Block::new(segment.base(), segment.size(), stream, pool);
        block.mapped = false;
        block.owner = owner;
        block.segment_order = self.order_of_new_segment();
        let segment_id = super::block::place_in_free_slot(&mut self.expandable_segments, segment);
        block.backing = Backing::Expandable(segment_id as ExpandableId);
        let id = self.arena.insert(block);
        self.pools
            .get_mut(owner, pool)
            .insert_unmapped(id, self.arena.get(id));
        self.count_segment_taken(owner);
        Ok(id)
    }

    /// An expandable block's address, size, stream, pool, private pool and segment.
    fn expandable_block(
        &self,
        id: BlockId,
    ) -> (DevicePtr, usize, StreamId, PoolKind, Owner, ExpandableId) {
        let b = self.arena.get(id);
        let segment = b
            .backing
            .expandable()
            .expect("a block of an expandable segment");
        (b.ptr, b.size, b.stream, b.pool, b.owner, segment)
    }

    /// `map_block`: maps pages under the first `size` bytes of an unmapped block; the mapped part
    /// becomes a free block of `stream` (merged with free neighbours), the rest stays unmapped.
    /// Unmapped pages hold nothing, so any stream may take them without waiting.
    /// `Ok(false)` when the device is out of memory.
    pub(super) fn map_block(
        &mut self,
        id: BlockId,
        size: usize,
        stream: StreamId,
    ) -> Result<bool, AllocError> {
        debug_assert!(!self.arena.get(id).mapped && size <= self.arena.get(id).size);
        let (ptr, block_size, _, pool, owner, segment_id) = self.expandable_block(id);
        let segment = self.expandable_segments[segment_id as usize]
            .as_mut()
            .expect("live expandable segment");
        let range = match segment.map(&mut self.device, ptr, size, &mut self.leftover_pages) {
            Ok(range) => range,
            Err(DeviceError::OutOfMemory) => return Ok(false),
            Err(err) => return Err(err.into()),
        };
        debug_assert!(range.ptr == ptr && range.size >= size);
        self.pools
            .get_mut(owner, pool)
            .remove_unmapped(self.arena.get(id));
        self.arena.get_mut(id).mapped = true;
        if range.size < block_size {
            // The rest stays unmapped, with the stream it had.
            let mut rest = self.piece_of(id, ptr + range.size as u64, block_size - range.size);
            rest.mapped = false;
            self.arena.get_mut(id).size = range.size;
            let rest_id = self.arena.insert_after(id, rest);
            self.pools
                .get_mut(owner, pool)
                .insert_unmapped(rest_id, self.arena.get(rest_id));
        }
        self.arena.get_mut(id).stream = stream;
        let (prev, next) = (self.arena.get(id).prev, self.arena.get(id).next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools
            .get_mut(owner, pool)
            .insert(id, self.arena.get_mut(id));
        self.total_allocated_memory += range.size;
        self.stats.reserved_bytes.increase(pool, range.size as u64);
        self.stats.num_device_alloc += 1;
        self.history
            .record(TraceAction::SegmentMap, range.ptr, range.size, stream);
        logging::pages_mapped(range.ptr, range.size, stream);
        Ok(true)
    }

    /// `unmap_block`: unmaps the whole pages inside a free expandable block; partial pages at
    /// either end stay mapped as free blocks of their own.
    pub(super) fn unmap_block(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let (ptr, size, stream, pool, owner, segment_id) = self.expandable_block(id);
        let segment = self.expandable_segments[segment_id as usize]
            .as_mut()
            .expect("live expandable segment");
        // With cross-stream reuse the free block may have served another stream last: unmapping
        // waits for that stream too.
        if stream != segment.stream() {
            self.device.synchronize_stream(stream)?;
        }
        let (range, failure) = segment.unmap(&mut self.device, ptr, size, &mut self.leftover_pages);
        if range.size == 0 {
            return failure.map_or(Ok(()), Err);
        }
        self.pools
            .get_mut(owner, pool)
            .remove(id, self.arena.get(id));
        // Partial pages at either end stay mapped, as free blocks of their own.
        let before = (range.ptr - ptr) as usize;
        let after = size - before - range.size;
        let mut pieces = Vec::with_capacity(2);
        if before > 0 {
            let piece = self.piece_of(id, ptr, before);
            pieces.push(self.arena.insert_before(id, piece));
        }
        if after > 0 {
            let piece = self.piece_of(id, range.ptr + range.size as u64, after);
            pieces.push(self.arena.insert_after(id, piece));
        }
        for piece in pieces {
            self.pools
                .get_mut(owner, pool)
                .insert(piece, self.arena.get_mut(piece));
        }
        let block = self.arena.get_mut(id);
        block.ptr = range.ptr;
        block.size = range.size;
        block.mapped = false;
        let (prev, next) = (block.prev, block.next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.pools
            .get_mut(owner, pool)
            .insert_unmapped(id, self.arena.get(id));
        self.total_allocated_memory -= range.size;
        self.stats.reserved_bytes.decrease(pool, range.size as u64);
        self.stats.num_device_free += 1;
        self.history
            .record(TraceAction::SegmentUnmap, range.ptr, range.size, stream);
        logging::pages_unmapped(range.ptr, range.size);
        failure.map_or(Ok(()), Err)
    }

    /// Retries what the device refused to take back: unmaps and releases the leftover pages,
    /// then frees the leftover address ranges (after the pages: a range with a page still
    /// mapped in it cannot be freed). What the device still refuses stays, and the first
    /// refusal is returned.
    pub(super) fn release_leftovers(&mut self) -> Result<(), DeviceError> {
        let mut outcome = Ok(());
        for mut page in std::mem::take(&mut self.leftover_pages) {
            let mut result = Ok(());
            if let Some((ptr, size)) = page.mapped_at {
                result = self.device.unmap(ptr, size);
                if result.is_ok() {
                    page.mapped_at = None;
                }
            }
            result = result.and_then(|()| self.device.release_physical(page.handle));
            if let Err(err) = result {
                self.leftover_pages.push(page);
                if outcome.is_ok() {
                    outcome = Err(err);
                }
            }
        }
        for range in std::mem::take(&mut self.leftover_ranges) {
            if let Err(err) = self.device.free_address_range(range.ptr, range.size) {
                self.leftover_ranges.push(range);
                if outcome.is_ok() {
                    outcome = Err(err);
                }
            }
        }
        outcome
    }

    /// `release_expandable_segment`: gives back the address range of a segment with nothing
    /// mapped (its one block spans the whole range, unmapped). The segment leaves the books
    /// either way; a range the device refuses to free becomes a leftover, retried by every
    /// `empty_cache` as leftover pages are (it holds nothing, and no segment can use it).
    pub(super) fn release_expandable_segment(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let segment_id = self
            .arena
            .get(id)
            .backing
            .expandable()
            .expect("expandable block");
        debug_assert_eq!(self.arena.get(id).size, self.segment(segment_id).size());
        let segment = self.expandable_segments[segment_id as usize]
            .take()
            .expect("live expandable segment");
        let block = self.arena.remove(id);
        self.pools.of_block_mut(&block).remove_unmapped(&block);
        self.count_segment_returned(block.owner);
        segment.release(&mut self.device).inspect_err(|_| {
            self.leftover_ranges.push(PageRange {
                ptr: segment.base(),
                size: segment.size(),
            });
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::{SimDevice, SimOp};

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
        let mut s =
            ExpandableSegment::reserve(&mut d, 0, PoolKind::Large, 20 * MIB, 9 << 27).unwrap();
        let r = s.map(&mut d, s.base(), 30 * MIB, &mut Vec::new()).unwrap();
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
            &mut Vec::new(),
        );
        assert!(err.is_none());
        assert_eq!(
            r,
            PageRange {
                ptr: s.base() + 20 * MIB as u64,
                size: 20 * MIB
            }
        );
        let (r, _) = s.unmap(&mut d, s.base(), 20 * MIB, &mut Vec::new());
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
            let mut s =
                ExpandableSegment::reserve(&mut d, 0, PoolKind::Small, 2 * MIB, 9 << 27).unwrap();
            s.map(&mut d, s.base(), 2 * MIB, &mut Vec::new()).unwrap();
            d.fail_nth(op, nth, fault.clone());
            let result = s.map(&mut d, s.base() + 2 * MIB as u64, 6 * MIB, &mut Vec::new());
            assert_eq!(result, Err(fault.clone()), "{op:?}");
            assert_eq!(s.mapped_bytes(), 2 * MIB, "{op:?}");
            assert_eq!(d.live_physical_handles(), 1, "{op:?}");
            assert_eq!(d.mapped_bytes(), 2 * MIB, "{op:?}");
            assert_eq!(d.physical_in_use(), 2 * MIB, "{op:?}");
            // And the segment grows fine afterwards.
            s.map(&mut d, s.base() + 2 * MIB as u64, 6 * MIB, &mut Vec::new())
                .unwrap();
            assert_eq!(s.mapped_bytes(), 8 * MIB);
        }
    }
}
