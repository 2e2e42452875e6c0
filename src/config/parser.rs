//! The parser: PyTorch's three passes over the tokens, one function per PyTorch rule
//! (`AcceleratorAllocatorConfig::parseArgs`, `CUDAAllocatorConfig::parseArgs`).

#[cfg(doc)]
use super::modelled::ModelledPyTorch;
use super::modelled::{AfterLargeSegmentPass, K_MIN_LARGE_ALLOC, K_ROUNDUP_POWER_OF_TWO_INTERVALS};
use super::numbers::{NumberError, c_stod, c_stoull};
use super::tokens::Tokens;
use super::{
    ACCELERATOR_KEYS, ALLOC_CONF_VARS, Backend, CUDA_KEYS, Config, ConfigError, ExpandableReserve,
    HONOURED_KEYS, MB, PINNED_MAX_REGISTER_THREADS, Result,
};

impl Config {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` value. An empty value gives the defaults.
    /// [`Provenance::source`](super::Provenance::source) stays `None`; [`Config::from_vars`]
    /// fills it in.
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
    /// its value, except those the PyTorch in use resets at each parse
    /// ([`ModelledPyTorch::after_large_segment_pass`] says which). ferrocache's own settings
    /// and the PyTorch being modelled stay.
    /// [`Provenance::source`](super::Provenance::source) becomes `text`, as PyTorch's
    /// `last_allocator_settings` does.
    ///
    /// A refused `text` changes nothing: PyTorch keeps what it parsed before the bad key
    /// (and the resets), ferrocache keeps every setting as it was.
    pub fn with_runtime_settings(&self, text: &str) -> Result<Config> {
        let mut start = self.clone();
        let after_large_segment_pass = reset_before_each_parse(&mut start);
        start.provenance.warnings.clear();
        let mut parser = Parser {
            tokens: Tokens::new(text),
            config: start,
        };
        parser.large_segment_pass(after_large_segment_pass)?;
        parser.accelerator_pass()?;
        parser.cuda_pass()?;
        let mut config = parser.config;
        let variable = self
            .provenance
            .source
            .as_ref()
            .map_or(ALLOC_CONF_VARS[0], |(name, _)| name.as_str());
        config.provenance.source = Some((variable.to_string(), text.to_string()));
        Ok(config)
    }
}

/// What PyTorch's `setAllocatorSettings` does to the settings in effect before it reads a
/// run-time text, for the PyTorch being modelled
/// ([`ModelledPyTorch::after_large_segment_pass`] gives the rule of each version): every
/// version from 2.4 on puts `max_split_size_mb`, `roundup_power2_divisions` and
/// `garbage_collection_threshold` back to their defaults. Returns what follows the
/// large-segment pass.
fn reset_before_each_parse(config: &mut Config) -> AfterLargeSegmentPass {
    let default = Config::default();
    config.max_split_size = default.max_split_size;
    config.roundup_power2_divisions = default.roundup_power2_divisions;
    config.garbage_collection_threshold = default.garbage_collection_threshold;
    config.modelled.after_large_segment_pass()
}

struct Parser {
    tokens: Tokens,
    config: Config,
}

impl Parser {
    fn warn(&mut self, message: String) {
        self.config.provenance.warn(message);
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
                self.config.provenance.ignore_key(key.clone());
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

#[cfg(test)]
mod tests;
