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
//!   does the same and adds a line to [`Config::warnings`].
//! - Numbers are read like C's `stoull`/`stod`: the leading number counts, the rest of the word is
//!   ignored (`40MB` is 40), and `stoull` wraps a negative number (`-1` is 2^64 - 1). Both also
//!   give a warning. Where PyTorch fails with a bare `std::invalid_argument("stoull")`, ferrocache
//!   says which key and which word.
//! - Booleans are exactly `True` or `False`; the newest PyTorch does not take `true`.

use crate::policy::{
    self, K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, K_ROUNDUP_POWER_OF_TWO_INTERVALS, OomWording, TieRule,
};
use serde_json::{Map, Value, json};
use std::fmt;

/// The variables that hold the allocator settings, in the order PyTorch reads them: the first
/// one that is set (even to an empty string) is used and the others are not read.
///
/// The newest PyTorch (`AcceleratorAllocatorConfig::instance` and
/// `CUDAAllocatorConfig::instance`) reads `PYTORCH_CUDA_ALLOC_CONF` first, "to keep the parsing
/// order stable". A short-lived version read `PYTORCH_ALLOC_CONF` first and warned that
/// `PYTORCH_CUDA_ALLOC_CONF` was deprecated; that was reverted. `PYTORCH_HIP_ALLOC_CONF` is read
/// by the accelerator parser on every build.
pub const ALLOC_CONF_VARS: [&str; 3] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
];

/// The variable that sets ferrocache's log level.
pub const LOG_LEVEL_VAR: &str = "TORCH_CUDA_ALLOC_LOG_LEVEL";

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
/// [`Config::ignored_keys`]: pinned (host) memory is PyTorch's business, `backend` picks
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
    /// `throw_on_cudamalloc_oom`: refuse a device allocation that would take the memory held
    /// past `per_process_memory_fraction` at once, without releasing cached blocks
    /// ([`policy::preemptive_rejection_limit`]).
    pub throw_on_cudamalloc_oom: bool,
    /// `expandable_segments_reserve`: the address range each expandable segment reserves
    /// ([`policy::expandable_segment_reserve`]); `None`: 9/8 of the device's memory. A value
    /// PyTorch would not take leaves the default, with a warning, as in PyTorch.
    pub expandable_segments_reserve: Option<ExpandableReserve>,
    /// `expandable_segments_reserve_by_class`, in order: reserves for streams that PyTorch's
    /// C++ API tagged with a class (`setExpandableSegmentReserveClassForStream`, which the
    /// allocator learns through `ferrocache_set_reserve_class_lookup`).
    pub expandable_segments_reserve_by_class: Vec<(String, ExpandableReserve)>,
    /// `backend`.
    pub backend: Backend,
    /// Keys PyTorch accepts that change nothing in ferrocache (pinned memory, ...), in order.
    pub ignored_keys: Vec<String>,
    /// The raw setting and the variable it came from, when one was set.
    pub source: Option<(String, String)>,
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
    /// ferrocache's own opt-in (`FERROCACHE_CROSS_STREAM`, never a key of
    /// `PYTORCH_CUDA_ALLOC_CONF`): a request that misses its stream's cache may take a block
    /// cached on another stream, after a device-side wait (see `allocator::cross_stream`).
    pub cross_stream: bool,
    /// ferrocache's own opt-in (`FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT`): `max_split_size_mb`
    /// does not apply to blocks inside expandable segments, which always split anyway. PyTorch
    /// applies it and then maps new pages beside a free block it refused, so reserved memory
    /// can grow without bound (pytorch#123548).
    pub expandable_ignore_max_split: bool,
    /// How ties between equal cached blocks break: the rule of the PyTorch ferrocache runs
    /// under (`FERROCACHE_PYTORCH_VERSION`, which `ferrocache.install()` sets from
    /// `torch.__version__`); PyTorch 2.15's by default.
    pub tie_rule: TieRule,
    /// The wording of the out-of-memory message: that of the PyTorch ferrocache runs under
    /// (`FERROCACHE_PYTORCH_VERSION`), PyTorch 2.15's by default.
    pub oom_wording: OomWording,
    /// The PyTorch ferrocache runs under (`FERROCACHE_PYTORCH_VERSION`), as `(major, minor)`;
    /// [`NEWEST_PYTORCH`] by default. What a run-time parse resets follows it
    /// ([`reset_before_each_parse`]).
    pub pytorch_version: (u32, u32),
    /// Things PyTorch lets pass that look like mistakes (a `,` where a `:` belongs, `40MB`, a
    /// variable hidden by another), one sentence each, no duplicates; for the caller to log.
    pub warnings: Vec<String>,
}

/// The PyTorch version ferrocache decides like (`2.12`, `2.12.1+cu128`, ...): set by
/// `ferrocache.install()` from `torch.__version__`; unset, PyTorch 2.15's rules.
pub const PYTORCH_VERSION_VAR: &str = "FERROCACHE_PYTORCH_VERSION";

/// The newest PyTorch whose rules ferrocache knows, and follows when no version is given.
pub const NEWEST_PYTORCH: (u32, u32) = (2, 15);

/// Reads `FERROCACHE_PYTORCH_VERSION`: the rules that changed between PyTorch versions follow
/// it; a value that is not a version is ignored with a warning.
fn apply_pytorch_version_var(config: &mut Config, value: Option<String>) {
    let Some(value) = value else { return };
    match parse_major_minor(&value) {
        Some((major, minor)) => {
            config.tie_rule = policy::tie_rule_of_pytorch(major, minor);
            config.oom_wording = policy::oom_wording_of_pytorch(major, minor);
            config.pytorch_version = (major, minor);
        }
        None => push_unique(
            &mut config.warnings,
            format!(
                "{PYTORCH_VERSION_VAR}={value:?} is not a PyTorch version (expected e.g. 2.15.0); \
                 PyTorch 2.15's rules apply"
            ),
        ),
    }
}

/// The tie rule `FERROCACHE_PYTORCH_VERSION` asks for (PyTorch 2.15's when it is unset or not
/// a version): what the replayer and `tune` judge a recording by, as the library does.
pub fn tie_rule_from_env() -> TieRule {
    let mut config = Config::default();
    apply_pytorch_version_var(&mut config, std::env::var(PYTORCH_VERSION_VAR).ok());
    config.tie_rule
}

/// The variable the settings are read from (the first of [`ALLOC_CONF_VARS`] that is set), to
/// name it in an error.
pub fn alloc_conf_variable_in_env() -> &'static str {
    selected_alloc_conf(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
        .map_or(ALLOC_CONF_VARS[0], |(name, _)| name)
}

/// `FERROCACHE_SLEEP=1`: every segment is made so that it can sleep from the start, so that a
/// sleep with no tag gives back all memory. Without it, only memory allocated after the first
/// tag was set (a `region`) can sleep.
pub fn sleep_ability_from_env() -> bool {
    std::env::var_os("FERROCACHE_SLEEP").is_some_and(|v| v == "1")
}

/// `major.minor` of a version string such as `2.12.1+cu128` or `2.16.0a0`.
fn parse_major_minor(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor.parse().ok()?))
}

/// ferrocache's own variable for cross-stream reuse (PyTorch would reject a new key in
/// `PYTORCH_CUDA_ALLOC_CONF`).
pub const CROSS_STREAM_VAR: &str = "FERROCACHE_CROSS_STREAM";

/// ferrocache's own variable naming where a snapshot is written at the first out-of-memory
/// (read by the Python package, `python/ferrocache/oom.py`; `ferrocache run --snapshot-on-oom`
/// sets it).
pub const SNAPSHOT_ON_OOM_VAR: &str = "FERROCACHE_SNAPSHOT_ON_OOM";

/// ferrocache's own variable that exempts blocks of expandable segments from
/// `max_split_size_mb` ([`Config::expandable_ignore_max_split`]).
pub const EXPANDABLE_IGNORE_MAX_SPLIT_VAR: &str = "FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT";

/// Reads one of ferrocache's on/off variables: `1`/`true`/`yes`/`on` turn it on, `0`/`false`/
/// `no`/`off`/empty leave it off; anything else leaves it off with a warning that names
/// `what` (bad input never stops the allocator).
fn flag_var(config: &mut Config, name: &str, value: Option<String>, what: &str) -> bool {
    let Some(value) = value else { return false };
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            push_unique(
                &mut config.warnings,
                format!("{name}={value:?} is not understood (expected 1 or 0); {what} stays off"),
            );
            false
        }
    }
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
            ignored_keys: Vec::new(),
            source: None,
            large_segment_size: K_LARGE_BUFFER,
            pinned_num_register_threads: 1,
            pinned_max_round_threshold: None,
            pinned_max_cached_size: None,
            pinned_use_cuda_host_register: false,
            graph_capture_record_stream_reuse: false,
            cross_stream: false,
            expandable_ignore_max_split: false,
            tie_rule: TieRule::default(),
            oom_wording: OomWording::default(),
            pytorch_version: NEWEST_PYTORCH,
            warnings: Vec::new(),
        }
    }
}

/// A setting PyTorch would reject; the message is PyTorch's own wording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub message: String,
}

