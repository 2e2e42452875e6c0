//! Where the settings come from: the variables PyTorch reads them from, in PyTorch's order of
//! precedence, ferrocache's own variables, and what the reading found ([`Provenance`]).

use super::{Config, ModelledPyTorch, OptIns, Result};
use crate::config::modelled::TieRule;
use crate::env;

pub use crate::env::ALLOC_CONF_VARS;

/// The PyTorch version ferrocache decides like (`2.12`, `2.12.1+cu128`, ...): set by
/// `ferrocache.install()` from `torch.__version__`; unset, PyTorch 2.15's rules.
pub const PYTORCH_VERSION_VAR: &str = env::PYTORCH_VERSION.name;

/// Where the settings came from, and what reading them found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Provenance {
    /// The raw setting and the variable it came from, when one was set.
    pub source: Option<(String, String)>,
    /// Keys PyTorch accepts that change nothing in ferrocache (pinned memory, ...), in order.
    pub ignored_keys: Vec<String>,
    /// Things PyTorch lets pass that look like mistakes (a `,` where a `:` belongs, `40MB`, a
    /// variable hidden by another), one sentence each, no duplicates; for the caller to log.
    pub warnings: Vec<String>,
}

impl Provenance {
    /// Adds a warning, unless it is there already.
    pub fn warn(&mut self, message: String) {
        push_unique(&mut self.warnings, message);
    }

    /// Adds a key to [`Provenance::ignored_keys`], unless it is there already.
    pub(crate) fn ignore_key(&mut self, key: String) {
        push_unique(&mut self.ignored_keys, key);
    }
}

fn push_unique(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

impl Config {
    /// Reads the settings from the process environment; see [`Config::from_vars`].
    pub fn from_env() -> Result<Config> {
        Config::from_vars(env::lookup)
    }

    /// Reads the settings through `lookup` (a variable's value, or `None` when it is not set):
    /// the first of [`ALLOC_CONF_VARS`] that is set is parsed and recorded in
    /// [`Provenance::source`]; none set gives the defaults. ferrocache's opt-ins
    /// ([`OptIns::from_vars`]) and the PyTorch being modelled (`FERROCACHE_PYTORCH_VERSION`)
    /// come from their own variables.
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut config = Config::from_alloc_conf_vars(&lookup)?;
        config.opt_in = OptIns::from_vars(&lookup, &mut config.provenance);
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
                config.provenance.warn(format!(
                    "{other} is set but not read: {name} takes precedence, as in PyTorch"
                ));
            }
        }
        config.provenance.source = Some((name.to_string(), value));
        Ok(config)
    }
}

/// Reads `FERROCACHE_PYTORCH_VERSION`: the rules that changed between PyTorch versions follow
/// it; a value that is not a version is ignored with a warning.
fn apply_pytorch_version_var(config: &mut Config, value: Option<String>) {
    let Some(value) = value else { return };
    match ModelledPyTorch::of_version_text(&value) {
        Some(modelled) => config.modelled = modelled,
        None => config.provenance.warn(format!(
            "{PYTORCH_VERSION_VAR}={value:?} is not a PyTorch version (expected e.g. 2.15.0); \
             PyTorch 2.15's rules apply"
        )),
    }
}

/// The variable the settings are read from (the first of [`ALLOC_CONF_VARS`] that is set), to
/// name it in an error.
pub fn alloc_conf_variable_in_env() -> &'static str {
    selected_alloc_conf(env::lookup).map_or(ALLOC_CONF_VARS[0], |(name, _)| name)
}

/// `FERROCACHE_SLEEP` on: every segment is made so that it can sleep from the start, so that a
/// sleep with no tag gives back all memory. Without it, only memory allocated after the first
/// tag was set (a `region`) can sleep.
pub fn sleep_ability_from_env() -> bool {
    env::flag_is_on(&env::SLEEP)
}

/// The tie rule `FERROCACHE_PYTORCH_VERSION` asks for (PyTorch 2.15's when it is unset or not
/// a version): what the replayer and `tune` judge a recording by, as the library does.
pub fn tie_rule_from_env() -> TieRule {
    let mut config = Config::default();
    apply_pytorch_version_var(&mut config, env::lookup(PYTORCH_VERSION_VAR));
    config.modelled.tie_rule
}

/// The first of [`ALLOC_CONF_VARS`] that is set, with its value: the variable PyTorch parses.
pub fn selected_alloc_conf(
    lookup: impl Fn(&str) -> Option<String>,
) -> Option<(&'static str, String)> {
    ALLOC_CONF_VARS
        .iter()
        .find_map(|name| lookup(name).map(|value| (*name, value)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::{KMB, vars};

    #[test]
    fn from_vars_follows_pytorch_precedence() {
        let c = Config::from_vars(vars(&[])).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c, Config::default());

        let c = Config::from_vars(vars(&[("PYTORCH_ALLOC_CONF", "max_split_size_mb:40")]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.max_split_size, 40 * KMB);
        assert_eq!(
            c.provenance.source,
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
            c.provenance.source.as_ref().map(|s| s.0.as_str()),
            Some("PYTORCH_CUDA_ALLOC_CONF")
        );
        assert_eq!(
            c.provenance.warnings,
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
            c.provenance.source,
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
}
