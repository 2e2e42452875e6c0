//! What a snapshot does not say, found from PyTorch's own decisions in it, so that a replay
//! reproduces its recording.
//!
//! - **The order PyTorch made the start segments in.** From PyTorch 2.13 on, best fit breaks
//!   ties between equal cached blocks by the segment made first (2.12: the block made first).
//!   A snapshot lists its segments by address and does not record which was made first; the
//!   driver gives a newer segment a lower address whenever one was freed below it. A replay
//!   that imports the start segments in address order then takes, for some request, the equal
//!   block of another segment than PyTorch did, and from there its decisions depart: a later
//!   request that PyTorch served from its cache takes a new segment. So the order is found by
//!   replaying: at the first allocation placed in another start segment than PyTorch's,
//!   PyTorch's segment was made before ours; it moves just before ours, and the replay runs
//!   again, as long as the first departure moves later.
//! - **The tie rule** (`TieRule`: the lower address up to PyTorch 2.11, the block made first in
//!   2.12, the segment made first from 2.13): a snapshot does not say which PyTorch made it.
//!   Each rule is tried, each with its own start order; the one that reproduces the recording
//!   best (the later first departure, then the more decisions and placements made as PyTorch
//!   made them) is kept, the assumed one (`FERROCACHE_PYTORCH_VERSION`, else 2.15's) among
//!   equals. When every rule reproduces it equally, its decisions do not tell, and no rule is
//!   fixed for it.
//!
//! All of it under the settings the recording ran with, from the reconstructed start, on a
//! simulated GPU large enough for the recording.

use super::bytes;
use super::engine::{self, DEFAULT_CAPACITY, ReplayOptions, ReplayReport, StartState};
use super::reconstruct::reconstruct;
use super::snapshot::Snapshot;
use super::workload::{DeviceWorkload, Op, SegmentRef, Workload};
use crate::config::Config;
use crate::policy::TieRule;

/// Every tie rule PyTorch has had, newest first.
pub const TIE_RULES: [TieRule; 3] = [TieRule::SegmentOrder, TieRule::BlockOrder, TieRule::Address];

/// The simulated GPU is at least as large as the recording needs, up to this (1 PiB): a
/// hostile snapshot's absurd sizes are then refused as out of memory, not counted.
const LARGEST_GPU: u64 = 1 << 50;

/// At most this many reorderings of the start segments per tie rule: each one is a replay.
const MAX_REORDERINGS: usize = 64;

/// How closely one replay reproduced its recording, comparable: greater is closer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Closeness {
    /// The op of the first departure (`usize::MAX` when there is none).
    first_departure: usize,
    /// Decisions, releases and placements made as PyTorch made them.
    matched: u64,
}

impl Closeness {
    fn of(report: &ReplayReport) -> Closeness {
        Closeness {
            first_departure: first_departure(report).unwrap_or(usize::MAX),
            matched: report.matching_segment_allocs
                + report.matching_segment_releases
                + report.placements_matching,
        }
    }
}

impl Workload {
    /// The workload of `snapshot` as every replay of it starts: reconstructed
    /// ([`reconstruct`], a pure function of the snapshot), then each device settled by the
    /// faithful pass ([`settle`]): the order PyTorch made its start segments in and its tie rule,
    /// found from its decisions; where they do not tell, `assumed` is kept (the caller's
    /// PyTorch: `FERROCACHE_PYTORCH_VERSION`'s rule for the command line, 2.15's by default).
    pub fn reconstruct(snapshot: &Snapshot, assumed: TieRule) -> Workload {
        let mut workload = reconstruct(snapshot);
        for device in &mut workload.devices {
            settle(device, &workload.config, assumed);
        }
        workload
    }
}

/// The op of the first departure from the recording: a segment decision or release made
/// differently, or an allocation placed elsewhere; `None` when there is none.
pub fn first_departure(report: &ReplayReport) -> Option<usize> {
    // A difference in a malloc that failed in PyTorch (no op) counts from the start.
    let decisions = report.mismatches.first().map(|m| m.op_index.unwrap_or(0));
    let releases = report
        .release_mismatches
        .first()
        .map(|m| m.op_index.unwrap_or(0));
    let placement = report.first_misplacement.as_ref().map(|m| m.op_index);
    [decisions, releases, placement].into_iter().flatten().min()
}

