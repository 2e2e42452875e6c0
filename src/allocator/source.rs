//! Where new segments come from: the guard in front of the device ([`super::guard`]), which
//! backing a new ordinary segment gets (plain, or VMM once sleep-ability is on), how large a
//! new expandable segment's range is (its stream's reserve class), and what the device refused
//! to take back ([`Leftovers`]).

use super::backing::Leftovers;
use super::guard::Guard;
use crate::device::StreamId;
use std::collections::HashSet;

/// Answers the reserve class PyTorch's C++ API gave a stream (empty: none).
pub type ReserveClassLookup = Box<dyn Fn(StreamId) -> String + Send>;

/// The allocator's source of device memory.
#[derive(Default)]
pub(crate) struct Source {
    pub(crate) guard: Guard,
    /// Pages and ranges the device refused to take back; retried by every `empty_cache`.
    pub(crate) leftovers: Leftovers,
    /// New ordinary segments are VMM-backed, so that they can sleep (see `sleep`).
    pub(crate) sleepable: bool,
    /// Where the reserve class of a stream comes from (PyTorch's C++ API, through the C ABI);
    /// `None`: every stream is untagged.
    pub(crate) reserve_classes: Option<ReserveClassLookup>,
    /// The reserve classes warned of as having no entry in
    /// `expandable_segments_reserve_by_class` (PyTorch warns once per class).
    pub(crate) warned_reserve_classes: HashSet<String>,
    /// Before the device: whether a miss of malloc's first search stops for the caller to run
    /// PyTorch's free-memory callbacks, which may free cached memory ([`super::free_memory`]).
    pub(crate) free_memory_callbacks: bool,
}
