//! The `ferrocache` command: `replay` PyTorch memory snapshots (or a built-in demo) through
//! ferrocache on a simulated GPU under several settings, `tune` (search the settings on them and
//! say what to set), `check-config` a `PYTORCH_CUDA_ALLOC_CONF` value, and write a recording's
//! `ops` as JSON (for the oracle). `--job` reads the snapshots as the ranks of one job
//! (`replay::job`).
//!
//! The program lives here, in the library, so that there is one of it: the `ferrocache` binary
//! (`src/bin/ferrocache.rs`, which cargo runs and the wheel ships) calls it through the C
//! function `ferrocache_cli_main` of `libferrocache.so`. [`run`] never exits the process: it
//! returns the exit status.
//!
//! Exit codes: 0 success; 1 a trace or the plot file could not be read or written (the other
//! traces are still replayed); 2 a usage error or a setting PyTorch would reject.

use crate::config::{self, Config};
use crate::replay::Workload;
use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `println!` that ignores a closed stdout (`ferrocache replay ... | head`) instead of panicking.
macro_rules! say {
    () => {{
        let _ = writeln!(std::io::stdout().lock());
    }};
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that ignores a closed stderr.
macro_rules! complain {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

// After the macros, which the rooms use.
mod job;
mod launcher;
mod replay;
mod rows;
mod table;
mod tune;

use launcher::{RunArgs, run_command};
use replay::{ReplayArgs, replay_command};
use tune::{TuneArgs, tune_command};

#[derive(Parser)]
#[command(
    name = "ferrocache",
    version,
    about = "PyTorch's CUDA caching allocator in Rust: replay memory snapshots, tune the \
             settings on them, check settings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run COMMAND with ferrocache as PyTorch's CUDA allocator in every Python process of it
    /// (torchrun's ranks, python -m, console scripts, multiprocessing), without changing its
    /// code; each process that used CUDA reports its memory on stderr when it exits.
    Run(RunArgs),
    /// Replay PyTorch memory snapshots (or the built-in demo) through ferrocache on a simulated
    /// GPU, one row per trace and configuration, beside PyTorch's own figures.
    Replay(ReplayArgs),
    /// Search the PYTORCH_CUDA_ALLOC_CONF settings on recorded snapshots with the replay engine
    /// and say which to set: the lowest peak reserved with no out-of-memory.
    Tune(TuneArgs),
    /// Say whether PyTorch and ferrocache accept a PYTORCH_CUDA_ALLOC_CONF value, and what it
    /// means.
    CheckConfig {
        /// The value, e.g. "expandable_segments:True,max_split_size_mb:128".
        conf: String,
    },
    /// Write the program a recording replays as, one JSON document per line and device: the
    /// allocations live when recording began (in address order), then every alloc, free,
    /// empty_cache and out-of-memory of the trace. The oracle drives it through PyTorch.
    Ops {
        /// Snapshots from torch.cuda.memory._dump_snapshot() (pickle) or the same data as JSON.
        #[arg(value_name = "TRACE", required = true)]
        traces: Vec<PathBuf>,
    },
}

fn parse_capacity(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib > 0.0 && gib <= 1.0e6 => Ok(gib),
        _ => Err(format!(
            "expected a number of GiB above 0 (at most 1000000), got {text:?}"
        )),
    }
}

/// How a row with cross-stream reuse names its setting.
const CROSS_STREAM_SUFFIX: &str = "+FERROCACHE_CROSS_STREAM=1";
const GIB: f64 = (1u64 << 30) as f64;

/// The exit status of success.
pub const SUCCESS: u8 = 0;
/// The exit status when a trace or the plot could not be read or written.
pub const FILE_ERROR: u8 = 1;
/// The exit status of a usage error or a setting PyTorch rejects (clap's, for usage errors).
pub const USAGE_ERROR: u8 = 2;

/// Runs the command line `args` (the program name first) and returns its exit status. Help,
/// version and usage errors are printed as clap prints them; nothing here exits the process.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => {
            // --help and --version come this way too, to stdout and with status 0.
            let _ = err.print();
            return u8::try_from(err.exit_code()).unwrap_or(USAGE_ERROR);
        }
    };
    match cli.command {
        Command::Run(args) => run_command(&args),
        Command::Replay(args) => replay_command(&args),
        Command::Tune(args) => tune_command(&args),
        Command::CheckConfig { conf } => check_config(&conf),
        Command::Ops { traces } => ops_command(&traces),
    }
}

fn ops_command(traces: &[PathBuf]) -> u8 {
    let mut status = SUCCESS;
    for path in traces {
        let snapshot = match crate::replay::load(path) {
            Ok(snapshot) => snapshot,
            Err(err) => {
                complain!("error: {err}");
                status = FILE_ERROR;
                continue;
            }
        };
        let workload = Workload::reconstruct(&snapshot, config::tie_rule_from_env());
        for device in &workload.devices {
            let program = crate::replay::program::program_json(&path.display().to_string(), device);
            say!("{program}");
        }
    }
    status
}

fn check_config(conf: &str) -> u8 {
    match Config::parse(conf) {
        Ok(config) => {
            say!("accepted: PyTorch and ferrocache both accept {conf:?}");
            for line in config.describe().lines() {
                say!("  {line}");
            }
            if !config.provenance.ignored_keys.is_empty() {
                say!(
                    "  ignored by ferrocache (PyTorch reads them; they change nothing here): {}",
                    config.provenance.ignored_keys.join(", ")
                );
            }
            for warning in &config.provenance.warnings {
                say!("warning: {warning}");
            }
            SUCCESS
        }
        Err(err) => {
            complain!("error: PyTorch rejects {conf:?}: {err}");
            USAGE_ERROR
        }
    }
}

/// A parsed `--conf` and its name.
#[derive(Clone)]
struct Setting {
    raw: String,
    config: Config,
}

/// Reads a snapshot, or says on stderr why it cannot (one line naming the file) and notes the
/// failure.
fn load_or_complain(path: &Path, failed: &mut bool) -> Option<crate::replay::Snapshot> {
    crate::replay::load(path)
        .inspect_err(|err| {
            complain!("error: {err}");
            *failed = true;
        })
        .ok()
}

/// Parses every `--conf`; a rejected one ends the command with PyTorch's message and code 2.
fn parse_settings(confs: &[String]) -> Result<Vec<Setting>, u8> {
    confs
        .iter()
        .map(|raw| match Config::parse(raw) {
            Ok(config) => Ok(Setting {
                raw: raw.clone(),
                config: Config {
                    modelled: config::ModelledPyTorch {
                        tie_rule: config::tie_rule_from_env(),
                        ..config.modelled
                    },
                    ..config
                },
            }),
            Err(err) => {
                complain!("error: --conf {raw:?}: PyTorch rejects it: {err}");
                Err(USAGE_ERROR)
            }
        })
        .collect()
}

fn conf_name(conf: &str) -> String {
    if conf.is_empty() {
        "PyTorch defaults".to_string()
    } else {
        conf.to_string()
    }
}

fn percent(ratio: f64) -> String {
    format!("{:.1}%", 100.0 * ratio)
}

fn ratio_of(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}
