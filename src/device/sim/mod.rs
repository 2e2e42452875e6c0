//! A simulated GPU: deterministic addresses, a capacity, streams whose work completes when the
//! test says so, and fault injection on every operation, so that every path of the allocator,
//! error paths included, runs in tests without hardware.

#![forbid(unsafe_code)]

use super::{
    Device, DeviceError, DevicePtr, EventHandle, MemInfo, PhysicalHandle, PinnedHostBuffer,
    ProcessMemory, StreamId,
};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

mod faults;
mod streams;

pub use faults::SimOp;
pub use streams::SimWait;
use streams::{SimEvent, StreamProgress};

/// Where the simulated address space starts (the region real drivers hand out on x86-64).
const ADDRESS_BASE: u64 = 0x7f00_0000_0000;
/// Every allocation and reservation starts on a 2 MiB boundary, like large `cudaMalloc`s.
const ADDRESS_ALIGNMENT: u64 = 2 << 20;
/// The simulated page granularity of `cuMemCreate`.
pub const SIM_PAGE_GRANULARITY: usize = 2 << 20;

/// How many times each operation was called (successfully or not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimCounters {
    pub mallocs: u64,
    pub frees: u64,
    pub events_recorded: u64,
    pub event_queries: u64,
    pub event_synchronizations: u64,
    pub stream_synchronizations: u64,
    pub event_waits: u64,
    pub reserves: u64,
    pub address_frees: u64,
    pub creates: u64,
    pub releases: u64,
    pub maps: u64,
    pub set_accesses: u64,
    pub unmaps: u64,
    pub device_synchronizations: u64,
    /// Bytes copied between device and host ([`Device::copy_to_host`], [`Device::copy_from_host`]).
    pub bytes_copied: u64,
    /// [`Device::compute_processes`] calls (NVML's, on a real GPU).
    pub process_queries: u64,
    /// [`Device::alloc_pinned_host`] calls (`cuMemHostAlloc`).
    pub pinned_host_allocations: u64,
    /// [`Device::free_pinned_host`] calls (`cuMemFreeHost`).
    pub pinned_host_frees: u64,
    /// Bytes queued by [`Device::copy_to_pinned_async`] and [`Device::copy_from_pinned_async`]
    /// (they count in `bytes_copied` too).
    pub bytes_copied_pinned: u64,
    /// Asynchronous copies queued (each a `cuMemcpy*Async` call).
    pub async_copies: u64,
    /// [`Device::create_stream`] calls.
    pub streams_created: u64,
}

#[derive(Debug, Clone)]
struct PhysicalPage {
    size: usize,
    /// What was written to the page; `None` until the first write (a new page reads as
    /// zeros, as the fake's memfd pages do; a real GPU's are undefined).
    contents: Option<Vec<u8>>,
    mapped_at: Option<DevicePtr>,
    released: bool,
}

#[derive(Debug, Clone)]
struct Mapping {
    size: usize,
    handle: PhysicalHandle,
    accessible: bool,
}

