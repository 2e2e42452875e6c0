//! Asynchrony, as the driver documents it, and the ordering check built on it.
//!
//! Work submitted to a stream (a copy, a memset) runs asynchronously: the host learns that it
//! finished only through a synchronization (`cuStreamSynchronize`, `cuCtxSynchronize`,
//! `cuEventSynchronize`), a query that answered "done" (`cuStreamQuery`, `cuEventQuery`), or an
//! implicit synchronization the documentation names (a synchronous copy; `cuMemFree`, which "may
//! perform implicit synchronization"). The fake moves the bytes at once but keeps its books as
//! if every piece of work were still running until one of those says otherwise. Order between
//! streams comes only from the stream semantics: program order within a stream,
//! `cuStreamWaitEvent` across streams, and the legacy default stream, which waits for and is
//! waited for by every blocking stream of its context. Each stream keeps a vector clock of the
//! work its next submission is ordered after.
//!
//! The check: device memory must never be unmapped, nor touched by a stream, while work of
//! another stream that touched it (one of the two writing) may still run and nothing orders the
//! two. That is the caching allocator's central promise: a block is handed to another stream, or
//! its pages unmapped, only after an event or a synchronization says its last use is done. A
//! violation is counted and reported on stderr; `FAKE_CUDA_ORDER_FATAL=1` aborts the process at
//! the first one (the test suites set it). `FAKE_CUDA_ORDER_REPORT=path` appends one line of
//! counts to `path` when the process exits.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