/// Finds the start order and the tie rule of `workload`'s recording, made under `recorded`
/// (the settings it ran with); `assumed` is the rule kept where the decisions do not tell.
/// Sets `workload.start_order`, `workload.tie_rule` and `workload.tie_rules_alike`.
pub fn settle(workload: &mut DeviceWorkload, recorded: &Config, assumed: TieRule) {
    workload.tie_rule = None;
    workload.tie_rules_alike.clear();
    // Only a trace that leads from the reconstructed start to the recorded end state says
    // anything about the order or the rule; the rest keep address order and the assumed rule.
    if !workload.diagnostics.is_consistent(&workload.figures) {
        return;
    }
    let address_order = workload.start_order.clone();
    let rules = std::iter::once(assumed).chain(TIE_RULES.into_iter().filter(|&r| r != assumed));
    let tried: Vec<(Closeness, TieRule, Vec<usize>)> = rules
        .map(|rule| {
            workload.start_order = address_order.clone();
            let closeness = settle_order(workload, recorded, rule);
            (closeness, rule, workload.start_order.clone())
        })
        .collect();
    let Some(best) = tried.iter().map(|(closeness, _, _)| *closeness).max() else {
        return;
    };
    // The assumed rule first among the best.
    let alike: Vec<&(Closeness, TieRule, Vec<usize>)> =
        tried.iter().filter(|(c, _, _)| *c == best).collect();
    let (_, rule, order) = alike[0];
    workload.start_order = order.clone();
    workload.tie_rules_alike = alike.iter().map(|(_, rule, _)| *rule).collect();
    workload.tie_rule = (alike.len() < tried.len()).then_some(*rule);
}

/// Reorders `workload.start_order` under `rule` while that moves the first departure later;
/// returns how close the best order came.
fn settle_order(workload: &mut DeviceWorkload, recorded: &Config, rule: TieRule) -> Closeness {
    let mut config = recorded.clone();
    config.modelled.tie_rule = rule;
    let options = ReplayOptions {
        capacity: DEFAULT_CAPACITY
            .max(workload.figures.peak_reserved.saturating_mul(2))
            .min(LARGEST_GPU),
        start: StartState::Reconstructed,
        record_timeline: false,
    };
    let mut report = engine::replay(workload, &config, &options);
    let mut best = Closeness::of(&report);
    for _ in 0..MAX_REORDERINGS.min(workload.start_segments.len()) {
        let Some(departure) = report.first_misplacement.as_ref() else {
            break;
        };
        let (SegmentRef::Start(pytorch), Some(ours)) = (
            departure.pytorch.segment,
            departure.ferrocache_start_segment,
        ) else {
            break;
        };
        let order = &mut workload.start_order;
        let (Some(at_pytorch), Some(at_ours)) = (
            order.iter().position(|&s| s == pytorch as usize),
            order.iter().position(|&s| s == ours),
        ) else {
            break;
        };
        if at_pytorch < at_ours {
            break; // PyTorch's segment is already the older: the order does not explain it
        }
        let previous = order.clone();
        let moved = order.remove(at_pytorch);
        order.insert(at_ours, moved);
        report = engine::replay(workload, &config, &options);
        let closeness = Closeness::of(&report);
        if closeness <= best {
            workload.start_order = previous;
            break;
        }
        best = closeness;
    }
    best
}

/// The rule's name for people: what PyTorch does and which versions do it.
pub fn tie_rule_name(rule: TieRule) -> &'static str {
    match rule {
        TieRule::Address => "the lower address (PyTorch up to 2.11)",
        TieRule::BlockOrder => "the block made first (PyTorch 2.12)",
        TieRule::SegmentOrder => "the segment made first (PyTorch 2.13 and later)",
    }
}

/// The rule's short name, for JSON.
pub fn tie_rule_key(rule: TieRule) -> &'static str {
    match rule {
        TieRule::Address => "address",
        TieRule::BlockOrder => "block_order",
        TieRule::SegmentOrder => "segment_order",
    }
}

/// Replays `workload` under `recorded` (the settings it ran with) from the reconstructed start
/// on a simulated GPU of `capacity` bytes, and says how closely that reproduced it.
pub fn self_check(workload: &DeviceWorkload, recorded: &Config, capacity: u64) -> Reproduction {
    let options = ReplayOptions {
        capacity,
        start: StartState::Reconstructed,
        record_timeline: false,
    };
    Reproduction::of(workload, &engine::replay(workload, recorded, &options))
}

