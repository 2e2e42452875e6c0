//! `--job`: the snapshots as the ranks of one job.

use super::replay::Row;
use super::{Setting, USAGE_ERROR};
use crate::replay::{self, JobSummary};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

/// With `--job`, the rank of each trace, from its file name; every problem on stderr and code
/// 2 otherwise. Without, `None`.
pub(super) fn job_ranks(job: bool, traces: &[PathBuf]) -> Result<Option<Vec<u32>>, u8> {
    if !job {
        return Ok(None);
    }
    replay::assign_ranks(traces).map(Some).map_err(|errors| {
        for error in errors {
            complain!("error: --job: {error}");
        }
        USAGE_ERROR
    })
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
