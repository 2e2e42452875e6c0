//! Sleep and wake: give a segment's physical memory back to the device and take it again later,
//! at the same addresses.
//!
//! Once sleep-ability is on ([`DeviceAllocator::set_sleepable`], or the first tagged
//! allocation), every new ordinary segment is VMM-backed ([`Backing::Vmm`]): an address range
//! reserved with `cuMemAddressReserve`, one physical allocation of the same size
//! (`cuMemCreate`) mapped into it and made accessible. Its size and its blocks are PyTorch's, as
//! for a `cudaMalloc`'d segment: only what it is made of differs.
//!
//! - [`DeviceAllocator::sleep`] waits for the device, copies each chosen segment to host memory
//!   (when asked to), unmaps it and releases its physical memory. The address range stays
//!   reserved, every block stays where it was, live ones included; a sleeping free block serves
//!   no request.
//! - [`DeviceAllocator::wake`] creates physical memory again, maps it at the same address,
//!   grants access and copies the backup back.
//!
//! Both are idempotent (a segment asleep is not slept again) and all-or-nothing per segment: a
//! driver call that fails leaves that segment either fully awake or fully asleep with its
//! backup, and the call can be repeated.
//!
//! Expandable segments are VMM-backed already, one physical allocation per page: their mapped
//! pages sleep and wake at the same addresses ([`ExpandableSegment::sleep_pages`],
//! [`ExpandableSegment::wake_pages`]). Their sleep is all or nothing per page (an unmap that
//! fails leaves the pages before it asleep, the rest mapped, and the segment counts as asleep
//! until a wake), their wake all or nothing per segment. A sleeping expandable segment does
//! not grow: a request that would need it reserves a new segment, as when the stream had none.

use super::DeviceAllocator;
use super::block::{Backing, BlockId, ExpandableId, VmmId};
use super::expandable::{ExpandableSegment, LeftoverPage, PageRange};
use super::guard::{Announce, Refusal};
use super::private_pool::Owner;
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle};
use crate::logging;
use std::time::{Duration, Instant};

/// What the log says when the device refuses to take memory back.
const LEFTOVER: &str = "the device refused to take memory back; empty_cache retries it";

/// A VMM-backed segment.
#[derive(Debug)]
pub struct VmmSegment {
    base: DevicePtr,
    /// The segment's size (what its blocks tile).
    size: usize,
    /// The reserved and mapped size: `size` in whole pages of the device's granularity.
    mapped_size: usize,
    /// The physical memory mapped now; `None` while asleep.
    handle: Option<PhysicalHandle>,
    /// The segment's bytes, copied to host memory when it went to sleep with a backup.
    backup: Option<Vec<u8>>,
}

/// What a sleep or a wake moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Segments that went to sleep (or woke).
    pub segments: usize,
    /// Their bytes (physical memory given back, or taken again).
    pub bytes: usize,
    /// Live blocks in them: allocations whose memory slept (or woke).
    pub blocks: usize,
    /// Bytes copied to host memory (sleep) or back from it (wake).
    pub copied_bytes: usize,
    /// Bytes of segments that matched but cannot sleep: `cudaMalloc`'d before sleep-ability
    /// was on.
    pub skipped_bytes: usize,
    pub elapsed: Duration,
}

/// Why a sleep or wake stopped. What was done before the failure stays done (and is in
/// `done`); the segment being worked on is left whole, awake or asleep with its backup; the
/// call may be repeated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SleepError {
    /// Sleep and wake wait for the device, which a CUDA graph capture forbids.
    Capturing,
    /// A driver call failed.
    Device {
        error: DeviceError,
        done: SleepReport,
    },
    /// Waking the next segment would take the memory reserved past the memory-fraction limit
    /// (`set_per_process_memory_fraction`), which bounds what the allocator reserves from the
    /// device, as for a new segment. It stays asleep.
    OverMemoryFraction {
        /// The bytes the segment would take.
        needed: usize,
        /// The bytes reserved now.
        reserved: usize,
        /// The limit.
        allowed: usize,
        done: SleepReport,
    },
    /// Waking the next segment would take the memory reserved past `throw_on_cudamalloc_oom`'s
    /// limit (the configured `per_process_memory_fraction` of the device), which refuses such
    /// a device allocation before the device is asked, as for a new segment. It stays asleep.
    PreemptivelyRejected {
        /// The bytes the segment would take.
        needed: usize,
        /// The bytes reserved now.
        reserved: usize,
        /// The limit.
        limit: usize,
        done: SleepReport,
    },
}

