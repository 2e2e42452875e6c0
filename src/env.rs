//! The environment variables ferrocache reads or sets, in one table ([`TABLE`]), and the one
//! place in the crate that reads the process environment ([`lookup`], [`flag_is_on`]).
//!
//! Every name is spelt here once; the rest of the crate takes it from a [`Variable`] constant.
//! The Python package keeps the same table in `python/ferrocache/_env.py`, and
//! `tests/env_table.rs` checks that the two agree ([`table_json`] is what it compares).
//!
//! On/off variables read the same everywhere ([`parse_flag`]): `1`, `true`, `yes`, `on` turn a
//! setting on, in any case and with white space around; `0`, `false`, `no`, `off` and the empty
//! string leave it off; anything else leaves it off (the library warns where it can).

#![forbid(unsafe_code)]

use serde::Serialize;
use std::ffi::OsString;
use std::path::PathBuf;

/// How a variable's value is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Parsing {
    /// On or off, as [`parse_flag`] reads it.
    Flag,
    /// PyTorch's allocator settings, read as the newest PyTorch reads them
    /// (`config::Config::parse`); PyTorch reads the variable too.
    AllocConf,
    /// A log level: `OFF`, `ERROR`, `WARN`, `INFO`, `DEBUG`, `TRACE`, in any case
    /// (`config::LogLevel::parse`).
    LogLevel,
    /// A PyTorch version such as `2.12.1+cu128`, of which `major.minor` counts; anything else
    /// is ignored with a warning.
    PytorchVersion,
    /// A whole number; anything else counts as unset.
    Number,
    /// A file or a folder.
    Path,
    /// A file in which `{rank}`, `{local_rank}` and `{pid}` are replaced.
    RankPath,
    /// Folders separated by `:`.
    PathList,
}

/// Which part of ferrocache reads a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reader {
    /// The library (this crate), in every process that loads it.
    Library,
    /// The Python package (`python/ferrocache`).
    Package,
    /// Both.
    LibraryAndPackage,
}

/// One environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Variable {
    pub name: &'static str,
    /// What it does, in one sentence.
    pub meaning: &'static str,
    pub parsing: Parsing,
    pub read_by: Reader,
    /// The `ferrocache run` option that sets it in the command's environment, when one does.
    pub run_option: Option<&'static str>,
}

/// `PYTORCH_CUDA_ALLOC_CONF`: PyTorch's allocator settings, the first of [`ALLOC_CONF_VARS`].
pub const ALLOC_CONF: Variable = Variable {
    name: "PYTORCH_CUDA_ALLOC_CONF",
    meaning: "PyTorch's allocator settings (max_split_size_mb, expandable_segments, ...), read \
              as PyTorch reads them; the first of the three that is set is used",
    parsing: Parsing::AllocConf,
    read_by: Reader::LibraryAndPackage,
    run_option: Some("--conf"),
};

/// `PYTORCH_HIP_ALLOC_CONF`: read when `PYTORCH_CUDA_ALLOC_CONF` is not set.
pub const HIP_ALLOC_CONF: Variable = Variable {
    name: "PYTORCH_HIP_ALLOC_CONF",
    meaning: "PyTorch's allocator settings when PYTORCH_CUDA_ALLOC_CONF is not set",
    parsing: Parsing::AllocConf,
    read_by: Reader::LibraryAndPackage,
    run_option: None,
};

/// `PYTORCH_ALLOC_CONF`: read when neither of the two before it is set.
pub const ANY_ALLOC_CONF: Variable = Variable {
    name: "PYTORCH_ALLOC_CONF",
    meaning: "PyTorch's allocator settings when neither PYTORCH_CUDA_ALLOC_CONF nor \
              PYTORCH_HIP_ALLOC_CONF is set",
    parsing: Parsing::AllocConf,
    read_by: Reader::LibraryAndPackage,
    run_option: None,
};