impl ConfigError {
    fn new(message: impl Into<String>) -> Self {
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

impl Config {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` value. An empty value gives the defaults.
    /// [`Config::source`] stays `None`; [`Config::from_vars`] fills it in.
    pub fn parse(text: &str) -> Result<Config> {
        let mut parser = Parser {
            tokens: Tokens::new(text),
            config: Config::default(),
        };
        parser.large_segment_pass(AfterLargeSegmentPass::RoundingFollowsLargeSegment)?;
        parser.accelerator_pass()?;
        parser.cuda_pass()?;
        Ok(parser.config)
    }

    /// The settings after `torch.cuda.memory._set_allocator_settings(text)` (PyTorch's
    /// `setAllocatorSettings`), which parses `text` over the settings in effect rather than
    /// over the defaults: a key `text` names takes its new value, and every other key keeps
    /// its value, except those [`reset_before_each_parse`] resets for the PyTorch in use
    /// ([`Config::pytorch_version`]). ferrocache's own settings
    /// and the PyTorch being modelled stay. [`Config::source`] becomes `text`, as PyTorch's
    /// `last_allocator_settings` does.
    ///
    /// A refused `text` changes nothing: PyTorch keeps what it parsed before the bad key
    /// (and the resets), ferrocache keeps every setting as it was.
    pub fn with_runtime_settings(&self, text: &str) -> Result<Config> {
        let mut start = self.clone();
        let after_large_segment_pass = reset_before_each_parse(&mut start, self.pytorch_version);
        start.warnings.clear();
        let mut parser = Parser {
            tokens: Tokens::new(text),
            config: start,
        };
        parser.large_segment_pass(after_large_segment_pass)?;
        parser.accelerator_pass()?;
        parser.cuda_pass()?;
        let mut config = parser.config;
        let variable = self
            .source
            .as_ref()
            .map_or(ALLOC_CONF_VARS[0], |(name, _)| name.as_str());
        config.source = Some((variable.to_string(), text.to_string()));
        Ok(config)
    }

    /// Reads the settings from the process environment; see [`Config::from_vars`].
    pub fn from_env() -> Result<Config> {
        Config::from_vars(|name| {
            std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Reads the settings through `lookup` (a variable's value, or `None` when it is not set):
    /// the first of [`ALLOC_CONF_VARS`] that is set is parsed and recorded in
    /// [`Config::source`]; none set gives the defaults.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut config = Config::from_alloc_conf_vars(&lookup)?;
        config.cross_stream = flag_var(
            &mut config,
            CROSS_STREAM_VAR,
            lookup(CROSS_STREAM_VAR),
            "cross-stream reuse",
        );
        config.expandable_ignore_max_split = flag_var(
            &mut config,
            EXPANDABLE_IGNORE_MAX_SPLIT_VAR,
            lookup(EXPANDABLE_IGNORE_MAX_SPLIT_VAR),
            "the exemption of expandable segments from max_split_size_mb",
        );
        apply_pytorch_version_var(&mut config, lookup(PYTORCH_VERSION_VAR));
        Ok(config)
    }

    /// `PYTORCH_CUDA_ALLOC_CONF` and its aliases alone.
    fn from_alloc_conf_vars(lookup: &impl Fn(&str) -> Option<String>) -> Result<Config> {
        let Some((name, value)) = selected_alloc_conf(lookup) else {
            return Ok(Config::default());
        };
        let mut config = Config::parse(&value)?;
        // The later variables are never read by PyTorch; say so when one of them is set too.
        for other in ALLOC_CONF_VARS.iter().skip_while(|v| **v != name).skip(1) {
            if lookup(other).is_some() {
                push_unique(
                    &mut config.warnings,
                    format!("{other} is set but not read: {name} takes precedence, as in PyTorch"),
                );
            }
        }
        config.source = Some((name.to_string(), value));
        Ok(config)
    }

    /// The effective settings that differ from PyTorch's defaults, one line each, for
    /// `ferrocache check-config` and the INFO start-up line. A single line says so when all
    /// settings are the defaults.
    pub fn describe(&self) -> String {
        let default = Config::default();
        let mut lines = Vec::new();
        if self.max_split_size != default.max_split_size {
            lines.push(format!(
                "max_split_size: {} (cached blocks this large or larger are never split)",
                format_bytes(self.max_split_size)
            ));
        }
        if self.max_non_split_rounding_size != default.max_non_split_rounding_size {
            lines.push(format!(
                "max_non_split_rounding_size: {} (how much larger than a request an oversize \
                 cached block may be and still serve it)",
                format_bytes(self.max_non_split_rounding_size)
            ));
        }
        if self.garbage_collection_threshold != default.garbage_collection_threshold {
            lines.push(format!(
                "garbage_collection_threshold: {} (free old cached blocks above this share of \
                 the allowed memory)",
                self.garbage_collection_threshold
            ));
        }
        if self.roundup_power2_divisions != default.roundup_power2_divisions {
            lines.push(format!(
                "roundup_power2_divisions: {}",
                describe_divisions(&self.roundup_power2_divisions)
            ));
        }
        if self.expandable_segments != default.expandable_segments {
            lines.push(format!(
                "expandable_segments: {}",
                py_bool(self.expandable_segments)
            ));
        }
        if self.cross_stream {
            lines.push(format!(
                "cross-stream reuse: on ({CROSS_STREAM_VAR}; a stream's miss may take another \
                 stream's cached block after one device-side event wait)"
            ));
        }
        if self.expandable_ignore_max_split {
            lines.push(format!(
                "max_split_size_mb does not apply inside expandable segments: on \
                 ({EXPANDABLE_IGNORE_MAX_SPLIT_VAR}; their blocks always split)"
            ));
        }
        if let Some(fraction) = self.per_process_memory_fraction {
            lines.push(format!(
                "per_process_memory_fraction: {fraction} (of each device's memory)"
            ));
        }
        if self.throw_on_cudamalloc_oom {
            let limit = match self.per_process_memory_fraction {
                Some(fraction) if fraction < 1.0 => format!("{fraction} of the device"),
                _ => "the device's memory".to_string(),
            };
            lines.push(format!(
                "throw_on_cudamalloc_oom: True (a device allocation that would take the memory \
                 held past {limit} is refused at once, without releasing cached blocks)"
            ));
        }
        if let Some(reserve) = self.expandable_segments_reserve {
            lines.push(format!(
                "expandable_segments_reserve: {reserve} (the address range of each expandable \
                 segment, at most 9/8 of the device's memory)"
            ));
        }
        if !self.expandable_segments_reserve_by_class.is_empty() {
            let classes: Vec<String> = self
                .expandable_segments_reserve_by_class
                .iter()
                .map(|(class, reserve)| format!("{class}: {reserve}"))
                .collect();
            lines.push(format!(
                "expandable_segments_reserve_by_class: {} (for the streams tagged with these \
                 classes through PyTorch's C++ API)",
                classes.join(", ")
            ));
        }
        if self.release_lock_on_cudamalloc != default.release_lock_on_cudamalloc {
            lines.push(format!(
                "release_lock_on_cudamalloc: {} (not used by ferrocache)",
                py_bool(self.release_lock_on_cudamalloc)
            ));
        }
        if self.backend != default.backend {
            lines.push(format!(
                "backend: {} (not used by ferrocache)",
                self.backend.as_str()
            ));
        }
        if self.large_segment_size != default.large_segment_size {
            lines.push(format!(
                "large_segment_size: {} (segments for 1-10 MiB requests, expandable large-pool pages, lower limit of the two limits above)",
                format_bytes(self.large_segment_size)
            ));
        }
        if lines.is_empty() {
            return "all allocator settings are PyTorch's defaults".to_string();
        }
        lines.join("\n")
    }

    /// The settings as PyTorch's snapshot shows them under `allocator_settings`
    /// (`torch/csrc/cuda/memory_snapshot.cpp`): the raw setting under `PYTORCH_CUDA_ALLOC_CONF`
    /// (whatever variable it came from), sizes in bytes as signed 64-bit numbers (so an
    /// unlimited `max_split_size` is -1), and `roundup_power2_divisions` keyed by interval
    /// size in MB (`"1"` ... `"32768"`).
    pub fn to_pytorch_settings(&self) -> Value {
        let raw = self
            .source
            .as_ref()
            .map(|(_, value)| value.as_str())
            .unwrap_or("");
        let mut divisions = Map::new();
        for (index, value) in self.roundup_power2_divisions.iter().enumerate() {
            divisions.insert((1u64 << index).to_string(), json!(*value as u64 as i64));
        }
        json!({
            "PYTORCH_CUDA_ALLOC_CONF": raw,
            // PyTorch writes int64_t(max_split_size): the bit pattern, so SIZE_MAX is -1.
            "max_split_size": self.max_split_size as u64 as i64,
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": self.pinned_num_register_threads as u64 as i64,
            "max_round_threshold": self.pinned_max_round_threshold.unwrap_or(usize::MAX) as u64 as i64,
            "max_cached_size": self.pinned_max_cached_size.unwrap_or(usize::MAX) as u64 as i64,
            "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
            "pinned_use_cuda_host_register": self.pinned_use_cuda_host_register,
            "graph_capture_record_stream_reuse": self.graph_capture_record_stream_reuse,
            "roundup_power2_divisions": Value::Object(divisions),
        })
    }
}

/// What PyTorch `version`'s `setAllocatorSettings` (`torch.cuda.memory._set_allocator_settings`)
/// does to the settings in effect around reading a run-time text; every key not reset here
/// keeps its value unless the text names it. Returns what follows the large-segment pass.
///
/// - Every version from 2.4 on first puts `max_split_size_mb`, `roundup_power2_divisions` and
///   `garbage_collection_threshold` back to their defaults: 2.4 to 2.8 at the top of
///   `CUDAAllocatorConfig::parseArgs` (c10/cuda/CUDAAllocatorConfig.cpp, "If empty, set the
///   default values": `m_max_split_size = ...max()`, `m_roundup_power2_divisions.assign(...)`,
///   `m_garbage_collection_threshold = 0`), later ones at the top of
///   `AcceleratorAllocatorConfig::parseArgs` (c10/core/AllocatorConfig.cpp, "reset to its
///   default value if not explicitly set each time").
/// - From [`LARGE_SEGMENT_PASS_SINCE`] on, the parse begins with a pass over
///   `large_segment_size_mb`, which then sets `max_non_split_rounding_mb` to
///   `large_segment_size_mb` (so a run-time text that does not name it puts it back). Older
///   versions have neither key nor pass: `max_non_split_rounding_mb` keeps its value.
///
/// Measured on each version's own allocator on the fake CUDA (docs/python.md, "Settings
/// changed at run time"): 2.8.0 and 2.10.0 keep `max_non_split_rounding_mb:40` across
/// `_set_allocator_settings("max_split_size_mb:30")`; 2.11.0, 2.13.0, 2.14.1 and 2.15.0 put it
/// back; `large_segment_size_mb` is in the strings of 2.11.0's `libc10.so`, not 2.10.0's. The
/// keys a version accepts at all are its parser's business: it runs before ferrocache's and
/// refuses what it lacks (2.8 and 2.10 refuse `large_segment_size_mb`).
fn reset_before_each_parse(config: &mut Config, version: (u32, u32)) -> AfterLargeSegmentPass {
    let default = Config::default();
    config.max_split_size = default.max_split_size;
    config.roundup_power2_divisions = default.roundup_power2_divisions;
    config.garbage_collection_threshold = default.garbage_collection_threshold;
    if version >= LARGE_SEGMENT_PASS_SINCE {
        AfterLargeSegmentPass::RoundingFollowsLargeSegment
    } else {
        AfterLargeSegmentPass::RoundingKept
    }
}

/// The first PyTorch whose parse has the large-segment pass ([`reset_before_each_parse`]).
const LARGE_SEGMENT_PASS_SINCE: (u32, u32) = (2, 11);

/// What a parse does to `max_non_split_rounding_mb` after its large-segment pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterLargeSegmentPass {
    /// It becomes `large_segment_size_mb` (then a later key in the text may set it).
    RoundingFollowsLargeSegment,
    /// It keeps its value: the PyTorch has no large-segment pass.
    RoundingKept,
}

/// The first of [`ALLOC_CONF_VARS`] that is set, with its value: the variable PyTorch parses.
pub fn selected_alloc_conf(
    lookup: impl Fn(&str) -> Option<String>,
) -> Option<(&'static str, String)> {
    ALLOC_CONF_VARS
        .iter()
        .find_map(|name| lookup(name).map(|value| (*name, value)))
}

/// ferrocache's log level (`TORCH_CUDA_ALLOC_LOG_LEVEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum LogLevel {
    Off,
    Error,
    #[default]
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    /// Parses a level name, in any case: `OFF`, `ERROR`, `WARN` (or `WARNING`), `INFO`, `DEBUG`,
    /// `TRACE`. Surrounding white space is ignored.
    pub fn parse(text: &str) -> Result<LogLevel> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(LogLevel::Off),
            "error" => Ok(LogLevel::Error),
            "warn" | "warning" => Ok(LogLevel::Warn),
            "info" => Ok(LogLevel::Info),
            "debug" => Ok(LogLevel::Debug),
            "trace" => Ok(LogLevel::Trace),
            _ => Err(ConfigError::new(format!(
                "Unknown {LOG_LEVEL_VAR} value '{text}', expected one of OFF, ERROR, WARN, \
                 INFO, DEBUG, TRACE"
            ))),
        }
    }

    /// Reads `TORCH_CUDA_ALLOC_LOG_LEVEL` from the process environment; see
    /// [`LogLevel::from_vars`].
    pub fn from_env() -> Result<LogLevel> {
        LogLevel::from_vars(|name| {
            std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Reads `TORCH_CUDA_ALLOC_LOG_LEVEL` through `lookup`; unset or blank gives `Warn`.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<LogLevel> {
        match lookup(LOG_LEVEL_VAR) {
            Some(value) if !value.trim().is_empty() => LogLevel::parse(&value),
            _ => Ok(LogLevel::default()),
        }
    }

    /// The upper-case name (`WARN`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Off => "OFF",
            LogLevel::Error => "ERROR",
            LogLevel::Warn => "WARN",
            LogLevel::Info => "INFO",
            LogLevel::Debug => "DEBUG",
            LogLevel::Trace => "TRACE",
        }
    }

    /// The `log` crate's filter for this level.
    pub fn to_level_filter(self) -> log::LevelFilter {
        match self {
            LogLevel::Off => log::LevelFilter::Off,
            LogLevel::Error => log::LevelFilter::Error,
            LogLevel::Warn => log::LevelFilter::Warn,
            LogLevel::Info => log::LevelFilter::Info,
            LogLevel::Debug => log::LevelFilter::Debug,
            LogLevel::Trace => log::LevelFilter::Trace,
        }
    }
}

impl fmt::Display for LogLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens
// ---------------------------------------------------------------------------------------------

/// PyTorch's `ConfigTokenizer`: the words and separators of a setting.
struct Tokens(Vec<String>);

impl Tokens {
    /// `,` `:` `[` `]` are tokens of their own; white space (C's `isspace`) is dropped, also
    /// inside words. Older PyTorch dropped only spaces.
    fn new(text: &str) -> Tokens {
        let mut tokens = Vec::new();
        let mut word = String::new();
        for ch in text.chars() {
            if matches!(ch, ',' | ':' | '[' | ']') {
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                tokens.push(ch.to_string());
            } else if !is_c_space(ch) {
                word.push(ch);
            }
        }
        if !word.is_empty() {
            tokens.push(word);
        }
        Tokens(tokens)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    /// `operator[]`/`checkIndex`: PyTorch fails an internal assertion past the end. The message
    /// keeps PyTorch's words and names the setting that ended too early.
    fn get(&self, i: usize, key: &str) -> Result<&str> {
        self.0.get(i).map(String::as_str).ok_or_else(|| {
            ConfigError::new(format!(
                "Index out of bounds in ConfigTokenizer (the value of {key} is missing or \
                 incomplete)"
            ))
        })
    }

    /// `checkToken` used as a question: is token `i` `expected`? Past the end is an error.
    fn is(&self, i: usize, expected: &str, key: &str) -> Result<bool> {
        Ok(self.get(i, key)? == expected)
    }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(ch: char) -> bool {
    matches!(ch, ' ' | '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r')
}

fn push_unique(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

// ---------------------------------------------------------------------------------------------
// Numbers, read as C reads them
// ---------------------------------------------------------------------------------------------

#[derive(Debug, PartialEq)]
enum NumberError {
    /// No number at the start of the word (`std::invalid_argument`).
    Invalid,
    /// A number too large (or too small) to hold (`std::out_of_range`).
    OutOfRange,
}

/// `std::stoull`: optional sign, decimal digits; the rest of the word is left over. A minus
/// sign wraps (`-1` is `u64::MAX`), as `strtoull` does. Returns the value and where it stopped.
fn c_stoull(word: &str) -> std::result::Result<(u64, usize), NumberError> {
    let bytes = word.as_bytes();
    let mut i = 0;
    let negative = matches!(bytes.first(), Some(b'-'));
    if matches!(bytes.first(), Some(b'+' | b'-')) {
        i += 1;
    }
    let digits_start = i;
    let mut value: u64 = 0;
    let mut overflow = false;
    while let Some(digit) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(digit - b'0')))
        {
            Some(v) => value = v,
            None => overflow = true,
        }
        i += 1;
    }
    if i == digits_start {
        return Err(NumberError::Invalid);
    }
    if overflow {
        return Err(NumberError::OutOfRange);
    }
    Ok((
        if negative {
            value.wrapping_neg()
        } else {
            value
        },
        i,
    ))
}

/// `std::stod`: optional sign, then `inf`/`infinity`/`nan`/`nan(...)` in any case, or a decimal
/// number with an optional exponent; the rest of the word is left over. Overflow and underflow
/// (to zero or to a subnormal) are out of range, as glibc's `strtod` reports them. Hexadecimal
/// floats (`0x1p-1`) are not read: they stop after the `0`.
fn c_stod(word: &str) -> std::result::Result<(f64, usize), NumberError> {
    let bytes = word.as_bytes();
    let mut i = 0;
    let negative = matches!(bytes.first(), Some(b'-'));
    if matches!(bytes.first(), Some(b'+' | b'-')) {
        i += 1;
    }
    let sign = if negative { -1.0 } else { 1.0 };
    let lower = word[i..].to_ascii_lowercase();
    if lower.starts_with("inf") {
        let len = if lower.starts_with("infinity") { 8 } else { 3 };
        return Ok((sign * f64::INFINITY, i + len));
    }
    if lower.starts_with("nan") {
        i += 3;
        // `nan(chars)` is one number when the parenthesis closes over letters, digits and `_`.
        if bytes.get(i) == Some(&b'(') {
            let inner = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                .count();
            if bytes.get(i + 1 + inner) == Some(&b')') {
                i += inner + 2;
            }
        }
        return Ok((f64::NAN, i));
    }
    let mantissa_start = i;
    let mut digits = 0;
    let mut nonzero = false;
    while let Some(b) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
        nonzero |= *b != b'0';
        digits += 1;
        i += 1;
    }
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        while let Some(b) = bytes.get(i).filter(|b| b.is_ascii_digit()) {
            nonzero |= *b != b'0';
            digits += 1;
            i += 1;
        }
    }
    if digits == 0 {
        return Err(NumberError::Invalid);
    }
    // An exponent counts only when digits follow the `e` (and its sign).
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        if matches!(bytes.get(j), Some(b'+' | b'-')) {
            j += 1;
        }
        if bytes.get(j).is_some_and(u8::is_ascii_digit) {
            while bytes.get(j).is_some_and(u8::is_ascii_digit) {
                j += 1;
            }
            i = j;
        }
    }
    let magnitude: f64 = word[mantissa_start..i]
        .parse()
        .map_err(|_| NumberError::Invalid)?;
    if magnitude.is_infinite() || (nonzero && magnitude < f64::MIN_POSITIVE) {
        return Err(NumberError::OutOfRange);
    }
    Ok((sign * magnitude, i))
}