/// What stops a sleep or wake part-way (made into a [`SleepError`] with what was done).
enum Stop {
    Device(DeviceError),
    OverMemoryFraction {
        needed: usize,
        reserved: usize,
        allowed: usize,
    },
    PreemptivelyRejected {
        needed: usize,
        reserved: usize,
        limit: usize,
    },
}

impl From<DeviceError> for Stop {
    fn from(error: DeviceError) -> Stop {
        Stop::Device(error)
    }
}

impl std::fmt::Display for SleepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SleepError::Capturing => {
                f.write_str("cannot sleep or wake while a CUDA graph capture is under way")
            }
            SleepError::Device { error, done } => write!(
                f,
                "CUDA error: {error} (after {} segment(s), {} bytes; call again to retry)",
                done.segments, done.bytes
            ),
            SleepError::OverMemoryFraction {
                needed,
                reserved,
                allowed,
                done,
            } => write!(
                f,
                "waking a segment of {needed} bytes would reserve {} bytes, past the memory \
                 fraction's limit of {allowed} bytes (after {} segment(s), {} bytes woke); free \
                 memory (empty_cache) or raise the fraction, and call again",
                reserved + needed,
                done.segments,
                done.bytes
            ),
            SleepError::PreemptivelyRejected {
                needed,
                reserved,
                limit,
                done,
            } => write!(
                f,
                "waking a segment of {needed} bytes would reserve {} bytes, past the limit of \
                 {limit} bytes that throw_on_cudamalloc_oom enforces (after {} segment(s), {} \
                 bytes woke); free memory (empty_cache), and call again",
                reserved + needed,
                done.segments,
                done.bytes
            ),
        }
    }
}

impl std::error::Error for SleepError {}

/// Which segments a sleep or wake is about.
#[derive(Debug, Clone, Copy)]
pub enum Tags<'a> {
    /// Everything the allocator holds.
    All,
    /// The memory allocated under these tags.
    Only(&'a [u32]),
}

impl<D: Device> DeviceAllocator<D> {
    /// Makes new ordinary segments VMM-backed (on), so that they can sleep, or `cudaMalloc`'d
    /// again (off). Segments already made keep their backing.
    pub fn set_sleepable(&mut self, on: bool) {
        self.sleepable = on;
    }

    pub fn is_sleepable(&self) -> bool {
        self.sleepable
    }

    /// The owner of tag `tag`'s allocations; a tag turns sleep-ability on.
    pub(super) fn tagged_owner(&mut self, tag: u32) -> Owner {
        self.sleepable = true;
        Owner::Tagged(self.pools.tag_index(tag))
    }

    /// Bytes asleep now, in VMM-backed segments and in expandable segments' pages.
    pub fn sleeping_bytes(&self) -> usize {
        let vmm: usize = self
            .vmm_segments
            .iter()
            .flatten()
            .filter(|s| s.handle.is_none())
            .map(|s| s.size)
            .sum();
        let expandable: usize = self
            .expandable_segments
            .iter()
            .flatten()
            .map(ExpandableSegment::sleeping_bytes)
            .sum();
        vmm + expandable
    }

    /// A new VMM-backed segment of `size` bytes: its base and backing. `Ok(None)` when the
    /// device is out of memory; nothing is left behind on any failure.
    pub(super) fn new_vmm_segment(
        &mut self,
        size: usize,
    ) -> Result<Option<(DevicePtr, Backing)>, DeviceError> {
        let granularity = self.device.page_granularity()?;
        let mapped_size = size.div_ceil(granularity) * granularity;
        let base = match self.device.reserve_address_range(mapped_size) {
            Ok(base) => base,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(err) => return Err(err),
        };
        let handle = match self.map_physical(base, mapped_size) {
            Ok(handle) => handle,
            Err(err) => {
                self.free_range_or_keep(base, mapped_size);
                return match err {
                    DeviceError::OutOfMemory => Ok(None),
                    err => Err(err),
                };
            }
        };
        let segment = VmmSegment {
            base,
            size,
            mapped_size,
            handle: Some(handle),
            backup: None,
        };
        let id = super::block::place_in_free_slot(&mut self.vmm_segments, segment);
        Ok(Some((base, Backing::Vmm(id as VmmId))))
    }

