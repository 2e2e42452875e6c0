//! `PYTORCH_CUDA_ALLOC_CONF` (and `PYTORCH_ALLOC_CONF`) and `TORCH_CUDA_ALLOC_LOG_LEVEL`.
//!
//! The same variable configures PyTorch itself, so ferrocache reads it exactly as the newest
//! PyTorch does: it accepts what PyTorch accepts, rejects what PyTorch rejects with PyTorch's own
//! words, and reaches the same values. The rules come from PyTorch's `ConfigTokenizer` and
//! `AcceleratorAllocatorConfig` (`c10/core/AllocatorConfig.{h,cpp}`, the settings shared by every
//! accelerator) and `CUDAAllocatorConfig` (`c10/cuda/CUDAAllocatorConfig.{h,cpp}`, the CUDA ones).
//!
//! How PyTorch reads a setting, and so how [`Config::parse`] does:
//! - The text is cut into tokens: `,` `:` `[` `]` are tokens of their own, white space is dropped
//!   everywhere (`max split_size_mb` is `max_split_size_mb`), everything else makes up words.
//! - Three passes walk the tokens: `large_segment_size_mb` first (other limits depend on it), then
//!   the accelerator settings (which also rejects unknown keys), then the CUDA settings. An error
//!   is therefore the first one of the earliest pass, not always the leftmost one.
//! - PyTorch checks that a `:`, `,` or `[` is present but not which one it is (`checkToken`'s
//!   result is ignored), so `max_split_size_mb,40` is read as `max_split_size_mb:40`. ferrocache
//!   does the same and adds a line to [`Provenance::warnings`].
//! - Numbers are read like C's `stoull`/`stod`: the leading number counts, the rest of the word is
//!   ignored (`40MB` is 40), and `stoull` wraps a negative number (`-1` is 2^64 - 1). Both also
//!   give a warning. Where PyTorch fails with a bare `std::invalid_argument("stoull")`, ferrocache
//!   says which key and which word.

#![forbid(unsafe_code)]

pub mod describe;
pub mod log_level;
pub mod modelled;
pub mod numbers;
pub mod opt_in;
pub mod parser;
pub mod provenance;
pub mod tokens;

pub use log_level::{LOG_LEVEL_VAR, LogLevel};
pub use modelled::{ModelledPyTorch, NEWEST_PYTORCH};
pub use opt_in::{CROSS_STREAM_VAR, EXPANDABLE_IGNORE_MAX_SPLIT_VAR, OptIns, SNAPSHOT_ON_OOM_VAR};
pub use provenance::{
    ALLOC_CONF_VARS, PYTORCH_VERSION_VAR, Provenance, alloc_conf_variable_in_env,
    selected_alloc_conf, sleep_ability_from_env, tie_rule_from_env,
};

use modelled::{K_LARGE_BUFFER, K_ROUNDUP_POWER_OF_TWO_INTERVALS};
use std::fmt;

/// Keys of PyTorch's `AcceleratorAllocatorConfig` (`getMutableKeys`).
pub const ACCELERATOR_KEYS: [&str; 9] = [
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
];

/// Keys of PyTorch's `CUDAAllocatorConfig` (`getKeys`). The `hip` spellings are accepted on
/// CUDA builds too.
pub const CUDA_KEYS: [&str; 13] = [
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

/// The keys that change what ferrocache does. Every other accepted key goes to
/// [`Provenance::ignored_keys`]: pinned (host) memory is PyTorch's business, `backend` picks
/// PyTorch's own allocator, ferrocache never releases its lock around `cudaMalloc`, and
/// `graph_capture_record_stream_reuse` is not implemented.
const HONOURED_KEYS: [&str; 10] = [
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "per_process_memory_fraction",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

const MB: usize = 1 << 20;
/// `CUDAAllocatorConfig::pinned_max_register_threads`.
const PINNED_MAX_REGISTER_THREADS: usize = 128;

/// An expandable segment's address-space reserve (`expandable_segments_reserve:0.5` or `:40G`):
/// a fraction of the device's memory, or a number of GiB (PyTorch's
/// `ExpandableSegmentReserveSpec`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpandableReserve {
    Fraction(f64),
    GiB(f64),
}

impl ExpandableReserve {
    /// `resolveBytes`: the reserve in bytes on a device of `device_total` bytes, computed in
    /// doubles and truncated; what does not fit saturates.
    pub fn resolve_bytes(self, device_total: usize) -> usize {
        let bytes = match self {
            ExpandableReserve::Fraction(value) => value * device_total as f64,
            ExpandableReserve::GiB(value) => value * (1u64 << 30) as f64,
        };
        if bytes >= usize::MAX as f64 {
            usize::MAX
        } else {
            bytes as usize
        }
    }
}

impl fmt::Display for ExpandableReserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpandableReserve::Fraction(value) => write!(f, "{value} of the device's memory"),
            ExpandableReserve::GiB(value) => write!(f, "{value} GiB"),
        }
    }
}