/// How closely a replay under the recording's own settings, from the reconstructed start,
/// reproduced the recording: the self-check `replay` and `tune` print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reproduction {
    /// PyTorch's `segment_alloc` + `segment_map`, and how many ferrocache made identically.
    pub segment_allocs: u64,
    pub matching_segment_allocs: u64,
    /// Device allocations ferrocache made where PyTorch made none (or made others).
    pub other_segment_allocs: usize,
    /// PyTorch's `segment_free` + `segment_unmap`, and how many ferrocache gave back alike.
    pub segment_frees: u64,
    pub matching_segment_frees: u64,
    /// Allocations placed where PyTorch placed them, of those checked.
    pub placements_checked: u64,
    pub placements_matching: u64,
    pub peak_reserved: u64,
    pub recorded_peak_reserved: u64,
    /// The first difference, in words; `None` when there is none.
    pub first_difference: Option<String>,
    /// The rule ties were broken by, and whether the recording's decisions told it (no other
    /// rule reproduces it as closely).
    pub tie_rule: TieRule,
    pub tie_rule_found: bool,
    /// The rules that reproduce it as closely as the one used (itself included); empty when
    /// they were not tried.
    pub tie_rules_alike: Vec<TieRule>,
    /// Start segments imported out of address order (PyTorch made them in another order).
    pub start_segments_reordered: usize,
}

impl Reproduction {
    /// The self-check of `report`, a replay of `workload` under its recorded settings from the
    /// reconstructed start.
    pub fn of(workload: &DeviceWorkload, report: &ReplayReport) -> Reproduction {
        let reordered = workload
            .start_order
            .iter()
            .enumerate()
            .filter(|&(place, &segment)| place != segment)
            .count();
        Reproduction {
            segment_allocs: workload.segment_decisions.len() as u64,
            matching_segment_allocs: report.matching_segment_allocs,
            other_segment_allocs: report
                .mismatches
                .iter()
                .filter(|m| m.ferrocache_count > 0)
                .count(),
            segment_frees: report.native_segment_releases,
            matching_segment_frees: report.matching_segment_releases,
            placements_checked: report.placements_checked,
            placements_matching: report.placements_matching,
            peak_reserved: report.peak_reserved,
            recorded_peak_reserved: workload.figures.peak_reserved,
            first_difference: describe_first_difference(workload, report),
            tie_rule: report.tie_rule,
            tie_rule_found: workload.tie_rules_alike.len() == 1,
            tie_rules_alike: workload.tie_rules_alike.clone(),
            start_segments_reordered: reordered,
        }
    }

    /// Every segment decision PyTorch made, made identically (and no other), and the
    /// recorded peak reserved reached.
    pub fn reproduced(&self) -> bool {
        self.matching_segment_allocs == self.segment_allocs
            && self.other_segment_allocs == 0
            && self.matching_segment_frees == self.segment_frees
            && self.peak_reserved == self.recorded_peak_reserved
    }

    /// The self-check as JSON (the keys as the fields, `reproduced`, `tie_rule` by its key).
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "reproduced": self.reproduced(),
            "segment_allocs": self.segment_allocs,
            "matching_segment_allocs": self.matching_segment_allocs,
            "other_segment_allocs": self.other_segment_allocs,
            "segment_frees": self.segment_frees,
            "matching_segment_frees": self.matching_segment_frees,
            "placements_checked": self.placements_checked,
            "placements_matching": self.placements_matching,
            "peak_reserved_bytes": self.peak_reserved,
            "recorded_peak_reserved_bytes": self.recorded_peak_reserved,
            "first_difference": self.first_difference,
            "tie_rule": tie_rule_key(self.tie_rule),
            "tie_rule_found": self.tie_rule_found,
            "tie_rules_alike": self.tie_rules_alike.iter().map(|&r| tie_rule_key(r)).collect::<Vec<_>>(),
            "start_segments_reordered": self.start_segments_reordered,
        })
    }

    /// One sentence: reproduced or not, the counts, the peaks, the first difference, the start
    /// order and the tie rule.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{}: {} of PyTorch's {} segment_alloc and {} of its {} segment_free made identically",
            if self.reproduced() {
                "reproduced"
            } else {
                "NOT reproduced"
            },
            self.matching_segment_allocs,
            self.segment_allocs,
            self.matching_segment_frees,
            self.segment_frees
        );
        if self.other_segment_allocs > 0 {
            text.push_str(&format!(
                " (and device allocations PyTorch did not make in {} malloc(s))",
                self.other_segment_allocs
            ));
        }
        if self.placements_checked > 0 {
            text.push_str(&format!(
                ", {} of {} allocations placed where PyTorch placed them",
                self.placements_matching, self.placements_checked
            ));
        }
        text.push_str(&format!(
            "; peak reserved {}, recorded {}",
            bytes(self.peak_reserved),
            bytes(self.recorded_peak_reserved)
        ));
        if self.peak_reserved != self.recorded_peak_reserved {
            let change = self.peak_reserved as f64 / self.recorded_peak_reserved.max(1) as f64;
            text.push_str(&format!(" ({:+.1}%)", 100.0 * (change - 1.0)));
        }
        if let Some(difference) = &self.first_difference {
            text.push_str(&format!("; the first difference: {difference}"));
        }
        if self.start_segments_reordered > 0 {
            text.push_str(&format!(
                "; {} start segments imported in the order PyTorch made them, not by address",
                self.start_segments_reordered
            ));
        }
        let how = if self.tie_rule_found {
            "found from the recording's decisions".to_string()
        } else if self.tie_rules_alike.is_empty() || self.tie_rules_alike.len() == TIE_RULES.len() {
            "assumed: the recording's decisions reproduce alike under every rule".to_string()
        } else {
            let others: Vec<&str> = self
                .tie_rules_alike
                .iter()
                .filter(|&&r| r != self.tie_rule)
                .map(|&r| tie_rule_name(r))
                .collect();
            let ruled_out: Vec<&str> = TIE_RULES
                .into_iter()
                .filter(|r| !self.tie_rules_alike.contains(r))
                .map(tie_rule_name)
                .collect();
            format!(
                "the recording's decisions rule out {}, but reproduce alike under {}",
                ruled_out.join(" and "),
                others.join(" and ")
            )
        };
        text.push_str(&format!(
            "; ties between equal cached blocks go to {} ({how})",
            tie_rule_name(self.tie_rule)
        ));
        text
    }
}

