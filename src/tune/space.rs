//! The settings `ferrocache tune` tries, chosen from the recording itself.
//!
//! Every candidate is a `PYTORCH_CUDA_ALLOC_CONF` value, written with the keys in one order,
//! plus ferrocache's own `FERROCACHE_CROSS_STREAM=1` where the recording uses several streams.
//! Each value is read back with [`Config::parse`] (PyTorch's rules and words): a value PyTorch
//! would reject is never tried, so never recommended.
//!
//! The dimensions ([`SearchSpace::of`]):
//! - `expandable_segments:True` or not;
//! - `max_split_size_mb` over a grid from the recording's own large requests
//!   ([`max_split_grid`]), each alone and with two `max_non_split_rounding_mb` values, with
//!   and without expandable segments (ferrocache applies it inside them as PyTorch does; the
//!   opt-in exemption `FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT` is not searched);
//! - `roundup_power2_divisions`: 2, 4, 8, 16, and three per-range lists;
//! - with a capacity given, `garbage_collection_threshold` 0.5, 0.7 and 0.9, each with
//!   `per_process_memory_fraction:1` (PyTorch collects garbage only under a memory fraction, and
//!   a fraction of 1 caps nothing);
//! - `FERROCACHE_CROSS_STREAM=1`, when the recording uses more than one stream;
//! - every combination of these.
//!
//! The list is ordered by the number of keys, simplest first, so that a search cut short (the
//! out-of-memory advice bounds its work) keeps the plain settings.

use crate::config::Config;
use crate::replay::{DeviceWorkload, Op};
use std::collections::{BTreeMap, BTreeSet};

const MIB: u64 = 1 << 20;
/// PyTorch's lower limit of `max_split_size_mb` and `max_non_split_rounding_mb` (the default
/// `large_segment_size_mb`).
const SEGMENT_LIMIT_MIB: u64 = 20;
/// At most this many `max_split_size_mb` values.
const MAX_SPLIT_VALUES: usize = 6;
/// The values people try by hand (blog posts, PyTorch's docs), kept where the recording has
/// requests that large.
const CLASSIC_MAX_SPLIT_MIB: [u64; 6] = [64, 128, 256, 512, 1024, 2048];
/// `max_non_split_rounding_mb` beside a `max_split_size_mb` (the default is 20).
const NON_SPLIT_ROUNDING_MIB: [u64; 2] = [64, 256];
/// `roundup_power2_divisions` as one number (1 rounds nothing, like the default).
const ROUNDUP_NUMBERS: [u32; 4] = [2, 4, 8, 16];
/// `roundup_power2_divisions` as per-range lists: PyTorch's documented example (coarser as
/// sizes grow), fine steps for small blocks and none for large ones, and none below 256 MiB
/// with quarter steps above.
pub const ROUNDUP_LISTS: [&str; 3] = [
    "[256:1,512:2,1024:4,>:8]",
    "[64:8,256:4,1024:2,>:1]",
    "[128:0,>:4]",
];
/// `garbage_collection_threshold` values, tried when a capacity is given.
const GC_THRESHOLDS: [&str; 3] = ["0.5", "0.7", "0.9"];

/// One setting to try.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The `PYTORCH_CUDA_ALLOC_CONF` value ("" for PyTorch's defaults).
    pub conf: String,
    /// `FERROCACHE_CROSS_STREAM=1` too.
    pub cross_stream: bool,
    /// The value as read by [`Config::parse`], with [`Config::cross_stream`] set.
    pub config: Config,
}

impl Candidate {
    /// `conf` read with PyTorch's rules, or PyTorch's message when it would reject it.
    pub fn new(conf: &str, cross_stream: bool) -> Result<Candidate, String> {
        let mut config = Config::parse(conf).map_err(|err| err.message)?;
        config.opt_in.cross_stream = cross_stream;
        Ok(Candidate {
            conf: conf.to_string(),
            cross_stream,
            config,
        })
    }

    /// PyTorch's defaults.
    pub fn defaults() -> Candidate {
        Candidate {
            conf: String::new(),
            cross_stream: false,
            config: Config::default(),
        }
    }