/// The simulated GPU.
#[derive(Debug)]
pub struct SimDevice {
    capacity: usize,
    physical_in_use: usize,
    physical_limit: Option<usize>,
    /// Occupied address ranges (allocations and reservations): start -> end.
    occupied: BTreeMap<DevicePtr, DevicePtr>,
    /// Everything in `[ADDRESS_BASE, no_gap_below)` is occupied: the first-fit search starts
    /// here, so a run of allocations without frees costs a lookup each, not a scan.
    no_gap_below: DevicePtr,
    allocations: HashMap<DevicePtr, usize>,
    reservations: BTreeMap<DevicePtr, usize>,
    mappings: BTreeMap<DevicePtr, Mapping>,
    pages: HashMap<PhysicalHandle, PhysicalPage>,
    next_handle: PhysicalHandle,
    events: HashMap<EventHandle, SimEvent>,
    next_event: EventHandle,
    streams: HashMap<StreamId, StreamProgress>,
    complete_immediately: bool,
    /// Every `wait_event`, in call order (unless switched off).
    waits: Vec<SimWait>,
    record_waits: bool,
    /// Per operation, the outcome of its next calls: `Some(error)` fails, `None` passes.
    faults: HashMap<SimOp, VecDeque<Option<DeviceError>>>,
    counters: SimCounters,
    /// What NVML would list besides this process, once [`SimDevice::report_processes`] said
    /// so; `None`: nobody answers, as without NVML.
    other_processes: Option<Vec<ProcessMemory>>,
    /// Where the next `malloc` goes if that range is free ([`SimDevice::prefer_next_address`]).
    preferred: Option<DevicePtr>,
    /// Page-locked host buffers ([`Device::alloc_pinned_host`]), by handle.
    pinned: HashMap<PinnedHostBuffer, Vec<u8>>,
    next_pinned: PinnedHostBuffer,
    next_stream: StreamId,
    /// Asynchronous copies queued, as (stream, sequence there, device range): an unmap of
    /// memory a copy not yet completed touches is refused, as the fake's ordering check
    /// catches it (`cuMemUnmap` does not wait for work in flight).
    async_copies: Vec<(StreamId, u64, DevicePtr, usize)>,
    /// Streams capturing a CUDA graph ([`SimDevice::begin_capture`]): the simulated GPU runs
    /// no graph, it only answers [`Device::stream_is_capturing`].
    capturing: HashSet<StreamId>,
}

fn invalid(call: &'static str, what: &str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 1,
        message: format!("invalid argument ({what})"),
    }
}

impl SimDevice {
    /// A GPU with `capacity` bytes of memory whose streams run only when told to
    /// ([`SimDevice::complete_stream`]).
    pub fn new(capacity: usize) -> SimDevice {
        SimDevice {
            capacity,
            physical_in_use: 0,
            physical_limit: None,
            occupied: BTreeMap::new(),
            no_gap_below: ADDRESS_BASE,
            allocations: HashMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            pages: HashMap::new(),
            next_handle: 1,
            events: HashMap::new(),
            next_event: 1,
            streams: HashMap::new(),
            complete_immediately: false,
            preferred: None,
            waits: Vec::new(),
            record_waits: true,
            faults: HashMap::new(),
            counters: SimCounters::default(),
            other_processes: None,
            pinned: HashMap::new(),
            next_pinned: 1,
            // Far from the streams tests make up (small numbers) and from real handles.
            next_stream: 0x5_0000,
            async_copies: Vec::new(),
            capturing: HashSet::new(),
        }
    }

    /// `cudaStreamBeginCapture` on `stream`, as far as the allocator can see it: from now until
    /// [`SimDevice::end_capture`], [`Device::stream_is_capturing`] says so.
    pub fn begin_capture(&mut self, stream: StreamId) {
        self.capturing.insert(stream);
    }

    /// `cudaStreamEndCapture` on `stream`.
    pub fn end_capture(&mut self, stream: StreamId) {
        self.capturing.remove(&stream);
    }

    /// Live page-locked host buffers and their bytes.
    pub fn pinned_host(&self) -> (usize, usize) {
        (self.pinned.len(), self.pinned.values().map(Vec::len).sum())
    }

    /// Queues an asynchronous copy on `stream` (it moves its bytes at once, and stays pending
    /// in the books until the stream completes it).
    fn queue_copy(&mut self, stream: StreamId, ptr: DevicePtr, len: usize) {
        let sequence = self.submit_work(stream);
        self.counters.async_copies += 1;
        self.counters.bytes_copied += len as u64;
        self.counters.bytes_copied_pinned += len as u64;
        self.async_copies.push((stream, sequence, ptr, len));
    }

    /// Whether a queued copy not yet completed touches `[ptr, ptr + size)`; forgets the
    /// completed ones.
    fn copy_pending_in(&mut self, ptr: DevicePtr, size: usize) -> bool {
        let streams = &self.streams;
        self.async_copies.retain(|&(stream, sequence, _, _)| {
            streams.get(&stream).is_none_or(|p| p.completed < sequence)
        });
        let end = ptr + size as u64;
        self.async_copies
            .iter()
            .any(|&(_, _, start, len)| start < end && ptr < start + len as u64)
    }

