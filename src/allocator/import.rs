//! Replay support: placing the allocations a recorded trace starts with.

use super::block::Block;
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
        let mut cursor = 0;
        for b in live {
            if b.offset < cursor || b.size == 0 || b.offset.saturating_add(b.size) > size {
                return Err(AllocError::InvalidArgument(format!(
                    "block at offset {} (size {}) does not fit a segment of {size} bytes",
                    b.offset, b.size
                )));
            }
            cursor = b.offset + b.size;
        }
        let base = match self.device.malloc(size, stream) {
            Ok(ptr) => ptr,
            Err(DeviceError::OutOfMemory) => {
                let request = Request {
                    size,
                    stream,
                    pool,
                    private_pool: None,
                    alloc_size: size,
                };
                return Err(self.out_of_memory(&request, size));
            }
            Err(err) => return Err(err.into()),
        };
        let head = self.adopt_segment(base, size, stream, pool);
        // Lay out the pieces: free gaps and live blocks, in address order.
        let mut pieces: Vec<(usize, usize, Option<usize>)> = Vec::new();
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
        let split = pieces.len() > 1;
        let mut ids = Vec::with_capacity(pieces.len());
        for (i, &(piece_offset, piece_size, requested)) in pieces.iter().enumerate() {
            let id = if i == 0 {
                let b = self.arena.get_mut(head);
                b.size = piece_size;
                head
            } else {
                self.arena.insert(Block::new(
                    base + piece_offset as u64,
                    piece_size,
                    stream,
                    pool,
                ))
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
                        .get_mut(None, pool)
                        .insert(id, self.arena.get_mut(id));
                    if split {
                        self.stats.inactive_split.increase(pool, 1);
                        self.stats
                            .inactive_split_bytes
                            .increase(pool, piece_size as u64);
                    }
                }
            }
        }
        Ok((base, pointers))
    }
}
