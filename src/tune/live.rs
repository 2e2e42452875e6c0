//! Advice from the running process: its recorded history (`torch.cuda.memory.
//! _record_memory_history()`, answered by ferrocache once installed, or
//! `ferrocache.record_memory_history()`) searched like a snapshot file, and the line an
//! out-of-memory adds to PyTorch's message.

use super::{Candidate, CapacitySource, Subject, TuneOptions, Tuning, report};
use crate::allocator::history::{MemorySnapshot, TraceAction};
use crate::allocator::{AllocError, DeviceAllocator, OutOfMemoryError};
use crate::config::Config;
use crate::device::sim::SimDevice;
use crate::replay::{AllocatorSettings, BlockState, BlockStatus, Segment, Snapshot, TraceEvent};

/// The out-of-memory advice replays at most this many events in all (candidates times the
/// history's length), so that the line comes within a few seconds however long the history;
/// the simplest candidates are kept.
pub const OOM_EVENT_BUDGET: u64 = 30_000_000;

/// How `ferrocache.advise()` tells a process without history how to record one.
pub const HOW_TO_RECORD: &str = "no allocation history was recorded in this process: call \
     torch.cuda.memory._record_memory_history() (with ferrocache installed) or \
     ferrocache.record_memory_history() before the work to advise on, then ferrocache.advise()";

/// One device allocator's own snapshot (device `device`) as the replay reader's [`Snapshot`],
/// `config` being the process's settings. The allocator lists its trace first, whatever its
/// device; the reader finds a device's trace at the device's index.
pub fn to_replay_snapshot(snapshot: &MemorySnapshot, config: &Config, device: usize) -> Snapshot {
    let segments = snapshot
        .segments
        .iter()
        .map(|s| Segment {
            device: usize::try_from(s.device).unwrap_or(0),
            address: s.address,
            total_size: s.total_size,
            stream: s.stream,
            is_small: s.segment_type == "small",
            is_expandable: s.is_expandable,
            blocks: s
                .blocks
                .iter()
                .map(|b| BlockState {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: match b.state {
                        "active_allocated" => BlockStatus::ActiveAllocated,
                        "active_pending_free" => BlockStatus::ActivePendingFree,
                        _ => BlockStatus::Inactive,
                    },
                })
                .collect(),
        })
        .collect();
    let mut device_traces: Vec<Vec<TraceEvent>> = vec![Vec::new(); device + 1];
    device_traces[device] = snapshot
        .device_traces
        .iter()
        .flatten()
        .map(|e| TraceEvent {
            action: Some(e.action),
            addr: if e.action == TraceAction::Oom {
                0
            } else {
                e.addr
            },
            size: e.size,
            stream: e.stream,
            time_us: e.time_us,
            device_free: (e.action == TraceAction::Oom).then_some(e.addr),
        })
        .collect();
    Snapshot {
        segments,
        device_traces,
        allocator_settings: Some(settings_of(config)),
    }
}

fn settings_of(config: &Config) -> AllocatorSettings {
    AllocatorSettings {
        alloc_conf: Some(super::conf_of(config)),
        max_split_size: (config.max_split_size != usize::MAX)
            .then_some(config.max_split_size as u64),
        garbage_collection_threshold: Some(config.garbage_collection_threshold),
        expandable_segments: Some(config.expandable_segments),
        release_lock_on_cudamalloc: Some(config.release_lock_on_cudamalloc),
        roundup_power2_divisions: Some(config.roundup_power2_divisions),
    }
}

/// The process's setting as a candidate: its `PYTORCH_CUDA_ALLOC_CONF` as written where that
/// reads the same, else the effective values written as one; cross-stream reuse as set.
pub fn current_setting(config: &Config) -> Candidate {
    let with_opt_ins = |mut candidate: Candidate| {
        candidate.config.opt_in.expandable_ignore_max_split =
            config.opt_in.expandable_ignore_max_split;
        candidate
    };
    let raw = config
        .provenance
        .source
        .as_ref()
        .map(|(_, value)| value.as_str());
    let from_raw = raw
        .and_then(|raw| Candidate::new(raw, config.opt_in.cross_stream).ok())
        .map(with_opt_ins);
    match from_raw {
        Some(candidate) if super::same_policy(&candidate.config, config) => candidate,
        _ => with_opt_ins(
            Candidate::new(&super::conf_of(config), config.opt_in.cross_stream)
                .unwrap_or_else(|_| Candidate::defaults()),
        ),
    }
}