    /// The bytes `[offset, offset + len)` of pinned buffer `buffer`.
    fn pinned_range(
        &mut self,
        call: &'static str,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
    ) -> Result<&mut [u8], DeviceError> {
        self.pinned
            .get_mut(&buffer)
            .and_then(|bytes| bytes.get_mut(offset..offset.checked_add(len)?))
            .ok_or_else(|| invalid(call, "not inside a pinned host buffer"))
    }

    /// Makes the device answer [`Device::compute_processes`] as NVML does: `others` (other
    /// processes with memory on this GPU), then this process with the memory it holds here.
    pub fn report_processes(&mut self, others: Vec<ProcessMemory>) {
        self.other_processes = Some(others);
    }

    /// Makes every stream finish its work as soon as it is submitted, so events are complete
    /// when recorded (what a replay wants).
    pub fn set_complete_immediately(&mut self, on: bool) {
        self.complete_immediately = on;
    }

    /// Physical memory (malloc + create_physical) beyond `limit` bytes reports out of memory;
    /// `None` lifts the limit (the capacity still applies).
    pub fn set_physical_limit(&mut self, limit: Option<usize>) {
        self.physical_limit = limit;
    }

    pub fn counters(&self) -> &SimCounters {
        &self.counters
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of physical memory in use (allocations plus physical pages not yet released).
    pub fn physical_in_use(&self) -> usize {
        self.physical_in_use
    }

    /// The live `malloc` allocations, by address.
    pub fn allocations(&self) -> BTreeMap<DevicePtr, usize> {
        self.allocations.iter().map(|(&p, &s)| (p, s)).collect()
    }

    /// Bytes currently mapped into reserved ranges.
    pub fn mapped_bytes(&self) -> usize {
        self.mappings.values().map(|m| m.size).sum()
    }

    /// Physical handles created and not released.
    pub fn live_physical_handles(&self) -> usize {
        self.pages.values().filter(|p| !p.released).count()
    }

    /// Reserved address ranges still held.
    pub fn reserved_ranges(&self) -> usize {
        self.reservations.len()
    }

    /// Events recorded and not released.
    pub fn live_events(&self) -> usize {
        self.events.len()
    }

    /// Whether `[ptr, ptr + size)` is memory a kernel could touch: inside one allocation, or
    /// covered entirely by accessible mappings.
    pub fn is_accessible(&self, ptr: DevicePtr, size: usize) -> bool {
        let end = ptr + size as u64;
        if let Some((&start, &len)) = self.allocations.iter().find(|(s, l)| {
            **s <= ptr && ptr < **s + **l as u64 // an allocation holding ptr
        }) {
            return end <= start + len as u64;
        }
        let mut cursor = ptr;
        while cursor < end {
            match self.mappings.range(..=cursor).next_back() {
                Some((&start, m)) if m.accessible && cursor < start + m.size as u64 => {
                    cursor = start + m.size as u64;
                }
                _ => return false,
            }
        }
        true
    }

    /// The pieces of `[ptr, ptr + len)` in accessible mappings, as (handle, offset in the page,
    /// length, offset in the range); an error when any byte is not accessible (what a kernel
    /// touching unmapped or sleeping memory would hit: an illegal address).
    fn mapped_pieces(
        &self,
        call: &'static str,
        ptr: DevicePtr,
        len: usize,
    ) -> Result<Vec<(PhysicalHandle, usize, usize, usize)>, DeviceError> {
        let end = ptr + len as u64;
        let mut cursor = ptr;
        let mut pieces = Vec::new();
        while cursor < end {
            match self.mappings.range(..=cursor).next_back() {
                Some((&start, m)) if m.accessible && cursor < start + m.size as u64 => {
                    let piece_end = end.min(start + m.size as u64);
                    pieces.push((
                        m.handle,
                        (cursor - start) as usize,
                        (piece_end - cursor) as usize,
                        (cursor - ptr) as usize,
                    ));
                    cursor = piece_end;
                }
                _ => {
                    return Err(DeviceError::Driver {
                        call,
                        code: 700,
                        message: format!("an illegal memory access was encountered at {cursor:#x}"),
                    });
                }
            }
        }
        Ok(pieces)
    }

    fn claim_physical(&mut self, size: usize) -> Result<(), DeviceError> {
        let after = self.physical_in_use.saturating_add(size);
        if after > self.capacity || self.physical_limit.is_some_and(|limit| after > limit) {
            return Err(DeviceError::OutOfMemory);
        }
        self.physical_in_use = after;
        Ok(())
    }

    /// The next `malloc` returns `ptr` when `[ptr, ptr + size)` is free (else it places as
    /// usual); `None` forgets an earlier wish. A replay asks for the addresses PyTorch's
    /// segments had, so that ties broken by address break as they did in PyTorch.
    pub fn prefer_next_address(&mut self, ptr: Option<DevicePtr>) {
        self.preferred = ptr;
    }

    /// The preferred address, when `size` bytes fit there.
    fn take_preferred(&mut self, size: u64) -> Option<DevicePtr> {
        let ptr = self.preferred.take().filter(|&p| p != 0)?;
        let end = ptr.checked_add(size)?;
        let overlaps = self
            .occupied
            .range(..end)
            .next_back()
            .is_some_and(|(_, &occupied_end)| occupied_end > ptr);
        (!overlaps).then_some(ptr)
    }

    /// First fit in the address space, 2 MiB aligned, so freed ranges are reused.
    fn place(&mut self, size: usize) -> DevicePtr {
        let size = (size as u64).div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT;
        if let Some(ptr) = self.take_preferred(size) {
            // Outside the first-fit search's bookkeeping: `no_gap_below` only ever rises
            // over ranges that the search itself filled.
            self.occupied.insert(ptr, ptr + size);
            return ptr;
        }
        let mut cursor = self.no_gap_below;
        let mut first_gap = None;
        for (&start, &end) in self.occupied.range(cursor..) {
            if start >= cursor + size {
                break;
            }
            if start > cursor && first_gap.is_none() {
                first_gap = Some(cursor); // too small for this request, not for a later one
            }
            cursor = cursor.max(end.div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT);
        }
        self.occupied.insert(cursor, cursor + size);
        self.no_gap_below = first_gap.unwrap_or(cursor + size);
        cursor
    }

    /// Gives an address range back to the first-fit search.
    fn unplace(&mut self, ptr: DevicePtr) {
        self.occupied.remove(&ptr);
        self.no_gap_below = self.no_gap_below.min(ptr);
    }

    fn reservation_holding(&self, ptr: DevicePtr, size: usize) -> bool {
        self.reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&start, &len)| ptr + size as u64 <= start + len as u64)
    }
}