    /// The `FERROCACHE_*` variables to set with the conf (the opt-ins its config has on).
    pub fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        if self.config.opt_in.cross_stream {
            env.insert(crate::config::CROSS_STREAM_VAR.to_string(), "1".to_string());
        }
        if self.config.opt_in.expandable_ignore_max_split {
            env.insert(
                crate::config::EXPANDABLE_IGNORE_MAX_SPLIT_VAR.to_string(),
                "1".to_string(),
            );
        }
        env
    }

    /// Keys of the conf plus the `FERROCACHE_*` variables: the last tie-break (fewer is simpler).
    pub fn keys(&self) -> usize {
        let keys = if self.conf.trim().is_empty() {
            0
        } else {
            // Per-range lists hold commas of their own.
            let mut depth = 0i32;
            let mut count = 1;
            for c in self.conf.chars() {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    ',' if depth == 0 => count += 1,
                    _ => {}
                }
            }
            count
        };
        keys + self.env().len()
    }

    /// How a table names it: the conf (or "PyTorch defaults"), `+FERROCACHE_CROSS_STREAM=1`.
    pub fn label(&self) -> String {
        let conf = if self.conf.is_empty() {
            "PyTorch defaults"
        } else {
            &self.conf
        };
        let mut label = conf.to_string();
        for (name, value) in self.env() {
            label.push_str(&format!(" +{name}={value}"));
        }
        label
    }

    /// Whether two candidates make the same decisions (the same conf text aside).
    pub fn same_setting(&self, other: &Candidate) -> bool {
        same_policy(&self.config, &other.config)
    }
}

/// Whether two settings make the same allocator decisions (the fields ferrocache acts on that a
/// user sets). The tie rule is not a setting but the PyTorch being modelled, the same for every
/// setting of one search or replay ([`TuneOptions::tie_rule`](super::TuneOptions::tie_rule)),
/// so it is left out: a setting read from a snapshot is the same setting under any rule.
pub fn same_policy(a: &Config, b: &Config) -> bool {
    a.opt_in == b.opt_in
        && a.max_split_size == b.max_split_size
        && a.max_non_split_rounding_size == b.max_non_split_rounding_size
        && a.garbage_collection_threshold == b.garbage_collection_threshold
        && a.roundup_power2_divisions == b.roundup_power2_divisions
        && a.expandable_segments == b.expandable_segments
        && a.per_process_memory_fraction == b.per_process_memory_fraction
        && a.large_segment_size == b.large_segment_size
}

/// What the recordings say about the space worth searching.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SearchSpace {
    /// `max_split_size_mb` values, ascending.
    pub max_split_mib: Vec<u64>,
    /// Whether any recording uses more than one stream.
    pub several_streams: bool,
    /// Whether garbage collection (under a memory fraction) is tried: only with a capacity.
    pub garbage_collection: bool,
}

impl SearchSpace {
    /// The space for these recordings; `capacity_given` turns on the garbage-collection
    /// dimension.
    pub fn of(workloads: &[&DeviceWorkload], capacity_given: bool) -> SearchSpace {
        let mut sizes: Vec<u64> = Vec::new();
        let mut streams: BTreeSet<u64> = BTreeSet::new();
        for workload in workloads {
            for allocation in &workload.start_allocations {
                sizes.push(allocation.requested_size);
                streams.insert(allocation.stream);
            }
            for op in &workload.ops {
                if let Op::Alloc { size, stream, .. } = *op {
                    sizes.push(size);
                    streams.insert(stream);
                }
            }
        }
        SearchSpace {
            max_split_mib: max_split_grid(&mut sizes),
            several_streams: streams.len() > 1,
            garbage_collection: capacity_given,
        }
    }