// ---------------------------------------------------------------------------------------------
// The parser: one function per PyTorch rule
// ---------------------------------------------------------------------------------------------

struct Parser {
    tokens: Tokens,
    config: Config,
}

impl Parser {
    fn warn(&mut self, message: String) {
        push_unique(&mut self.config.warnings, message);
    }

    /// `checkToken(i, sep)` as PyTorch uses it after a key or a value: the token must exist,
    /// but PyTorch ignores which one it is. A wrong one gives a warning.
    fn expect(&mut self, i: usize, expected: &str, key: &str) -> Result<()> {
        let found = self.tokens.get(i, key)?;
        if found != expected {
            let message = format!(
                "Expected '{expected}' at index {i} of the allocator settings but got \
                 '{found}'; PyTorch reads on as if it were there, and so does ferrocache"
            );
            self.warn(message);
        }
        Ok(())
    }

    /// `toSizeT` (`std::stoull`): a count or a size in MB.
    fn read_size(&mut self, i: usize, key: &str) -> Result<usize> {
        let word = self.tokens.get(i, key)?.to_string();
        match c_stoull(&word) {
            Ok((value, end)) => {
                if word.starts_with('-') && value != 0 {
                    self.warn(format!(
                        "{key}: '{word}' is read as {value}, as PyTorch's stoull wraps negative \
                         numbers"
                    ));
                }
                self.warn_trailing(&word, end, key);
                Ok(usize::try_from(value).unwrap_or(usize::MAX))
            }
            Err(NumberError::Invalid) => Err(ConfigError::new(format!(
                "Invalid value '{word}' for {key}: expected an unsigned integer (PyTorch fails \
                 with std::invalid_argument: stoull)"
            ))),
            Err(NumberError::OutOfRange) => Err(ConfigError::new(format!(
                "Value '{word}' for {key} is out of range (PyTorch fails with \
                 std::out_of_range: stoull)"
            ))),
        }
    }

    /// `toDouble` (`std::stod`).
    fn read_double(&mut self, i: usize, key: &str) -> Result<f64> {
        let word = self.tokens.get(i, key)?.to_string();
        match c_stod(&word) {
            Ok((value, end)) => {
                self.warn_trailing(&word, end, key);
                Ok(value)
            }
            Err(NumberError::Invalid) => Err(ConfigError::new(format!(
                "Invalid value '{word}' for {key}: expected a number (PyTorch fails with \
                 std::invalid_argument: stod)"
            ))),
            Err(NumberError::OutOfRange) => Err(ConfigError::new(format!(
                "Value '{word}' for {key} is out of range (PyTorch fails with \
                 std::out_of_range: stod)"
            ))),
        }
    }

    fn warn_trailing(&mut self, word: &str, end: usize, key: &str) {
        if end < word.len() {
            self.warn(format!(
                "{key}: '{}' after the number in '{word}' is ignored, as PyTorch reads only the \
                 leading number",
                &word[end..]
            ));
        }
    }