/// The subject of the process's history on `device`, or why there is none.
pub fn live_subject(
    snapshot: &MemorySnapshot,
    config: &Config,
    device: i32,
) -> Result<Subject, String> {
    let recorded_events = snapshot.device_traces.iter().map(Vec::len).sum::<usize>();
    if recorded_events == 0 {
        return Err(HOW_TO_RECORD.to_string());
    }
    let index = usize::try_from(device).map_err(|_| format!("invalid device ordinal {device}"))?;
    let replay_snapshot = to_replay_snapshot(snapshot, config, index);
    let name = format!("this process (device {device})");
    let mut subjects =
        Subject::from_snapshot(&name, None, &replay_snapshot, config.modelled.tie_rule);
    let index = subjects
        .iter()
        .position(|s| s.workload.device == index)
        .ok_or_else(|| {
            format!("no allocation history was recorded on device {device}: {HOW_TO_RECORD}")
        })?;
    let mut subject = subjects.swap_remove(index);
    subject.name = name;
    subject.recorded = Some(current_setting(config));
    // After an out-of-memory, the request that failed is part of what to serve.
    subject.serve_final_oom();
    Ok(subject)
}

/// What the process could use on the device when it ran out: what it held plus what the
/// device still had free, within the memory fraction's limit.
pub fn oom_capacity(reserved: u64, device_free: u64, allowed: Option<u64>) -> u64 {
    let usable = reserved.saturating_add(device_free);
    allowed.map_or(usable, |allowed| usable.min(allowed))
}

/// What the out-of-memory advice found.
#[derive(Debug, Clone, PartialEq)]
pub enum OomAdvice {
    /// The program's live tensors and the request alone exceed the memory.
    LiveBytesExceed { live: u64, capacity: u64 },
    /// This setting would have served the history so far, the failed request included.
    Setting {
        candidate: Box<Candidate>,
        peak_reserved: u64,
        current_peak_reserved: Option<u64>,
        capacity: u64,
        events: u64,
        is_current: bool,
    },
    /// No candidate tried served it without an out-of-memory.
    NoneFits { capacity: u64, tried: usize },
}

impl OomAdvice {
    /// The advice as one log line (without the `Allocator: ` prefix).
    pub fn line(&self, device: i32) -> String {
        let gib = |b: u64| report::bytes(b);
        match self {
            OomAdvice::LiveBytesExceed { live, capacity } => format!(
                "advice: no PYTORCH_CUDA_ALLOC_CONF would have served this program: its live \
                 tensors and this request alone need {}, more than the {} it could use on GPU \
                 {device}",
                gib(*live),
                gib(*capacity)
            ),
            OomAdvice::Setting {
                candidate,
                peak_reserved,
                current_peak_reserved,
                capacity,
                events,
                is_current,
            } => {
                if *is_current {
                    return format!(
                        "advice: replayed, the current setting would have served the {events} \
                         recorded allocations and frees and this request within the {} this process could use \
                         on GPU {device} (peak reserved {}), and no other setting tried does \
                         better: the memory went to what the history does not show (allocations \
                         before recording began, other processes); ferrocache.advise() shows \
                         the table",
                        gib(*capacity),
                        gib(*peak_reserved)
                    );
                }
                let env: String = candidate
                    .env()
                    .iter()
                    .map(|(name, value)| format!(" with {name}={value}"))
                    .collect();
                let current = current_peak_reserved
                    .map(|c| format!(", where the current setting needs {}", gib(c)))
                    .unwrap_or_default();
                format!(
                    "advice: PYTORCH_CUDA_ALLOC_CONF={}{env} would have served this program so \
                     far ({events} recorded allocations and frees, and this request) within the \
                     {} it could use on GPU {device}: peak reserved {}{current}; \
                     ferrocache.advise() shows the table",
                    report::shell_quote(&candidate.conf),
                    gib(*capacity),
                    gib(*peak_reserved)
                )
            }
            OomAdvice::NoneFits { capacity, tried } => format!(
                "advice: none of the {tried} settings tried would have served this program \
                 within the {} it could use on GPU {device} (the live tensors fit, but not \
                 with the cache around them); ferrocache.advise() shows the table",
                gib(*capacity)
            ),
        }
    }
}

