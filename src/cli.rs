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
use crate::replay::{
    self, DeviceWorkload, JobSummary, NativeFigures, PlotPanel, PlotSeries, ReplayOptions,
    ReplayReport, StartState, Workload, demo, demo_fsdp, faithful, faithful::Reproduction,
};
use crate::tune::report::{bytes, grouped, wrap};
use crate::tune::{self, Subject, TuneOptions, same_policy, short_trace};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use std::collections::BTreeSet;
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

#[derive(Args)]
struct ReplayArgs {
    /// Snapshots from torch.cuda.memory._dump_snapshot() (pickle) or the same data as JSON.
    #[arg(value_name = "TRACE")]
    traces: Vec<PathBuf>,
    /// Replay a built-in transformer training loop (with no --conf: four settings compared).
    #[arg(long)]
    demo: bool,
    /// A PYTORCH_CUDA_ALLOC_CONF value to replay under; repeat to compare several ("" is
    /// PyTorch's defaults, the default).
    #[arg(long = "conf", value_name = "CONF")]
    confs: Vec<String>,
    /// Replay with cross-stream reuse on (FERROCACHE_CROSS_STREAM=1): a stream's miss may take
    /// another stream's cached block after a device-side event wait. Applies to every --conf.
    #[arg(long)]
    cross_stream: bool,
    /// Start from an empty GPU (allocations live at the start made first, in address order)
    /// instead of the segments and blocks PyTorch held when recording began.
    #[arg(long)]
    fresh: bool,
    /// One JSON object per row, one per line, instead of the table.
    #[arg(long)]
    json: bool,
    /// Draw reserved and requested bytes over the events into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Memory of the simulated GPU, in GiB.
    #[arg(long, value_name = "N", default_value_t = 80.0, value_parser = parse_capacity)]
    capacity_gib: f64,
    /// The snapshots are the ranks of one job (torchrun): a row per rank, then the job's row
    /// (the worst rank, the spread, the sum). The rank comes from each file's name
    /// (snapshot_rank3.pickle, rank3/snapshot.pickle, snapshot-3.pickle).
    #[arg(long)]
    job: bool,
    /// A recording that ends in an out-of-memory (no allocation after its last one) replays
    /// the request that failed as an allocation, as tune does.
    #[arg(long)]
    serve_final_oom: bool,
}

#[derive(Args)]
struct TuneArgs {
    /// Snapshots from torch.cuda.memory._dump_snapshot() (pickle) or the same data as JSON;
    /// several get one setting, judged by the worst of them.
    #[arg(value_name = "TRACE")]
    traces: Vec<PathBuf>,
    /// Memory of the simulated GPU, in GiB (default: the recording's GPU where its
    /// out-of-memory entries tell, else 80). Also tries garbage_collection_threshold.
    #[arg(long, value_name = "N", value_parser = parse_capacity)]
    capacity_gib: Option<f64>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Draw reserved and requested bytes over the events under PyTorch's defaults, the
    /// recording's setting and the recommendation into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// The snapshots are the ranks of one job: the setting that minimizes the worst rank, ties
    /// broken by the sum over ranks. Ranks come from the file names, as for replay --job.
    #[arg(long)]
    job: bool,
    /// Start every replay from an empty GPU instead of the reconstructed start (as replay
    /// --fresh).
    #[arg(long)]
    fresh: bool,
    /// Candidates shown in the table (the defaults and the recorded setting are always shown).
    #[arg(long, value_name = "N", default_value_t = tune::report::TOP)]
    top: usize,
}

fn parse_capacity(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib > 0.0 && gib <= 1.0e6 => Ok(gib),
        _ => Err(format!(
            "expected a number of GiB above 0 (at most 1000000), got {text:?}"
        )),
    }
}

/// The settings `--demo` compares when no `--conf` is given.
const DEMO_CONFIGURATIONS: [&str; 4] = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:128",
    "roundup_power2_divisions:4",
];
const DEMO_NAME: &str = "demo";
/// The settings the FSDP demo compares (each per stream, with cross-stream reuse, and on one
/// stream) when no `--conf` is given.
const FSDP_DEMO_CONFIGURATIONS: [&str; 2] = ["", "expandable_segments:True"];
const FSDP_DEMO_NAME: &str = "demo-fsdp (4 streams)";
const FSDP_ONE_STREAM_NAME: &str = "demo-fsdp (1 stream)";
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
        Command::Replay(args) => replay_command(&args),
        Command::Tune(args) => tune_command(&args),
        Command::CheckConfig { conf } => check_config(&conf),
        Command::Ops { traces } => ops_command(&traces),
    }
}

