//! Which `PYTORCH_CUDA_ALLOC_CONF` to set: the settings space searched on recordings with the
//! replay engine (`ferrocache tune`, `ferrocache.advise()`, the out-of-memory advice).
//!
//! [`SearchSpace`] lists the candidates from the recordings themselves; [`tune`] replays every
//! candidate on every recording, each replay on its own simulated GPU, in parallel over the
//! cores (rayon), and ranks them ([`Tuning`]); [`report`] writes the table, the lines to paste
//! and the JSON; [`live`] does the same from this process's own history.
//!
//! **The objective.** The lowest peak reserved with no out-of-memory at the capacity. With
//! several recordings (the ranks of one job, several runs of one script) one setting serves
//! them all: the one whose worst recording has the lowest peak. Ties go to the lowest sum of
//! peaks, then to the fewest device allocations (`cudaMalloc`s and mapped pages, over all
//! recordings), then to the setting with the fewest keys, then to the earlier candidate.
//!
//! **Faithful numbers.** A candidate's figures are exactly what `ferrocache replay` prints for
//! the same trace, setting, capacity and start (`--conf`, `--cross-stream`, `--capacity-gib`,
//! `--fresh`): the same engine, deterministic, no timing in the decisions.

#![forbid(unsafe_code)]

pub mod live;
pub mod report;
pub mod space;
mod subject;

pub use space::{Candidate, SearchSpace, conf_of, same_policy};
pub use subject::{
    CapacitySource, DEFAULT_CAPACITY, Subject, final_oom, recorded_capacity, recorded_setting,
    search_capacity, serve_final_oom, short_trace,
};

use crate::policy::TieRule;
use crate::replay::faithful::{self, Reproduction};
use crate::replay::{
    self, DeviceWorkload, MemoryPoint, Op, ReplayOptions, ReplayReport, StartState, Workload,
};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// `ferrocache tune` on one snapshot's bytes (pickle or JSON), as `ferrocache.advise(snapshot)`
/// asks it: every device of it, or only `device`; a recording that ends in an out-of-memory has
/// that request served ([`Subject::serve_final_oom`]). `tie_rule` is the rule the settings are
/// judged by; `assumed`, the rule kept for the recording where its decisions do not tell
/// ([`Workload::reconstruct`]).
pub fn tune_snapshot(
    bytes: &[u8],
    device: Option<usize>,
    capacity: Option<u64>,
    max_candidates: Option<usize>,
    tie_rule: TieRule,
    assumed: TieRule,
) -> Result<Tuning, String> {
    let snapshot = replay::parse_snapshot(bytes, "the snapshot").map_err(|e| e.to_string())?;
    let workload = Workload::reconstruct(&snapshot, assumed);
    let recorded = recorded_setting(&snapshot, &workload);
    let recorded_capacity = workload
        .devices
        .iter()
        .filter_map(|d| recorded_capacity(&snapshot, d))
        .min();
    let mut subjects = Subject::from_workload("snapshot", None, workload, recorded);
    for subject in &mut subjects {
        subject.serve_final_oom();
    }
    if let Some(device) = device {
        subjects.retain(|s| s.workload.device == device);
        if subjects.is_empty() {
            return Err(format!("the snapshot holds nothing of device {device}"));
        }
    }
    let (capacity, capacity_source) = search_capacity(capacity, recorded_capacity);
    let options = TuneOptions {
        capacity,
        capacity_source,
        max_candidates,
        tie_rule,
        ..TuneOptions::default()
    };
    Ok(tune(&subjects, &options))
}

/// How to search.
#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// Bytes of memory of the simulated GPU.
    pub capacity: u64,
    pub capacity_source: CapacitySource,
    pub start: StartState,
    /// The subjects are the ranks of one job (the report speaks of ranks).
    pub job: bool,
    /// Try at most this many candidates (the simplest first).
    pub max_candidates: Option<usize>,
    /// Try at most as many candidates as fit this many replayed events in all.
    pub event_budget: Option<u64>,
    /// Worker threads; `None`: rayon's default (`RAYON_NUM_THREADS`, else every core).
    pub threads: Option<usize>,
    /// How every candidate breaks ties between equal cached blocks: the rule of the PyTorch
    /// the recording's process ran (advice from a running process), else PyTorch 2.15's.
    pub tie_rule: TieRule,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            capacity: DEFAULT_CAPACITY,
            capacity_source: CapacitySource::Default,
            start: StartState::Reconstructed,
            job: false,
            max_candidates: None,
            event_budget: None,
            threads: None,
            tie_rule: TieRule::default(),
        }
    }
}