/// The variables that hold the allocator settings, in the order PyTorch reads them: the first
/// one that is set (even to an empty string) is used and the others are not read.
///
/// The newest PyTorch (`AcceleratorAllocatorConfig::instance` and
/// `CUDAAllocatorConfig::instance`) reads `PYTORCH_CUDA_ALLOC_CONF` first, "to keep the parsing
/// order stable". A short-lived version read `PYTORCH_ALLOC_CONF` first and warned that
/// `PYTORCH_CUDA_ALLOC_CONF` was deprecated; that was reverted. `PYTORCH_HIP_ALLOC_CONF` is read
/// by the accelerator parser on every build.
pub const ALLOC_CONF_VARS: [&str; 3] = [ALLOC_CONF.name, HIP_ALLOC_CONF.name, ANY_ALLOC_CONF.name];

/// `TORCH_CUDA_ALLOC_LOG_LEVEL`: ferrocache's log level.
pub const LOG_LEVEL: Variable = Variable {
    name: "TORCH_CUDA_ALLOC_LOG_LEVEL",
    meaning: "ferrocache's log level on stderr: OFF, ERROR, WARN (the default), INFO, DEBUG, \
              TRACE",
    parsing: Parsing::LogLevel,
    read_by: Reader::LibraryAndPackage,
    run_option: Some("--log-level"),
};

/// `TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC`: PyTorch's switch for creating expandable segments'
/// physical memory shareable as POSIX file descriptors (on unless `0`), which CUDA IPC of such
/// memory needs; some containers' drivers refuse that handle type.
pub const EXPANDABLE_SEGMENTS_IPC: Variable = Variable {
    name: "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC",
    meaning: "0 creates expandable and sleep-able segments' physical memory without a shareable \
              handle type (no CUDA IPC of it), as PyTorch's; on by default where the device \
              supports POSIX file descriptors",
    parsing: Parsing::Flag,
    read_by: Reader::Library,
    run_option: None,
};

/// Whether physical memory is created shareable: [`EXPANDABLE_SEGMENTS_IPC`] unset or on.
pub fn expandable_segments_ipc_enabled() -> bool {
    lookup(EXPANDABLE_SEGMENTS_IPC.name)
        .and_then(|value| parse_flag(&value))
        .unwrap_or(true)
}

/// `FERROCACHE_CROSS_STREAM`: cross-stream reuse (ferrocache's opt-in).
pub const CROSS_STREAM: Variable = Variable {
    name: "FERROCACHE_CROSS_STREAM",
    meaning: "cross-stream reuse: a request that misses its stream's cache may take a block \
              cached on another stream, after a device-side wait",
    parsing: Parsing::Flag,
    read_by: Reader::Library,
    run_option: Some("--cross-stream"),
};

/// `FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT`: `max_split_size_mb` does not apply inside
/// expandable segments (ferrocache's opt-in).
pub const EXPANDABLE_IGNORE_MAX_SPLIT: Variable = Variable {
    name: "FERROCACHE_EXPANDABLE_IGNORE_MAX_SPLIT",
    meaning: "max_split_size_mb does not apply to blocks of expandable segments, which always \
              split (pytorch#123548)",
    parsing: Parsing::Flag,
    read_by: Reader::Library,
    run_option: None,
};

/// `FERROCACHE_PYTORCH_VERSION`: the PyTorch whose rules ferrocache follows where they changed
/// between versions.
pub const PYTORCH_VERSION: Variable = Variable {
    name: "FERROCACHE_PYTORCH_VERSION",
    meaning: "the PyTorch ferrocache decides like where its rules changed between versions (tie \
              rule, out-of-memory wording, run-time settings); install() sets it from \
              torch.__version__; unset, PyTorch 2.15's",
    parsing: Parsing::PytorchVersion,
    read_by: Reader::LibraryAndPackage,
    run_option: None,
};

/// `FERROCACHE_SLEEP`: every segment is made so that it can sleep.
pub const SLEEP: Variable = Variable {
    name: "FERROCACHE_SLEEP",
    meaning: "every segment is made so that it can sleep from the start, so that sleep() with \
              no tag gives back all memory; without it, only memory allocated after the first \
              region() can",
    parsing: Parsing::Flag,
    read_by: Reader::Library,
    run_option: None,
};

/// `FERROCACHE_SNAPSHOT_ON_OOM`: where a snapshot is written at the first out-of-memory.
pub const SNAPSHOT_ON_OOM: Variable = Variable {
    name: "FERROCACHE_SNAPSHOT_ON_OOM",
    meaning: "record the allocation history and write a snapshot to this file at the first \
              out-of-memory",
    parsing: Parsing::RankPath,
    read_by: Reader::Package,
    run_option: Some("--snapshot-on-oom"),
};