    /// Every candidate, simplest first (fewest keys), each accepted by PyTorch's rules. The
    /// defaults come first.
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut splits: Vec<Vec<String>> = vec![Vec::new()];
        for &mib in &self.max_split_mib {
            splits.push(vec![format!("max_split_size_mb:{mib}")]);
            for rounding in NON_SPLIT_ROUNDING_MIB {
                splits.push(vec![
                    format!("max_split_size_mb:{mib}"),
                    format!("max_non_split_rounding_mb:{rounding}"),
                ]);
            }
        }
        let mut roundups: Vec<Option<String>> = vec![None];
        roundups.extend(
            ROUNDUP_NUMBERS
                .iter()
                .map(|n| Some(format!("roundup_power2_divisions:{n}"))),
        );
        roundups.extend(
            ROUNDUP_LISTS
                .iter()
                .map(|l| Some(format!("roundup_power2_divisions:{l}"))),
        );
        let mut collections: Vec<Vec<String>> = vec![Vec::new()];
        if self.garbage_collection {
            collections.extend(GC_THRESHOLDS.iter().map(|t| {
                vec![
                    format!("garbage_collection_threshold:{t}"),
                    "per_process_memory_fraction:1".to_string(),
                ]
            }));
        }
        let cross: &[bool] = if self.several_streams {
            &[false, true]
        } else {
            &[false]
        };

        let mut out: Vec<(usize, Candidate)> = Vec::new();
        for expandable in [false, true] {
            for split in &splits {
                for roundup in &roundups {
                    for collection in &collections {
                        for &cross_stream in cross {
                            let mut keys: Vec<String> = Vec::new();
                            if expandable {
                                keys.push("expandable_segments:True".to_string());
                            }
                            keys.extend(split.iter().cloned());
                            keys.extend(roundup.iter().cloned());
                            keys.extend(collection.iter().cloned());
                            let conf = keys.join(",");
                            // Every value here is one PyTorch accepts; a test holds it to that.
                            if let Ok(candidate) = Candidate::new(&conf, cross_stream) {
                                out.push((candidate.keys(), candidate));
                            }
                        }
                    }
                }
            }
        }
        // Stable: within a number of keys, the order of the loops above.
        out.sort_by_key(|(keys, _)| *keys);
        out.into_iter().map(|(_, c)| c).collect()
    }
}

/// `max_split_size_mb` values worth trying: blocks this large or larger are never split, so a
/// value matters only where requests reach it. From the recording's requests of more than
/// 20 MiB (`sizes` is sorted in place): the median and the 90th percentile of their sizes (in
/// whole MiB, rounded down: those requests and larger become unsplittable), and the values
/// people try by hand, kept below the largest request; at most six, spread over the range.
pub fn max_split_grid(sizes: &mut [u64]) -> Vec<u64> {
    let mut large: Vec<u64> = sizes
        .iter()
        .copied()
        .filter(|&s| s > SEGMENT_LIMIT_MIB * MIB)
        .collect();
    if large.is_empty() {
        return Vec::new();
    }
    large.sort_unstable();
    let largest_mib = large[large.len() - 1] / MIB;
    let quantile = |q: f64| large[((large.len() - 1) as f64 * q).round() as usize] / MIB;
    let mut values: BTreeSet<u64> = [quantile(0.5), quantile(0.9)].into_iter().collect();
    values.extend(CLASSIC_MAX_SPLIT_MIB.iter().copied());
    let values: Vec<u64> = values
        .into_iter()
        .filter(|&mib| mib >= SEGMENT_LIMIT_MIB && mib <= largest_mib)
        .collect();
    if values.len() <= MAX_SPLIT_VALUES {
        return values;
    }
    // Evenly spread over the sorted values, the smallest and the largest kept.
    let last = values.len() - 1;
    let picked: BTreeSet<u64> = (0..MAX_SPLIT_VALUES)
        .map(|i| values[(i * last + (MAX_SPLIT_VALUES - 1) / 2) / (MAX_SPLIT_VALUES - 1)])
        .collect();
    picked.into_iter().collect()
}