/// What one candidate did on one subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figures {
    pub peak_reserved: u64,
    pub peak_requested: u64,
    /// `cudaMalloc`s and page mappings over the whole replay (`num_device_alloc`).
    pub device_allocs: u64,
    pub retries: u64,
    pub ooms: u64,
}

impl Figures {
    fn of(report: &ReplayReport) -> Figures {
        Figures {
            peak_reserved: report.peak_reserved,
            peak_requested: report.peak_requested,
            device_allocs: report.device_mallocs,
            retries: report.retries,
            ooms: report.ooms,
        }
    }
}

/// A candidate and what it did on every subject.
#[derive(Debug, Clone)]
pub struct Evaluated {
    pub candidate: Candidate,
    /// Per subject, in the subjects' order.
    pub figures: Vec<Figures>,
    /// Its place in the generated list (the last tie-break).
    pub order: usize,
}

impl Evaluated {
    /// The subject with the highest peak reserved (the first among equals).
    pub fn worst(&self) -> usize {
        let mut worst = 0;
        for (index, f) in self.figures.iter().enumerate() {
            if f.peak_reserved > self.figures[worst].peak_reserved {
                worst = index;
            }
        }
        worst
    }

    pub fn worst_peak_reserved(&self) -> u64 {
        self.figures
            .get(self.worst())
            .map_or(0, |f| f.peak_reserved)
    }

    pub fn sum_peak_reserved(&self) -> u64 {
        self.figures
            .iter()
            .fold(0u64, |sum, f| sum.saturating_add(f.peak_reserved))
    }

    pub fn device_allocs(&self) -> u64 {
        self.figures.iter().map(|f| f.device_allocs).sum()
    }

    pub fn retries(&self) -> u64 {
        self.figures.iter().map(|f| f.retries).sum()
    }

    pub fn ooms(&self) -> u64 {
        self.figures.iter().map(|f| f.ooms).sum()
    }

    /// Whether it served every recording within the capacity.
    pub fn fits(&self) -> bool {
        self.ooms() == 0
    }

    /// The ranking key, smallest best (see the module docs).
    fn rank_key(&self) -> (u64, u64, u64, u64, usize, usize) {
        (
            self.ooms(),
            self.worst_peak_reserved(),
            self.sum_peak_reserved(),
            self.device_allocs(),
            self.candidate.keys(),
            self.order,
        )
    }
}

/// The outcome of a search.
#[derive(Debug, Clone)]
pub struct Tuning {
    pub subjects: Vec<SubjectInfo>,
    /// Every candidate tried, best first.
    pub ranked: Vec<Evaluated>,
    /// Index in `ranked` of PyTorch's defaults.
    pub defaults: usize,
    /// Index in `ranked` of the setting the recordings ran under, when they say (the first
    /// subject's, when they differ; see `recorded_differ`).
    pub recorded: Option<usize>,
    /// Whether the subjects were recorded under different settings.
    pub recorded_differ: bool,
    /// Index in `ranked` of the recommendation: the best, when it fits.
    pub recommended: Option<usize>,
    /// Candidates the space held before the budget cut it short.
    pub space_size: usize,
    pub options: TuneOptions,
    pub elapsed: Duration,
    pub threads: usize,
}

/// What the report needs of a subject once the search is done.
#[derive(Debug, Clone)]
pub struct SubjectInfo {
    pub name: String,
    pub rank: Option<u32>,
    pub events: u64,
    /// What the program itself held at most (the same under every setting, start included).
    pub peak_requested: u64,
    /// Bytes live at the start of the recording (requested).
    pub live_at_start: u64,
    /// The request the recording ran out of memory for, served in the search.
    pub served_oom: Option<u64>,
    /// How closely its replay under the setting it was recorded with (PyTorch's defaults when
    /// it does not say), from the reconstructed start, reproduced it: the search's figures are
    /// only as good as that.
    pub reproduction: Reproduction,
}