    /// Creates `size` bytes of physical memory, maps it at `base` and grants access: all or
    /// nothing (what the device will not take back becomes a leftover page).
    fn map_physical(
        &mut self,
        base: DevicePtr,
        size: usize,
    ) -> Result<PhysicalHandle, DeviceError> {
        let handle = self.device.create_physical(size)?;
        if let Err(err) = self.device.map(base, size, handle) {
            self.release_or_keep(handle, None);
            return Err(err);
        }
        if let Err(err) = self.device.set_access(base, size) {
            self.unmap_and_release_or_keep(base, size, handle);
            return Err(err);
        }
        Ok(handle)
    }

    /// Releases physical memory; what the device refuses is kept, retried by `empty_cache`.
    fn release_or_keep(&mut self, handle: PhysicalHandle, mapped_at: Option<(DevicePtr, usize)>) {
        if let Err(err) = self.device.release_physical(handle) {
            logging::device_error(LEFTOVER, &err);
            self.leftover_pages.push(LeftoverPage { mapped_at, handle });
        }
    }

    fn unmap_and_release_or_keep(&mut self, base: DevicePtr, size: usize, handle: PhysicalHandle) {
        if let Err(err) = self.device.unmap(base, size) {
            logging::device_error(LEFTOVER, &err);
            self.leftover_pages.push(LeftoverPage {
                mapped_at: Some((base, size)),
                handle,
            });
        } else {
            self.release_or_keep(handle, None);
        }
    }

    fn free_range_or_keep(&mut self, ptr: DevicePtr, size: usize) {
        if let Err(err) = self.device.free_address_range(ptr, size) {
            logging::device_error(LEFTOVER, &err);
            self.leftover_ranges.push(PageRange { ptr, size });
        }
    }

    /// Gives a wholly free, awake VMM-backed segment back to the device. The unmap decides:
    /// if it fails nothing changed; a release or address free that fails after it leaves a
    /// leftover, retried by every `empty_cache`.
    pub(super) fn release_vmm_segment(&mut self, id: VmmId) -> Result<(), DeviceError> {
        let segment = self.vmm_segments[id as usize]
            .as_ref()
            .expect("a live VMM segment");
        let (base, mapped_size, handle) = (segment.base, segment.mapped_size, segment.handle);
        if let Some(handle) = handle {
            self.device.unmap(base, mapped_size)?;
            self.release_or_keep(handle, None);
        }
        self.free_range_or_keep(base, mapped_size);
        self.vmm_segments[id as usize] = None;
        Ok(())
    }

    /// The first block of each segment of `tags`, with what the segment is made of.
    fn segments_of(&self, tags: Tags<'_>) -> Vec<(BlockId, Backing)> {
        self.arena
            .iter()
            .filter(|(_, b)| b.prev.is_none())
            .filter(|(_, b)| match (tags, b.owner) {
                (Tags::All, _) => true,
                (Tags::Only(tags), Owner::Tagged(index)) => {
                    tags.contains(&self.pools.tag_of(index))
                }
                (Tags::Only(_), _) => false,
            })
            .map(|(id, b)| (id, b.backing))
            .collect()
    }

    /// Marks every block of the segment starting at `head` asleep or awake; returns the live
    /// blocks among them.
    fn set_segment_asleep(&mut self, head: BlockId, asleep: bool) -> usize {
        let mut live = 0;
        let mut cursor = Some(head);
        while let Some(id) = cursor {
            let block = self.arena.get_mut(id);
            block.asleep = asleep;
            live += usize::from(!block.is_available());
            cursor = block.next;
        }
        live
    }

    fn vmm(&self, id: VmmId) -> &VmmSegment {
        self.vmm_segments[id as usize]
            .as_ref()
            .expect("a live VMM segment")
    }

    fn vmm_mut(&mut self, id: VmmId) -> &mut VmmSegment {
        self.vmm_segments[id as usize]
            .as_mut()
            .expect("a live VMM segment")
    }

