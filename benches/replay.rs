//! Replay throughput: operations replayed per second by the engine's loop (the start state is
//! built outside the timing), on the shared PyTorch snapshots (skipped where absent) and on the
//! built-in demo, under PyTorch's defaults and with expandable segments.
//!
//! `cargo bench --bench replay`; criterion reports the median as elements (events) per second.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ferrocache::config::Config;
use ferrocache::policy::TieRule;
use ferrocache::replay::{self, DeviceWorkload, ReplayOptions, Workload, demo};
use std::time::Duration;

#[path = "../tests/common/traces.rs"]
mod traces;
use traces::traces_dir;

const TRACES: [&str; 3] = [
    "eor_nn.pickle",
    "cs336_memory_ctx128_forward.pickle",
    "bcrafton_0c0e8a7.pickle",
];

fn workloads() -> Vec<(String, DeviceWorkload)> {
    let mut out = Vec::new();
    if let Some(dir) = traces_dir() {
        for name in TRACES {
            match replay::load(&dir.join(name)) {
                Ok(snapshot) => {
                    let mut workload = Workload::reconstruct(&snapshot, TieRule::default());
                    if !workload.devices.is_empty() {
                        out.push((name.to_string(), workload.devices.remove(0)));
                    }
                }
                Err(err) => eprintln!("note: skipping {name}: {err}"),
            }
        }
    }
    out.push(("demo".to_string(), demo::transformer_training()));
    out
}

fn replay_throughput(c: &mut Criterion) {
    let workloads = workloads();
    for (conf_name, conf) in [("defaults", ""), ("expandable", "expandable_segments:True")] {
        let config = Config::parse(conf).expect("a valid setting");
        let mut group = c.benchmark_group(format!("replay_{conf_name}"));
        group.measurement_time(Duration::from_secs(3));
        for (name, workload) in &workloads {
            let options = ReplayOptions::default();
            let events = replay::replay(workload, &config, &options).events;
            group.throughput(Throughput::Elements(events));
            group.bench_with_input(BenchmarkId::from_parameter(name), workload, |b, w| {
                // Only the operations loop counts: the start state (hundreds of imported
                // segments for cs336) is set-up, not replay.
                b.iter_custom(|iterations| {
                    (0..iterations)
                        .map(|_| replay::replay(w, &config, &options).elapsed)
                        .sum()
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, replay_throughput);
criterion_main!(benches);
