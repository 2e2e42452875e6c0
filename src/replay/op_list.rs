//! The op list a built-in demo workload is written into (`demo`, `demo_fsdp`): allocations and
//! frees in program order, with the figures the replayer reports against.

use super::workload::{Allocation, DeviceWorkload, Figures, Op, OpOrigin};

/// A demo program under construction.
#[derive(Default)]
pub(super) struct OpList {
    ops: Vec<Op>,
    allocations: Vec<Allocation>,
    requested: u64,
    figures: Figures,
}

impl OpList {
    /// Allocates `size` bytes on `stream`; the allocation's id.
    pub(super) fn alloc(&mut self, size: u64, stream: u64) -> u32 {
        let id = self.allocations.len() as u32;
        self.allocations.push(Allocation {
            address: 0,
            requested_size: size,
            stream,
            live_at_start: false,
            placed: None,
        });
        self.ops.push(Op::Alloc { id, size, stream });
        self.requested += size;
        self.figures.allocs += 1;
        self.figures.peak_requested = self.figures.peak_requested.max(self.requested);
        id
    }

    pub(super) fn free(&mut self, id: u32) {
        self.requested -= self.allocations[id as usize].requested_size;
        self.figures.frees += 1;
        self.ops.push(Op::Free { id });
    }

    pub(super) fn free_all(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            self.free(id);
        }
    }

    /// The finished workload of device 0, starting from an empty device.
    pub(super) fn into_workload(self) -> DeviceWorkload {
        let op_origins = (0..self.ops.len())
            .map(|index| OpOrigin {
                trace_index: index,
                time_us: 0,
            })
            .collect();
        DeviceWorkload {
            device: 0,
            allocations: self.allocations,
            ops: self.ops,
            op_origins,
            figures: Figures {
                end_requested: self.requested,
                ..self.figures
            },
            ..DeviceWorkload::default()
        }
    }
}
