//! Host staging for sleep's backups: page-locked host memory (`cuMemHostAlloc`), kept from one
//! sleep to the next, and the allocator's own stream for the copies.
//!
//! A sleep with backup takes one buffer large enough for the live bytes it copies: an idle one
//! if there is one (the smallest that fits), otherwise a new one (idle buffers too small to
//! serve are given back first, so that host memory does not pile up). Each sleeping segment
//! whose backup lies in a buffer holds it; the buffer is idle again once they all woke, and
//! the next sleep reuses it, so a second sleep and wake of the same memory allocates nothing.
//! [`DeviceAllocator::release_host_memory`] gives the idle buffers back.
//!
//! Pinned memory is what lets the copies run at the bus's speed and asynchronously: a copy
//! from pageable memory is staged by the driver through a pinned buffer of its own, and a
//! `cuMemcpyDtoHAsync` into pageable memory is synchronous.

use super::DeviceAllocator;
use crate::device::{Device, DeviceError, PinnedHostBuffer, StreamId};
use crate::logging;

/// Pinned buffers come in whole 2 MiB: a size that varies a little from one sleep to the next
/// still fits the buffer of the last one.
const BUFFER_GRANULARITY: usize = 2 << 20;

#[derive(Debug)]
struct StagingBuffer {
    buffer: PinnedHostBuffer,
    size: usize,
    /// Sleeping segments whose backup lies in this buffer.
    backups: usize,
}

/// The pinned host buffers that hold sleep's backups, and the stream that copies into them.
#[derive(Debug, Default)]
pub(crate) struct HostStaging {
    buffers: Vec<StagingBuffer>,
    /// A non-blocking stream of the allocator's own, made at the first backup.
    stream: Option<StreamId>,
}

impl HostStaging {
    /// The stream for sleep's and wake's copies (made at the first call).
    pub(crate) fn stream<D: Device>(&mut self, device: &mut D) -> Result<StreamId, DeviceError> {
        if let Some(stream) = self.stream {
            return Ok(stream);
        }
        let stream = device.create_stream()?;
        self.stream = Some(stream);
        Ok(stream)
    }

    /// The copy stream, if a backup ever made it.
    pub(crate) fn existing_stream(&self) -> Option<StreamId> {
        self.stream
    }

    /// An idle buffer of at least `size` bytes, and the host allocations made to get it (0 or
    /// 1). Idle buffers too small are given back before a new one is made; one the device
    /// refuses to take back is logged and kept.
    pub(crate) fn take<D: Device>(
        &mut self,
        device: &mut D,
        size: usize,
    ) -> Result<(PinnedHostBuffer, usize), DeviceError> {
        let fitting = self
            .buffers
            .iter()
            .filter(|b| b.backups == 0 && b.size >= size)
            .min_by_key(|b| b.size);
        if let Some(fitting) = fitting {
            return Ok((fitting.buffer, 0));
        }
        self.release_idle(device, |b| b.size < size);
        let size = size.div_ceil(BUFFER_GRANULARITY) * BUFFER_GRANULARITY;
        let buffer = device.alloc_pinned_host(size)?;
        self.buffers.push(StagingBuffer {
            buffer,
            size,
            backups: 0,
        });
        Ok((buffer, 1))
    }

    /// A sleeping segment's backup now lies in `buffer`.
    pub(crate) fn hold(&mut self, buffer: PinnedHostBuffer) {
        if let Some(b) = self.buffers.iter_mut().find(|b| b.buffer == buffer) {
            b.backups += 1;
        }
    }

    /// A backup in `buffer` is no longer needed (its segment woke).
    pub(crate) fn let_go(&mut self, buffer: PinnedHostBuffer) {
        if let Some(b) = self.buffers.iter_mut().find(|b| b.buffer == buffer) {
            b.backups = b.backups.saturating_sub(1);
        }
    }

    /// Gives back the idle buffers that `which` picks; returns their bytes. What the device
    /// refuses is logged and kept (it stays idle, for the next sleep or the next try).
    fn release_idle<D: Device>(
        &mut self,
        device: &mut D,
        which: impl Fn(&StagingBuffer) -> bool,
    ) -> usize {
        let mut released = 0;
        self.buffers.retain(|b| {
            if b.backups > 0 || !which(b) {
                return true;
            }
            match device.free_pinned_host(b.buffer) {
                Ok(()) => {
                    released += b.size;
                    false
                }
                Err(err) => {
                    logging::device_error("the device refused to free pinned host memory", &err);
                    true
                }
            }
        });
        released
    }

    /// Bytes of pinned host memory held now, idle or holding backups.
    pub(crate) fn held_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.size).sum()
    }
}

impl<D: Device> DeviceAllocator<D> {
    /// Gives back the pinned host memory that sleep keeps for its backups, except what holds
    /// the backup of a segment still asleep; returns the bytes given back. The next sleep with
    /// backup allocates it again.
    pub fn release_host_memory(&mut self) -> usize {
        self.staging.release_idle(&mut self.device, |_| true)
    }

    /// Bytes of pinned host memory sleep holds now (idle, or holding backups).
    pub fn host_memory_bytes(&self) -> usize {
        self.staging.held_bytes()
    }
}