    /// `toBool`: exactly `True` or `False`. Older PyTorch said
    /// "Expected a single True/False argument for <key>".
    fn read_bool(&self, i: usize, key: &str) -> Result<bool> {
        match self.tokens.get(i, key)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => Err(ConfigError::new(format!(
                "Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{other}'"
            ))),
        }
    }

    /// `skipKey`: steps over a key the current pass does not handle and returns the index of
    /// its value (a word, or the `]` that closes a list).
    fn skip_key(&mut self, i: usize, key: &str) -> Result<usize> {
        self.expect(i + 1, ":", key)?;
        let mut i = i + 2;
        if self.tokens.get(i, key)? != "[" {
            return Ok(i);
        }
        i += 1;
        while i < self.tokens.len() && self.tokens.0[i] != "]" {
            i += 1;
        }
        if i >= self.tokens.len() {
            return Err(unclosed_list());
        }
        Ok(i)
    }

    /// A `key:bool` setting; returns the value and the index of its token.
    fn bool_setting(&mut self, i: usize, key: &str) -> Result<(bool, usize)> {
        self.expect(i + 1, ":", key)?;
        Ok((self.read_bool(i + 2, key)?, i + 2))
    }

    /// A `key:<size in MB>` setting: the value in MB (at most what fits in bytes) and its index.
    fn mb_setting(&mut self, i: usize, key: &str) -> Result<(usize, usize)> {
        self.expect(i + 1, ":", key)?;
        let mb = self.read_size(i + 2, key)?;
        Ok((mb, i + 2))
    }

    // --- pass 1: large_segment_size_mb, which the other limits depend on -------------------

    /// PyTorch reads `large_segment_size_mb` before anything else, looking at every token, and
    /// then makes it the default of `max_non_split_rounding_mb`.
    fn large_segment_pass(&mut self, after: AfterLargeSegmentPass) -> Result<()> {
        let mut i = 0;
        while i < self.tokens.len() {
            if self.tokens.0[i] == "large_segment_size_mb" {
                i = self.parse_large_segment_size(i)?;
            }
            i += 1;
        }
        if after == AfterLargeSegmentPass::RoundingFollowsLargeSegment {
            self.config.max_non_split_rounding_size = self.config.large_segment_size;
        }
        Ok(())
    }

    /// `large_segment_size_mb` must exceed `kMinLargeAlloc` (10 MB).
    fn parse_large_segment_size(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "large_segment_size_mb";
        let (mb, i) = self.mb_setting(i, KEY)?;
        let min_mb = K_MIN_LARGE_ALLOC / MB;
        if mb <= min_mb {
            return Err(ConfigError::new(format!(
                "CachingAllocator option {KEY} must be > {min_mb} MB"
            )));
        }
        self.config.large_segment_size = mb_to_bytes(mb);
        Ok(i)
    }

    // --- pass 2: the accelerator settings (AcceleratorAllocatorConfig::parseArgs) ----------

    fn accelerator_pass(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.tokens.len() {
            let key = self.tokens.0[i].clone();
            if !is_known_key(&key) {
                // With a device parser registered (CUDA always is), unknown keys are an error.
                // Older PyTorch said "Unrecognized CachingAllocator option: <key>"; the CUDA
                // parser of mid-2025 said "Unrecognized key '<key>' in CUDA allocator config.".
                return Err(ConfigError::new(format!(
                    "Unrecognized key '{key}' in Accelerator allocator config."
                )));
            }
            if !HONOURED_KEYS.contains(&key.as_str()) {
                push_unique(&mut self.config.ignored_keys, key.clone());
            }
            i = match key.as_str() {
                "max_split_size_mb" => self.parse_max_split_size(i)?,
                "max_non_split_rounding_mb" => self.parse_max_non_split_rounding_size(i)?,
                "garbage_collection_threshold" => self.parse_garbage_collection_threshold(i)?,
                "roundup_power2_divisions" => self.parse_roundup_power2_divisions(i)?,
                "expandable_segments" => self.parse_expandable_segments(i)?,
                "pinned_use_background_threads" => self.parse_pinned_use_background_threads(i)?,
                "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
                    self.parse_pinned_max_sizes(i, &key)?
                }
                // large_segment_size_mb (read in pass 1) and the CUDA keys (pass 3).
                _ => self.skip_key(i, &key)?,
            };
            if i + 1 < self.tokens.len() {
                i += 1;
                self.expect(i, ",", &key)?;
            }
            i += 1;
        }
        self.warn_of_pinned_limits();
        Ok(())
    }

    /// `max_split_size_mb`: at least `large_segment_size_mb` (20), kept in bytes. Older PyTorch
    /// required more than 20 ("too small, must be > 20"); the newest takes 20.
    fn parse_max_split_size(&mut self, i: usize) -> Result<usize> {
        let (bytes, i) = self.parse_segment_limit(i, "max_split_size_mb")?;
        self.config.max_split_size = bytes;
        Ok(i)
    }

    /// `max_non_split_rounding_mb`: at least `large_segment_size_mb` (20), kept in bytes.
    fn parse_max_non_split_rounding_size(&mut self, i: usize) -> Result<usize> {
        let (bytes, i) = self.parse_segment_limit(i, "max_non_split_rounding_mb")?;
        self.config.max_non_split_rounding_size = bytes;
        Ok(i)
    }

    /// A size in MB that may not be below `large_segment_size_mb`: the value in bytes and the
    /// index of its last token.
    fn parse_segment_limit(&mut self, i: usize, key: &str) -> Result<(usize, usize)> {
        let (mb, i) = self.mb_setting(i, key)?;
        let min_mb = self.config.large_segment_size / MB;
        if mb < min_mb {
            return Err(ConfigError::new(format!(
                "CachingAllocator option {key} too small, must be >= {min_mb}"
            )));
        }
        Ok((mb_to_bytes(mb), i))
    }

    /// `garbage_collection_threshold`: strictly between 0 and 1. Older PyTorch said
    /// "garbage_collect_threshold too small/too big, set it 0.0~1.0".
    fn parse_garbage_collection_threshold(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "garbage_collection_threshold";
        self.expect(i + 1, ":", KEY)?;
        let value = self.read_double(i + 2, KEY)?;
        if !(value > 0.0 && value < 1.0) {
            return Err(ConfigError::new(
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            ));
        }
        self.config.garbage_collection_threshold = value;
        Ok(i + 2)
    }

    /// `roundup_power2_divisions`: one number for every interval, or a list
    /// `[<interval MB>:<divisions>, ..., >:<divisions>]`. In a list the first entry also fills
    /// every lower interval, an interval of `n` MB is entry `log2(n)` (clamped to the last), and
    /// `>` fills every interval after the last one named. Divisions are powers of two, or 0 in a
    /// list. Older PyTorch let `>` overwrite the last named interval as well, and spelt the
    /// message "divisons".
    fn parse_roundup_power2_divisions(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "roundup_power2_divisions";
        self.expect(i + 1, ":", KEY)?;
        let mut i = i + 2;
        if self.tokens.get(i, KEY)? != "[" {
            // The single-number form, kept by PyTorch for backward compatibility.
            let value = self.read_size(i, KEY)?;
            if !value.is_power_of_two() {
                return Err(ConfigError::new(
                    "For roundups, the divisions has to be power of 2 ",
                ));
            }
            self.config.roundup_power2_divisions = [value; K_ROUNDUP_POWER_OF_TWO_INTERVALS];
            return Ok(i);
        }
        let last = K_ROUNDUP_POWER_OF_TWO_INTERVALS - 1;
        let mut first_value = true;
        let mut last_index = 0;
        i += 1;
        while i < self.tokens.len() && self.tokens.0[i] != "]" {
            let interval_at = i;
            self.expect(i + 1, ":", KEY)?;
            i += 2;
            let value = self.read_size(i, KEY)?;
            if value != 0 && !value.is_power_of_two() {
                return Err(ConfigError::new(
                    "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                ));
            }
            let divisions = &mut self.config.roundup_power2_divisions;
            if self.tokens.0[interval_at] == ">" {
                for entry in divisions.iter_mut().skip(last_index + 1) {
                    *entry = value;
                }
            } else {
                let interval = self.read_size(interval_at, KEY)?;
                if !interval.is_power_of_two() {
                    return Err(ConfigError::new(
                        "For roundups, the intervals have to be power of 2 ",
                    ));
                }
                let index = (interval.trailing_zeros() as usize).min(last);
                let divisions = &mut self.config.roundup_power2_divisions;
                if first_value {
                    divisions[..index].fill(value);
                    first_value = false;
                }
                divisions[index] = value;
                last_index = index;
            }
            if !self.tokens.is(i + 1, "]", KEY)? {
                i += 1;
                self.expect(i, ",", KEY)?;
            }
            i += 1;
        }
        if i >= self.tokens.len() {
            return Err(unclosed_list());
        }
        Ok(i)
    }

    /// `expandable_segments:True|False`. Older PyTorch said
    /// "Expected a single True/False argument for expandable_segments".
    fn parse_expandable_segments(&mut self, i: usize) -> Result<usize> {
        let (value, i) = self.bool_setting(i, "expandable_segments")?;
        self.config.expandable_segments = value;
        Ok(i)
    }

    /// `pinned_use_background_threads:True|False` (host memory; checked, not used).
    fn parse_pinned_use_background_threads(&mut self, i: usize) -> Result<usize> {
        Ok(self.bool_setting(i, "pinned_use_background_threads")?.1)
    }

    /// `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`: any size (host memory;
    /// kept for snapshots, not used).
    fn parse_pinned_max_sizes(&mut self, i: usize, key: &str) -> Result<usize> {
        let (mb, i) = self.mb_setting(i, key)?;
        let bytes = Some(mb_to_bytes(mb));
        if key == "pinned_max_round_threshold_mb" {
            self.config.pinned_max_round_threshold = bytes;
        } else {
            self.config.pinned_max_cached_size = bytes;
        }
        Ok(i)
    }

    /// PyTorch 2.15 warns when both pinned limits are given and the rounding threshold is the
    /// larger (in MB, after the clamp to what fits in bytes).
    fn warn_of_pinned_limits(&mut self) {
        if let (Some(round), Some(cached)) = (
            self.config.pinned_max_round_threshold,
            self.config.pinned_max_cached_size,
        ) && round > cached
        {
            self.warn(format!(
                "pinned_max_round_threshold_mb ({}) > pinned_max_cached_size_mb ({}). The cache \
                 size limit takes precedence: allocations above pinned_max_cached_size_mb are \
                 never rounded up.",
                round / MB,
                cached / MB
            ));
        }
    }

    // --- pass 3: the CUDA settings (CUDAAllocatorConfig::parseArgs) -------------------------

    fn cuda_pass(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.tokens.len() {
            let key = self.tokens.0[i].clone();
            i = match key.as_str() {
                "backend" => self.parse_backend(i)?,
                "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                    self.parse_release_lock_on_cudamalloc(i, &key)?
                }
                "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                    self.parse_pinned_use_cuda_host_register(i, &key)?
                }
                "pinned_num_register_threads" => self.parse_pinned_num_register_threads(i)?,
                "pinned_reserve_segment_size_mb" => self.parse_pinned_reserve_segment_size(i)?,
                "graph_capture_record_stream_reuse" => {
                    self.parse_graph_capture_record_stream_reuse(i)?
                }
                "per_process_memory_fraction" => self.parse_per_process_memory_fraction(i)?,
                "pinned_free_catch_all" => self.bool_setting(i, &key)?.1,
                "throw_on_cudamalloc_oom" => self.parse_throw_on_cudamalloc_oom(i)?,
                "expandable_segments_reserve" => self.parse_expandable_segments_reserve(i)?,
                "expandable_segments_reserve_by_class" => {
                    self.parse_expandable_segments_reserve_by_class(i)?
                }
                _ if is_known_key(&key) => self.skip_key(i, &key)?,
                // Pass 2 rejects unknown keys first; this is PyTorch's CUDA-side check.
                _ => {
                    return Err(ConfigError::new(format!(
                        "Unrecognized key '{key}' in CUDA allocator config."
                    )));
                }
            };
            if i + 1 < self.tokens.len() {
                i += 1;
                self.expect(i, ",", &key)?;
            }
            i += 1;
        }
        Ok(())
    }

    /// `backend:native|cudaMallocAsync` (chooses PyTorch's allocator; recorded, not used).
    fn parse_backend(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "backend";
        self.expect(i + 1, ":", KEY)?;
        let i = i + 2;
        self.config.backend = match self.tokens.get(i, KEY)? {
            "native" => Backend::Native,
            "cudaMallocAsync" => Backend::CudaMallocAsync,
            _ => {
                return Err(ConfigError::new(
                    "Unknown allocator backend, options are native and cudaMallocAsync",
                ));
            }
        };
        Ok(i)
    }

    /// `release_lock_on_cudamalloc` (or `_hipmalloc`): `True|False`. Older PyTorch said
    /// "Expected a single True/False argument for release_lock_on_cudamalloc".
    fn parse_release_lock_on_cudamalloc(&mut self, i: usize, key: &str) -> Result<usize> {
        let (value, i) = self.bool_setting(i, key)?;
        self.config.release_lock_on_cudamalloc = value;
        Ok(i)
    }

    /// `pinned_use_cuda_host_register` (or `_hip_`): `True|False`.
    fn parse_pinned_use_cuda_host_register(&mut self, i: usize, key: &str) -> Result<usize> {
        let (value, i) = self.bool_setting(i, key)?;
        self.config.pinned_use_cuda_host_register = value;
        Ok(i)
    }

    /// `pinned_num_register_threads`: a power of two, at most 128.
    fn parse_pinned_num_register_threads(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "pinned_num_register_threads";
        self.expect(i + 1, ":", KEY)?;
        let value = self.read_size(i + 2, KEY)?;
        if !value.is_power_of_two() {
            return Err(ConfigError::new(format!(
                "Number of register threads has to be power of 2, got {value}"
            )));
        }
        if value > PINNED_MAX_REGISTER_THREADS {
            return Err(ConfigError::new(format!(
                "Number of register threads should be less than or equal to \
                 {PINNED_MAX_REGISTER_THREADS}, got {value}"
            )));
        }
        self.config.pinned_num_register_threads = value;
        Ok(i + 2)
    }

    /// `pinned_reserve_segment_size_mb`: more than 0 (host memory; checked, not used).
    fn parse_pinned_reserve_segment_size(&mut self, i: usize) -> Result<usize> {
        let (mb, i) = self.mb_setting(i, "pinned_reserve_segment_size_mb")?;
        if mb == 0 {
            return Err(ConfigError::new(
                "Pinned reserve segment size has to be greater than 0",
            ));
        }
        Ok(i)
    }

    /// `graph_capture_record_stream_reuse`: `True|False`.
    fn parse_graph_capture_record_stream_reuse(&mut self, i: usize) -> Result<usize> {
        let (value, i) = self.bool_setting(i, "graph_capture_record_stream_reuse")?;
        self.config.graph_capture_record_stream_reuse = value;
        Ok(i)
    }

    /// `per_process_memory_fraction`: from 0 to 1, both included.
    fn parse_per_process_memory_fraction(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "per_process_memory_fraction";
        self.expect(i + 1, ":", KEY)?;
        let value = self.read_double(i + 2, KEY)?;
        if !(0.0..=1.0).contains(&value) {
            return Err(ConfigError::new(
                "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
            ));
        }
        self.config.per_process_memory_fraction = Some(value);
        Ok(i + 2)
    }

    /// `throw_on_cudamalloc_oom:True|False` (PyTorch 2.12 and later).
    fn parse_throw_on_cudamalloc_oom(&mut self, i: usize) -> Result<usize> {
        let (value, i) = self.bool_setting(i, "throw_on_cudamalloc_oom")?;
        self.config.throw_on_cudamalloc_oom = value;
        Ok(i)
    }

    /// `expandable_segments_reserve:<fraction>|<n>G` (PyTorch 2.15). PyTorch keeps its default
    /// on a bad value and only warns; a later good value replaces an earlier one.
    fn parse_expandable_segments_reserve(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "expandable_segments_reserve";
        self.expect(i + 1, ":", KEY)?;
        let i = i + 2;
        let word = self.tokens.get(i, KEY)?.to_string();
        if let Some(reserve) = self.parse_reserve_spec(&word) {
            self.config.expandable_segments_reserve = Some(reserve);
        }
        Ok(i)
    }

    /// `expandable_segments_reserve_by_class:[<class>:<reserve>, ...]` (PyTorch 2.15); a bad
    /// entry warns and is left out, the others apply; a later list replaces an earlier one.
    fn parse_expandable_segments_reserve_by_class(&mut self, i: usize) -> Result<usize> {
        const KEY: &str = "expandable_segments_reserve_by_class";
        self.expect(i + 1, ":", KEY)?;
        self.expect(i + 2, "[", KEY)?;
        let mut i = i + 2;
        let mut classes: Vec<(String, ExpandableReserve)> = Vec::new();
        while !self.tokens.is(i + 1, "]", KEY)? {
            let class = self.tokens.get(i + 1, KEY)?.to_string();
            self.expect(i + 2, ":", KEY)?;
            i += 3;
            let word = self.tokens.get(i, KEY)?.to_string();
            if let Some(reserve) = self.parse_reserve_spec(&word) {
                // A class named twice keeps its last reserve (PyTorch's map).
                classes.retain(|(name, _)| *name != class);
                classes.push((class, reserve));
            }
            if self.tokens.is(i + 1, ",", KEY)? {
                i += 1;
            }
        }
        self.config.expandable_segments_reserve_by_class = classes;
        Ok(i + 1)
    }

    /// `parseReserveSpec`: a positive, finite fraction, or a number of GiB ending in `G`/`g`;
    /// anything else warns (PyTorch's words) and gives `None`.
    fn parse_reserve_spec(&mut self, word: &str) -> Option<ExpandableReserve> {
        let (number, gib) = match word.strip_suffix(['G', 'g']) {
            Some(number) => (number, true),
            None => (word, false),
        };
        let value = number
            .parse::<f64>()
            .ok()
            .filter(|value| value.is_finite() && *value > 0.0);
        match value {
            Some(value) if gib => Some(ExpandableReserve::GiB(value)),
            Some(value) => Some(ExpandableReserve::Fraction(value)),
            None => {
                self.warn(format!(
                    "Ignoring invalid expandable-segment reserve value '{word}' in \
                     PYTORCH_CUDA_ALLOC_CONF (expected a positive, finite fraction like 0.5 or \
                     an absolute size like 40G); using default."
                ));
                None
            }
        }
    }
}