/// `config` written as a `PYTORCH_CUDA_ALLOC_CONF` value: the keys ferrocache acts on that
/// differ from PyTorch's defaults, in one order. `Config::parse` of it makes the same
/// decisions (a test holds it to that).
pub fn conf_of(config: &Config) -> String {
    const MB: usize = 1 << 20;
    let default = Config::default();
    let mut keys: Vec<String> = Vec::new();
    if config.large_segment_size != default.large_segment_size {
        keys.push(format!(
            "large_segment_size_mb:{}",
            config.large_segment_size / MB
        ));
    }
    if config.expandable_segments {
        keys.push("expandable_segments:True".to_string());
    }
    if config.max_split_size != default.max_split_size {
        keys.push(format!("max_split_size_mb:{}", config.max_split_size / MB));
    }
    if config.max_non_split_rounding_size != default.max_non_split_rounding_size {
        keys.push(format!(
            "max_non_split_rounding_mb:{}",
            config.max_non_split_rounding_size / MB
        ));
    }
    let divisions = &config.roundup_power2_divisions;
    if *divisions != default.roundup_power2_divisions {
        if divisions.iter().all(|&d| d == divisions[0]) && divisions[0].is_power_of_two() {
            keys.push(format!("roundup_power2_divisions:{}", divisions[0]));
        } else {
            let entries: Vec<String> = divisions
                .iter()
                .enumerate()
                .map(|(index, d)| format!("{}:{d}", 1u64 << index))
                .collect();
            keys.push(format!("roundup_power2_divisions:[{}]", entries.join(",")));
        }
    }
    if config.garbage_collection_threshold > 0.0 {
        keys.push(format!(
            "garbage_collection_threshold:{}",
            config.garbage_collection_threshold
        ));
    }
    if let Some(fraction) = config.per_process_memory_fraction {
        keys.push(format!("per_process_memory_fraction:{fraction}"));
    }
    keys.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_candidate_is_accepted_by_pytorchs_rules_and_unique() {
        let space = SearchSpace {
            max_split_mib: vec![21, 128, 300, 1024, 4000, 9000],
            several_streams: true,
            garbage_collection: true,
        };
        let candidates = space.candidates();
        // (1 + 6 * 3) splits * 2 expandable * 8 roundings * 4 collections * 2 streams.
        assert_eq!(candidates.len(), 19 * 2 * 8 * 4 * 2);
        for c in &candidates {
            Config::parse(&c.conf).unwrap_or_else(|e| panic!("{:?}: {}", c.conf, e.message));
        }
        assert_eq!(candidates[0], Candidate::defaults());
        let mut seen = std::collections::HashSet::new();
        for c in &candidates {
            assert!(seen.insert((c.conf.clone(), c.cross_stream)), "{c:?} twice");
        }
        let keys: Vec<usize> = candidates.iter().map(Candidate::keys).collect();
        assert!(keys.windows(2).all(|w| w[0] <= w[1]), "simplest first");
        // No two candidates make the same decisions.
        for (i, a) in candidates.iter().enumerate() {
            for b in &candidates[i + 1..] {
                assert!(!a.same_setting(b), "{} and {}", a.label(), b.label());
            }
        }
    }

    #[test]
    fn one_stream_and_no_capacity_leave_those_dimensions_out() {
        let space = SearchSpace::default();
        let candidates = space.candidates();
        assert_eq!(candidates.len(), 2 * 8);
        assert!(candidates.iter().all(|c| !c.cross_stream));
        assert!(
            candidates
                .iter()
                .all(|c| !c.conf.contains("garbage_collection"))
        );
    }

    #[test]
    fn keys_count_lists_as_one_and_the_environment_too() {
        let c = Candidate::new(
            "expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:8]",
            true,
        )
        .unwrap();
        assert_eq!(c.keys(), 3);
        assert_eq!(Candidate::defaults().keys(), 0);
        assert_eq!(
            c.label(),
            "expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:8] \
             +FERROCACHE_CROSS_STREAM=1"
        );
        assert_eq!(
            c.env()
                .get(crate::env::CROSS_STREAM.name)
                .map(String::as_str),
            Some("1")
        );
    }

    #[test]
    fn the_max_split_grid_comes_from_the_large_requests() {
        assert!(max_split_grid(&mut [MIB, 10 * MIB, 20 * MIB]).is_empty());
        let mut sizes: Vec<u64> = (0..100).map(|i| (30 + i) * MIB).collect();
        // 30..129 MiB: the median (index 49.5, rounded up) is 80, the 90th percentile 119, and
        // the classic 64 and 128 are at most the largest (129).
        assert_eq!(max_split_grid(&mut sizes), vec![64, 80, 119, 128]);
        let mut huge: Vec<u64> = (1..=50).map(|i| i * 200 * MIB).collect();
        let grid = max_split_grid(&mut huge);
        assert_eq!(grid.len(), MAX_SPLIT_VALUES);
        assert_eq!(grid.first(), Some(&64));
        assert_eq!(grid.last(), Some(&9000));
    }
}