impl Tuning {
    /// The recordings whose replay does not reproduce them: what a setting saves on them is
    /// not claimed.
    pub fn unreproduced(&self) -> impl Iterator<Item = &SubjectInfo> {
        self.subjects
            .iter()
            .filter(|s| !s.reproduction.reproduced())
    }

    /// Whether the savings found can be claimed: every recording's replay reproduces it.
    pub fn claims_savings(&self) -> bool {
        self.unreproduced().next().is_none()
    }
}

/// The self-check of `subject` ([`faithful::self_check`]): its workload as recorded (a request
/// it ran out of memory for unserved again), under the setting it ran with.
fn self_check(subject: &Subject, capacity: u64) -> Reproduction {
    let recorded = subject
        .recorded
        .as_ref()
        .map(|c| c.config.clone())
        .unwrap_or_default();
    if subject.served_oom.is_none() {
        return faithful::self_check(&subject.workload, &recorded, capacity);
    }
    let mut workload = subject.workload.clone();
    let served = workload.allocations.len().checked_sub(1);
    if let Some(op) = workload
        .ops
        .iter_mut()
        .rev()
        .find(|op| matches!(op, Op::Alloc { id, .. } if Some(*id as usize) == served))
        && let Op::Alloc { size, stream, .. } = *op
    {
        *op = Op::Oom { size, stream };
    }
    faithful::self_check(&workload, &recorded, capacity)
}

/// Searches the settings space of `subjects` (see the module docs). `subjects` must not be
/// empty.
pub fn tune(subjects: &[Subject], options: &TuneOptions) -> Tuning {
    let workloads: Vec<&DeviceWorkload> = subjects.iter().map(|s| &s.workload).collect();
    let space = SearchSpace::of(&workloads, options.capacity_source == CapacitySource::Given);
    let mut candidates = space.candidates();
    let space_size = candidates.len();
    let events: u64 = subjects.iter().map(Subject::events).sum::<u64>().max(1);
    let mut keep = options.max_candidates.unwrap_or(usize::MAX);
    if let Some(budget) = options.event_budget {
        keep = keep.min(usize::try_from(budget / events).unwrap_or(usize::MAX));
    }
    candidates.truncate(keep.max(1));
    // The recorded settings are always judged, even outside the space or past the budget.
    for subject in subjects {
        if let Some(recorded) = &subject.recorded
            && !candidates.iter().any(|c| c.same_setting(recorded))
        {
            candidates.push(recorded.clone());
        }
    }
    tune_candidates(subjects, candidates, space_size, options)
}

/// Replays `candidates` (the defaults among them, or they are added) on every subject and
/// ranks them.
pub fn tune_candidates(
    subjects: &[Subject],
    mut candidates: Vec<Candidate>,
    space_size: usize,
    options: &TuneOptions,
) -> Tuning {
    let started = Instant::now();
    if !candidates
        .iter()
        .any(|c| c.same_setting(&Candidate::defaults()))
    {
        candidates.insert(0, Candidate::defaults());
    }
    // Every candidate is replayed under the rule of the PyTorch being modelled.
    for candidate in &mut candidates {
        candidate.config.modelled.tie_rule = options.tie_rule;
    }
    let replay_options = ReplayOptions {
        capacity: options.capacity,
        start: options.start,
        record_timeline: false,
    };
    let pairs: Vec<(usize, usize)> = (0..candidates.len())
        .flat_map(|c| (0..subjects.len()).map(move |s| (c, s)))
        .collect();
    let run = |&(c, s): &(usize, usize)| {
        Figures::of(&replay::replay(
            &subjects[s].workload,
            &candidates[c].config,
            &replay_options,
        ))
    };
    let (figures, threads): (Vec<Figures>, usize) =
        in_parallel(options.threads, || pairs.par_iter().map(run).collect());
    let mut evaluated: Vec<Evaluated> = candidates
        .into_iter()
        .enumerate()
        .map(|(order, candidate)| Evaluated {
            candidate,
            figures: Vec::with_capacity(subjects.len()),
            order,
        })
        .collect();
    for (&(c, _), f) in pairs.iter().zip(figures) {
        evaluated[c].figures.push(f);
    }
    evaluated.sort_by_key(Evaluated::rank_key);

    let find = |wanted: &Candidate| {
        evaluated
            .iter()
            .position(|e| e.candidate.same_setting(wanted))
    };
    let defaults = find(&Candidate::defaults()).unwrap_or(0);
    let recorded_settings: Vec<&Candidate> = subjects
        .iter()
        .filter_map(|s| s.recorded.as_ref())
        .collect();
    let recorded = recorded_settings.first().and_then(|r| find(r));
    let recorded_differ = recorded_settings
        .windows(2)
        .any(|pair| !pair[0].same_setting(pair[1]));
    let recommended = evaluated.first().filter(|e| e.fits()).map(|_| 0);
    Tuning {
        subjects: subjects
            .iter()
            .map(|s| SubjectInfo {
                name: s.name.clone(),
                rank: s.rank,
                events: s
                    .workload
                    .ops
                    .iter()
                    .filter(|op| !matches!(op, Op::Oom { .. }))
                    .count() as u64,
                peak_requested: s.workload.figures.peak_requested,
                live_at_start: s.workload.figures.live_at_start_requested,
                served_oom: s.served_oom,
                reproduction: self_check(s, options.capacity),
            })
            .collect(),
        ranked: evaluated,
        defaults,
        recorded,
        recorded_differ,
        recommended,
        space_size,
        options: options.clone(),
        elapsed: started.elapsed(),
        threads,
    }
}