/// Which allocator PyTorch is told to use (`backend:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Native,
    CudaMallocAsync,
}

impl Backend {
    /// The spelling PyTorch uses (`native`, `cudaMallocAsync`).
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// The allocator settings: PyTorch's keys, as PyTorch reads them (the fields under PyTorch's
/// names), and beside them ferrocache's opt-ins, the PyTorch being modelled and the provenance.
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
    /// `throw_on_cudamalloc_oom`: refuse a device allocation that would take the memory held
    /// past `per_process_memory_fraction` at once, without releasing cached blocks
    /// ([`crate::policy::preemptive_rejection_limit`]).
    pub throw_on_cudamalloc_oom: bool,
    /// `expandable_segments_reserve`: the address range each expandable segment reserves
    /// ([`crate::policy::expandable_segment_reserve`]); `None`: 9/8 of the device's memory. A value
    /// PyTorch would not take leaves the default, with a warning, as in PyTorch.
    pub expandable_segments_reserve: Option<ExpandableReserve>,
    /// `expandable_segments_reserve_by_class`, in order: reserves for streams that PyTorch's
    /// C++ API tagged with a class (`setExpandableSegmentReserveClassForStream`, which the
    /// allocator learns through `ferrocache_set_reserve_class_lookup`).
    pub expandable_segments_reserve_by_class: Vec<(String, ExpandableReserve)>,
    /// `backend`.
    pub backend: Backend,
    /// `large_segment_size_mb` in bytes (default `K_LARGE_BUFFER`): the lower limit of
    /// `max_split_size_mb` and `max_non_split_rounding_mb`, and the default of the latter.
    pub large_segment_size: usize,
    /// `pinned_num_register_threads` (default 1); shown in snapshots, not used by ferrocache.
    pub pinned_num_register_threads: usize,
    /// `pinned_max_round_threshold_mb` in bytes, when given; shown in snapshots
    /// (`max_round_threshold`, unlimited by default), not used by ferrocache.
    pub pinned_max_round_threshold: Option<usize>,
    /// `pinned_max_cached_size_mb` in bytes, when given; shown in snapshots (`max_cached_size`,
    /// unlimited by default), not used by ferrocache.
    pub pinned_max_cached_size: Option<usize>,
    /// `pinned_use_cuda_host_register`; shown in snapshots, not used by ferrocache.
    pub pinned_use_cuda_host_register: bool,
    /// `graph_capture_record_stream_reuse`; shown in snapshots, not used by ferrocache.
    pub graph_capture_record_stream_reuse: bool,
    /// ferrocache's own opt-ins (`FERROCACHE_*` variables, never keys of
    /// `PYTORCH_CUDA_ALLOC_CONF`).
    pub opt_in: OptIns,
    /// The PyTorch ferrocache runs under, and the rules of that version.
    pub modelled: ModelledPyTorch,
    /// Where the settings came from, and what reading them found.
    pub provenance: Provenance,
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
            throw_on_cudamalloc_oom: false,
            expandable_segments_reserve: None,
            expandable_segments_reserve_by_class: Vec::new(),
            backend: Backend::Native,
            large_segment_size: K_LARGE_BUFFER,
            pinned_num_register_threads: 1,
            pinned_max_round_threshold: None,
            pinned_max_cached_size: None,
            pinned_use_cuda_host_register: false,
            graph_capture_record_stream_reuse: false,
            opt_in: OptIns::default(),
            modelled: ModelledPyTorch::default(),
            provenance: Provenance::default(),
        }
    }
}

/// A setting PyTorch would reject; the message is PyTorch's own wording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

type Result<T> = std::result::Result<T, ConfigError>;

/// What the tests of the settings share.
#[cfg(test)]
mod test_support {
    use super::Config;
    use std::collections::HashMap;

    pub(crate) const KMB: usize = 1 << 20;

    pub(crate) fn ok(text: &str) -> Config {
        match Config::parse(text) {
            Ok(config) => config,
            Err(e) => panic!("{text:?} was rejected: {e}"),
        }
    }

    pub(crate) fn err(text: &str) -> String {
        match Config::parse(text) {
            Ok(config) => panic!("{text:?} was accepted: {config:?}"),
            Err(e) => e.message,
        }
    }

    /// The `roundup_power2_divisions` entry that applies to a request of `mb` MiB.
    pub(crate) fn divisions_at(config: &Config, mb: usize) -> usize {
        crate::policy::roundup_power2_divisions(mb * KMB, &config.roundup_power2_divisions)
    }

    /// A `lookup` that answers from `pairs`, as the environment would.
    pub(crate) fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }
}
