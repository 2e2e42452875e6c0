//! The caching allocator (being written).
