//! Plain backing: one device allocation per segment (`cudaMalloc`, `cudaFree`), as PyTorch's
//! segments are without expandable segments. It cannot sleep: its physical memory and its
//! addresses come and go together.

use crate::device::{Device, DeviceError, DevicePtr, StreamId};

/// A new device allocation of `size` bytes for `stream`; `Ok(None)` when the device is out of
/// memory.
pub(crate) fn obtain<D: Device>(
    device: &mut D,
    size: usize,
    stream: StreamId,
) -> Result<Option<DevicePtr>, DeviceError> {
    match device.malloc(size, stream) {
        Ok(ptr) => Ok(Some(ptr)),
        Err(DeviceError::OutOfMemory) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Gives the allocation at `ptr` back; if the device refuses, nothing changed.
pub(crate) fn release<D: Device>(device: &mut D, ptr: DevicePtr) -> Result<(), DeviceError> {
    device.free(ptr)
}