fn is_known_key(key: &str) -> bool {
    ACCELERATOR_KEYS.contains(&key) || CUDA_KEYS.contains(&key)
}

fn unclosed_list() -> ConfigError {
    ConfigError::new("Expected closing bracket ']' in ConfigTokenizer but reached end of config")
}

/// MB to bytes, at most the largest whole number of MB that fits (PyTorch's clamp).
fn mb_to_bytes(mb: usize) -> usize {
    mb.min(usize::MAX / MB) * MB
}

// ---------------------------------------------------------------------------------------------
// Descriptions
// ---------------------------------------------------------------------------------------------

fn py_bool(value: bool) -> &'static str {
    if value { "True" } else { "False" }
}

/// `40 MiB`, `2 GiB`, `1536 KiB`, `unlimited`.
fn format_bytes(bytes: usize) -> String {
    const GIB: usize = 1 << 30;
    if bytes >= usize::MAX / MB * MB {
        "unlimited".to_string()
    } else if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else if bytes.is_multiple_of(MB) {
        format!("{} MiB", bytes / MB)
    } else {
        format!("{bytes} bytes")
    }
}

/// An interval's lower bound (`2^index` MiB) as `64M` or `2G`.
fn interval_label(index: usize) -> String {
    if index < 10 {
        format!("{}M", 1usize << index)
    } else {
        format!("{}G", 1usize << (index - 10))
    }
}

