//! Replay support: placing the allocations a recorded trace starts with.

use super::backing::Memory;
use super::block::BlockId;
use super::owner::Owner;
use super::segments::Segment;
use super::{AllocError, DeviceAllocator, ImportedBlock, Request};
use crate::device::{Device, DeviceError, DevicePtr, StreamId};
use crate::policy::PoolKind;

impl<D: Device> DeviceAllocator<D> {
    /// Takes a segment of `size` bytes from the device and places live allocations at the given
    /// offsets in it, as if the program had made them: the state a recorded trace starts from.
    /// The gaps become cached free blocks. Returns the segment's address and the allocations'
    /// addresses, in the order given. Offsets must be ascending, 512-aligned and not overlap.
    pub fn import_segment(
        &mut self,
        size: usize,
        stream: StreamId,
        pool: PoolKind,
        live: &[ImportedBlock],
    ) -> Result<(DevicePtr, Vec<DevicePtr>), AllocError> {
        check_fit(live, size, &format!("a segment of {size} bytes"))?;
        let base = match self.device.malloc(size, stream) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory) => {
                let request = Request {
                    size,
                    stream,
                    pool,
                    owner: Owner::Ordinary,
                    alloc_size: size,
                };
                return Err(self.out_of_memory(&request, size));
            }
            Err(err) => return Err(err.into()),
        };
        let segment = Segment {
            owner: Owner::Ordinary,
            kind: pool,
            memory: Memory::Plain,
            asleep: false,
        };
        let head = self.adopt_segment(base, size, stream, segment);
        let pieces = pieces(live, size);
        let split = pieces.len() > 1;
        let mut ids = Vec::with_capacity(pieces.len());
        for (i, &(piece_offset, piece_size, requested)) in pieces.iter().enumerate() {
            let id = if i == 0 {
                let b = self.arena.get_mut(head);
                b.size = piece_size;
                head
            } else {
                let piece = self.piece_of(head, base + piece_offset as u64, piece_size);
                self.arena.insert(piece)
            };
            ids.push((id, requested));
        }
        for w in 0..ids.len() {
            let id = ids[w].0;
            let b = self.arena.get_mut(id);
            b.prev = w.checked_sub(1).map(|p| ids[p].0);
            b.next = ids.get(w + 1).map(|n| n.0);
        }
        let mut pointers = Vec::with_capacity(live.len());
        for &(id, requested) in &ids {
            let (ptr, piece_size) = {
                let b = self.arena.get(id);
                (b.ptr, b.size)
            };
            match requested {
                Some(requested) => {
                    self.hand_out(id, requested);
                    pointers.push(ptr);
                }
                None => {
                    self.pools
                        .get_mut(Owner::Ordinary, pool)
                        .insert(id, self.arena.get_mut(id));
                    if split {
                        self.ledger.stats.inactive_split.increase(pool, 1);
                        self.ledger
                            .stats
                            .inactive_split_bytes
                            .increase(pool, piece_size as u64);
                    }
                }
            }
        }
        Ok((base, pointers))
    }
}

impl<D: Device> DeviceAllocator<D> {
    /// Reserves a new expandable segment for `stream` in `pool`, maps its first `mapped` bytes
    /// (whole pages) and places live allocations at the given offsets in them: the state of an
    /// expandable segment when a recorded trace starts, as PyTorch had it, so that later
    /// requests grow it (and free space at its end joins the new pages). The gaps become free
    /// blocks. Returns the segment's address and the allocations' addresses, in the order
    /// given. Offsets must be ascending, 512-aligned and not overlap.
    pub fn import_expandable_segment(
        &mut self,
        mapped: usize,
        stream: StreamId,
        pool: PoolKind,
        live: &[ImportedBlock],
    ) -> Result<(DevicePtr, Vec<DevicePtr>), AllocError> {
        check_fit(live, mapped, &format!("{mapped} mapped bytes"))?;
        let head = self.new_expandable_segment(stream, pool, Owner::Ordinary)?;
        let (base, range) = {
            let b = self.arena.get(head);
            (b.ptr, b.size)
        };
        let refused = |size| {
            AllocError::InvalidArgument(format!(
                "{mapped} mapped bytes do not fit an expandable segment of {size} bytes"
            ))
        };
        if mapped == 0 || mapped > range {
            self.release_expandable_segment(head)?;
            return Err(refused(range));
        }
        if !self.map_block(head, mapped, stream)? {
            self.release_expandable_segment(head)?;
            let request = Request {
                size: mapped,
                stream,
                pool,
                alloc_size: mapped,
                owner: Owner::Ordinary,
            };
            return Err(self.out_of_memory(&request, mapped));
        }
        // `head` is now the free mapped block at the start of the range, whole pages long.
        self.pools
            .get_mut(Owner::Ordinary, pool)
            .remove(head, self.arena.get(head));
        let pieces = pieces(live, self.arena.get(head).size);
        let mut pointers = Vec::with_capacity(live.len());
        let mut previous: Option<BlockId> = None;
        for &(piece_offset, piece_size, requested) in &pieces {
            let id = match previous {
                None => {
                    self.arena.get_mut(head).size = piece_size;
                    head
                }
                Some(previous) => {
                    let piece = self.piece_of(head, base + piece_offset as u64, piece_size);
                    self.arena.insert_after(previous, piece)
                }
            };
            match requested {
                Some(requested) => pointers.push(self.hand_out(id, requested)),
                // Blocks of expandable segments are never inactive splits (PyTorch's rule).
                None => self
                    .pools
                    .get_mut(Owner::Ordinary, pool)
                    .insert(id, self.arena.get_mut(id)),
            }
            previous = Some(id);
        }
        Ok((base, pointers))
    }
}

/// Refuses live blocks that are empty, out of order, overlapping, or beyond the `room` bytes
/// that `room_name` describes.
fn check_fit(live: &[ImportedBlock], room: usize, room_name: &str) -> Result<(), AllocError> {
    let mut cursor = 0;
    for b in live {
        if b.offset < cursor || b.size == 0 || b.offset.saturating_add(b.size) > room {
            return Err(AllocError::InvalidArgument(format!(
                "block at offset {} (size {}) does not fit {room_name}",
                b.offset, b.size
            )));
        }
        cursor = b.offset + b.size;
    }
    Ok(())
}

/// The pieces of `size` bytes holding `live`, in address order: `(offset, size, Some(requested
/// size))` for a live block, `(offset, size, None)` for a free gap.
fn pieces(live: &[ImportedBlock], size: usize) -> Vec<(usize, usize, Option<usize>)> {
    let mut pieces = Vec::with_capacity(2 * live.len() + 1);
    let mut offset = 0;
    for b in live {
        if b.offset > offset {
            pieces.push((offset, b.offset - offset, None));
        }
        pieces.push((b.offset, b.size, Some(b.requested_size)));
        offset = b.offset + b.size;
    }
    if offset < size {
        pieces.push((offset, size - offset, None));
    }
    pieces
}
