//! `ferrocache tune`: search the settings on recordings and say what to set.

#![forbid(unsafe_code)]

use super::job::job_ranks;
use super::replay::{idle_devices_note, workload_notes};
use super::{FILE_ERROR, GIB, SUCCESS, USAGE_ERROR, load_or_complain, parse_capacity};
use crate::config;
use crate::replay::{self, PlotPanel, PlotSeries, ReplayOptions, StartState, Workload};
use crate::tune::report::bytes;
use crate::tune::{self, Subject, TuneOptions};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub(super) struct TuneArgs {
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

pub(super) fn tune_command(args: &TuneArgs) -> u8 {
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
        let workload = Workload::reconstruct(&snapshot, config::tie_rule_from_env());
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
