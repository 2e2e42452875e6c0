//! What the settings say in words: the lines of `ferrocache check-config` and of the INFO
//! start-up log, and the `allocator_settings` of PyTorch's snapshots.

use super::modelled::K_ROUNDUP_POWER_OF_TWO_INTERVALS;
use super::opt_in::{CROSS_STREAM_VAR, EXPANDABLE_IGNORE_MAX_SPLIT_VAR};
use super::{Config, MB};
use serde_json::{Map, Value, json};

impl Config {
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
        if self.opt_in.cross_stream {
            lines.push(format!(
                "cross-stream reuse: on ({CROSS_STREAM_VAR}; a stream's miss may take another \
                 stream's cached block after one device-side event wait)"
            ));
        }
        if self.opt_in.expandable_ignore_max_split {
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
            .provenance
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::{ok, vars};

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
            c.provenance.warnings,
            [
                "pinned_max_round_threshold_mb (17592186044415) > pinned_max_cached_size_mb (0). \
                 The cache size limit takes precedence: allocations above \
                 pinned_max_cached_size_mb are never rounded up."
            ]
        );
        let v = c.to_pytorch_settings();
        assert_eq!(v["max_cached_size"], 0);
        assert_eq!(v["max_round_threshold"], -1_048_576);
        assert!(
            ok("pinned_max_cached_size_mb:0")
                .provenance
                .warnings
                .is_empty()
        );
        assert!(
            ok("pinned_max_cached_size_mb:64,pinned_max_round_threshold_mb:64")
                .provenance
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
}