impl Device for SimDevice {
    fn malloc(&mut self, size: usize, _stream: StreamId) -> Result<DevicePtr, DeviceError> {
        self.counters.mallocs += 1;
        self.take_fault(SimOp::Malloc)?;
        if size == 0 {
            return Err(invalid("cuMemAlloc_v2", "size 0"));
        }
        self.claim_physical(size)?;
        let ptr = self.place(size);
        self.allocations.insert(ptr, size);
        Ok(ptr)
    }

    fn free(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        self.counters.frees += 1;
        self.take_fault(SimOp::Free)?;
        let size = self
            .allocations
            .remove(&ptr)
            .ok_or_else(|| invalid("cuMemFree_v2", "unknown pointer"))?;
        self.unplace(ptr);
        self.physical_in_use -= size;
        Ok(())
    }

    fn mem_get_info(&mut self) -> Result<MemInfo, DeviceError> {
        self.take_fault(SimOp::MemGetInfo)?;
        Ok(MemInfo {
            free: self.capacity - self.physical_in_use,
            total: self.capacity,
        })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventHandle, DeviceError> {
        self.counters.events_recorded += 1;
        self.take_fault(SimOp::RecordEvent)?;
        let immediate = self.complete_immediately;
        let progress = self.stream_progress(stream);
        progress.submitted += 1;
        if immediate {
            progress.completed = progress.submitted;
        }
        let sequence = progress.submitted;
        let waited_for = progress.waited_for.clone();
        let handle = self.next_event;
        self.next_event += 1;
        self.events.insert(
            handle,
            SimEvent {
                stream,
                sequence,
                waited_for,
            },
        );
        Ok(handle)
    }

    fn query_event(&mut self, event: EventHandle) -> Result<bool, DeviceError> {
        self.counters.event_queries += 1;
        self.take_fault(SimOp::QueryEvent)?;
        let e = self
            .events
            .get(&event)
            .ok_or_else(|| invalid("cuEventQuery", "unknown event"))?;
        Ok(self.event_is_complete(e))
    }

    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), DeviceError> {
        self.counters.event_synchronizations += 1;
        self.take_fault(SimOp::SynchronizeEvent)?;
        let e = self
            .events
            .get(&event)
            .ok_or_else(|| invalid("cuEventSynchronize", "unknown event"))?
            .clone();
        let progress = self.stream_progress(e.stream);
        progress.completed = progress.completed.max(e.sequence);
        Ok(())
    }

