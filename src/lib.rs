//! ferrocache: PyTorch's CUDA caching allocator, in Rust, loadable through
//! `torch.cuda.memory.CUDAPluggableAllocator`.

pub mod allocator;
pub mod cli;
pub mod config;
pub mod device;
mod ffi;
pub mod lock;
pub mod logging;
pub mod policy;
pub mod replay;
pub mod trace;
pub mod tune;

/// The property tests' configuration, shared with the integration tests.
#[cfg(test)]
#[path = "../tests/common/properties.rs"]
mod test_properties;