/// The advice after an out-of-memory on `device`: the history so far with the failed request
/// served, searched within `capacity` (bounded by [`OOM_EVENT_BUDGET`]). `live` is what the
/// program held plus the request.
pub fn oom_advice(
    snapshot: &MemorySnapshot,
    config: &Config,
    device: i32,
    capacity: u64,
    live: u64,
) -> Result<OomAdvice, String> {
    if live > capacity {
        return Ok(OomAdvice::LiveBytesExceed { live, capacity });
    }
    let subject = live_subject(snapshot, config, device)?;
    // The request that failed was served by live_subject: it is not one of the recorded events.
    let events = subject
        .workload
        .ops
        .iter()
        .filter(|op| !matches!(op, crate::replay::Op::Oom { .. }))
        .count() as u64
        - u64::from(subject.served_oom.is_some());
    let options = TuneOptions {
        capacity,
        capacity_source: CapacitySource::Device,
        event_budget: Some(OOM_EVENT_BUDGET),
        tie_rule: config.modelled.tie_rule,
        ..TuneOptions::default()
    };
    let tuning = super::tune(std::slice::from_ref(&subject), &options);
    Ok(match tuning.recommendation() {
        Some(best) => OomAdvice::Setting {
            candidate: Box::new(best.candidate.clone()),
            peak_reserved: best.worst_peak_reserved(),
            current_peak_reserved: tuning
                .recorded()
                .filter(|r| r.fits())
                .map(|r| r.worst_peak_reserved()),
            capacity,
            events,
            is_current: tuning.recommended == tuning.recorded,
        },
        None => OomAdvice::NoneFits {
            capacity,
            tried: tuning.ranked.len(),
        },
    })
}

/// `ferrocache.advise()` on the process's history: the search and its report.
pub fn advise_live(
    snapshot: &MemorySnapshot,
    config: &Config,
    device: i32,
    capacity: (u64, CapacitySource),
    max_candidates: Option<usize>,
) -> Result<Tuning, String> {
    let subject = live_subject(snapshot, config, device)?;
    let options = TuneOptions {
        capacity: capacity.0,
        capacity_source: capacity.1,
        max_candidates,
        tie_rule: config.modelled.tie_rule,
        ..TuneOptions::default()
    };
    Ok(super::tune(std::slice::from_ref(&subject), &options))
}

