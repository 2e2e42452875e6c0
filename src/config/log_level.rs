//! `TORCH_CUDA_ALLOC_LOG_LEVEL`: ferrocache's log level.

use super::{ConfigError, Result};
use crate::env;
use std::fmt;

/// The variable that sets ferrocache's log level.
pub const LOG_LEVEL_VAR: &str = env::LOG_LEVEL.name;

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
        LogLevel::from_vars(env::lookup)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::vars;

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
}
