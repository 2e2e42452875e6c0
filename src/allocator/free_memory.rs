//! PyTorch's free-memory callbacks on a cache miss, the allocator's side.
//!
//! PyTorch's `malloc` searches the cached blocks, and when that misses it runs every
//! `FreeCudaMemoryCallback` registered (libtorch_python's "cuda_ipc_collect" frees the blocks
//! waiting in the CUDA IPC limbo once their receivers let go) and searches again only if one
//! of them says it freed memory:
//! `get_free_block(params) || (trigger_free_memory_callbacks(params) && get_free_block(params))`.
//! The callbacks free through the allocator itself, which PyTorch's recursive mutex allows.
//!
//! ferrocache's lock is not recursive, and the allocator runs no foreign code. So, with
//! [`DeviceAllocator::set_free_memory_callbacks`] on, `malloc` stops where PyTorch runs them:
//! its first search missed, nothing else was decided, and it returns
//! [`AllocError::RunFreeMemoryCallbacks`]. The caller releases the lock, runs the callbacks,
//! takes the lock again and calls [`DeviceAllocator::malloc_after_free_memory_callbacks`],
//! which makes every decision afresh from the state it finds then. Off (the default: the
//! oracle, replay, `rust_malloc` without the front end), `malloc` is exactly as before.

use super::owner::Owner;
use super::{AllocError, DeviceAllocator};
use crate::device::{Device, DevicePtr, StreamId};

impl<D: Device> DeviceAllocator<D> {
    /// Whether `malloc` stops at a miss of its first search for the caller to run PyTorch's
    /// free-memory callbacks (see the module documentation). Off by default.
    pub fn set_free_memory_callbacks(&mut self, on: bool) {
        self.source.free_memory_callbacks = on;
    }

    pub fn runs_free_memory_callbacks(&self) -> bool {
        self.source.free_memory_callbacks
    }

    /// The rest of a [`malloc_tagged`](Self::malloc_tagged) that returned
    /// [`AllocError::RunFreeMemoryCallbacks`], once the caller ran the callbacks: `freed` says
    /// whether one of them freed memory (or may have: one that failed). As PyTorch's `&&`, the
    /// cached blocks are searched a second time only then (and only then does the search count
    /// for garbage collection's clock); after that, the miss path: the opt-in cross-stream
    /// reuse, then a new block.
    ///
    /// The caller released the lock while the callbacks ran, so nothing from the first call is
    /// kept: the owner (a capture may have begun), the rounding and the pool are taken from the
    /// state and settings now. Completed events are not processed again: PyTorch processes them
    /// once per malloc, at its start.
    pub fn malloc_after_free_memory_callbacks(
        &mut self,
        size: usize,
        stream: StreamId,
        tag: Option<u32>,
        freed: bool,
    ) -> Result<DevicePtr, AllocError> {
        let owner = if self.pools.captures.is_empty() {
            match tag {
                None => Owner::Ordinary,
                Some(tag) => self.tagged_owner(tag),
            }
        } else {
            self.private_pool_for(stream)?
        };
        let mut request = self.request_for(size, stream, owner);
        let (rounded, pool) = (request.size, request.pool);
        let found = if freed {
            self.get_free_block(&request)
        } else {
            None
        };
        let id = match found {
            Some(id) => id,
            None => match self.take_from_other_stream(&request)? {
                Some(id) => id,
                None => self.allocate_new_block(&mut request, size)?,
            },
        };
        let split = self.should_split(request.owner, self.arena.get(id).size, rounded, pool);
        Ok(self.alloc_found_block(id, &request, size, split))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::device::sim::SimDevice;
    use crate::policy::PoolKind;

    const MIB: usize = 1 << 20;
    /// A large request served by a segment of exactly its size (no rest to cache).
    const WHOLE: usize = 12 * MIB;

    fn plain(config: Config) -> DeviceAllocator<SimDevice> {
        let mut allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, config);
        // Garbage collection needs a memory fraction below 1; with both, each search counts.
        allocator.set_memory_fraction(0.99).unwrap();
        allocator
    }

    fn allocator(config: Config) -> DeviceAllocator<SimDevice> {
        let mut allocator = plain(config);
        allocator.set_free_memory_callbacks(true);
        allocator
    }

    /// Garbage collection on, so that each search of the large pool is counted.
    fn counting_searches() -> Config {
        Config::parse("garbage_collection_threshold:0.9").unwrap()
    }

