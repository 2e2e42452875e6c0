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

use super::engine::{self, DEFAULT_CAPACITY, ReplayOptions, ReplayReport, StartState};
use super::workload::{DeviceWorkload, SegmentRef};
use crate::config::Config;
use crate::policy::TieRule;

/// Every tie rule PyTorch has had, newest first.
pub const TIE_RULES: [TieRule; 3] = [TieRule::SegmentOrder, TieRule::BlockOrder, TieRule::Address];

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
/// Sets `workload.start_order` and `workload.tie_rule`.
pub fn settle(workload: &mut DeviceWorkload, recorded: &Config, assumed: TieRule) {
    workload.tie_rule = None;
    let address_order = workload.start_order.clone();
    let rules = std::iter::once(assumed).chain(TIE_RULES.into_iter().filter(|&r| r != assumed));
    let mut best: Option<(Closeness, TieRule, Vec<usize>)> = None;
    let mut all_equal = true;
    for rule in rules {
        workload.start_order = address_order.clone();
        let closeness = settle_order(workload, recorded, rule);
        match &best {
            Some((close, _, _)) if closeness <= *close => all_equal &= closeness == *close,
            Some(_) => {
                all_equal = false;
                best = Some((closeness, rule, workload.start_order.clone()));
            }
            None => best = Some((closeness, rule, workload.start_order.clone())),
        }
    }
    if let Some((_, rule, order)) = best {
        workload.start_order = order;
        workload.tie_rule = (!all_equal).then_some(rule);
    }
}

/// Reorders `workload.start_order` under `rule` while that moves the first departure later;
/// returns how close the best order came.
fn settle_order(workload: &mut DeviceWorkload, recorded: &Config, rule: TieRule) -> Closeness {
    let mut config = recorded.clone();
    config.tie_rule = rule;
    let options = ReplayOptions {
        capacity: DEFAULT_CAPACITY.max(workload.figures.peak_reserved.saturating_mul(2)),
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