    /// Runs `per_segment` on each segment of `tags` (its first block and backing) after
    /// `prepare`, refused during a capture, timed, and stopped at the first failure (a driver
    /// call, or a wake past the memory fraction) with what was done by then.
    fn each_segment(
        &mut self,
        tags: Tags<'_>,
        prepare: impl FnOnce(&mut Self) -> Result<(), DeviceError>,
        mut per_segment: impl FnMut(&mut Self, BlockId, Backing, &mut SleepReport) -> Result<(), Stop>,
    ) -> Result<SleepReport, SleepError> {
        if !self.captures.is_empty() {
            return Err(SleepError::Capturing);
        }
        let started = Instant::now();
        let mut report = SleepReport::default();
        let outcome = prepare(self).map_err(Stop::Device).and_then(|()| {
            self.segments_of(tags)
                .into_iter()
                .try_for_each(|(head, backing)| per_segment(self, head, backing, &mut report))
        });
        report.elapsed = started.elapsed();
        match outcome {
            Ok(()) => Ok(report),
            Err(Stop::Device(error)) => Err(SleepError::Device {
                error,
                done: report,
            }),
            Err(Stop::OverMemoryFraction {
                needed,
                reserved,
                allowed,
            }) => Err(SleepError::OverMemoryFraction {
                needed,
                reserved,
                allowed,
                done: report,
            }),
            Err(Stop::PreemptivelyRejected {
                needed,
                reserved,
                limit,
            }) => Err(SleepError::PreemptivelyRejected {
                needed,
                reserved,
                limit,
                done: report,
            }),
        }
    }

    /// Puts the memory of `tags` to sleep: waits for the device, copies each segment to host
    /// memory when `backup` (otherwise its contents are dropped), unmaps it and releases its
    /// physical memory. Addresses, blocks and live allocations stay. Segments already asleep
    /// are left as they are.
    pub fn sleep(&mut self, tags: Tags<'_>, backup: bool) -> Result<SleepReport, SleepError> {
        // Unmapping does not wait for kernels still using the memory, and a backup must see
        // their results: everything queued so far finishes first.
        let prepare = |this: &mut Self| {
            this.synchronize_and_free_events()?;
            this.device.synchronize_device()
        };
        let report =
            self.each_segment(tags, prepare, |this, head, backing, report| match backing {
                Backing::Plain => {
                    report.skipped_bytes += this.segment_size(head);
                    Ok(())
                }
                Backing::Vmm(vmm) => Ok(this.sleep_segment(head, vmm, backup, report)?),
                Backing::Expandable(segment) => {
                    Ok(this.sleep_expandable(head, segment, backup, report)?)
                }
            })?;
        logging::slept(&report, backup);
        Ok(report)
    }

    fn sleep_segment(
        &mut self,
        head: BlockId,
        vmm: VmmId,
        backup: bool,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let segment = self.vmm(vmm);
        let Some(handle) = segment.handle else {
            return Ok(());
        };
        let (base, size, mapped_size) = (segment.base, segment.size, segment.mapped_size);
        let saved = if backup {
            let mut bytes = vec![0; size];
            self.device.copy_to_host(base, &mut bytes)?;
            Some(bytes)
        } else {
            None
        };
        self.device.unmap(base, mapped_size)?;
        // Unmapped: the segment sleeps. A release the device refuses leaves the memory held
        // until a later `empty_cache` retries it, not the segment awake.
        self.release_or_keep(handle, None);
        report.copied_bytes += saved.as_ref().map_or(0, Vec::len);
        let segment = self.vmm_mut(vmm);
        segment.handle = None;
        segment.backup = saved;
        let pool = self.arena.get(head).pool;
        report.blocks += self.set_segment_asleep(head, true);
        report.segments += 1;
        report.bytes += size;
        self.sleeping_segments += 1;
        self.total_allocated_memory -= size;
        self.stats.reserved_bytes.decrease(pool, size as u64);
        Ok(())
    }

    /// Wakes the memory of `tags`: creates physical memory again, maps it at the same
    /// addresses, grants access and copies back what was backed up. Segments awake are left as
    /// they are. Under a memory fraction, a segment whose wake would reserve past the limit
    /// stays asleep and the call stops there ([`SleepError::OverMemoryFraction`]), as a new
    /// segment would be refused: the fraction bounds what the allocator reserves.
    pub fn wake(&mut self, tags: Tags<'_>) -> Result<SleepReport, SleepError> {
        let report = self.each_segment(
            tags,
            |_| Ok(()),
            |this, head, backing, report| {
                let needed = match backing {
                    Backing::Plain => return Ok(()),
                    Backing::Vmm(vmm) => match this.vmm(vmm).handle {
                        Some(_) => return Ok(()),
                        None => this.vmm(vmm).size,
                    },
                    Backing::Expandable(segment) => this.segment(segment).sleeping_bytes(),
                };
                let reserved = this.total_allocated_memory;
                match this.admit(needed, Announce::Yes)? {
                    Ok(()) => {}
                    Err(Refusal::OverMemoryFraction { allowed }) => {
                        return Err(Stop::OverMemoryFraction {
                            needed,
                            reserved,
                            allowed,
                        });
                    }
                    Err(Refusal::Rejected { limit }) => {
                        return Err(Stop::PreemptivelyRejected {
                            needed,
                            reserved,
                            limit,
                        });
                    }
                }
                match backing {
                    Backing::Plain => Ok(()),
                    Backing::Vmm(vmm) => Ok(this.wake_segment(head, vmm, report)?),
                    Backing::Expandable(segment) => {
                        Ok(this.wake_expandable(head, segment, report)?)
                    }
                }
            },
        )?;
        logging::woke(&report);
        Ok(report)
    }

