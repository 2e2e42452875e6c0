//! Whose memory a segment is: the ordinary pools, a private pool (a CUDA graph capture, a
//! shared pool handle) or a tag's pools (`ferrocache.region`). A leaf, so that blocks,
//! segments and pools can all name it.

/// Where a private pool sits in the allocator's table (stable while the pool exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrivatePoolIndex(pub u32);

/// Whose memory a segment is, and so which block pools its free blocks go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Owner {
    /// The ordinary small and large pools.
    #[default]
    Ordinary,
    /// A private pool (a CUDA graph capture, a shared pool handle).
    Private(PrivatePoolIndex),
    /// The pools of a tag (`ferrocache.region(tag)`), whose memory sleeps and wakes together.
    Tagged(TagIndex),
}

/// Where a tag's pools sit in the allocator's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TagIndex(pub u32);

impl Owner {
    /// The private pool, when the owner is one.
    #[inline]
    pub fn private(self) -> Option<PrivatePoolIndex> {
        match self {
            Owner::Private(index) => Some(index),
            Owner::Ordinary | Owner::Tagged(_) => None,
        }
    }
}
