"""The differential oracle: PyTorch's own caching allocator against ferrocache (see harness)."""