/// The earliest op where the replay departs from the recording, in words.
fn describe_first_difference(workload: &DeviceWorkload, report: &ReplayReport) -> Option<String> {
    let at = first_departure(report)?;
    let place = |op: Option<usize>, trace: Option<usize>| match (op, trace) {
        (Some(op), Some(entry)) => format!("op {op} (trace entry {entry})"),
        (Some(op), None) => format!("op {op}"),
        _ => "a malloc that failed in PyTorch".to_string(),
    };
    if let Some(m) = report
        .mismatches
        .first()
        .filter(|m| m.op_index.unwrap_or(0) == at)
    {
        let request = m
            .requested
            .map(|r| format!(", a request of {}", bytes(r)))
            .unwrap_or_default();
        let pytorch = if m.pytorch_sizes.is_empty() {
            "PyTorch served it from its cache".to_string()
        } else {
            let sizes: Vec<String> = m.pytorch_sizes.iter().map(|&s| bytes(s)).collect();
            format!("PyTorch took {} from the device", sizes.join(" + "))
        };
        let ours = if m.ferrocache_count == 0 {
            "ferrocache served it from its cache".to_string()
        } else {
            format!(
                "ferrocache made {} device allocation(s) of {} in all",
                m.ferrocache_count,
                bytes(m.ferrocache_bytes)
            )
        };
        return Some(format!(
            "{}{request}: {pytorch}, {ours}",
            place(m.op_index, m.trace_index)
        ));
    }
    if let Some(m) = report
        .release_mismatches
        .first()
        .filter(|m| m.op_index.unwrap_or(0) == at)
    {
        let what = match m.op_index.and_then(|op| workload.ops.get(op)) {
            Some(Op::EmptyCache) => "an empty_cache()",
            _ => "a malloc",
        };
        return Some(format!(
            "{}, {what}: PyTorch gave back {} segment(s) of {}, ferrocache {} of {}",
            place(m.op_index, m.trace_index),
            m.pytorch_segments,
            bytes(m.pytorch_bytes),
            m.ferrocache_segments,
            bytes(m.ferrocache_bytes)
        ));
    }
    let m = report.first_misplacement.as_ref()?;
    let segment = |s: SegmentRef| match s {
        SegmentRef::Start(i) => format!("start segment {i}"),
        SegmentRef::Decision(d) => format!("the segment of its decision {d}"),
    };
    let ours = match m.ferrocache_start_segment {
        Some(i) => format!("start segment {i}"),
        None => "another segment".to_string(),
    };
    Some(format!(
        "{}, a request of {}: PyTorch placed it in {} at offset {}, ferrocache in {ours}",
        place(Some(m.op_index), m.trace_index),
        bytes(m.requested),
        segment(m.pytorch.segment),
        m.pytorch.offset
    ))
}
