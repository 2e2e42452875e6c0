//! VMM backing: an address range reserved with `cuMemAddressReserve`, one physical allocation
//! of the same size (`cuMemCreate`) mapped into it and made accessible. Its size and its
//! blocks are PyTorch's, as for a `cudaMalloc`'d segment: only what it is made of differs, so
//! that its physical memory can sleep while its addresses stay.
//!
//! - obtain ([`VmmSegment::obtain`]): reserve, create, map, grant access; all or nothing;
//! - release ([`VmmSegment::release`]): the unmap decides; a release or address free that
//!   fails after it becomes a leftover;
//! - sleep: with a backup, the live bytes are first queued for copying into pinned host memory
//!   (`Memory::copy_out`), then, once the copies completed, [`VmmSegment::sleep`] unmaps and
//!   releases and keeps the backup; without, `sleep` alone;
//! - wake ([`VmmSegment::wake`]): create, map, grant access, queue the copies back; all or
//!   nothing.

use super::{Backup, Leftovers, Slept, no_copy_stream};
use crate::device::{Device, DeviceError, DevicePtr, PhysicalHandle, StreamId};

/// A VMM-backed segment's memory.
#[derive(Debug)]
pub(crate) struct VmmSegment {
    base: DevicePtr,
    /// The segment's size (what its blocks tile).
    size: usize,
    /// The reserved and mapped size: `size` in whole pages of the device's granularity.
    mapped_size: usize,
    /// The physical memory mapped now; `None` while asleep.
    handle: Option<PhysicalHandle>,
    /// The segment's live bytes, copied to pinned host memory when it went to sleep with a
    /// backup.
    backup: Option<Backup>,
}

impl VmmSegment {
    /// A new VMM-backed segment of `size` bytes. `Ok(None)` when the device is out of memory;
    /// nothing is left behind on any failure.
    pub(crate) fn obtain<D: Device>(
        device: &mut D,
        size: usize,
        leftovers: &mut Leftovers,
    ) -> Result<Option<VmmSegment>, DeviceError> {
        let granularity = device.page_granularity()?;
        let mapped_size = size.div_ceil(granularity) * granularity;
        let base = match device.reserve_address_range(mapped_size) {
            Ok(base) => base,
            Err(DeviceError::OutOfMemory) => return Ok(None),
            Err(err) => return Err(err),
        };
        let handle = match map_physical(device, base, mapped_size, leftovers) {
            Ok(handle) => handle,
            Err(err) => {
                leftovers.free_range_or_keep(device, base, mapped_size);
                return match err {
                    DeviceError::OutOfMemory => Ok(None),
                    err => Err(err),
                };
            }
        };
        Ok(Some(VmmSegment {
            base,
            size,
            mapped_size,
            handle: Some(handle),
            backup: None,
        }))
    }

    pub(crate) fn base(&self) -> DevicePtr {
        self.base
    }

    pub(crate) fn sleeping_bytes(&self) -> usize {
        if self.handle.is_none() { self.size } else { 0 }
    }

    /// Gives the memory back to the device: the unmap decides (if it fails nothing changed); a
    /// release or address free that fails after it leaves a leftover.
    pub(crate) fn release<D: Device>(
        &self,
        device: &mut D,
        leftovers: &mut Leftovers,
    ) -> Result<(), DeviceError> {
        if let Some(handle) = self.handle {
            device.unmap(self.base, self.mapped_size)?;
            leftovers.release_or_keep(device, handle);
        }
        leftovers.free_range_or_keep(device, self.base, self.mapped_size);
        Ok(())
    }

    pub(crate) fn is_awake(&self) -> bool {
        self.handle.is_some()
    }

    /// The physical memory mapped now and the bytes it covers from [`VmmSegment::base`] (whole
    /// pages), for CUDA IPC; `None` while asleep.
    pub(crate) fn physical(&self) -> Option<(PhysicalHandle, usize)> {
        self.handle.map(|handle| (handle, self.mapped_size))
    }

    /// Unmaps the segment and releases its physical memory, keeping `backup` (whose copies
    /// have completed) for the wake; without one its contents are dropped. If the unmap fails
    /// nothing changed; a release the device refuses leaves the memory held until a later
    /// `empty_cache` retries it, not the segment awake. Nothing to do when asleep already.
    pub(crate) fn sleep<D: Device>(
        &mut self,
        device: &mut D,
        backup: Option<Backup>,
        leftovers: &mut Leftovers,
    ) -> Slept {
        let Some(handle) = self.handle else {
            return Slept::default();
        };
        if let Err(err) = device.unmap(self.base, self.mapped_size) {
            return Slept {
                error: Some(err),
                ..Slept::default()
            };
        }
        leftovers.release_or_keep(device, handle);
        let backup = backup.filter(|b| !b.ranges.is_empty());
        let copied_bytes = backup.as_ref().map_or(0, Backup::len);
        let held = backup.as_ref().map(|b| b.buffer);
        self.handle = None;
        self.backup = backup;
        Slept {
            bytes: self.size,
            copied_bytes,
            held,
            error: None,
        }
    }

    /// Creates physical memory again, maps it at the same address, grants access and queues
    /// the copies of the backup back on `stream`: the bytes woken, and the backup (its bytes
    /// are back once the stream is synchronized; its buffer is free then). All or nothing: on
    /// a failure the segment stays asleep with its backup (a copy that fails part-way is
    /// waited for, one more host synchronization counted in `waits`, before the memory it
    /// wrote goes back). Nothing to do when awake.
    pub(crate) fn wake<D: Device>(
        &mut self,
        device: &mut D,
        leftovers: &mut Leftovers,
        stream: Option<StreamId>,
        waits: &mut usize,
    ) -> Result<(usize, Option<Backup>), DeviceError> {
        if self.handle.is_some() {
            return Ok((0, None));
        }
        let handle = map_physical(device, self.base, self.mapped_size, leftovers)?;
        if let Some(backup) = &self.backup {
            let copied = stream.ok_or_else(no_copy_stream).and_then(|stream| {
                let mut queued = false;
                let outcome = backup.copies(self.base).try_for_each(|(ptr, at, len)| {
                    device.copy_from_pinned_async(ptr, backup.buffer, at, len, stream)?;
                    queued = true;
                    Ok(())
                });
                // The pages may not go back while a copy into them is pending.
                if outcome.is_err() && queued {
                    *waits += 1;
                    device.synchronize_stream(stream)?;
                }
                outcome
            });
            if let Err(err) = copied {
                leftovers.unmap_and_release_or_keep(device, self.base, self.mapped_size, handle);
                return Err(err);
            }
        }
        self.handle = Some(handle);
        Ok((self.size, self.backup.take()))
    }
}

/// Creates `size` bytes of physical memory, maps it at `base` and grants access: all or
/// nothing (what the device will not take back becomes a leftover page).
fn map_physical<D: Device>(
    device: &mut D,
    base: DevicePtr,
    size: usize,
    leftovers: &mut Leftovers,
) -> Result<PhysicalHandle, DeviceError> {
    let handle = device.create_physical(size)?;
    if let Err(err) = device.map(base, size, handle) {
        leftovers.release_or_keep(device, handle);
        return Err(err);
    }
    if let Err(err) = device.set_access(base, size) {
        leftovers.unmap_and_release_or_keep(device, base, size, handle);
        return Err(err);
    }
    Ok(handle)
}