/// `FERROCACHE_LIBRARY`: the `libferrocache.so` the Python package loads.
pub const LIBRARY: Variable = Variable {
    name: "FERROCACHE_LIBRARY",
    meaning: "the libferrocache.so the Python package loads; ferrocache run sets it to its own \
              library when it is not set",
    parsing: Parsing::Path,
    read_by: Reader::Package,
    run_option: None,
};

/// `FERROCACHE_OOM_SHIM`: a prebuilt out-of-memory shim.
pub const OOM_SHIM: Variable = Variable {
    name: "FERROCACHE_OOM_SHIM",
    meaning: "a prebuilt shim that raises torch.OutOfMemoryError, loaded instead of building one",
    parsing: Parsing::Path,
    read_by: Reader::Package,
    run_option: None,
};

/// `FERROCACHE_CACHE_DIR`: where built shims are kept.
pub const CACHE_DIR: Variable = Variable {
    name: "FERROCACHE_CACHE_DIR",
    meaning: "where built shims are kept (default $XDG_CACHE_HOME/ferrocache or \
              ~/.cache/ferrocache)",
    parsing: Parsing::Path,
    read_by: Reader::Package,
    run_option: None,
};

/// `FERROCACHE_FRONTEND`: off keeps PyTorch's `CUDAPluggableAllocator` instead of ferrocache's
/// own allocator object (python/ferrocache/frontend.cpp); on by default.
pub const FRONTEND: Variable = Variable {
    name: "FERROCACHE_FRONTEND",
    meaning: "off (0, false, no): install PyTorch's CUDAPluggableAllocator instead of ferrocache's \
              own allocator object for PyTorch (on by default)",
    parsing: Parsing::Flag,
    read_by: Reader::Package,
    run_option: None,
};

/// `FERROCACHE_CUDA_INCLUDE`: CUDA's runtime headers for building the front end.
pub const CUDA_INCLUDE: Variable = Variable {
    name: "FERROCACHE_CUDA_INCLUDE",
    meaning: "a folder with CUDA's cuda_runtime.h (and crt/), searched first when the front end \
              is built",
    parsing: Parsing::Path,
    read_by: Reader::Package,
    run_option: None,
};

/// `FERROCACHE_RUN_REPORT`: `ferrocache run`'s report at each process's exit.
pub const RUN_REPORT: Variable = Variable {
    name: "FERROCACHE_RUN_REPORT",
    meaning: "ferrocache run: each process prints its report at exit (on unless set to off)",
    parsing: Parsing::Flag,
    read_by: Reader::Package,
    run_option: Some("--quiet"),
};

/// `FERROCACHE_RUN_RECORD`: keep the history and advise at exit.
pub const RUN_RECORD: Variable = Variable {
    name: "FERROCACHE_RUN_RECORD",
    meaning: "ferrocache run: keep the allocation history, so that the report advises a setting",
    parsing: Parsing::Flag,
    read_by: Reader::Package,
    run_option: Some("--record"),
};

/// `FERROCACHE_RUN_REPORT_JSON`: each process's report as JSON too.
pub const RUN_REPORT_JSON: Variable = Variable {
    name: "FERROCACHE_RUN_REPORT_JSON",
    meaning: "ferrocache run: each process also writes its report as JSON to this file",
    parsing: Parsing::RankPath,
    read_by: Reader::Package,
    run_option: Some("--report"),
};

/// `FERROCACHE_RUN_DIR`: the launcher's folder for the processes' JSON reports.
pub const RUN_DIR: Variable = Variable {
    name: "FERROCACHE_RUN_DIR",
    meaning: "ferrocache run: the launcher's folder, where every process leaves its JSON report \
              for the job's rows",
    parsing: Parsing::Path,
    read_by: Reader::Package,
    run_option: Some("(always)"),
};

/// `WORLD_SIZE`: the number of processes of a distributed job (`torchrun` sets it).
pub const WORLD_SIZE: Variable = Variable {
    name: "WORLD_SIZE",
    meaning: "torchrun: the number of processes of the job; above 1, log lines start with \
              [rankN]:",
    parsing: Parsing::Number,
    read_by: Reader::LibraryAndPackage,
    run_option: None,
};