    fn wake_segment(
        &mut self,
        head: BlockId,
        vmm: VmmId,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let segment = self.vmm(vmm);
        if segment.handle.is_some() {
            return Ok(());
        }
        let (base, size, mapped_size) = (segment.base, segment.size, segment.mapped_size);
        let handle = self.map_physical(base, mapped_size)?;
        let backup = self.vmm_mut(vmm).backup.take();
        if let Some(bytes) = &backup
            && let Err(err) = self.device.copy_from_host(base, bytes)
        {
            // The segment goes back to sleep whole, its backup kept for the next try.
            self.unmap_and_release_or_keep(base, mapped_size, handle);
            self.vmm_mut(vmm).backup = backup;
            return Err(err);
        }
        report.copied_bytes += backup.as_ref().map_or(0, Vec::len);
        self.vmm_mut(vmm).handle = Some(handle);
        let pool = self.arena.get(head).pool;
        report.blocks += self.set_segment_asleep(head, false);
        report.segments += 1;
        report.bytes += size;
        self.sleeping_segments -= 1;
        self.total_allocated_memory += size;
        self.stats.reserved_bytes.increase(pool, size as u64);
        Ok(())
    }

    /// Puts the mapped pages of expandable segment `id` (first block `head`) to sleep. A
    /// failure part-way leaves the pages slept so far asleep, counted in `report`; the
    /// segment then counts as asleep, and a later sleep goes on with the pages still mapped.
    fn sleep_expandable(
        &mut self,
        head: BlockId,
        id: ExpandableId,
        backup: bool,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let segment = self.expandable_segments[id as usize]
            .as_mut()
            .expect("a live expandable segment");
        let was_asleep = segment.is_asleep();
        let slept = segment.sleep_pages(&mut self.device, backup, &mut self.leftover_pages);
        let (pool, bytes) = (segment.pool(), slept.pages * segment.page_size());
        if slept.pages > 0 {
            if !was_asleep {
                report.blocks += self.set_segment_asleep(head, true);
                self.sleeping_segments += 1;
            }
            report.segments += 1;
            report.bytes += bytes;
            report.copied_bytes += slept.copied_bytes;
            self.total_allocated_memory -= bytes;
            self.stats.reserved_bytes.decrease(pool, bytes as u64);
        }
        slept.error.map_or(Ok(()), Err)
    }

    /// Wakes the sleeping pages of expandable segment `id` (first block `head`), all or
    /// nothing.
    fn wake_expandable(
        &mut self,
        head: BlockId,
        id: ExpandableId,
        report: &mut SleepReport,
    ) -> Result<(), DeviceError> {
        let segment = self.expandable_segments[id as usize]
            .as_mut()
            .expect("a live expandable segment");
        if !segment.is_asleep() {
            return Ok(());
        }
        let (pages, copied) = segment.wake_pages(&mut self.device, &mut self.leftover_pages)?;
        let (pool, bytes) = (segment.pool(), pages * segment.page_size());
        report.blocks += self.set_segment_asleep(head, false);
        report.segments += 1;
        report.bytes += bytes;
        report.copied_bytes += copied;
        self.sleeping_segments -= 1;
        self.total_allocated_memory += bytes;
        self.stats.reserved_bytes.increase(pool, bytes as u64);
        Ok(())
    }

    /// The bytes of the segment whose first block is `head`.
    fn segment_size(&self, head: BlockId) -> usize {
        let mut size = 0;
        let mut cursor = Some(head);
        while let Some(id) = cursor {
            let b = self.arena.get(id);
            if b.mapped {
                size += b.size;
            }
            cursor = b.next;
        }
        size
    }
}