/// Where a stream's work goes: one lane per stream, as the driver orders them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Lane {
    /// A stream made by `cuStreamCreate*`, by its handle.
    Created(usize),
    /// The legacy default stream (`NULL`, `CU_STREAM_LEGACY`) of a context.
    Legacy(usize),
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`) of a context on one thread.
    PerThread(usize, u64),
}

impl Lane {
    fn context(self) -> usize {
        match self {
            Lane::Created(_) => 0,
            Lane::Legacy(context) | Lane::PerThread(context, _) => context,
        }
    }
}

/// For each lane, how many of its pieces of work (numbered from 1) come before.
#[derive(Clone, Default, Debug)]
pub struct Clock(HashMap<Lane, u64>);

impl Clock {
    fn covers(&self, lane: Lane, work: u64) -> bool {
        self.0.get(&lane).is_some_and(|&n| n >= work)
    }

    fn advance(&mut self, lane: Lane, work: u64) {
        let entry = self.0.entry(lane).or_default();
        *entry = (*entry).max(work);
    }

    pub fn join(&mut self, other: &Clock) {
        for (&lane, &work) in &other.0 {
            self.advance(lane, work);
        }
    }
}

struct LaneState {
    /// Pieces of work submitted so far.
    submitted: u64,
    /// What its next piece of work is ordered after, other than its own earlier work.
    after: Clock,
    /// Blocking streams synchronize with the legacy default stream of their context.
    blocking: bool,
    context: usize,
}

/// One piece of work's use of a device range.
struct Access {
    end: u64,
    lane: Lane,
    work: u64,
    write: bool,
}

/// A device range a piece of work touches.
#[derive(Clone, Copy)]
pub struct Touch {
    pub start: u64,
    pub len: u64,
    pub write: bool,
}

/// What the check looked at, for `fake_cuda_stat` and the report at exit.
#[derive(Default, Clone, Copy)]
pub struct Counts {
    /// Pieces of work submitted.
    pub work: u64,
    /// Uses of device memory that earlier work of another stream had touched and that was not
    /// known to be finished: each one had to be ordered after it.
    pub handoffs_checked: u64,
    /// `cuMemFree` calls (each synchronizes, as the documentation allows; none can fail the check).
    pub frees_checked: u64,
    /// `cuMemUnmap` calls checked for pending work on their pages.
    pub unmaps_checked: u64,
    pub violations: u64,
    /// Of the pieces of work, kernels and library calls (`launch.rs`).
    pub kernels: u64,
}

#[derive(Default)]
pub struct Timeline {
    lanes: HashMap<Lane, LaneState>,
    /// The work the host knows to be finished.
    finished: Clock,
    /// Uses of device memory by work not known to be finished, by start address.
    pending: BTreeMap<u64, Vec<Access>>,
    /// The longest range in `pending`, so that a look-up knows how far back to start.
    longest: u64,
    pub counts: Counts,
}

/// Whether `FAKE_CUDA_ORDER_FATAL` asks for an abort at the first violation.
fn fatal() -> bool {
    static FATAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FATAL.get_or_init(|| {
        std::env::var("FAKE_CUDA_ORDER_FATAL").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

impl Timeline {
    /// A stream made by `cuStreamCreate*` in `context`; `blocking` unless made with
    /// `CU_STREAM_NON_BLOCKING`.
    pub fn stream_created(&mut self, handle: usize, context: usize, blocking: bool) {
        self.lanes.insert(
            Lane::Created(handle),
            LaneState {
                submitted: 0,
                after: Clock::default(),
                blocking,
                context,
            },
        );
    }

    fn lane_mut(&mut self, lane: Lane) -> &mut LaneState {
        self.lanes.entry(lane).or_insert_with(|| LaneState {
            submitted: 0,
            after: Clock::default(),
            // The default streams are blocking: the per-thread one synchronizes with the
            // legacy one, as the documentation says.
            blocking: !matches!(lane, Lane::Legacy(_)),
            context: lane.context(),
        })
    }

    /// Everything that precedes the next piece of work submitted to `lane`, its own included.
    pub fn clock_of(&mut self, lane: Lane) -> Clock {
        let state = self.lane_mut(lane);
        let mut clock = state.after.clone();
        clock.advance(lane, state.submitted);
        clock
    }

    /// `cuStreamWaitEvent`: the lane's later work runs after what `clock` covers.
    pub fn wait(&mut self, lane: Lane, clock: &Clock) {
        self.lane_mut(lane).after.join(clock);
    }

    /// The host learned that everything `clock` covers has finished.
    pub fn finished(&mut self, clock: &Clock) {
        self.finished.join(clock);
        self.forget_finished();
    }

    /// `cuStreamSynchronize` or a query that answered "done": the lane's work so far has
    /// finished, and so has everything it waited for.
    pub fn lane_finished(&mut self, lane: Lane) {
        let clock = self.clock_of(lane);
        self.finished(&clock);
    }

    /// `cuCtxSynchronize`: all work of every stream of `context` has finished.
    pub fn context_finished(&mut self, context: usize) {
        let lanes: Vec<Lane> = self
            .lanes
            .iter()
            .filter(|(_, state)| state.context == context)
            .map(|(&lane, _)| lane)
            .collect();
        for lane in lanes {
            self.lane_finished(lane);
        }
    }

    fn forget_finished(&mut self) {
        let finished = &self.finished;
        self.pending.retain(|_, accesses| {
            accesses.retain(|a| !finished.covers(a.lane, a.work));
            !accesses.is_empty()
        });
        if self.pending.is_empty() {
            self.longest = 0;
        }
    }

    /// Submits one piece of work to `lane` that touches `touches`; checks each touch against the
    /// pending work of other streams.
    pub fn submit(&mut self, lane: Lane, touches: &[Touch], what: &str) {
        self.order_with_legacy_stream(lane);
        let state = self.lane_mut(lane);
        state.submitted += 1;
        let work = state.submitted;
        let after = state.after.clone();
        self.counts.work += 1;
        for touch in touches.iter().filter(|t| t.len > 0) {
            let end = touch.start.saturating_add(touch.len);
            let others: Vec<(u64, u64, Lane, u64, bool)> = self
                .overlapping(touch.start, end)
                .filter(|(_, a)| a.lane != lane && !self.finished.covers(a.lane, a.work))
                .map(|(&s, a)| (s, a.end, a.lane, a.work, a.write))
                .collect();
            self.counts.handoffs_checked += others.len() as u64;
            let conflicts: Vec<_> = others
                .into_iter()
                .filter(|&(_, _, other, other_work, other_write)| {
                    (touch.write || other_write) && !after.covers(other, other_work)
                })
                .collect();
            if let Some(&(start, access_end, other, other_work, other_write)) = conflicts.first() {
                self.violation(&format!(
                    "{what} on {lane:?} {} [{:#x}, {end:#x}) while work #{other_work} of \
                     {other:?}, which {} [{start:#x}, {access_end:#x}), may still run and no \
                     event or synchronization orders the two ({} such piece(s) of work)",
                    if touch.write { "writes" } else { "reads" },
                    touch.start,
                    if other_write { "wrote" } else { "read" },
                    conflicts.len(),
                ));
            }
            self.record(touch.start, end, lane, work, touch.write, &after);
        }
    }

    /// The legacy default stream waits for every blocking stream of its context, and a blocking
    /// stream waits for the legacy stream's earlier work.
    fn order_with_legacy_stream(&mut self, lane: Lane) {
        match lane {
            Lane::Legacy(context) => {
                let blocking: Vec<Lane> = self
                    .lanes
                    .iter()
                    .filter(|(l, s)| s.blocking && s.context == context && **l != lane)
                    .map(|(&l, _)| l)
                    .collect();
                for other in blocking {
                    let clock = self.clock_of(other);
                    self.wait(lane, &clock);
                }
            }
            _ => {
                let state = self.lane_mut(lane);
                if state.blocking {
                    let legacy = Lane::Legacy(state.context);
                    let clock = self.clock_of(legacy);
                    self.wait(lane, &clock);
                }
            }
        }
    }

    fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = (&u64, &Access)> {
        self.pending
            .range(start.saturating_sub(self.longest)..end)
            .flat_map(|(s, accesses)| accesses.iter().map(move |a| (s, a)))
            .filter(move |(s, a)| **s < end && a.end > start)
    }

    fn record(&mut self, start: u64, end: u64, lane: Lane, work: u64, write: bool, after: &Clock) {
        let accesses = self.pending.entry(start).or_default();
        // Earlier work that this work is ordered after, on a range this one covers, need not be
        // kept: whatever must wait for it must wait for this too (a read does not cover a write).
        accesses.retain(|a| {
            let ordered_before = a.lane == lane || after.covers(a.lane, a.work);
            !(ordered_before && a.end <= end && (write || !a.write))
        });
        accesses.push(Access {
            end,
            lane,
            work,
            write,
        });
        self.longest = self.longest.max(end - start);
    }

    /// `cuMemUnmap`: no pending work may touch the pages any more.
    pub fn check_unmap(&mut self, start: u64, len: u64) {
        self.counts.unmaps_checked += 1;
        let end = start.saturating_add(len);
        let busy: Vec<(Lane, u64)> = self
            .overlapping(start, end)
            .filter(|(_, a)| !self.finished.covers(a.lane, a.work))
            .map(|(_, a)| (a.lane, a.work))
            .collect();
        if let Some((lane, work)) = busy.first() {
            self.violation(&format!(
                "cuMemUnmap of [{start:#x}, {end:#x}) while work #{work} of {lane:?} that touched \
                 it may still run ({} piece(s) of pending work there)",
                busy.len()
            ));
        }
    }

    fn violation(&mut self, what: &str) {
        self.counts.violations += 1;
        eprintln!("fake-cuda: ORDER VIOLATION: {what}");
        if fatal() {
            eprintln!("fake-cuda: FAKE_CUDA_ORDER_FATAL is set: aborting");
            std::process::abort();
        }
    }

    /// Pieces of work whose use of memory the host does not yet know to be finished.
    pub fn pending_uses(&self) -> u64 {
        self.pending.values().map(|a| a.len() as u64).sum()
    }
}

/// Appends the counts to `FAKE_CUDA_ORDER_REPORT`, if set: called once at process exit.
pub fn write_report(counts: Counts) {
    let Some(path) = std::env::var_os("FAKE_CUDA_ORDER_REPORT").filter(|p| !p.is_empty()) else {
        return;
    };
    let line = format!(
        "pid {} work {} handoffs_checked {} frees_checked {} unmaps_checked {} violations {} kernels {}\n",
        std::process::id(),
        counts.work,
        counts.handoffs_checked,
        counts.frees_checked,
        counts.unmaps_checked,
        counts.violations,
        counts.kernels
    );
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = file.write_all(line.as_bytes());
    }
}