fn ops_command(traces: &[PathBuf]) -> u8 {
    let mut status = SUCCESS;
    for path in traces {
        let snapshot = match replay::load(path) {
            Ok(snapshot) => snapshot,
            Err(err) => {
                complain!("error: {err}");
                status = FILE_ERROR;
                continue;
            }
        };
        let workload = Workload::reconstruct(&snapshot);
        for device in &workload.devices {
            let program = replay::program::program_json(&path.display().to_string(), device);
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
            if !config.ignored_keys.is_empty() {
                say!(
                    "  ignored by ferrocache (PyTorch reads them; they change nothing here): {}",
                    config.ignored_keys.join(", ")
                );
            }
            for warning in &config.warnings {
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

/// One replay's row.
struct Row {
    /// The trace as given (with the device when a snapshot has several), or `demo`.
    trace: String,
    /// Its rank, with `--job`.
    rank: Option<u32>,
    conf: String,
    report: ReplayReport,
    native: Option<NativeFigures>,
    /// The self-check of the row's recording (the same for each of its rows).
    check: Option<Reproduction>,
}

/// A parsed `--conf` and its name.
#[derive(Clone)]
struct Setting {
    raw: String,
    config: Config,
}

fn replay_command(args: &ReplayArgs) -> u8 {
    if args.traces.is_empty() && !args.demo {
        complain!("error: nothing to replay: give TRACE files, or --demo");
        return USAGE_ERROR;
    }
    if args.job && args.demo {
        complain!(
            "error: --job reads TRACE files as the ranks of one job; it does not apply to --demo"
        );
        return USAGE_ERROR;
    }
    let ranks = match job_ranks(args.job, &args.traces) {
        Ok(ranks) => ranks,
        Err(code) => return code,
    };
    let mut given = match parse_settings(&args.confs) {
        Ok(settings) => settings,
        Err(code) => return code,
    };
    if args.cross_stream {
        given = if given.is_empty() {
            vec![with_cross_stream(Setting {
                raw: String::new(),
                config: Config::default(),
            })]
        } else {
            given.into_iter().map(with_cross_stream).collect()
        };
    }
    let trace_settings = if given.is_empty() {
        vec![Setting {
            raw: String::new(),
            config: Config::default(),
        }]
    } else {
        given.clone()
    };
    let options = ReplayOptions {
        capacity: (args.capacity_gib * GIB) as u64,
        start: if args.fresh {
            StartState::Fresh
        } else {
            StartState::Reconstructed
        },
        record_timeline: args.plot.is_some(),
    };

    let mut rows: Vec<Row> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    // The self-check of each recording: replayed under its own settings from the
    // reconstructed start, how closely that reproduced it.
    let mut checks: Vec<String> = Vec::new();
    let mut failed = false;
    for (index, path) in args.traces.iter().enumerate() {
        let rank = ranks.as_ref().map(|r| r[index]);
        let Some(snapshot) = load_or_complain(path, &mut failed) else {
            continue;
        };
        let mut workload = Workload::reconstruct(&snapshot);
        if args.serve_final_oom {
            for device in &mut workload.devices {
                if let Some(size) = tune::serve_final_oom(device) {
                    notes.push(format!(
                        "{} (device {}): the request of {} it ended in running out of memory \
                         for is replayed as an allocation (--serve-final-oom)",
                        path.display(),
                        device.device,
                        bytes(size)
                    ));
                }
            }
        }
        notes.extend(idle_devices_note(&path.display().to_string(), &workload));
        let several = workload.devices.len() > 1;
        for device in &workload.devices {
            let trace = if several {
                format!("{} (device {})", path.display(), device.device)
            } else {
                path.display().to_string()
            };
            notes.extend(workload_notes(&trace, &workload, device, &options));
            let check = faithful::self_check(device, &workload.config, options.capacity);
            checks.push(format!("{trace}: {}", check.describe()));
            for setting in &trace_settings {
                let report = replay::replay(device, &setting.config, &options);
                let row = Row {
                    trace: trace.clone(),
                    rank,
                    conf: setting.raw.clone(),
                    native: Some(NativeFigures::of(device)),
                    report,
                    check: Some(check.clone()),
                };
                notes.extend(start_note(&row, args.capacity_gib));
                emit(args.json, row, &mut rows);
            }
        }
    }
    let mut demo_ops = 0;
    if args.demo {
        let workload = demo::transformer_training();
        demo_ops = workload.ops.len();
        let demo_settings = if given.is_empty() {
            let defaults: Vec<String> = DEMO_CONFIGURATIONS.iter().map(|c| c.to_string()).collect();
            parse_settings(&defaults).unwrap_or_default()
        } else {
            given
        };
        for setting in &demo_settings {
            let report = replay::replay(&workload, &setting.config, &options);
            let row = Row {
                trace: DEMO_NAME.to_string(),
                rank: None,
                conf: setting.raw.clone(),
                report,
                native: None,
                check: None,
            };
            emit(args.json, row, &mut rows);
        }
    }

    let mut fsdp_ops = 0;
    if args.demo {
        let workload = demo_fsdp::fsdp_training();
        let one_stream = demo_fsdp::on_one_stream(&workload);
        fsdp_ops = workload.ops.len();
        let defaults: Vec<String> = FSDP_DEMO_CONFIGURATIONS
            .iter()
            .map(|c| c.to_string())
            .collect();
        let plain = if args.confs.is_empty() {
            parse_settings(&defaults).unwrap_or_default()
        } else {
            parse_settings(&args.confs).unwrap_or_default()
        };
        for setting in plain {
            let runs = [
                (FSDP_DEMO_NAME, &workload, setting.clone()),
                (
                    FSDP_DEMO_NAME,
                    &workload,
                    with_cross_stream(setting.clone()),
                ),
                (FSDP_ONE_STREAM_NAME, &one_stream, setting),
            ];
            for (trace, workload, setting) in runs {
                let report = replay::replay(workload, &setting.config, &options);
                let row = Row {
                    trace: trace.to_string(),
                    rank: None,
                    conf: setting.raw.clone(),
                    report,
                    native: None,
                    check: None,
                };
                emit(args.json, row, &mut rows);
            }
        }
    }

    if rows.is_empty() && failed {
        // Nothing was replayed, and each unreadable trace has had its line on stderr: a table
        // without rows, its column key or an empty plot would only bury the errors.
        if args.job {
            complain!(
                "error: none of the {} snapshots of the job could be read",
                args.traces.len()
            );
        }
        return FILE_ERROR;
    }
    let jobs = if args.job {
        job_rows(&rows, &trace_settings)
    } else {
        Vec::new()
    };
    if args.job && failed {
        let read: BTreeSet<u32> = rows.iter().filter_map(|r| r.rank).collect();
        notes.push(format!(
            "the job rows cover the {} rank(s) that could be read ({}) of the {} given",
            read.len(),
            read.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            args.traces.len()
        ));
    }
    if args.json {
        for job in &jobs {
            say!("{}", job.to_json());
        }
        for check in &checks {
            complain!("self-check: {check}");
        }
        for note in &notes {
            complain!("note: {note}");
        }
    } else {
        print_table(&rows);
        if !jobs.is_empty() {
            say!();
            print_job_table(&jobs);
        }
        for check in &checks {
            say!("self-check: {check}");
        }
        for note in &notes {
            say!("note: {note}");
        }
        say!();
        say!("{}", wrap(&column_key(), 100));
        if args.demo {
            say!();
            say!(
                "{}",
                wrap(&demo_explanation(&rows, demo_ops, args.capacity_gib), 100)
            );
            say!();
            say!("{}", wrap(&fsdp_demo_explanation(&rows, fsdp_ops), 100));
        }
    }
    if let Some(file) = &args.plot
        && let Err(message) = write_plot(file, &rows)
    {
        complain!("error: {message}");
        failed = true;
    }
    if failed { FILE_ERROR } else { SUCCESS }
}

/// Reads a snapshot, or says on stderr why it cannot (one line naming the file) and notes the
/// failure.
fn load_or_complain(path: &Path, failed: &mut bool) -> Option<replay::Snapshot> {
    replay::load(path)
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
                    tie_rule: config::tie_rule_from_env(),
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

/// The setting with cross-stream reuse on, named so in the rows.
fn with_cross_stream(setting: Setting) -> Setting {
    let raw = if setting.raw.is_empty() {
        CROSS_STREAM_SUFFIX.to_string()
    } else {
        format!("{} {CROSS_STREAM_SUFFIX}", setting.raw)
    };
    Setting {
        raw,
        config: Config {
            cross_stream: true,
            ..setting.config
        },
    }
}

/// Prints a JSON row at once (so long runs stream), or keeps it for the table.
fn emit(json: bool, row: Row, rows: &mut Vec<Row>) {
    if json {
        let native = row.native.as_ref();
        let mut value = json!({
            "trace": row.trace,
            "conf": row.conf,
            "events": row.report.events,
            "peak_requested_bytes": row.report.peak_requested,
            "peak_reserved_bytes": row.report.peak_reserved,
            "utilization": row.report.utilization(),
            "segment_allocs": row.report.segment_allocs,
            "device_mallocs": row.report.device_mallocs,
            "device_frees": row.report.device_frees,
            "retries": row.report.retries,
            "cross_stream_reuses": row.report.cross_stream_reuses,
            "ooms": row.report.ooms,
            "native_peak_reserved_bytes": native.map(|n| n.peak_reserved),
            "native_segment_allocs": native.map(|n| n.segment_allocs),
            "matching_segment_allocs": native.map(|_| row.report.matching_segment_allocs),
            "events_per_second": row.report.events_per_second(),
            "self_check": row.check.as_ref().map(Reproduction::json),
        });
        if let (Some(rank), Some(object)) = (row.rank, value.as_object_mut()) {
            object.insert("rank".to_string(), json!(rank));
        }
        let mut out = std::io::stdout().lock();
        // A closed pipe (`| head`) is not worth a panic.
        let _ = writeln!(out, "{value}");
    }
    rows.push(row);
}

/// Names the devices a snapshot holds segments of but recorded nothing on (not replayed).
fn idle_devices_note(trace: &str, workload: &Workload) -> Option<String> {
    if workload.idle_devices.is_empty() {
        return None;
    }
    let list = |devices: &mut dyn Iterator<Item = usize>| {
        devices
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    Some(format!(
        "{trace}: device(s) {} hold segments but recorded no trace events, so there is nothing \
         to replay there; replayed: device(s) {}",
        list(&mut workload.idle_devices.iter().copied()),
        list(&mut workload.devices.iter().map(|d| d.device))
    ))
}

/// What a person should know about a recorded workload before trusting its rows.
fn workload_notes(
    trace: &str,
    workload: &Workload,
    device: &DeviceWorkload,
    options: &ReplayOptions,
) -> Vec<String> {
    let mut notes = Vec::new();
    if workload.settings_recorded && !same_policy(&workload.config, &Config::default()) {
        notes.push(format!(
            "{trace} was recorded with these settings (PyTorch's decisions were made under \
             them): {}",
            workload.config.describe().replace('\n', "; ")
        ));
    }
    let d = &device.diagnostics;
    if !d.is_consistent(&device.figures) {
        notes.push(format!(
            "{trace}: the trace does not lead from the reconstructed start to the recorded end \
             state (unknown frees {}, allocs over live blocks {}, allocations missing at the end \
             {}, inconsistent frees {}, segment mismatches {}, blocks outside segments {}); the \
             replay starts from a best guess",
            d.unknown_frees,
            d.allocs_over_live,
            d.allocs_missing_at_end,
            d.inconsistent_frees,
            d.segment_mismatches,
            d.start_blocks_outside_segments
        ));
    }
    if options.start == StartState::Reconstructed && d.estimated_block_sizes > 0 {
        notes.push(format!(
            "{trace}: {} of the blocks live at the start have estimated sizes (the trace frees \
             them without saying how large their blocks were)",
            d.estimated_block_sizes
        ));
    }
    notes
}

/// Says when the start state did not fit the simulated GPU (the rows then understate).
fn start_note(row: &Row, capacity_gib: f64) -> Option<String> {
    let start = &row.report.start;
    (start.failures > 0).then(|| {
        format!(
            "{} under {}: {} segments or allocations of the start state did not fit on the \
             simulated {} GiB GPU (see --capacity-gib)",
            row.trace,
            conf_name(&row.conf),
            start.failures,
            trim_float(capacity_gib)
        )
    })
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

fn print_table(rows: &[Row]) {
    let header = [
        "trace",
        "configuration",
        "events",
        "peak requested",
        "peak reserved",
        "util.",
        "segments",
        "mallocs/frees",
        "retries",
        "OOMs",
        "|",
        "PyTorch: peak reserved",
        "util.",
        "segments",
        "matching",
    ];
    // Left-aligned: the two names; everything else right-aligned.
    let left = |column: usize| column < 2;
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for row in rows {
        let r = &row.report;
        let native = row.native.as_ref();
        let na = || "-".to_string();
        table.push(vec![
            match row.rank {
                Some(rank) => format!("rank {rank}: {}", short_trace(&row.trace)),
                None => short_trace(&row.trace),
            },
            conf_name(&row.conf),
            grouped(r.events),
            bytes(r.peak_requested),
            bytes(r.peak_reserved),
            percent(r.utilization()),
            grouped(r.segment_allocs),
            format!("{}/{}", r.device_mallocs, r.device_frees),
            grouped(r.retries),
            grouped(r.ooms),
            "|".to_string(),
            native.map_or_else(na, |n| bytes(n.peak_reserved)),
            native.map_or_else(na, |n| percent(n.utilization)),
            native.map_or_else(na, |n| grouped(n.segment_allocs)),
            native.map_or_else(na, |n| {
                format!("{}/{}", r.matching_segment_allocs, n.segment_allocs)
            }),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            table
                .iter()
                .map(|row| row[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = std::io::stdout().lock();
    for row in &table {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if left(c) {
                    format!("{cell:<width$}", width = widths[c])
                } else {
                    format!("{cell:>width$}", width = widths[c])
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
}

fn column_key() -> String {
    "Columns: events = allocations, frees and empty_cache calls replayed; peak requested = most \
     bytes the program held at once (what it asked for); peak reserved = most bytes taken from \
     the GPU (cudaMalloc'd segments and mapped pages), start state included; util. = peak \
     requested / peak reserved; segments = device allocations made while replaying (PyTorch's \
     segment_alloc + segment_map); mallocs/frees = all cudaMalloc-like and cudaFree-like calls, \
     start state included; retries = mallocs that had to release cached memory and try again; \
     OOMs = requests ferrocache could not serve. After the bar, PyTorch's own figures from the \
     recording; matching = how many of PyTorch's segment decisions ferrocache made identically \
     (same size, in the malloc of the same request)."
        .to_string()
}

/// The paragraph about the FSDP demo's rows: peak reserved per stream, with cross-stream reuse,
/// and on one stream, per setting.
fn fsdp_demo_explanation(rows: &[Row], ops: usize) -> String {
    let mut text = format!(
        "The FSDP demo is {} allocation events of an FSDP-style training step on four streams \
         (16 layers; parameters all-gathered in a burst on one stream, activations on compute, \
         gradient buckets on a reduce-scatter stream, batches on a data stream), replayed per \
         stream as PyTorch caches, with cross-stream reuse ({CROSS_STREAM_SUFFIX}), and as the \
         same program put on one stream.",
        grouped(ops as u64)
    );
    let reserved = |trace: &str, conf: &str| {
        rows.iter()
            .find(|r| r.trace == trace && r.conf == conf)
            .map(|r| r.report.peak_reserved)
    };
    for conf in rows
        .iter()
        .filter(|r| r.trace == FSDP_ONE_STREAM_NAME)
        .map(|r| r.conf.as_str())
    {
        let cross = with_cross_stream(Setting {
            raw: conf.to_string(),
            config: Config::default(),
        })
        .raw;
        if let (Some(per_stream), Some(shared), Some(one)) = (
            reserved(FSDP_DEMO_NAME, conf),
            reserved(FSDP_DEMO_NAME, &cross),
            reserved(FSDP_ONE_STREAM_NAME, conf),
        ) {
            text.push_str(&format!(
                " Under {}: {} reserved per stream ({:.2}x one stream), {} with cross-stream \
                 reuse ({:.2}x), {} on one stream.",
                conf_name(conf),
                bytes(per_stream),
                ratio_of(per_stream, one),
                bytes(shared),
                ratio_of(shared, one),
                bytes(one)
            ));
        }
    }
    text
}

fn ratio_of(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The paragraph under the demo's table, with its figures.
fn demo_explanation(rows: &[Row], ops: usize, capacity_gib: f64) -> String {
    let demo_rows: Vec<&Row> = rows.iter().filter(|r| r.trace == DEMO_NAME).collect();
    let mut text = format!(
        "The demo is a training loop of a GPT-style transformer (12 layers, hidden size 2048, \
         batch 8, fp32, Adam) over 8 steps whose sequence length grows from 256 to 1024 tokens, \
         {} allocation events on two streams, replayed on a simulated {} GiB GPU. Peak \
         requested is the same in every row: it is the program's own demand. Peak reserved is \
         what each setting needed from the GPU to serve it; the gap is fragmentation.",
        grouped(ops as u64),
        trim_float(capacity_gib)
    );
    let lowest = demo_rows.iter().min_by_key(|r| r.report.peak_reserved);
    let highest = demo_rows.iter().max_by_key(|r| r.report.peak_reserved);
    if let (Some(low), Some(high)) = (lowest, highest)
        && demo_rows.len() > 1
    {
        text.push_str(&format!(
            " Here {} needs least ({} reserved, {} utilization) and {} most ({}, {}).",
            conf_name(&low.conf),
            bytes(low.report.peak_reserved),
            percent(low.report.utilization()),
            conf_name(&high.conf),
            bytes(high.report.peak_reserved),
            percent(high.report.utilization()),
        ));
    }
    let shown: Vec<&str> = demo_rows.iter().map(|r| r.conf.as_str()).collect();
    if shown == DEMO_CONFIGURATIONS {
        text.push_str(
            " Why: with the defaults, each step's larger activations no longer fit the blocks \
             the previous step cached, so new segments are taken while the old ones stay \
             partly in use. expandable_segments:True keeps one growing segment per stream and \
             maps pages on demand, so freed space serves any later size. max_split_size_mb:128 \
             stops large cached blocks from being split: good against fragmentation when memory \
             is tight, but with memory to spare the unsplittable blocks just accumulate until \
             a cudaMalloc fails. roundup_power2_divisions:4 rounds requests up to quarter \
             powers of two so blocks of nearby sizes can be reused, which helps little when \
             sizes only grow. Try --capacity-gib 40 to see the settings under pressure, or \
             --plot memory.svg to see where memory goes.",
        );
    }
    text
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// One panel per workload (trace, device or demo), one line pair per configuration.
fn write_plot(file: &Path, rows: &[Row]) -> Result<(), String> {
    let mut order: Vec<&str> = Vec::new();
    for row in rows {
        if !order.contains(&row.trace.as_str()) {
            order.push(&row.trace);
        }
    }
    let titles: Vec<String> = order
        .iter()
        .map(|t| {
            if *t == DEMO_NAME {
                "demo: transformer training, sequence length 256 -> 1024".to_string()
            } else {
                short_trace(t)
            }
        })
        .collect();
    let labels: Vec<String> = rows.iter().map(|r| conf_name(&r.conf)).collect();
    let panels: Vec<PlotPanel<'_>> = order
        .iter()
        .zip(&titles)
        .map(|(trace, title)| PlotPanel {
            title,
            series: rows
                .iter()
                .zip(&labels)
                .filter(|(r, _)| r.trace == *trace)
                .map(|(r, label)| PlotSeries {
                    label,
                    timeline: &r.report.timeline,
                })
                .collect(),
        })
        .collect();
    std::fs::write(file, replay::render_svg(&panels))
        .map_err(|err| format!("{}: cannot write the plot: {err}", file.display()))
}

// ------------------------------------------------------------------------------------------------
// --job: the snapshots as the ranks of one job
// ------------------------------------------------------------------------------------------------

/// With `--job`, the rank of each trace, from its file name; every problem on stderr and code
/// 2 otherwise. Without, `None`.
fn job_ranks(job: bool, traces: &[PathBuf]) -> Result<Option<Vec<u32>>, u8> {
    if !job {
        return Ok(None);
    }
    replay::assign_ranks(traces).map(Some).map_err(|errors| {
        for error in errors {
            complain!("error: --job: {error}");
        }
        USAGE_ERROR
    })
}

/// The job's row under one setting.
struct JobRow {
    conf: String,
    summary: JobSummary,
    ooms: u64,
}

impl JobRow {
    fn to_json(&self) -> serde_json::Value {
        let s = &self.summary;
        json!({
            "job": true,
            "conf": self.conf,
            "ranks": s.ranks,
            "worst_rank": s.worst_rank,
            "worst_peak_reserved_bytes": s.worst_peak_reserved,
            "spread": s.spread,
            "sum_peak_reserved_bytes": s.sum_peak_reserved,
            "ooms": self.ooms,
        })
    }
}

/// One job row per setting, from the per-rank rows.
fn job_rows(rows: &[Row], settings: &[Setting]) -> Vec<JobRow> {
    settings
        .iter()
        .filter_map(|setting| {
            let ranked: Vec<&Row> = rows
                .iter()
                .filter(|r| r.rank.is_some() && r.conf == setting.raw)
                .collect();
            let peaks: Vec<(u32, u64)> = ranked
                .iter()
                .filter_map(|r| Some((r.rank?, r.report.peak_reserved)))
                .collect();
            Some(JobRow {
                conf: setting.raw.clone(),
                summary: JobSummary::of(&peaks)?,
                ooms: ranked.iter().map(|r| r.report.ooms).sum(),
            })
        })
        .collect()
}

fn print_job_table(jobs: &[JobRow]) {
    let ranks = jobs.first().map_or(0, |j| j.summary.ranks);
    let mut table: Vec<Vec<String>> = vec![
        [
            &format!("job ({ranks} ranks)") as &str,
            "worst peak reserved",
            "worst rank",
            "spread (max/min)",
            "sum of peaks",
            "OOMs",
        ]
        .iter()
        .map(|h| h.to_string())
        .collect(),
    ];
    for job in jobs {
        let s = &job.summary;
        table.push(vec![
            conf_name(&job.conf),
            bytes(s.worst_peak_reserved),
            s.worst_rank.to_string(),
            if s.spread.is_finite() {
                format!("{:.2}x", s.spread)
            } else {
                "-".to_string()
            },
            bytes(s.sum_peak_reserved),
            grouped(job.ooms),
        ]);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|c| {
            table
                .iter()
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &table {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c == 0 {
                    format!("{cell:<width$}", width = widths[c])
                } else {
                    format!("{cell:>width$}", width = widths[c])
                }
            })
            .collect();
        say!("{}", cells.join("  ").trim_end());
    }
    say!(
        "{}",
        wrap(
            "The job row: the rank with the highest peak reserved (it decides whether the job \
             runs out of memory), the spread = highest / lowest peak over the ranks, and the sum \
             of the ranks' peaks.",
            100
        )
    );
}

// ------------------------------------------------------------------------------------------------
// tune
// ------------------------------------------------------------------------------------------------

fn tune_command(args: &TuneArgs) -> u8 {
    if args.traces.is_empty() {
        complain!("error: nothing to tune: give TRACE files");
        return USAGE_ERROR;
    }
    let ranks = match job_ranks(args.job, &args.traces) {
        Ok(ranks) => ranks,
        Err(code) => return code,
    };
    let start = if args.fresh {
        StartState::Fresh
    } else {
        StartState::Reconstructed
    };
    let probe = ReplayOptions {
        capacity: args
            .capacity_gib
            .map_or(tune::DEFAULT_CAPACITY, |gib| (gib * GIB) as u64),
        start,
        record_timeline: false,
    };
    let mut subjects: Vec<Subject> = Vec::new();
    let mut recorded_capacity: Option<u64> = None;
    let mut notes: Vec<String> = Vec::new();
    let mut failed = false;
    let mut read: Vec<String> = Vec::new();
    for (index, path) in args.traces.iter().enumerate() {
        let Some(snapshot) = load_or_complain(path, &mut failed) else {
            continue;
        };
        let name = path.display().to_string();
        let workload = Workload::reconstruct(&snapshot);
        notes.extend(idle_devices_note(&name, &workload));
        for device in &workload.devices {
            notes.extend(workload_notes(&name, &workload, device, &probe));
            if let Some(capacity) = tune::recorded_capacity(&snapshot, device) {
                recorded_capacity = Some(recorded_capacity.map_or(capacity, |c| c.min(capacity)));
            }
        }
        let recorded = tune::recorded_setting(&snapshot, &workload);
        let rank = ranks.as_ref().map(|r| r[index]);
        for mut subject in Subject::from_workload(&name, rank, workload, recorded) {
            if subject.serve_final_oom() {
                notes.push(format!(
                    "{} ends in an out-of-memory (a request of {}): the search serves it, so \
                     that the setting found would have gone on (replay --serve-final-oom \
                     replays it the same way)",
                    subject.name,
                    bytes(subject.served_oom.unwrap_or(0))
                ));
            }
            subjects.push(subject);
        }
        read.push(name);
    }
    if subjects.is_empty() {
        if args.traces.len() > 1 {
            complain!(
                "error: none of the {} snapshots could be read",
                args.traces.len()
            );
        }
        return FILE_ERROR;
    }
    if failed {
        notes.push(format!(
            "tuned on the {} snapshot(s) that could be read, of the {} given",
            read.len(),
            args.traces.len()
        ));
    }
    let given = args.capacity_gib.map(|gib| (gib * GIB) as u64);
    let (capacity, capacity_source) = tune::search_capacity(given, recorded_capacity);
    let options = TuneOptions {
        capacity,
        capacity_source,
        start,
        job: args.job,
        tie_rule: config::tie_rule_from_env(),
        ..TuneOptions::default()
    };
    let tuning = tune::tune(&subjects, &options);
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&tune::report::json(&tuning)).unwrap_or_default()
        );
        for note in &notes {
            complain!("note: {note}");
        }
    } else {
        let text = tune::report::text(
            &tuning,
            &tune::report::TextOptions {
                check_traces: Some(read),
                top: Some(args.top),
            },
        );
        say!("{}", text.trim_end());
        for note in &notes {
            say!("note: {note}");
        }
    }
    if let Some(file) = &args.plot
        && let Err(message) = write_tune_plot(file, &subjects, &tuning)
    {
        complain!("error: {message}");
        failed = true;
    }
    if failed { FILE_ERROR } else { SUCCESS }
}

/// One panel per recording: PyTorch's defaults, the recording's setting and the
/// recommendation (each once, where they are the same setting).
fn write_tune_plot(file: &Path, subjects: &[Subject], tuning: &tune::Tuning) -> Result<(), String> {
    let mut chosen: Vec<(String, &tune::Candidate)> = Vec::new();
    let roles = [
        ("defaults", Some(tuning.defaults())),
        ("recorded", tuning.recorded()),
        ("recommended", tuning.recommendation()),
    ];
    for (role, evaluated) in roles {
        let Some(candidate) = evaluated.map(|e| &e.candidate) else {
            continue;
        };
        if let Some((label, _)) = chosen.iter_mut().find(|(_, c)| c.same_setting(candidate)) {
            label.push_str(&format!(" = {role}"));
        } else {
            chosen.push((format!("{role}: {}", candidate.label()), candidate));
        }
    }
    let timelines: Vec<Vec<Vec<replay::MemoryPoint>>> = chosen
        .iter()
        .map(|(_, candidate)| tune::timelines(subjects, candidate, &tuning.options))
        .collect();
    let titles: Vec<String> = subjects.iter().map(Subject::short_name).collect();
    let panels: Vec<PlotPanel<'_>> = titles
        .iter()
        .enumerate()
        .map(|(index, title)| PlotPanel {
            title,
            series: chosen
                .iter()
                .zip(&timelines)
                .map(|((label, _), lines)| PlotSeries {
                    label,
                    timeline: &lines[index],
                })
                .collect(),
        })
        .collect();
    std::fs::write(file, replay::render_svg(&panels))
        .map_err(|err| format!("{}: cannot write the plot: {err}", file.display()))
}