/// The divisions as runs of equal values over size ranges: `<128M:8 128M-256M:2 >=2G:1`.
/// Interval `k` holds sizes from `2^k` MiB up to `2^(k+1)` MiB; the first also holds everything
/// smaller and the last everything larger.
fn describe_divisions(divisions: &[usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS]) -> String {
    let last = K_ROUNDUP_POWER_OF_TWO_INTERVALS - 1;
    let mut runs = Vec::new();
    let mut start = 0;
    for index in 0..=last {
        if index < last && divisions[index + 1] == divisions[start] {
            continue;
        }
        let range = match (start, index) {
            (0, end) if end == last => "all sizes".to_string(),
            (0, end) => format!("<{}", interval_label(end + 1)),
            (begin, end) if end == last => format!(">={}", interval_label(begin)),
            (begin, end) => format!("{}-{}", interval_label(begin), interval_label(end + 1)),
        };
        runs.push(format!("{range}:{}", divisions[start]));
        start = index + 1;
    }
    runs.join(" ")
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {

    #[test]
    fn settings_changed_at_run_time_keep_what_pytorch_keeps_and_reset_what_it_resets() {
        let start = Config::parse(
            "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.6,\
             max_non_split_rounding_mb:40,throw_on_cudamalloc_oom:True",
        )
        .unwrap();
        let changed = start
            .with_runtime_settings("expandable_segments:True")
            .unwrap();
        assert!(changed.expandable_segments);
        // Reset at every parse by PyTorch's AcceleratorAllocatorConfig::parseArgs.
        assert_eq!(changed.max_split_size, usize::MAX);
        assert_eq!(changed.roundup_power2_divisions, [0; 16]);
        assert_eq!(changed.garbage_collection_threshold, 0.0);
        assert_eq!(changed.max_non_split_rounding_size, 20 * MB);
        // Kept: a CUDA key not named.
        assert!(changed.throw_on_cudamalloc_oom);
        assert_eq!(
            changed.source,
            Some((
                "PYTORCH_CUDA_ALLOC_CONF".into(),
                "expandable_segments:True".into()
            ))
        );
        let again = changed
            .with_runtime_settings("expandable_segments:False,max_split_size_mb:40")
            .unwrap();
        assert!(!again.expandable_segments);
        assert_eq!(again.max_split_size, 40 * MB);
    }

    /// The settings in effect under PyTorch `version` after `start` from the environment and
    /// `runtime` from `_set_allocator_settings`.
    fn after_runtime_parse(version: &str, start: &str, runtime: &str) -> Config {
        let config = Config::from_vars(vars(&[
            ("PYTORCH_CUDA_ALLOC_CONF", start),
            (PYTORCH_VERSION_VAR, version),
        ]))
        .unwrap();
        config.with_runtime_settings(runtime).unwrap()
    }

    #[test]
    fn every_version_resets_the_same_three_keys_at_each_runtime_parse() {
        for version in [
            "2.4.1", "2.8.0", "2.9.1", "2.12.1", "2.13.0", "2.15.0", "2.16.0a0",
        ] {
            let changed = after_runtime_parse(
                version,
                "max_split_size_mb:64,roundup_power2_divisions:4,\
                 garbage_collection_threshold:0.6,release_lock_on_cudamalloc:True",
                "expandable_segments:True",
            );
            assert_eq!(changed.max_split_size, usize::MAX, "{version}");
            assert_eq!(changed.roundup_power2_divisions, [0; 16], "{version}");
            assert_eq!(changed.garbage_collection_threshold, 0.0, "{version}");
            assert!(changed.release_lock_on_cudamalloc, "{version}: kept");
            assert!(changed.expandable_segments, "{version}");
        }
    }

    #[test]
    fn max_non_split_rounding_is_kept_before_the_large_segment_pass_and_put_back_after() {
        let start = "max_split_size_mb:30,max_non_split_rounding_mb:40";
        for (version, rounding_mb) in [
            ("2.4.1", 40),
            ("2.8.0", 40),
            ("2.10.0", 40),
            ("2.11.0", 20),
            ("2.12.1", 20),
            ("2.13.0", 20),
            ("2.14.1", 20),
            ("2.15.0", 20),
            ("2.16.0a0", 20),
        ] {
            let changed = after_runtime_parse(version, start, "max_split_size_mb:30");
            assert_eq!(
                changed.max_non_split_rounding_size,
                rounding_mb * MB,
                "torch {version}"
            );
            assert_eq!(changed.max_split_size, 30 * MB);
            // Named again, it is taken on every version.
            let named = after_runtime_parse(version, start, "max_non_split_rounding_mb:50");
            assert_eq!(
                named.max_non_split_rounding_size,
                50 * MB,
                "torch {version}"
            );
        }
        // Where the pass exists, the rounding follows a large segment size given in the same
        // text, and one given before.
        let larger = after_runtime_parse("2.15.0", start, "large_segment_size_mb:40");
        assert_eq!(larger.max_non_split_rounding_size, 40 * MB);
        let kept = larger.with_runtime_settings("").unwrap();
        assert_eq!(kept.large_segment_size, 40 * MB);
        assert_eq!(kept.max_non_split_rounding_size, 40 * MB);
    }

    #[test]
    fn without_a_version_the_newest_rules_apply() {
        let config = Config::parse("max_non_split_rounding_mb:40").unwrap();
        assert_eq!(config.pytorch_version, NEWEST_PYTORCH);
        let changed = config.with_runtime_settings("").unwrap();
        assert_eq!(changed.max_non_split_rounding_size, 20 * MB);
        let unreadable = Config::from_vars(vars(&[
            ("PYTORCH_CUDA_ALLOC_CONF", "max_non_split_rounding_mb:40"),
            (PYTORCH_VERSION_VAR, "nightly"),
        ]))
        .unwrap();
        assert_eq!(unreadable.pytorch_version, NEWEST_PYTORCH);
    }

    #[test]
    fn a_refused_runtime_setting_names_pytorchs_reason() {
        let start = Config::parse("max_split_size_mb:64").unwrap();
        let err = start
            .with_runtime_settings("max_split_size_mb:10")
            .unwrap_err();
        assert_eq!(
            err.message,
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
        let err = start
            .with_runtime_settings("expandable_segments:true")
            .unwrap_err();
        assert!(err.message.contains("Expected 'True' or 'False'"), "{err}");
    }

    use super::*;
    use crate::policy::roundup_power2_divisions;
    use std::collections::HashMap;

    const KMB: usize = 1 << 20;

    fn ok(text: &str) -> Config {
        match Config::parse(text) {
            Ok(config) => config,
            Err(e) => panic!("{text:?} was rejected: {e}"),
        }
    }

    fn err(text: &str) -> String {
        match Config::parse(text) {
            Ok(config) => panic!("{text:?} was accepted: {config:?}"),
            Err(e) => e.message,
        }
    }

    fn divisions_at(config: &Config, mb: usize) -> usize {
        roundup_power2_divisions(mb * KMB, &config.roundup_power2_divisions)
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    // --- tokens and empty settings --------------------------------------------------------

    #[test]
    fn tokens_split_on_separators_and_drop_white_space() {
        let tokens = Tokens::new(" max split_size_mb :\t40,\nx:[1:2]");
        assert_eq!(
            tokens.0,
            [
                "maxsplit_size_mb",
                ":",
                "40",
                ",",
                "x",
                ":",
                "[",
                "1",
                ":",
                "2",
                "]"
            ]
        );
    }

    #[test]
    fn empty_or_blank_setting_is_the_defaults() {
        assert_eq!(ok(""), Config::default());
        assert_eq!(ok("  \t "), Config::default());
    }

    #[test]
    fn spaces_anywhere_are_dropped() {
        let c = ok(" max_split_size_mb : 4 0 , expandable_segments : Tr ue ");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert!(c.expandable_segments);
    }

    // --- PyTorch's own test (c10/test/core/AllocatorConfig_test.cpp) -----------------------

    #[test]
    fn pytorch_allocator_config_test_first_setting() {
        let c = ok("max_split_size_mb:40,\
                    max_non_split_rounding_mb:30,\
                    garbage_collection_threshold:0.5,\
                    roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],\
                    expandable_segments:True,\
                    pinned_use_background_threads:True");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(c.max_non_split_rounding_size, 30 * KMB);
        assert_eq!(c.garbage_collection_threshold, 0.5);
        for (mb, expected) in [
            (32, 8),
            (64, 8),
            (128, 2),
            (256, 4),
            (512, 2),
            (1024, 4),
            (2048, 1),
            (4096, 1),
            (8192, 1),
        ] {
            assert_eq!(divisions_at(&c, mb), expected, "{mb} MiB");
        }
        assert!(c.expandable_segments);
        assert_eq!(c.ignored_keys, ["pinned_use_background_threads"]);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn pytorch_allocator_config_test_limits_of_twenty() {
        let c = ok(
            "max_split_size_mb:20,max_non_split_rounding_mb:40,garbage_collection_threshold:0.8",
        );
        assert_eq!(c.max_split_size, 20 * KMB);
        assert_eq!(c.max_non_split_rounding_size, 40 * KMB);
        assert_eq!(c.garbage_collection_threshold, 0.8);
    }

    #[test]
    fn pytorch_allocator_config_test_list_with_gap_and_greater() {
        let c = ok("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
        for (mb, expected) in [
            (64, 8),
            (128, 8),
            (256, 16),
            (512, 1),
            (1024, 0),
            (2048, 8),
            (4096, 2),
        ] {
            assert_eq!(divisions_at(&c, mb), expected, "{mb} MiB");
        }
    }

    #[test]
    fn pytorch_allocator_config_test_single_value_and_trailing_comma() {
        let c = ok("roundup_power2_divisions:4");
        for mb in [64, 256, 2048] {
            assert_eq!(divisions_at(&c, mb), 4);
        }
        assert_eq!(c.roundup_power2_divisions, [4; 16]);
        let c = ok("expandable_segments:False,");
        assert!(!c.expandable_segments);
        assert!(c.warnings.is_empty());
    }

    /// test_cuda.py `test_allocator_settings`: 84 MiB rounds with 8 divisions, 400 MiB with 2.
    #[test]
    fn pytorch_test_cuda_allocator_settings_list() {
        let c = ok("garbage_collection_threshold:0.5,\
                    roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]");
        assert_eq!(divisions_at(&c, 84), 8);
        assert_eq!(divisions_at(&c, 400), 2);
        assert_eq!(
            err("foo:1,bar:2"),
            "Unrecognized key 'foo' in Accelerator allocator config."
        );
        assert_eq!(
            err("garbage_collection_threshold:1.2"),
            "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"
        );
        assert_eq!(
            err("max_split_size_mb:2"),
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
    }

    // --- max_split_size_mb / max_non_split_rounding_mb / large_segment_size_mb -------------

    #[test]
    fn max_split_size_is_kept_in_bytes_and_clamped() {
        assert_eq!(ok("max_split_size_mb:40").max_split_size, 40 * KMB);
        assert_eq!(ok("max_split_size_mb:+40").max_split_size, 40 * KMB);
        let huge = ok("max_split_size_mb:18446744073709551615");
        assert_eq!(huge.max_split_size, usize::MAX / KMB * KMB);
        assert_eq!(
            err("max_split_size_mb:19"),
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
        assert_eq!(
            err("max_split_size_mb:0"),
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
    }

    #[test]
    fn max_non_split_rounding_limits() {
        assert_eq!(
            ok("max_non_split_rounding_mb:20").max_non_split_rounding_size,
            20 * KMB
        );
        assert_eq!(
            err("max_non_split_rounding_mb:19"),
            "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"
        );
    }

    #[test]
    fn large_segment_size_sets_the_other_limits() {
        let c = ok("max_split_size_mb:12,large_segment_size_mb:12");
        assert_eq!(c.large_segment_size, 12 * KMB);
        assert_eq!(c.max_split_size, 12 * KMB);
        // max_non_split_rounding_mb defaults to the large segment size.
        assert_eq!(c.max_non_split_rounding_size, 12 * KMB);
        assert!(c.ignored_keys.is_empty());
        assert_eq!(
            err("large_segment_size_mb:40,max_non_split_rounding_mb:30"),
            "CachingAllocator option max_non_split_rounding_mb too small, must be >= 40"
        );
        assert_eq!(
            err("large_segment_size_mb:10"),
            "CachingAllocator option large_segment_size_mb must be > 10 MB"
        );
        assert_eq!(ok("large_segment_size_mb:11").large_segment_size, 11 * KMB);
    }

    // --- numbers ---------------------------------------------------------------------------

    #[test]
    fn numbers_are_read_like_stoull() {
        assert_eq!(c_stoull("40"), Ok((40, 2)));
        assert_eq!(c_stoull("40MB"), Ok((40, 2)));
        assert_eq!(c_stoull("-1"), Ok((u64::MAX, 2)));
        assert_eq!(c_stoull("-0"), Ok((0, 2)));
        assert_eq!(c_stoull("0x10"), Ok((0, 1)));
        assert_eq!(c_stoull("abc"), Err(NumberError::Invalid));
        assert_eq!(c_stoull("-"), Err(NumberError::Invalid));
        assert_eq!(c_stoull(""), Err(NumberError::Invalid));
        assert_eq!(
            c_stoull("18446744073709551616"),
            Err(NumberError::OutOfRange)
        );
    }

    #[test]
    fn numbers_are_read_like_stod() {
        assert_eq!(c_stod("0.5"), Ok((0.5, 3)));
        assert_eq!(c_stod(".5x"), Ok((0.5, 2)));
        assert_eq!(c_stod("5."), Ok((5.0, 2)));
        assert_eq!(c_stod("1e-1"), Ok((0.1, 4)));
        assert_eq!(c_stod("1e"), Ok((1.0, 1)));
        assert_eq!(c_stod("-2E+1"), Ok((-20.0, 5)));
        assert_eq!(c_stod("InFiNiTy"), Ok((f64::INFINITY, 8)));
        assert_eq!(c_stod("-inf"), Ok((f64::NEG_INFINITY, 4)));
        assert!(c_stod("nan(x1)").is_ok_and(|(v, end)| v.is_nan() && end == 7));
        assert!(c_stod("nan(").is_ok_and(|(v, end)| v.is_nan() && end == 3));
        assert_eq!(c_stod("."), Err(NumberError::Invalid));
        assert_eq!(c_stod("e5"), Err(NumberError::Invalid));
        assert_eq!(c_stod("1e999"), Err(NumberError::OutOfRange));
        assert_eq!(c_stod("1e-400"), Err(NumberError::OutOfRange));
        assert_eq!(c_stod("0e-400"), Ok((0.0, 6)));
    }

    #[test]
    fn a_word_that_is_not_a_number_names_the_key() {
        assert_eq!(
            err("max_split_size_mb:abc"),
            "Invalid value 'abc' for max_split_size_mb: expected an unsigned integer \
             (PyTorch fails with std::invalid_argument: stoull)"
        );
        assert_eq!(
            err("garbage_collection_threshold:half"),
            "Invalid value 'half' for garbage_collection_threshold: expected a number \
             (PyTorch fails with std::invalid_argument: stod)"
        );
        assert_eq!(
            err("max_split_size_mb:99999999999999999999"),
            "Value '99999999999999999999' for max_split_size_mb is out of range \
             (PyTorch fails with std::out_of_range: stoull)"
        );
        assert_eq!(
            err("per_process_memory_fraction:1e999"),
            "Value '1e999' for per_process_memory_fraction is out of range \
             (PyTorch fails with std::out_of_range: stod)"
        );
    }

    #[test]
    fn leading_numbers_and_negative_numbers_are_taken_with_a_warning() {
        let c = ok("max_split_size_mb:40MB");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.warnings,
            [
                "max_split_size_mb: 'MB' after the number in '40MB' is ignored, as PyTorch reads \
              only the leading number"
            ]
        );
        let c = ok("max_split_size_mb:-1");
        assert_eq!(c.max_split_size, usize::MAX / KMB * KMB);
        assert_eq!(
            c.warnings,
            [
                "max_split_size_mb: '-1' is read as 18446744073709551615, as PyTorch's stoull \
              wraps negative numbers"
            ]
        );
    }

    #[test]
    fn a_missing_value_is_out_of_bounds() {
        let message = "Index out of bounds in ConfigTokenizer (the value of max_split_size_mb is \
                       missing or incomplete)";
        assert_eq!(err("max_split_size_mb"), message);
        assert_eq!(err("max_split_size_mb:"), message);
        assert_eq!(
            err("expandable_segments:"),
            "Index out of bounds in ConfigTokenizer (the value of expandable_segments is \
             missing or incomplete)"
        );
    }

    // --- garbage_collection_threshold -------------------------------------------------------

    #[test]
    fn garbage_collection_threshold_is_strictly_between_0_and_1() {
        assert_eq!(
            ok("garbage_collection_threshold:0.25").garbage_collection_threshold,
            0.25
        );
        for bad in ["0", "1", "1.0", "-0.5", "2", "nan", "inf"] {
            assert_eq!(
                err(&format!("garbage_collection_threshold:{bad}")),
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
                "{bad}"
            );
        }
    }

    // --- roundup_power2_divisions -----------------------------------------------------------

    #[test]
    fn roundup_single_value_must_be_a_power_of_two() {
        let message = "For roundups, the divisions has to be power of 2 ";
        assert_eq!(err("roundup_power2_divisions:3"), message);
        assert_eq!(err("roundup_power2_divisions:0"), message);
        assert_eq!(
            ok("roundup_power2_divisions:1").roundup_power2_divisions,
            [1; 16]
        );
    }

    #[test]
    fn roundup_list_rejections() {
        assert_eq!(
            err("roundup_power2_divisions:[64:3]"),
            "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
        );
        assert_eq!(
            err("roundup_power2_divisions:[65:8]"),
            "For roundups, the intervals have to be power of 2 "
        );
        assert_eq!(
            err("roundup_power2_divisions:[0:8]"),
            "For roundups, the intervals have to be power of 2 "
        );
        // The division is checked before the interval.
        assert_eq!(
            err("roundup_power2_divisions:[65:3]"),
            "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
        );
        assert_eq!(
            err("roundup_power2_divisions:[64:8,"),
            "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
        );
        let out_of_bounds = "Index out of bounds in ConfigTokenizer (the value of \
                             roundup_power2_divisions is missing or incomplete)";
        assert_eq!(err("roundup_power2_divisions:[64:8"), out_of_bounds);
        assert_eq!(err("roundup_power2_divisions:[64]"), out_of_bounds);
        assert_eq!(err("roundup_power2_divisions:"), out_of_bounds);
        assert_eq!(
            err("roundup_power2_divisions:[abc:8]"),
            "Invalid value 'abc' for roundup_power2_divisions: expected an unsigned integer \
             (PyTorch fails with std::invalid_argument: stoull)"
        );
    }

    #[test]
    fn roundup_list_semantics() {
        // An empty list changes nothing.
        assert_eq!(
            ok("roundup_power2_divisions:[]").roundup_power2_divisions,
            [0; 16]
        );
        // 0 is allowed in a list; interval 1 MB is entry 0; a huge interval is the last entry.
        let c = ok("roundup_power2_divisions:[1:4,2:0,1048576:16]");
        let mut expected = [0; 16];
        expected[0] = 4;
        expected[15] = 16;
        assert_eq!(c.roundup_power2_divisions, expected);
        // `>` first: last_index is 0, so entry 0 keeps its value (the newest PyTorch).
        let c = ok("roundup_power2_divisions:[>:4]");
        let mut expected = [4; 16];
        expected[0] = 0;
        assert_eq!(c.roundup_power2_divisions, expected);
        // A later setting replaces the whole list.
        let c = ok("roundup_power2_divisions:4,roundup_power2_divisions:[256:2]");
        let mut expected = [2; 16];
        expected[9..].fill(4);
        assert_eq!(c.roundup_power2_divisions, expected);
    }

    // --- booleans ---------------------------------------------------------------------------

    #[test]
    fn booleans_are_exactly_true_or_false() {
        assert!(ok("expandable_segments:True").expandable_segments);
        assert!(!ok("expandable_segments:False").expandable_segments);
        assert_eq!(
            err("expandable_segments:true"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"
        );
        assert_eq!(
            err("max_split_size_mb:40,release_lock_on_cudamalloc:1"),
            "Expected 'True' or 'False' at index 6 in ConfigTokenizer but got '1'"
        );
        for key in [
            "pinned_use_background_threads",
            "release_lock_on_hipmalloc",
            "pinned_use_cuda_host_register",
            "pinned_use_hip_host_register",
            "graph_capture_record_stream_reuse",
            "pinned_free_catch_all",
            "throw_on_cudamalloc_oom",
        ] {
            assert_eq!(
                err(&format!("{key}:yes")),
                "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'",
                "{key}"
            );
            if key != "throw_on_cudamalloc_oom" {
                assert_eq!(ok(&format!("{key}:True")).ignored_keys, [key]);
            }
        }
    }

    #[test]
    fn throw_on_cudamalloc_oom_is_honoured() {
        let c = ok("throw_on_cudamalloc_oom:True");
        assert!(c.throw_on_cudamalloc_oom);
        assert!(c.ignored_keys.is_empty());
        assert!(!ok("throw_on_cudamalloc_oom:False").throw_on_cudamalloc_oom);
        // PyTorch's toBool: `true` is refused (the comment in PyTorch's parser says otherwise).
        assert_eq!(
            err("throw_on_cudamalloc_oom:true"),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"
        );
        assert!(
            ok("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5")
                .describe()
                .contains("past 0.5 of the device is refused at once")
        );
    }

    #[test]
    fn release_lock_is_recorded_and_listed_as_ignored() {
        let c = ok("release_lock_on_cudamalloc:True");
        assert!(c.release_lock_on_cudamalloc);
        assert_eq!(c.ignored_keys, ["release_lock_on_cudamalloc"]);
        assert!(ok("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc);
    }

    // --- CUDA settings ----------------------------------------------------------------------

    #[test]
    fn backend_is_native_or_cuda_malloc_async() {
        assert_eq!(ok("backend:native").backend, Backend::Native);
        let c = ok("backend:cudaMallocAsync");
        assert_eq!(c.backend, Backend::CudaMallocAsync);
        assert_eq!(c.ignored_keys, ["backend"]);
        let message = "Unknown allocator backend, options are native and cudaMallocAsync";
        assert_eq!(err("backend:hipMallocAsync"), message);
        assert_eq!(err("backend:Native"), message);
    }

    #[test]
    fn pinned_register_threads_and_reserve_segment() {
        let c = ok("pinned_num_register_threads:8");
        assert_eq!(c.pinned_num_register_threads, 8);
        assert_eq!(
            ok("pinned_num_register_threads:128").pinned_num_register_threads,
            128
        );
        assert_eq!(
            err("pinned_num_register_threads:3"),
            "Number of register threads has to be power of 2, got 3"
        );
        assert_eq!(
            err("pinned_num_register_threads:0"),
            "Number of register threads has to be power of 2, got 0"
        );
        assert_eq!(
            err("pinned_num_register_threads:256"),
            "Number of register threads should be less than or equal to 128, got 256"
        );
        ok("pinned_reserve_segment_size_mb:64");
        assert_eq!(
            err("pinned_reserve_segment_size_mb:0"),
            "Pinned reserve segment size has to be greater than 0"
        );
        ok("pinned_max_round_threshold_mb:4,pinned_max_cached_size_mb:1024");
    }

    #[test]
    fn per_process_memory_fraction_is_from_0_to_1() {
        assert_eq!(
            ok("per_process_memory_fraction:0.5").per_process_memory_fraction,
            Some(0.5)
        );
        assert_eq!(
            ok("per_process_memory_fraction:0").per_process_memory_fraction,
            Some(0.0)
        );
        assert_eq!(
            ok("per_process_memory_fraction:1").per_process_memory_fraction,
            Some(1.0)
        );
        for bad in ["1.5", "-0.1", "nan"] {
            assert_eq!(
                err(&format!("per_process_memory_fraction:{bad}")),
                "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
            );
        }
        assert!(
            ok("per_process_memory_fraction:0.5")
                .ignored_keys
                .is_empty()
        );
    }

    #[test]
    fn expandable_segments_reserve_warns_on_bad_values() {
        let c = ok("expandable_segments_reserve:0.5,expandable_segments_reserve:40G");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert!(c.ignored_keys.is_empty());
        assert_eq!(
            c.expandable_segments_reserve,
            Some(ExpandableReserve::GiB(40.0))
        );
        assert_eq!(
            ok("expandable_segments_reserve:0.25").expandable_segments_reserve,
            Some(ExpandableReserve::Fraction(0.25))
        );
        // A bad value keeps what was there: the default, or an earlier good value.
        let c = ok("expandable_segments_reserve:0.5,expandable_segments_reserve:abc");
        assert_eq!(
            c.expandable_segments_reserve,
            Some(ExpandableReserve::Fraction(0.5))
        );
        for bad in ["0", "-0.5", "inf", "nan", "G", "1e", "0x10", "1GG"] {
            let c = ok(&format!("expandable_segments_reserve:{bad}"));
            assert_eq!(c.expandable_segments_reserve, None, "{bad}");
            assert_eq!(c.warnings.len(), 1, "{bad}");
        }
        assert_eq!(
            ExpandableReserve::Fraction(0.5).resolve_bytes(1 << 30),
            1 << 29
        );
        assert_eq!(ExpandableReserve::GiB(1.5).resolve_bytes(0), 3 << 29);
        assert_eq!(ExpandableReserve::GiB(1e20).resolve_bytes(0), usize::MAX);
        assert_eq!(
            ExpandableReserve::Fraction(1e-300).resolve_bytes(1 << 30),
            0
        );
        let c = ok("expandable_segments_reserve:-1");
        assert_eq!(
            c.warnings,
            [
                "Ignoring invalid expandable-segment reserve value '-1' in PYTORCH_CUDA_ALLOC_CONF \
              (expected a positive, finite fraction like 0.5 or an absolute size like 40G); \
              using default."
            ]
        );
        let c = ok("expandable_segments_reserve_by_class:[a:0.5,b:8g],max_split_size_mb:40");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.expandable_segments_reserve_by_class,
            [
                ("a".to_string(), ExpandableReserve::Fraction(0.5)),
                ("b".to_string(), ExpandableReserve::GiB(8.0))
            ]
        );
        assert!(c.ignored_keys.is_empty());
        let c = ok("expandable_segments_reserve_by_class:[a:x,b:0.1,b:0.2]");
        assert_eq!(c.warnings.len(), 1);
        assert_eq!(
            c.expandable_segments_reserve_by_class,
            [("b".to_string(), ExpandableReserve::Fraction(0.2))]
        );
        ok("expandable_segments_reserve_by_class:[]");
        // The accelerator pass skips the list first and finds no `]`.
        assert_eq!(
            err("expandable_segments_reserve_by_class:[a:0.5"),
            "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
        );
        // A list that closes too early fails in the CUDA pass.
        assert_eq!(
            err("expandable_segments_reserve_by_class:[a]"),
            "Index out of bounds in ConfigTokenizer (the value of \
             expandable_segments_reserve_by_class is missing or incomplete)"
        );
    }

    // --- keys, order, separators -------------------------------------------------------------

    #[test]
    fn unknown_keys_are_rejected() {
        assert_eq!(
            err("foo:1"),
            "Unrecognized key 'foo' in Accelerator allocator config."
        );
        assert_eq!(
            err("max_split_size_mb:40,,expandable_segments:True"),
            "Unrecognized key ',' in Accelerator allocator config."
        );
        assert_eq!(
            err("Expandable_segments:True"),
            "Unrecognized key 'Expandable_segments' in Accelerator allocator config."
        );
    }

    #[test]
    fn ignored_keys_are_in_order_without_duplicates() {
        let c = ok(
            "pinned_num_register_threads:8,max_split_size_mb:40,backend:native,\
                    pinned_num_register_threads:4,graph_capture_record_stream_reuse:True,\
                    pinned_use_cuda_host_register:True",
        );
        assert_eq!(
            c.ignored_keys,
            [
                "pinned_num_register_threads",
                "backend",
                "graph_capture_record_stream_reuse",
                "pinned_use_cuda_host_register"
            ]
        );
        assert_eq!(c.pinned_num_register_threads, 4);
    }

    #[test]
    fn every_accepted_key_parses() {
        let c = ok(
            "large_segment_size_mb:20,max_split_size_mb:40,max_non_split_rounding_mb:40,\
                    garbage_collection_threshold:0.5,roundup_power2_divisions:[256:2,>:4],\
                    expandable_segments:True,pinned_use_background_threads:True,\
                    pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:64,\
                    backend:native,release_lock_on_cudamalloc:True,\
                    pinned_use_cuda_host_register:True,release_lock_on_hipmalloc:False,\
                    pinned_use_hip_host_register:False,graph_capture_record_stream_reuse:True,\
                    pinned_reserve_segment_size_mb:8,pinned_num_register_threads:8,\
                    per_process_memory_fraction:0.9,pinned_free_catch_all:True,\
                    throw_on_cudamalloc_oom:True,expandable_segments_reserve:0.5,\
                    expandable_segments_reserve_by_class:[x:1G]",
        );
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let expected_ignored: Vec<&str> = ACCELERATOR_KEYS
            .iter()
            .chain(CUDA_KEYS.iter())
            .copied()
            .filter(|k| !HONOURED_KEYS.contains(k))
            .collect();
        let mut ignored = c.ignored_keys.clone();
        ignored.sort();
        let mut expected = expected_ignored.clone();
        expected.sort();
        assert_eq!(ignored, expected);
        assert!(
            !c.release_lock_on_cudamalloc,
            "the later hipmalloc spelling wins"
        );
        assert!(!c.pinned_use_cuda_host_register);
        assert!(c.graph_capture_record_stream_reuse);
    }

    #[test]
    fn accelerator_errors_come_before_cuda_errors() {
        // PyTorch parses the shared settings over the whole string before the CUDA ones.
        assert_eq!(
            err("backend:foo,max_split_size_mb:2"),
            "CachingAllocator option max_split_size_mb too small, must be >= 20"
        );
        // large_segment_size_mb is read before everything else.
        assert_eq!(
            err("max_split_size_mb:2,large_segment_size_mb:1"),
            "CachingAllocator option large_segment_size_mb must be > 10 MB"
        );
    }

    #[test]
    fn wrong_separators_pass_with_a_warning_as_in_pytorch() {
        let c = ok("max_split_size_mb,40");
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.warnings,
            [
                "Expected ':' at index 1 of the allocator settings but got ','; PyTorch reads on \
              as if it were there, and so does ferrocache"
            ]
        );
        let c = ok("max_split_size_mb:40:expandable_segments:True");
        assert!(c.expandable_segments);
        assert_eq!(c.warnings.len(), 1);
        let c = ok("roundup_power2_divisions:[64,8]");
        assert_eq!(divisions_at(&c, 64), 8);
    }

    // --- environment ---------------------------------------------------------------------------

    #[test]
    fn from_vars_follows_pytorch_precedence() {
        let c = Config::from_vars(vars(&[])).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c, Config::default());

        let c = Config::from_vars(vars(&[("PYTORCH_ALLOC_CONF", "max_split_size_mb:40")]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.source,
            Some(("PYTORCH_ALLOC_CONF".into(), "max_split_size_mb:40".into()))
        );

        let c = Config::from_vars(vars(&[
            ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40"),
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, usize::MAX);
        assert_eq!(
            c.source.as_ref().map(|s| s.0.as_str()),
            Some("PYTORCH_CUDA_ALLOC_CONF")
        );
        assert_eq!(
            c.warnings,
            [
                "PYTORCH_ALLOC_CONF is set but not read: PYTORCH_CUDA_ALLOC_CONF takes precedence, \
              as in PyTorch"
            ]
        );

        // Set but empty still wins, and gives the defaults.
        let c = Config::from_vars(vars(&[
            ("PYTORCH_CUDA_ALLOC_CONF", ""),
            ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40"),
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.max_split_size, usize::MAX);
        assert_eq!(
            c.source,
            Some(("PYTORCH_CUDA_ALLOC_CONF".into(), String::new()))
        );

        let c = Config::from_vars(vars(&[
            ("PYTORCH_HIP_ALLOC_CONF", "max_split_size_mb:60"),
            ("PYTORCH_ALLOC_CONF", "max_split_size_mb:40"),
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.max_split_size, 60 * KMB);

        let e = Config::from_vars(vars(&[("PYTORCH_CUDA_ALLOC_CONF", "foo:1")]));
        assert_eq!(
            e.map_err(|e| e.message),
            Err("Unrecognized key 'foo' in Accelerator allocator config.".to_string())
        );
    }

    #[test]
    fn log_level_parses_any_case() {
        for (text, level) in [
            ("OFF", LogLevel::Off),
            ("error", LogLevel::Error),
            ("Warn", LogLevel::Warn),
            ("WARNING", LogLevel::Warn),
            ("info", LogLevel::Info),
            (" DEBUG ", LogLevel::Debug),
            ("trace", LogLevel::Trace),
        ] {
            assert_eq!(LogLevel::parse(text), Ok(level), "{text}");
        }
        assert_eq!(
            LogLevel::parse("loud").map_err(|e| e.message),
            Err(
                "Unknown TORCH_CUDA_ALLOC_LOG_LEVEL value 'loud', expected one of OFF, ERROR, \
                 WARN, INFO, DEBUG, TRACE"
                    .to_string()
            )
        );
        assert_eq!(LogLevel::from_vars(vars(&[])), Ok(LogLevel::Warn));
        assert_eq!(
            LogLevel::from_vars(vars(&[(LOG_LEVEL_VAR, "")])),
            Ok(LogLevel::Warn)
        );
        assert_eq!(
            LogLevel::from_vars(vars(&[(LOG_LEVEL_VAR, "debug")])),
            Ok(LogLevel::Debug)
        );
        assert!(LogLevel::from_vars(vars(&[(LOG_LEVEL_VAR, "x")])).is_err());
        assert_eq!(LogLevel::Info.to_level_filter(), log::LevelFilter::Info);
        assert_eq!(LogLevel::Off.to_string(), "OFF");
    }

    // --- descriptions ------------------------------------------------------------------------

    #[test]
    fn describe_lists_what_differs_from_the_defaults() {
        assert_eq!(
            Config::default().describe(),
            "all allocator settings are PyTorch's defaults"
        );
        let c = ok("max_split_size_mb:40,garbage_collection_threshold:0.5,\
                    roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],\
                    expandable_segments:True,backend:cudaMallocAsync,\
                    per_process_memory_fraction:0.5,pinned_num_register_threads:8");
        let text = c.describe();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        assert_eq!(
            lines[0],
            "max_split_size: 40 MiB (cached blocks this large or larger are never split)"
        );
        assert_eq!(
            lines[2],
            "roundup_power2_divisions: <128M:8 128M-256M:2 256M-512M:4 512M-1G:2 1G-2G:4 >=2G:1"
        );
        assert_eq!(lines[3], "expandable_segments: True");
        assert!(lines[5].starts_with("backend: cudaMallocAsync"));
        assert_eq!(
            ok("roundup_power2_divisions:4").describe(),
            "roundup_power2_divisions: all sizes:4"
        );
        assert!(ok("max_split_size_mb:2048").describe().contains("2 GiB"));
    }

    #[test]
    fn pytorch_settings_match_the_snapshot_format() {
        let v = Config::default().to_pytorch_settings();
        assert_eq!(v["PYTORCH_CUDA_ALLOC_CONF"], "");
        assert_eq!(v["max_split_size"], -1);
        assert_eq!(v["garbage_collection_threshold"], 0.0);
        assert_eq!(v["expandable_segments"], false);
        assert_eq!(v["pinned_num_register_threads"], 1);
        assert_eq!(v["release_lock_on_cudamalloc"], false);
        assert_eq!(v["pinned_use_cuda_host_register"], false);
        assert_eq!(v["graph_capture_record_stream_reuse"], false);
        assert_eq!(v["max_round_threshold"], -1);
        assert_eq!(v["max_cached_size"], -1);
        // Both pinned limits given, the rounding threshold larger: PyTorch 2.15's warning, the
        // clamped MB in it and the clamped bytes in the snapshot.
        let c = ok("pinned_max_cached_size_mb:0,pinned_max_round_threshold_mb:100000000000000");
        assert_eq!(
            c.warnings,
            [
                "pinned_max_round_threshold_mb (17592186044415) > pinned_max_cached_size_mb (0). \
                 The cache size limit takes precedence: allocations above \
                 pinned_max_cached_size_mb are never rounded up."
            ]
        );
        let v = c.to_pytorch_settings();
        assert_eq!(v["max_cached_size"], 0);
        assert_eq!(v["max_round_threshold"], -1_048_576);
        assert!(ok("pinned_max_cached_size_mb:0").warnings.is_empty());
        assert!(
            ok("pinned_max_cached_size_mb:64,pinned_max_round_threshold_mb:64")
                .warnings
                .is_empty()
        );
        let divisions = v["roundup_power2_divisions"]
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {v}"));
        assert_eq!(divisions.len(), 16);
        assert_eq!(divisions["1"], 0);
        assert_eq!(divisions["32768"], 0);

        let text = "max_split_size_mb:40,roundup_power2_divisions:[64:8,>:2],\
                    expandable_segments:True";
        let c = Config::from_vars(vars(&[("PYTORCH_ALLOC_CONF", text)]))
            .unwrap_or_else(|e| panic!("{e}"));
        let v = c.to_pytorch_settings();
        assert_eq!(v["PYTORCH_CUDA_ALLOC_CONF"], text);
        assert_eq!(v["max_split_size"], 40 * 1024 * 1024);
        assert_eq!(v["expandable_segments"], true);
        assert_eq!(v["roundup_power2_divisions"]["64"], 8);
        assert_eq!(v["roundup_power2_divisions"]["1"], 8);
        assert_eq!(v["roundup_power2_divisions"]["128"], 2);
    }

    // --- no panics ------------------------------------------------------------------------------

    /// Feeds many malformed settings built from PyTorch's own words and separators (and some
    /// noise); every one must give a value or an error, never a panic or a hang.
    #[test]
    fn malformed_settings_never_panic() {
        const PIECES: [&str; 32] = [
            ",",
            ":",
            "[",
            "]",
            ">",
            " ",
            "True",
            "False",
            "true",
            "0",
            "1",
            "2",
            "20",
            "64",
            "-1",
            "0.5",
            "1e999",
            "nan",
            "abc",
            "é",
            "\u{0}",
            "40MB",
            "18446744073709551616",
            "max_split_size_mb",
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "expandable_segments",
            "backend",
            "large_segment_size_mb",
            "expandable_segments_reserve_by_class",
            "per_process_memory_fraction",
            "pinned_num_register_threads",
        ];
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for _ in 0..20_000 {
            let len = (next() % 12) as usize;
            let text: String = (0..len)
                .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
                .collect();
            if let Ok(config) = Config::parse(&text) {
                accepted += 1;
                let _ = config.describe();
                let _ = config.to_pytorch_settings();
            }
        }
        assert!(accepted > 0);
        for text in [
            "[",
            "]",
            ":",
            ",",
            "[[[",
            "]]]",
            ":::",
            ",,,",
            "roundup_power2_divisions:[",
            "roundup_power2_divisions:[>",
            "roundup_power2_divisions:[>:",
            "roundup_power2_divisions:[>:1",
            "roundup_power2_divisions:[:]",
            "expandable_segments_reserve_by_class:",
            "expandable_segments_reserve_by_class:[",
            "expandable_segments_reserve_by_class:[a",
            "expandable_segments_reserve_by_class:[a:",
            "backend",
            "backend:",
            "max_split_size_mb:18446744073709551615",
            "max_non_split_rounding_mb:-1",
            "large_segment_size_mb:-1",
        ] {
            let _ = Config::parse(text);
        }
    }
}
