//! The recordings a search runs on ([`Subject`]: one device of one snapshot) and what they tell
//! beyond their workload: the setting they ran under, the GPU's memory, the out-of-memory they
//! end in.

use super::space::{Candidate, conf_of};
use crate::policy::TieRule;
use crate::replay::{self, DeviceWorkload, Op, Snapshot, Workload};
use crate::trace::TraceAction;

/// The capacity when neither the user nor the recording says: an 80 GiB card (A100/H100).
pub const DEFAULT_CAPACITY: u64 = replay::DEFAULT_CAPACITY;

/// Where the simulated GPU's memory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapacitySource {
    /// `--capacity-gib` (or `advise(capacity_gib=...)`).
    Given,
    /// The recording's device: the free memory its `oom` entries report plus what was
    /// reserved then.
    Recording,
    /// The device this process runs on (total memory, or the memory fraction's limit).
    Device,
    /// Neither said: [`DEFAULT_CAPACITY`].
    Default,
}

impl CapacitySource {
    pub fn as_str(self) -> &'static str {
        match self {
            CapacitySource::Given => "given",
            CapacitySource::Recording => "recording",
            CapacitySource::Device => "device",
            CapacitySource::Default => "default",
        }
    }
}

/// One recording to tune on: one device of one snapshot.
#[derive(Debug, Clone)]
pub struct Subject {
    /// The trace as given (with ` (device N)` when its snapshot has several).
    pub name: String,
    /// Its rank, for a job.
    pub rank: Option<u32>,
    pub workload: DeviceWorkload,
    /// The setting it was recorded under, when the snapshot says.
    pub recorded: Option<Candidate>,
    /// The size of the request it ended in running out of memory for, when
    /// [`Subject::serve_final_oom`] made that request part of the workload.
    pub served_oom: Option<u64>,
}

impl Subject {
    /// When the recording ends in an out-of-memory ([`final_oom`]), makes the failed request
    /// part of the workload, so that the search finds a setting that serves it; says whether it
    /// did. A recording that ends so without this would make every setting look enough.
    pub fn serve_final_oom(&mut self) -> bool {
        let Some(size) = serve_final_oom(&mut self.workload) else {
            return false;
        };
        self.served_oom = Some(size);
        true
    }

    /// One subject per device of `snapshot`, named after `name`; `assumed` is the tie rule kept
    /// where the recording's decisions do not tell ([`Workload::reconstruct`]).
    pub fn from_snapshot(
        name: &str,
        rank: Option<u32>,
        snapshot: &Snapshot,
        assumed: TieRule,
    ) -> Vec<Subject> {
        let workload = Workload::reconstruct(snapshot, assumed);
        let recorded = recorded_setting(snapshot, &workload);
        Subject::from_workload(name, rank, workload, recorded)
    }

    /// One subject per device of `workload` (reconstructed from a snapshot), named after
    /// `name`, each recorded under `recorded`.
    pub fn from_workload(
        name: &str,
        rank: Option<u32>,
        workload: Workload,
        recorded: Option<Candidate>,
    ) -> Vec<Subject> {
        let several = workload.devices.len() > 1;
        workload
            .devices
            .into_iter()
            .map(|device| Subject {
                name: if several {
                    format!("{name} (device {})", device.device)
                } else {
                    name.to_string()
                },
                rank,
                recorded: recorded.clone(),
                workload: device,
                served_oom: None,
            })
            .collect()
    }

    /// Operations replayed per candidate (the start state's allocations included).
    pub fn events(&self) -> u64 {
        (self.workload.ops.len() + self.workload.start_allocations.len()) as u64
    }

    /// How a table names it: `rank 3` in a job, else the file name.
    pub fn short_name(&self) -> String {
        let file = short_trace(&self.name);
        match self.rank {
            Some(rank) => format!("rank {rank} ({file})"),
            None => file,
        }
    }
}