/// The example of docs/tune.md and the tests: on a 200 MiB simulated GPU under PyTorch's
/// defaults, with history recorded, 100 MiB is allocated and freed, then two 60 MiB blocks are:
/// the first is carved from the cached 100 MiB block, stranding its 40 MiB tail, so the next
/// 50 MiB cannot be had although only 120 MiB are live. Returns the allocator and that
/// out-of-memory.
pub fn stranded_tail_example() -> (DeviceAllocator<SimDevice>, Box<OutOfMemoryError>) {
    const MIB: usize = 1 << 20;
    let mut device = SimDevice::new(200 * MIB);
    device.set_complete_immediately(true);
    let mut allocator = DeviceAllocator::new(device, 0, Config::default());
    allocator.record_history(true, usize::MAX);
    let first = allocator.malloc(100 * MIB, 0).expect("100 MiB of 200 MiB");
    let _ = allocator.free(first);
    for _ in 0..2 {
        allocator.malloc(60 * MIB, 0).expect("60 MiB, twice");
    }
    match allocator.malloc(50 * MIB, 0) {
        Err(AllocError::OutOfMemory(oom)) => (allocator, oom),
        other => panic!("the defaults should run out of memory here, not {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A history in which growing requests fragment the default cache.
    fn recorded_allocator(capacity: usize) -> DeviceAllocator<SimDevice> {
        let mut device = SimDevice::new(capacity);
        device.set_complete_immediately(true);
        let mut allocator = DeviceAllocator::new(device, 0, Config::default());
        allocator.record_history(true, usize::MAX);
        let mut live = Vec::new();
        for step in 1..=6usize {
            let size = (20 + 7 * step) * MIB;
            for _ in 0..3 {
                live.push(allocator.malloc(size, 0).unwrap());
            }
            for ptr in live.drain(..) {
                allocator.free(ptr).unwrap();
            }
        }
        allocator
    }

    #[test]
    fn the_live_history_reads_like_a_snapshot_file() {
        let allocator = recorded_allocator(8 << 30);
        let snapshot = allocator.history_snapshot();
        let subject = live_subject(&snapshot, allocator.config(), 0).unwrap();
        assert_eq!(subject.workload.ops.len(), 36);
        assert!(
            subject
                .workload
                .diagnostics
                .is_consistent(&subject.workload.figures)
        );
        assert_eq!(subject.recorded, Some(Candidate::defaults()));
        // The replay under the process's own setting is what the allocator did.
        let report = crate::replay::replay(
            &subject.workload,
            &Config::default(),
            &crate::replay::ReplayOptions::default(),
        );
        assert_eq!(
            report.peak_reserved,
            allocator.stats().reserved_bytes.all.peak as u64
        );
    }

    #[test]
    fn another_devices_history_is_found_under_its_index() {
        let mut device = SimDevice::new(1 << 30);
        device.set_complete_immediately(true);
        let mut allocator = DeviceAllocator::new(device, 2, Config::default());
        allocator.record_history(true, usize::MAX);
        let block = allocator.malloc(30 * MIB, 0).unwrap();
        allocator.free(block).unwrap();
        let subject = live_subject(&allocator.history_snapshot(), allocator.config(), 2).unwrap();
        assert_eq!(subject.workload.device, 2);
        assert_eq!(subject.workload.ops.len(), 2);
        assert_eq!(subject.workload.segment_decisions.len(), 1);
        assert!(
            subject
                .workload
                .diagnostics
                .is_consistent(&subject.workload.figures)
        );
    }

    #[test]
    fn without_history_the_error_says_how_to_record() {
        let allocator = DeviceAllocator::new(SimDevice::new(1 << 30), 0, Config::default());
        let err = live_subject(&allocator.history_snapshot(), allocator.config(), 0).unwrap_err();
        assert!(err.contains("_record_memory_history()"), "{err}");
    }

    #[test]
    fn an_out_of_memory_names_a_setting_that_would_have_served() {
        let (allocator, oom) = stranded_tail_example();
        let capacity = oom_capacity(
            oom.reserved as u64,
            oom.device_free as u64,
            oom.allowed.map(|a| a as u64),
        );
        assert_eq!(capacity, (200 * MIB) as u64);
        let advice = oom_advice(
            &allocator.history_snapshot(),
            allocator.config(),
            0,
            capacity,
            (oom.allocated + oom.allocation_size) as u64,
        )
        .unwrap();
        let OomAdvice::Setting {
            candidate,
            peak_reserved,
            is_current,
            events,
            ..
        } = &advice
        else {
            panic!("a setting should serve it: {advice:?}");
        };
        assert!(!is_current);
        assert!(!candidate.conf.is_empty() || candidate.cross_stream);
        assert!(*peak_reserved <= capacity);
        assert_eq!(*events, 4, "the request that failed is not counted");
        let line = advice.line(0);
        assert!(
            line.starts_with(&format!(
                "advice: PYTORCH_CUDA_ALLOC_CONF={} would have served this program so far",
                report::shell_quote(&candidate.conf)
            )),
            "{line}"
        );
    }

    #[test]
    fn live_bytes_beyond_the_memory_need_no_search() {
        let advice = oom_advice(
            &MemorySnapshot {
                segments: Vec::new(),
                device_traces: Vec::new(),
                allocator_settings: serde_json::Value::Null,
            },
            &Config::default(),
            0,
            1 << 30,
            2 << 30,
        )
        .unwrap();
        assert_eq!(
            advice.line(0),
            "advice: no PYTORCH_CUDA_ALLOC_CONF would have served this program: its live \
             tensors and this request alone need 2.00 GiB, more than the 1.00 GiB it could use \
             on GPU 0"
        );
    }
}
