//! ferrocache's own opt-ins: improvements that change decisions, each turned on by a
//! `FERROCACHE_*` variable of [`crate::env::TABLE`], never by a key of
//! `PYTORCH_CUDA_ALLOC_CONF` (PyTorch reads that variable too and rejects keys it does not know).

use super::Provenance;
use crate::env;

/// ferrocache's own variable for cross-stream reuse ([`OptIns::cross_stream`]).
pub const CROSS_STREAM_VAR: &str = env::CROSS_STREAM.name;

/// ferrocache's own variable naming where a snapshot is written at the first out-of-memory
/// (read by the Python package, `python/ferrocache/oom.py`; `ferrocache run --snapshot-on-oom`
/// sets it).
pub const SNAPSHOT_ON_OOM_VAR: &str = env::SNAPSHOT_ON_OOM.name;

/// ferrocache's own variable that exempts blocks of expandable segments from
/// `max_split_size_mb` ([`OptIns::expandable_ignore_max_split`]).
pub const EXPANDABLE_IGNORE_MAX_SPLIT_VAR: &str = env::EXPANDABLE_IGNORE_MAX_SPLIT.name;

/// ferrocache's own opt-ins, all off by default (PyTorch's behaviour).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OptIns {
    /// `FERROCACHE_CROSS_STREAM`: a request that misses its stream's cache may take a block
    /// cached on another stream, after a device-side wait (see `allocator::cross_stream`).
    pub cross_stream: bool,
    /// `FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT`: `max_split_size_mb` does not apply to blocks
    /// inside expandable segments, which always split anyway. PyTorch applies it and then maps
    /// new pages beside a free block it refused, so reserved memory can grow without bound
    /// (pytorch#123548).
    pub expandable_ignore_max_split: bool,
}

impl OptIns {
    /// Reads the opt-ins through `lookup` (a variable's value, or `None` when it is not set);
    /// a value that is not on/off leaves its opt-in off, with a warning in `provenance`.
    pub fn from_vars(
        lookup: &impl Fn(&str) -> Option<String>,
        provenance: &mut Provenance,
    ) -> Self {
        OptIns {
            cross_stream: flag_var(
                provenance,
                CROSS_STREAM_VAR,
                lookup(CROSS_STREAM_VAR),
                "cross-stream reuse",
            ),
            expandable_ignore_max_split: flag_var(
                provenance,
                EXPANDABLE_IGNORE_MAX_SPLIT_VAR,
                lookup(EXPANDABLE_IGNORE_MAX_SPLIT_VAR),
                "the exemption of expandable segments from max_split_size_mb",
            ),
        }
    }
}

/// Reads one of ferrocache's on/off variables ([`env::parse_flag`]); anything not understood
/// leaves it off with a warning that names `what` (bad input never stops the allocator).
fn flag_var(provenance: &mut Provenance, name: &str, value: Option<String>, what: &str) -> bool {
    let Some(value) = value else { return false };
    match env::parse_flag(&value) {
        Some(on) => on,
        None => {
            provenance.warn(format!(
                "{name}={value:?} is not understood (expected 1 or 0); {what} stays off"
            ));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(name: &str, value: &str) -> (OptIns, Provenance) {
        let mut provenance = Provenance::default();
        let lookup = |asked: &str| (asked == name).then(|| value.to_string());
        (OptIns::from_vars(&lookup, &mut provenance), provenance)
    }

    #[test]
    fn each_opt_in_is_off_unless_its_variable_says_on() {
        assert_eq!(read("OTHER", "1").0, OptIns::default());
        let (opt_in, _) = read(CROSS_STREAM_VAR, "yes");
        assert!(opt_in.cross_stream && !opt_in.expandable_ignore_max_split);
        let (opt_in, _) = read(EXPANDABLE_IGNORE_MAX_SPLIT_VAR, "On");
        assert!(opt_in.expandable_ignore_max_split && !opt_in.cross_stream);
        assert!(!read(CROSS_STREAM_VAR, "0").0.cross_stream);
    }

    #[test]
    fn a_value_that_is_not_on_or_off_leaves_the_opt_in_off_with_a_warning() {
        let (opt_in, provenance) = read(CROSS_STREAM_VAR, "maybe");
        assert!(!opt_in.cross_stream);
        assert_eq!(
            provenance.warnings,
            [format!(
                "{CROSS_STREAM_VAR}=\"maybe\" is not understood (expected 1 or 0); cross-stream \
                 reuse stays off"
            )]
        );
    }
}