    fn release_event(&mut self, event: EventHandle) {
        self.events.remove(&event);
    }

    fn wait_event(&mut self, stream: StreamId, event: EventHandle) -> Result<(), DeviceError> {
        self.counters.event_waits += 1;
        self.take_fault(SimOp::WaitEvent)?;
        let e = self
            .events
            .get(&event)
            .ok_or_else(|| invalid("cuStreamWaitEvent", "unknown event"))?
            .clone();
        let clock = &mut self.stream_progress(stream).waited_for;
        for (other, sequence) in e.waited_for.into_iter().chain([(e.stream, e.sequence)]) {
            if other != stream {
                let waited = clock.entry(other).or_default();
                *waited = (*waited).max(sequence);
            }
        }
        if self.record_waits {
            self.waits.push(SimWait {
                stream,
                event_stream: e.stream,
                sequence: e.sequence,
            });
        }
        Ok(())
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        self.counters.stream_synchronizations += 1;
        self.take_fault(SimOp::SynchronizeStream)?;
        self.complete_stream(stream);
        Ok(())
    }

    fn stream_is_capturing(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        Ok(self.capturing.contains(&stream))
    }

    fn page_granularity(&mut self) -> Result<usize, DeviceError> {
        Ok(SIM_PAGE_GRANULARITY)
    }

    fn reserve_address_range(&mut self, size: usize) -> Result<DevicePtr, DeviceError> {
        self.counters.reserves += 1;
        self.take_fault(SimOp::ReserveAddressRange)?;
        if size == 0 || !size.is_multiple_of(SIM_PAGE_GRANULARITY) {
            return Err(invalid(
                "cuMemAddressReserve",
                "size not a multiple of the granularity",
            ));
        }
        let ptr = self.place(size);
        self.reservations.insert(ptr, size);
        Ok(ptr)
    }

    fn free_address_range(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        self.counters.address_frees += 1;
        self.take_fault(SimOp::FreeAddressRange)?;
        if self.reservations.get(&ptr) != Some(&size) {
            return Err(invalid("cuMemAddressFree", "not a reserved range"));
        }
        let end = ptr + size as u64;
        if self.mappings.range(ptr..end).next().is_some() {
            return Err(invalid("cuMemAddressFree", "range still mapped"));
        }
        self.reservations.remove(&ptr);
        self.unplace(ptr);
        Ok(())
    }

