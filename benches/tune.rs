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
    }
}

fn search(c: &mut Criterion) {
    let subjects = vec![recording()];
    let options = TuneOptions {
        capacity: 40 << 30,
        capacity_source: CapacitySource::Given,
        ..TuneOptions::default()
    };
    let first = tune::tune(&subjects, &options);
    eprintln!(
        "tune bench: {} candidates x {} events ({} replayed in all), {} threads; the first \
         search took {:.2} s; recommended: {}",
        first.ranked.len(),
        subjects[0].events(),
        first.ranked.len() as u64 * subjects[0].events(),
        first.threads,
        first.elapsed.as_secs_f64(),
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
    group.bench_function("search_demo_16_steps", |b| {
        b.iter(|| tune::tune(&subjects, &options).ranked.len())
    });
    group.finish();
}

criterion_group!(benches, search);
criterion_main!(benches);
