//! What PyTorch's CUDA graph trees ask of a private pool: which allocations in it are live
//! (`checkPoolLiveAllocations`). Checkpoints of a pool (`getCheckpointState` /
//! `setCheckpointPoolState`) are to come here too. And the pool options PyTorch sets one at a
//! time (`setUseOnOOM`, `setNoSplit`).

use super::DeviceAllocator;
use super::private_pool::{MempoolId, Owner};
use crate::device::{Device, DevicePtr};

impl<D: Device> DeviceAllocator<D> {
    /// The addresses of the blocks handed out from private pool `id` and not freed yet, in
    /// address order; `None` for a pool this allocator does not know.
    pub fn pool_live_allocations(&self, id: MempoolId) -> Option<Vec<DevicePtr>> {
        let index = self.pools.find(id)?;
        let mut live: Vec<DevicePtr> = self
            .arena
            .iter()
            .filter(|(_, block)| block.allocated && block.owner == Owner::Private(index))
            .map(|(_, block)| block.ptr)
            .collect();
        live.sort_unstable();
        Some(live)
    }

    /// A private pool's options `(use_on_oom, no_split)`; `None` for an unknown pool.
    pub fn pool_options(&self, id: MempoolId) -> Option<(bool, bool)> {
        let pool = self.pools.private(self.pools.find(id)?);
        Some((pool.use_on_oom, pool.no_split))
    }
}
