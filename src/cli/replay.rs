//! `ferrocache replay`: snapshots (or a built-in demo) replayed on a simulated GPU under several
//! settings, one row per trace and setting.

#![forbid(unsafe_code)]

use super::job::job_ranks;
use super::rows::{Row, job_rows};
use super::table::{column_key, print_job_table, print_table};
use super::{
    CROSS_STREAM_SUFFIX, FILE_ERROR, GIB, SUCCESS, Setting, USAGE_ERROR, conf_name,
    load_or_complain, parse_capacity, parse_settings, percent, ratio_of, trim_float,
};
use crate::config::{self, Config};
use crate::replay::{
    self, DeviceWorkload, NativeFigures, PlotPanel, PlotSeries, ReplayOptions, StartState,
    Workload, demo, demo_fsdp, faithful,
};
use crate::tune::report::{bytes, grouped, wrap};
use crate::tune::{same_policy, short_trace};
use clap::Args;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub(super) struct ReplayArgs {
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

pub(super) fn replay_command(args: &ReplayArgs) -> u8 {
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
        let mut workload = Workload::reconstruct(&snapshot, config::tie_rule_from_env());
        if args.serve_final_oom {
            for device in &mut workload.devices {
                if let Some(size) = crate::tune::serve_final_oom(device) {
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
            opt_in: crate::config::OptIns {
                cross_stream: true,
                ..setting.config.opt_in
            },
            ..setting.config
        },
    }
}

/// Prints a JSON row at once (so long runs stream), or keeps it for the table.
fn emit(json: bool, row: Row, rows: &mut Vec<Row>) {
    if json {
        let mut out = std::io::stdout().lock();
        // A closed pipe (`| head`) is not worth a panic.
        let _ = writeln!(out, "{}", row.to_json());
    }
    rows.push(row);
}

/// Names the devices a snapshot holds segments of but recorded nothing on (not replayed).
pub(super) fn idle_devices_note(trace: &str, workload: &Workload) -> Option<String> {
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
pub(super) fn workload_notes(
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