/// `RANK`: this process's rank in the job (`torchrun` sets it).
pub const RANK: Variable = Variable {
    name: "RANK",
    meaning: "torchrun: this process's rank in the job (log lines, per-rank file names)",
    parsing: Parsing::Number,
    read_by: Reader::LibraryAndPackage,
    run_option: None,
};

/// `LOCAL_RANK`: this process's rank on its machine (`torchrun` sets it).
pub const LOCAL_RANK: Variable = Variable {
    name: "LOCAL_RANK",
    meaning: "torchrun: this process's rank on its machine (per-rank file names)",
    parsing: Parsing::Number,
    read_by: Reader::Package,
    run_option: None,
};

/// `PYTHONPATH`: `ferrocache run` puts the package's startup hook first on it.
pub const PYTHONPATH: Variable = Variable {
    name: "PYTHONPATH",
    meaning: "ferrocache run puts the package's startup hook (_startup/) first, before the \
              environment's own entries",
    parsing: Parsing::PathList,
    read_by: Reader::Package,
    run_option: Some("(always)"),
};

/// Every variable ferrocache reads or sets, PyTorch's first, then ferrocache's own, then those
/// of `ferrocache run`, then `torchrun`'s and Python's.
pub const TABLE: [Variable; 23] = [
    ALLOC_CONF,
    HIP_ALLOC_CONF,
    ANY_ALLOC_CONF,
    LOG_LEVEL,
    EXPANDABLE_SEGMENTS_IPC,
    CROSS_STREAM,
    EXPANDABLE_IGNORE_MAX_SPLIT,
    PYTORCH_VERSION,
    SLEEP,
    SNAPSHOT_ON_OOM,
    LIBRARY,
    OOM_SHIM,
    CACHE_DIR,
    FRONTEND,
    CUDA_INCLUDE,
    RUN_REPORT,
    RUN_RECORD,
    RUN_REPORT_JSON,
    RUN_DIR,
    WORLD_SIZE,
    RANK,
    LOCAL_RANK,
    PYTHONPATH,
];

/// The table as JSON: a list of `{name, meaning, parsing, read_by, run_option}`.
pub fn table_json() -> serde_json::Value {
    serde_json::to_value(TABLE).unwrap_or_default()
}

/// A variable's value, or `None` when it is not set; a value that is not UTF-8 is read lossily.
pub fn lookup(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}

/// A variable's value as the operating system holds it (for passing on to a child).
pub fn lookup_os(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// The folder for temporary files (`TMPDIR`, else `/tmp`).
pub fn temp_dir() -> PathBuf {
    std::env::temp_dir()
}

/// An on/off value: `Some(true)` for `1`/`true`/`yes`/`on`, `Some(false)` for `0`/`false`/
/// `no`/`off`/empty (any case, white space around ignored), `None` for anything else.
pub fn parse_flag(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Whether an on/off variable is on in the process environment; unset or not understood is off.
pub fn flag_is_on(variable: &Variable) -> bool {
    debug_assert_eq!(variable.parsing, Parsing::Flag, "{}", variable.name);
    lookup(variable.name)
        .and_then(|value| parse_flag(&value))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_spelling_reads_the_same() {
        for on in ["1", "true", "TRUE", "yes", "On", " on "] {
            assert_eq!(parse_flag(on), Some(true), "{on:?}");
        }
        for off in ["", "0", "false", "No", "OFF", " 0 "] {
            assert_eq!(parse_flag(off), Some(false), "{off:?}");
        }
        for unknown in ["2", "enabled", "y"] {
            assert_eq!(parse_flag(unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn each_name_is_in_the_table_once() {
        let mut names: Vec<&str> = TABLE.iter().map(|v| v.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), TABLE.len());
    }

    #[test]
    fn the_json_table_has_one_object_per_variable() {
        let json = table_json();
        let rows = json.as_array().expect("a list");
        assert_eq!(rows.len(), TABLE.len());
        assert_eq!(rows[5]["name"], "FERROCACHE_CROSS_STREAM");
        assert_eq!(rows[5]["parsing"], "flag");
        assert_eq!(rows[5]["read_by"], "library");
        assert_eq!(rows[5]["run_option"], "--cross-stream");
        assert_eq!(rows[1]["run_option"], serde_json::Value::Null);
    }
}