    fn create_physical(&mut self, size: usize) -> Result<PhysicalHandle, DeviceError> {
        self.counters.creates += 1;
        self.take_fault(SimOp::CreatePhysical)?;
        if size == 0 || !size.is_multiple_of(SIM_PAGE_GRANULARITY) {
            return Err(invalid(
                "cuMemCreate",
                "size not a multiple of the granularity",
            ));
        }
        self.claim_physical(size)?;
        let handle = self.next_handle;
        self.next_handle += 1;
        self.pages.insert(
            handle,
            PhysicalPage {
                size,
                contents: None,
                mapped_at: None,
                released: false,
            },
        );
        Ok(handle)
    }

    fn release_physical(&mut self, handle: PhysicalHandle) -> Result<(), DeviceError> {
        self.counters.releases += 1;
        self.take_fault(SimOp::ReleasePhysical)?;
        let page = self
            .pages
            .get_mut(&handle)
            .filter(|p| !p.released)
            .ok_or_else(|| invalid("cuMemRelease", "unknown handle"))?;
        page.released = true;
        // As in CUDA, the memory goes back once the handle is released and no longer mapped.
        if page.mapped_at.is_none() {
            let size = page.size;
            self.pages.remove(&handle);
            self.physical_in_use -= size;
        }
        Ok(())
    }