/// The setting a snapshot was recorded under: the raw `PYTORCH_CUDA_ALLOC_CONF` when PyTorch
/// wrote it and it still reads, else the recorded values written as a conf; `None` when the
/// snapshot does not say.
pub fn recorded_setting(snapshot: &Snapshot, workload: &Workload) -> Option<Candidate> {
    let settings = snapshot.allocator_settings.as_ref()?;
    if let Some(raw) = &settings.alloc_conf
        && let Ok(candidate) = Candidate::new(raw, false)
    {
        return Some(candidate);
    }
    Candidate::new(&conf_of(&workload.config), false).ok()
}

/// The memory of the recording's device as far as the snapshot tells: at each `oom` entry,
/// the free memory CUDA reported plus what PyTorch held then; the largest such figure.
pub fn recorded_capacity(snapshot: &Snapshot, workload: &DeviceWorkload) -> Option<u64> {
    let trace = snapshot.device_traces.get(workload.device)?;
    let mut best: Option<u64> = None;
    for (index, event) in trace.iter().enumerate() {
        if event.action != Some(TraceAction::Oom) {
            continue;
        }
        let Some(free) = event.device_free else {
            continue;
        };
        let reserved = workload
            .timeline
            .iter()
            .take_while(|point| point.trace_index <= index)
            .last()
            .map_or(workload.figures.reserved_at_start, |point| point.reserved);
        let capacity = reserved.saturating_add(free);
        best = Some(best.map_or(capacity, |b| b.max(capacity)));
    }
    best
}

/// The GPU a search fits the settings in: the memory given, else the smallest that the
/// recordings' out-of-memory entries tell ([`recorded_capacity`]), else [`DEFAULT_CAPACITY`].
pub fn search_capacity(given: Option<u64>, recorded: Option<u64>) -> (u64, CapacitySource) {
    match (given, recorded) {
        (Some(bytes), _) => (bytes, CapacitySource::Given),
        (None, Some(bytes)) => (bytes, CapacitySource::Recording),
        (None, None) => (DEFAULT_CAPACITY, CapacitySource::Default),
    }
}

/// The trace's file name with its device (the table is for reading; JSON keeps the path).
pub fn short_trace(trace: &str) -> String {
    let (path, device) = match trace.find(" (device ") {
        Some(at) => trace.split_at(at),
        None => (trace, ""),
    };
    let name = std::path::Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_string());
    format!("{name}{device}")
}

/// The request of the out-of-memory a recording ends in: its last `Oom` when no allocation
/// follows it (the program died of it, or dumped its snapshot there; frees of tensors released
/// while the exception unwound may follow). `None` when the program carried on after its last
/// out-of-memory, or never ran out.
pub fn final_oom(workload: &DeviceWorkload) -> Option<(usize, u64, u64)> {
    let at = workload
        .ops
        .iter()
        .rposition(|op| matches!(op, Op::Oom { .. }))?;
    let carried_on = workload.ops[at + 1..]
        .iter()
        .any(|op| matches!(op, Op::Alloc { .. }));
    match workload.ops[at] {
        Op::Oom { size, stream } if !carried_on => Some((at, size, stream)),
        _ => None,
    }
}

/// Serves the out-of-memory `workload` ends in ([`final_oom`]): the request PyTorch (or
/// ferrocache) could not satisfy becomes an allocation of its (rounded) size, so that a search
/// looks for a setting under which the program would have gone on. Returns that size; `None`,
/// and the workload unchanged, when it does not end in an out-of-memory.
pub fn serve_final_oom(workload: &mut DeviceWorkload) -> Option<u64> {
    let (at, size, stream) = final_oom(workload)?;
    let id = workload.allocations.len() as u32;
    workload.allocations.push(replay::Allocation {
        address: 0,
        requested_size: size,
        stream,
        live_at_start: false,
        placed: None,
    });
    workload.ops[at] = Op::Alloc { id, size, stream };
    Some(size)
}
