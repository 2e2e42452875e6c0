//! Fault injection: per operation, the outcome of its next calls.

use super::SimDevice;
use crate::device::DeviceError;
use std::collections::VecDeque;

/// The operations of [`Device`], to aim injected faults at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimOp {
    Malloc,
    Free,
    MemGetInfo,
    RecordEvent,
    QueryEvent,
    SynchronizeEvent,
    SynchronizeStream,
    WaitEvent,
    ReserveAddressRange,
    FreeAddressRange,
    CreatePhysical,
    ReleasePhysical,
    Map,
    SetAccess,
    Unmap,
    SynchronizeDevice,
    CopyToHost,
    CopyFromHost,
    AllocPinnedHost,
    FreePinnedHost,
    CreateStream,
    CopyToPinnedAsync,
    CopyFromPinnedAsync,
}

impl SimDevice {
    /// The next `count` calls of `op` fail with `error` (queued after faults already injected).
    pub fn fail_next(&mut self, op: SimOp, count: usize, error: DeviceError) {
        let queue = self.faults.entry(op).or_default();
        queue.extend(std::iter::repeat_n(Some(error), count));
    }

    /// The `nth` call of `op` from now (1 = the next one) fails with `error`; the calls before
    /// it pass. Use it to fail an operation in the middle of a sequence.
    pub fn fail_nth(&mut self, op: SimOp, nth: usize, error: DeviceError) {
        let queue = self.faults.entry(op).or_default();
        queue.extend(std::iter::repeat_n(None, nth.saturating_sub(1)));
        queue.push_back(Some(error));
    }

    /// Forgets every injected fault that has not fired yet.
    pub fn clear_faults(&mut self) {
        self.faults.clear();
    }

    /// The next `count` `malloc`s report out of memory.
    pub fn fail_next_mallocs(&mut self, count: usize) {
        self.fail_next(SimOp::Malloc, count, DeviceError::OutOfMemory);
    }

    pub(super) fn take_fault(&mut self, op: SimOp) -> Result<(), DeviceError> {
        match self.faults.get_mut(&op).and_then(VecDeque::pop_front) {
            Some(Some(error)) => Err(error),
            _ => Ok(()),
        }
    }
}