    fn map(
        &mut self,
        ptr: DevicePtr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), DeviceError> {
        self.counters.maps += 1;
        self.take_fault(SimOp::Map)?;
        if !self.reservation_holding(ptr, size) {
            return Err(invalid("cuMemMap", "range not reserved"));
        }
        let end = ptr + size as u64;
        let overlaps_before = self
            .mappings
            .range(..ptr)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size as u64 > ptr);
        if overlaps_before || self.mappings.range(ptr..end).next().is_some() {
            return Err(invalid("cuMemMap", "range already mapped"));
        }
        let page = self
            .pages
            .get_mut(&handle)
            .filter(|p| !p.released && p.mapped_at.is_none() && p.size == size)
            .ok_or_else(|| invalid("cuMemMap", "bad handle"))?;
        page.mapped_at = Some(ptr);
        self.mappings.insert(
            ptr,
            Mapping {
                size,
                handle,
                accessible: false,
            },
        );
        Ok(())
    }

    fn set_access(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        self.counters.set_accesses += 1;
        self.take_fault(SimOp::SetAccess)?;
        let end = ptr + size as u64;
        let mut cursor = ptr;
        let mut covered = Vec::new();
        while cursor < end {
            match self.mappings.get(&cursor) {
                Some(m) => {
                    covered.push(cursor);
                    cursor += m.size as u64;
                }
                None => return Err(invalid("cuMemSetAccess", "range not mapped")),
            }
        }
        for start in covered {
            if let Some(m) = self.mappings.get_mut(&start) {
                m.accessible = true;
            }
        }
        Ok(())
    }

    fn unmap(&mut self, ptr: DevicePtr, size: usize) -> Result<(), DeviceError> {
        self.counters.unmaps += 1;
        self.take_fault(SimOp::Unmap)?;
        if self.copy_pending_in(ptr, size) {
            return Err(invalid(
                "cuMemUnmap",
                "a copy still pending touches the range",
            ));
        }
        let mapping = match self.mappings.get(&ptr) {
            Some(m) if m.size == size => m.clone(),
            _ => return Err(invalid("cuMemUnmap", "not a mapped range")),
        };
        self.mappings.remove(&ptr);
        if let Some(page) = self.pages.get_mut(&mapping.handle) {
            page.mapped_at = None;
            if page.released {
                self.pages.remove(&mapping.handle);
                self.physical_in_use -= mapping.size;
            }
        }
        Ok(())
    }

    fn synchronize_device(&mut self) -> Result<(), DeviceError> {
        self.counters.device_synchronizations += 1;
        self.take_fault(SimOp::SynchronizeDevice)?;
        self.complete_all_streams();
        Ok(())
    }

    fn copy_to_host(&mut self, ptr: DevicePtr, host: &mut [u8]) -> Result<(), DeviceError> {
        self.take_fault(SimOp::CopyToHost)?;
        for (handle, offset, len, at) in self.mapped_pieces("cuMemcpyDtoH_v2", ptr, host.len())? {
            let target = &mut host[at..at + len];
            match &self.pages[&handle].contents {
                Some(contents) => target.copy_from_slice(&contents[offset..offset + len]),
                None => target.fill(0),
            }
        }
        self.counters.bytes_copied += host.len() as u64;
        Ok(())
    }

    fn copy_from_host(&mut self, ptr: DevicePtr, host: &[u8]) -> Result<(), DeviceError> {
        self.take_fault(SimOp::CopyFromHost)?;
        for (handle, offset, len, at) in self.mapped_pieces("cuMemcpyHtoD_v2", ptr, host.len())? {
            let page = self.pages.get_mut(&handle).expect("a mapped page exists");
            let contents = page.contents.get_or_insert_with(|| vec![0; page.size]);
            contents[offset..offset + len].copy_from_slice(&host[at..at + len]);
        }
        self.counters.bytes_copied += host.len() as u64;
        Ok(())
    }

    fn alloc_pinned_host(&mut self, size: usize) -> Result<PinnedHostBuffer, DeviceError> {
        self.counters.pinned_host_allocations += 1;
        self.take_fault(SimOp::AllocPinnedHost)?;
        let buffer = self.next_pinned;
        self.next_pinned += 1;
        self.pinned.insert(buffer, vec![0; size]);
        Ok(buffer)
    }

    fn free_pinned_host(&mut self, buffer: PinnedHostBuffer) -> Result<(), DeviceError> {
        self.counters.pinned_host_frees += 1;
        self.take_fault(SimOp::FreePinnedHost)?;
        self.pinned
            .remove(&buffer)
            .map(drop)
            .ok_or_else(|| invalid("cuMemFreeHost", "not a pinned host buffer"))
    }

    fn create_stream(&mut self) -> Result<StreamId, DeviceError> {
        self.counters.streams_created += 1;
        self.take_fault(SimOp::CreateStream)?;
        let stream = self.next_stream;
        self.next_stream += 1;
        Ok(stream)
    }

    fn copy_to_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        const CALL: &str = "cuMemcpyDtoHAsync_v2";
        self.take_fault(SimOp::CopyToPinnedAsync)?;
        let pieces = self.mapped_pieces(CALL, ptr, len)?;
        let mut bytes = vec![0; len];
        for (handle, at_page, piece, at) in pieces {
            if let Some(contents) = &self.pages[&handle].contents {
                bytes[at..at + piece].copy_from_slice(&contents[at_page..at_page + piece]);
            }
        }
        self.pinned_range(CALL, buffer, offset, len)?
            .copy_from_slice(&bytes);
        self.queue_copy(stream, ptr, len);
        Ok(())
    }

    fn copy_from_pinned_async(
        &mut self,
        ptr: DevicePtr,
        buffer: PinnedHostBuffer,
        offset: usize,
        len: usize,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        const CALL: &str = "cuMemcpyHtoDAsync_v2";
        self.take_fault(SimOp::CopyFromPinnedAsync)?;
        let pieces = self.mapped_pieces(CALL, ptr, len)?;
        let bytes = self.pinned_range(CALL, buffer, offset, len)?.to_vec();
        for (handle, at_page, piece, at) in pieces {
            let page = self.pages.get_mut(&handle).expect("a mapped page exists");
            let contents = page.contents.get_or_insert_with(|| vec![0; page.size]);
            contents[at_page..at_page + piece].copy_from_slice(&bytes[at..at + piece]);
        }
        self.queue_copy(stream, ptr, len);
        Ok(())
    }

    fn compute_processes(&mut self) -> Vec<ProcessMemory> {
        self.counters.process_queries += 1;
        let Some(others) = &self.other_processes else {
            return Vec::new();
        };
        let this_process = ProcessMemory {
            pid: std::process::id(),
            used_bytes: self.physical_in_use as u64,
        };
        others.iter().copied().chain([this_process]).collect()
    }
}

#[cfg(test)]
mod tests;