    fn searches(allocator: &DeviceAllocator<SimDevice>) -> u64 {
        allocator
            .pools
            .get(Owner::Ordinary, PoolKind::Large)
            .get_free_blocks_call_count
    }

    /// A malloc as the C ABI makes it: the callbacks (`callbacks`, given the allocator to free
    /// through, saying whether they freed) run between the miss and the continuation.
    fn malloc_running(
        allocator: &mut DeviceAllocator<SimDevice>,
        size: usize,
        callbacks: impl FnOnce(&mut DeviceAllocator<SimDevice>) -> bool,
    ) -> Result<DevicePtr, AllocError> {
        match allocator.malloc(size, 0) {
            Err(AllocError::RunFreeMemoryCallbacks) => {
                let freed = callbacks(allocator);
                allocator.malloc_after_free_memory_callbacks(size, 0, None, freed)
            }
            done => done,
        }
    }

    #[test]
    fn a_hit_never_stops_for_the_callbacks_and_a_miss_stops_before_deciding_anything() {
        let mut allocator = allocator(Config::default());
        assert_eq!(
            allocator.malloc(WHOLE, 0),
            Err(AllocError::RunFreeMemoryCallbacks)
        );
        assert_eq!(allocator.reserved_bytes(), 0, "no segment asked for");
        assert_eq!(allocator.live_allocations(), 0);
        let ptr = allocator
            .malloc_after_free_memory_callbacks(WHOLE, 0, None, false)
            .unwrap();
        allocator.free(ptr).unwrap();
        assert_eq!(allocator.malloc(WHOLE, 0), Ok(ptr), "a hit: no stop");
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn a_block_the_callbacks_free_is_found_by_the_second_search() {
        let mut allocator = allocator(counting_searches());
        let held = malloc_running(&mut allocator, WHOLE, |_| false).unwrap();
        let before = searches(&allocator);
        let again = malloc_running(&mut allocator, WHOLE, |allocator| {
            allocator.free(held).unwrap();
            true
        })
        .unwrap();
        assert_eq!(again, held, "the freed block, at the same address");
        assert_eq!(allocator.stats().num_device_alloc, 1, "no new segment");
        assert_eq!(
            searches(&allocator) - before,
            2,
            "the first search and the second"
        );
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn callbacks_that_freed_nothing_give_no_second_search() {
        let mut allocator = allocator(counting_searches());
        let held = malloc_running(&mut allocator, WHOLE, |_| false).unwrap();
        let before = searches(&allocator);
        // It frees, but says it did not: PyTorch's `&&` does not search again.
        let again = malloc_running(&mut allocator, WHOLE, |allocator| {
            allocator.free(held).unwrap();
            false
        })
        .unwrap();
        assert_ne!(again, held, "a new segment, the freed block left cached");
        assert_eq!(allocator.stats().num_device_alloc, 2);
        assert_eq!(searches(&allocator) - before, 1, "the first search only");
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn without_callbacks_a_miss_is_served_in_one_call_as_before() {
        let mut plain = plain(counting_searches());
        let ptr = plain.malloc(WHOLE, 0).unwrap();
        assert_eq!(searches(&plain), 1);
        assert!(!plain.runs_free_memory_callbacks());
        // The same sequence with the callbacks on and doing nothing: the same decisions.
        let mut with = allocator(counting_searches());
        assert_eq!(malloc_running(&mut with, WHOLE, |_| false), Ok(ptr));
        assert_eq!(searches(&with), 1);
        assert_eq!(with.reserved_bytes(), plain.reserved_bytes());
    }

    #[test]
    fn the_continuation_decides_from_the_state_it_finds_not_the_one_of_the_first_call() {
        let mut allocator = allocator(Config::default());
        // While the lock was released for the callbacks, another thread began a capture on
        // the stream: the allocation is the capture's, as it would be if made now.
        let pool = (7, 0);
        assert_eq!(
            allocator.malloc(WHOLE, 5),
            Err(AllocError::RunFreeMemoryCallbacks)
        );
        allocator
            .begin_allocate_to_pool(pool, Box::new(|stream| Ok(stream == 5)))
            .unwrap();
        let ptr = allocator
            .malloc_after_free_memory_callbacks(WHOLE, 5, None, false)
            .unwrap();
        assert_eq!(
            allocator.allocation_info(ptr).unwrap().private_pool,
            Some(pool)
        );
        allocator.check_invariants().unwrap();
    }
}
