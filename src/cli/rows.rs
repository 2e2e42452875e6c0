//! The rows the commands print: one replay's ([`Row`]) and a job's under one setting
//! ([`JobRow`]), as the table and as JSON.

#![forbid(unsafe_code)]

use super::Setting;
use crate::replay::faithful::Reproduction;
use crate::replay::{JobSummary, NativeFigures, ReplayReport};
use serde_json::json;

/// One replay's row.
pub(super) struct Row {
    /// The trace as given (with the device when a snapshot has several), or `demo`.
    pub(super) trace: String,
    /// Its rank, with `--job`.
    pub(super) rank: Option<u32>,
    pub(super) conf: String,
    pub(super) report: ReplayReport,
    pub(super) native: Option<NativeFigures>,
    /// The self-check of the row's recording (the same for each of its rows).
    pub(super) check: Option<Reproduction>,
}

impl Row {
    /// The row as one JSON object (`replay --json`).
    pub(super) fn to_json(&self) -> serde_json::Value {
        let native = self.native.as_ref();
        let mut value = json!({
            "trace": self.trace,
            "conf": self.conf,
            "events": self.report.events,
            "peak_requested_bytes": self.report.peak_requested,
            "peak_reserved_bytes": self.report.peak_reserved,
            "utilization": self.report.utilization(),
            "segment_allocs": self.report.segment_allocs,
            "device_mallocs": self.report.device_mallocs,
            "device_frees": self.report.device_frees,
            "retries": self.report.retries,
            "cross_stream_reuses": self.report.cross_stream_reuses,
            "ooms": self.report.ooms,
            "native_peak_reserved_bytes": native.map(|n| n.peak_reserved),
            "native_segment_allocs": native.map(|n| n.segment_allocs),
            "matching_segment_allocs": native.map(|_| self.report.matching_segment_allocs),
            "events_per_second": self.report.events_per_second(),
            "self_check": self.check.as_ref().map(Reproduction::json),
        });
        if let (Some(rank), Some(object)) = (self.rank, value.as_object_mut()) {
            object.insert("rank".to_string(), json!(rank));
        }
        value
    }
}

/// The job's row under one setting.
pub(super) struct JobRow {
    pub(super) conf: String,
    pub(super) summary: JobSummary,
    pub(super) ooms: u64,
}

impl JobRow {
    pub(super) fn to_json(&self) -> serde_json::Value {
        let s = &self.summary;
        json!({
            "job": true,
            "conf": self.conf,
            "ranks": s.ranks,
            "worst_rank": s.worst_rank,
            "worst_peak_reserved_bytes": s.worst_peak_reserved,
            "spread": s.spread,
            "sum_peak_reserved_bytes": s.sum_peak_reserved,
            "ooms": self.ooms,
        })
    }
}

/// One job row per setting, from the per-rank rows.
pub(super) fn job_rows(rows: &[Row], settings: &[Setting]) -> Vec<JobRow> {
    settings
        .iter()
        .filter_map(|setting| {
            let ranked: Vec<&Row> = rows
                .iter()
                .filter(|r| r.rank.is_some() && r.conf == setting.raw)
                .collect();
            let peaks: Vec<(u32, u64)> = ranked
                .iter()
                .filter_map(|r| Some((r.rank?, r.report.peak_reserved)))
                .collect();
            Some(JobRow {
                conf: setting.raw.clone(),
                summary: JobSummary::of(&peaks)?,
                ooms: ranked.iter().map(|r| r.report.ooms).sum(),
            })
        })
        .collect()
}