/// Runs `work` on a thread pool of its own (`threads`, or rayon's default), whose threads log
/// nothing: their allocators are simulations, their lines are not the process's. Without a
/// pool (threads cannot be made) the work runs here, silenced the same way. Returns the
/// result and the number of threads.
fn in_parallel<R: Send>(threads: Option<usize>, work: impl FnOnce() -> R + Send) -> (R, usize) {
    let mut builder =
        rayon::ThreadPoolBuilder::new().start_handler(|_| crate::logging::silence_this_thread());
    if let Some(threads) = threads {
        builder = builder.num_threads(threads.max(1));
    }
    match builder.build() {
        Ok(pool) => {
            let threads = pool.current_num_threads();
            (pool.install(work), threads)
        }
        Err(_) => (crate::logging::silenced(work), 1),
    }
}

impl Tuning {
    pub fn recommendation(&self) -> Option<&Evaluated> {
        self.recommended.map(|i| &self.ranked[i])
    }

    pub fn defaults(&self) -> &Evaluated {
        &self.ranked[self.defaults]
    }

    pub fn recorded(&self) -> Option<&Evaluated> {
        self.recorded.map(|i| &self.ranked[i])
    }

    /// The highest peak requested over the subjects: no setting reserves less.
    pub fn peak_requested(&self) -> u64 {
        self.subjects
            .iter()
            .map(|s| s.peak_requested)
            .max()
            .unwrap_or(0)
    }
}

