//! `PYTORCH_CUDA_ALLOC_CONF` (and `PYTORCH_ALLOC_CONF`) and `TORCH_CUDA_ALLOC_LOG_LEVEL`.
//!
//! STUB: the parser is being written; only the shape of [`Config`] is fixed here.

use crate::policy::{K_LARGE_BUFFER, K_ROUNDUP_POWER_OF_TWO_INTERVALS};
use std::fmt;

/// Which allocator PyTorch is told to use (`backend:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Native,
    CudaMallocAsync,
}

/// The allocator settings, as PyTorch reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Blocks of this size or more are never split (`max_split_size_mb`); `usize::MAX` = no limit.
    pub max_split_size: usize,
    /// How much larger than a request an oversize cached block may be and still serve it
    /// (`max_non_split_rounding_mb`); PyTorch's default is `K_LARGE_BUFFER` (20 MiB).
    pub max_non_split_rounding_size: usize,
    /// `garbage_collection_threshold`; 0.0 = off.
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions`, one entry per power-of-two interval from 1 MiB to 64 GiB;
    /// 0 or 1 = plain 512-byte rounding.
    pub roundup_power2_divisions: [usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS],
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_cudamalloc: bool,
    /// `per_process_memory_fraction`, when given.
    pub per_process_memory_fraction: Option<f64>,
    /// `backend`.
    pub backend: Backend,
    /// Keys PyTorch accepts that change nothing in ferrocache (pinned memory, ...), in order.
    pub ignored_keys: Vec<String>,
    /// The raw setting and the variable it came from, when one was set.
    pub source: Option<(String, String)>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_split_size: usize::MAX,
            max_non_split_rounding_size: K_LARGE_BUFFER,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; K_ROUNDUP_POWER_OF_TWO_INTERVALS],
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
            per_process_memory_fraction: None,
            backend: Backend::Native,
            ignored_keys: Vec::new(),
            source: None,
        }
    }
}

/// A setting PyTorch would reject; the message is PyTorch's own wording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// The settings as PyTorch's snapshot `allocator_settings` shows them. (STUB)
    pub fn to_pytorch_settings(&self) -> serde_json::Value {
        serde_json::json!({})
    }

    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` value.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let _ = text;
        Ok(Config::default())
    }
}
