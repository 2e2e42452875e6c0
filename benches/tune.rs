//! `ferrocache tune`'s search: every candidate of the settings space replayed on a
//! 20,000-event recording, in parallel over the cores (rayon), as the command does it. The
//! aim (issue 22): at least 500 candidates in 5 s or less on 2 cores.
//!
//! `cargo bench --bench tune`; criterion reports the median time of one whole search. The
//! workload is the built-in transformer demo over 16 steps (two streams: cross-stream reuse is
//! a dimension) on a given 40 GiB GPU (so garbage collection is one too, and the defaults run
//! short and retry); the candidate and event counts are printed first. `RAYON_NUM_THREADS=1`
//! gives the one-core figure.

use criterion::{Criterion, criterion_group, criterion_main};
use ferrocache::replay::demo::{self, DemoSpec};
use ferrocache::tune::{self, CapacitySource, Subject, TuneOptions};
use std::time::Duration;

/// `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it, as
/// a test of the code, where the small demo is enough.
fn benching() -> bool {
    std::env::args().any(|arg| arg == "--bench")
}

fn recording() -> Subject {
    let spec = if benching() {
        DemoSpec {
            sequence_lengths: (0..16).map(|step| 256 + 48 * step).collect(),
            ..DemoSpec::default()
        }
    } else {
        DemoSpec::tiny()
    };
    Subject {
        name: "demo, 16 steps".to_string(),
        rank: None,
        workload: demo::build(&spec),
        recorded: None,
        served_oom: None,
    }
}

fn search(c: &mut Criterion) {
    let subjects = vec![recording()];
    let options = TuneOptions {
        capacity: 40 << 30,
        capacity_source: CapacitySource::Given,
        ..TuneOptions::default()
    };
    let cpu_before = cpu_seconds();
    let first = tune::tune(&subjects, &options);
    let cpu = cpu_seconds()
        .zip(cpu_before)
        .map(|(after, before)| after - before);
    eprintln!(
        "tune bench: {} candidates x {} events ({} replayed in all), {} threads; the first \
         search took {:.2} s wall, {} CPU (the machine is shared: CPU time / threads is the \
         wall time it would take on idle cores); recommended: {}",
        first.ranked.len(),
        subjects[0].events(),
        first.ranked.len() as u64 * subjects[0].events(),
        first.threads,
        first.elapsed.as_secs_f64(),
        cpu.map_or("n/a".to_string(), |c| format!("{c:.2} s")),
        first
            .recommendation()
            .map_or("none".to_string(), |b| b.candidate.label()),
    );
    if benching() {
        assert!(
            first.ranked.len() >= 500,
            "the aim is 500 candidates or more"
        );
        assert!(subjects[0].events() >= 20_000);
    }
    let mut group = c.benchmark_group("tune");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(40));
    // The whole space, and the 500 simplest settings (the figure).
    group.bench_function("demo_16_steps_all", |b| {
        b.iter(|| tune::tune(&subjects, &options).ranked.len())
    });
    let first_500 = TuneOptions {
        max_candidates: Some(500),
        ..options.clone()
    };
    group.bench_function("demo_16_steps_500", |b| {
        b.iter(|| tune::tune(&subjects, &first_500).ranked.len())
    });
    group.finish();
}

/// This process's user + system CPU time so far, from /proc/self/stat (Linux); `None`
/// elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command's closing parenthesis; utime and stime are the 14th and
    // 15th fields of the whole line, in clock ticks (100 per second on Linux).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

criterion_group!(benches, search);
criterion_main!(benches);