/// Requested and reserved bytes over each subject under `candidate` (for the plot): the same
/// replay, with the timeline kept.
pub fn timelines(
    subjects: &[Subject],
    candidate: &Candidate,
    options: &TuneOptions,
) -> Vec<Vec<MemoryPoint>> {
    let replay_options = ReplayOptions {
        capacity: options.capacity,
        start: options.start,
        record_timeline: true,
    };
    crate::logging::silenced(|| {
        subjects
            .iter()
            .map(|s| replay::replay(&s.workload, &candidate.config, &replay_options).timeline)
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::replay::demo::{self, DemoSpec};

    fn subject(workload: DeviceWorkload) -> Subject {
        Subject {
            name: "demo".to_string(),
            rank: None,
            workload,
            recorded: None,
            served_oom: None,
        }
    }

    #[test]
    fn conf_of_writes_what_parse_reads() {
        for conf in [
            "",
            "expandable_segments:True",
            "max_split_size_mb:128,max_non_split_rounding_mb:64",
            "roundup_power2_divisions:4",
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
            "garbage_collection_threshold:0.7,per_process_memory_fraction:0.5",
            "large_segment_size_mb:40,max_split_size_mb:40",
        ] {
            let config = Config::parse(conf).unwrap();
            let written = conf_of(&config);
            let read = Config::parse(&written)
                .unwrap_or_else(|e| panic!("{conf:?} -> {written:?}: {}", e.message));
            assert!(same_policy(&config, &read), "{conf:?} -> {written:?}");
        }
        assert_eq!(conf_of(&Config::default()), "");
    }

    #[test]
    fn the_defaults_are_always_judged_and_the_best_fitting_one_recommended() {
        let workload = demo::build(&DemoSpec::tiny());
        let subjects = vec![subject(workload)];
        let options = TuneOptions {
            threads: Some(2),
            ..TuneOptions::default()
        };
        let tuning = tune(&subjects, &options);
        assert_eq!(tuning.ranked.len(), tuning.space_size);
        let best = tuning.recommendation().expect("the tiny demo fits 80 GiB");
        for other in &tuning.ranked {
            assert!(best.worst_peak_reserved() <= other.worst_peak_reserved());
        }
        assert_eq!(tuning.defaults().candidate.conf, "");
        // Each figure is the replay's own.
        let again = replay::replay(
            &subjects[0].workload,
            &best.candidate.config,
            &ReplayOptions::default(),
        );
        assert_eq!(again.peak_reserved, best.worst_peak_reserved());
    }

    #[test]
    fn every_tie_rule_judges_each_setting_once_and_finds_the_recorded_one() {
        let workload = demo::build(&DemoSpec::tiny());
        let mut recorded = subject(workload);
        // As a snapshot file says it: parsed, with PyTorch 2.15's rule.
        recorded.recorded = Some(Candidate::new("roundup_power2_divisions:4", false).unwrap());
        let subjects = vec![recorded];
        for tie_rule in [TieRule::Address, TieRule::BlockOrder, TieRule::SegmentOrder] {
            let options = TuneOptions {
                threads: Some(2),
                max_candidates: Some(4),
                tie_rule,
                ..TuneOptions::default()
            };
            let tuning = tune(&subjects, &options);
            for (i, a) in tuning.ranked.iter().enumerate() {
                assert_eq!(a.candidate.config.modelled.tie_rule, tie_rule);
                for b in &tuning.ranked[i + 1..] {
                    assert!(
                        !a.candidate.same_setting(&b.candidate),
                        "{tie_rule:?}: {} judged twice",
                        a.candidate.label()
                    );
                }
            }
            assert_eq!(tuning.defaults().candidate.conf, "", "{tie_rule:?}");
            let found = tuning.recorded().map(|e| e.candidate.conf.as_str());
            assert_eq!(found, Some("roundup_power2_divisions:4"), "{tie_rule:?}");
        }
    }

    #[test]
    fn a_budget_keeps_the_simplest_candidates() {
        let subjects = vec![subject(demo::build(&DemoSpec::tiny()))];
        let events = subjects[0].events();
        let options = TuneOptions {
            event_budget: Some(events * 3),
            threads: Some(1),
            ..TuneOptions::default()
        };
        let tuning = tune(&subjects, &options);
        assert_eq!(tuning.ranked.len(), 3);
        assert!(tuning.ranked.iter().all(|e| e.candidate.keys() <= 1));
    }

    #[test]
    fn several_subjects_are_judged_by_the_worst() {
        let small = demo::build(&DemoSpec::tiny());
        let large = demo::build(&DemoSpec {
            layers: 3,
            ..DemoSpec::tiny()
        });
        let subjects = vec![subject(small), subject(large)];
        let tuning = tune(
            &subjects,
            &TuneOptions {
                threads: Some(2),
                max_candidates: Some(6),
                ..TuneOptions::default()
            },
        );
        for e in &tuning.ranked {
            assert_eq!(e.figures.len(), 2);
            assert_eq!(e.worst(), 1, "the larger model is the worst rank");
        }
        let keys: Vec<_> = tuning.ranked.iter().map(Evaluated::rank_key).collect();
        assert!(keys.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_capacity_too_small_recommends_nothing() {
        let subjects = vec![subject(demo::build(&DemoSpec::tiny()))];
        let tuning = tune(
            &subjects,
            &TuneOptions {
                capacity: 1 << 20,
                capacity_source: CapacitySource::Given,
                threads: Some(1),
                max_candidates: Some(4),
                ..TuneOptions::default()
            },
        );
        assert!(tuning.recommendation().is_none());
        assert!(tuning.ranked.iter().all(|e| !e.fits()));
    }
}
