//! The tables `replay` prints: one row per trace and setting, and with `--job` one per setting
//! for the whole job.

#![forbid(unsafe_code)]

use super::rows::{JobRow, Row};
use super::{conf_name, percent};
use crate::tune::report::{bytes, grouped, wrap, write_rows};
use crate::tune::short_trace;
use std::io::Write;

pub(super) fn print_table(rows: &[Row]) {
    let header = [
        "trace",
        "configuration",
        "events",
        "peak requested",
        "peak reserved",
        "util.",
        "segments",
        "mallocs/frees",
        "retries",
        "OOMs",
        "|",
        "PyTorch: peak reserved",
        "util.",
        "segments",
        "matching",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for row in rows {
        let r = &row.report;
        let native = row.native.as_ref();
        let na = || "-".to_string();
        table.push(vec![
            match row.rank {
                Some(rank) => format!("rank {rank}: {}", short_trace(&row.trace)),
                None => short_trace(&row.trace),
            },
            conf_name(&row.conf),
            grouped(r.events),
            bytes(r.peak_requested),
            bytes(r.peak_reserved),
            percent(r.utilization()),
            grouped(r.segment_allocs),
            format!("{}/{}", r.device_mallocs, r.device_frees),
            grouped(r.retries),
            grouped(r.ooms),
            "|".to_string(),
            native.map_or_else(na, |n| bytes(n.peak_reserved)),
            native.map_or_else(na, |n| percent(n.utilization)),
            native.map_or_else(na, |n| grouped(n.segment_allocs)),
            native.map_or_else(na, |n| {
                format!("{}/{}", r.matching_segment_allocs, n.segment_allocs)
            }),
        ]);
    }
    print_aligned(&table, 2);
}

pub(super) fn column_key() -> String {
    "Columns: events = allocations, frees and empty_cache calls replayed; peak requested = most \
     bytes the program held at once (what it asked for); peak reserved = most bytes taken from \
     the GPU (cudaMalloc'd segments and mapped pages), start state included; util. = peak \
     requested / peak reserved; segments = device allocations made while replaying (PyTorch's \
     segment_alloc + segment_map); mallocs/frees = all cudaMalloc-like and cudaFree-like calls, \
     start state included; retries = mallocs that had to release cached memory and try again; \
     OOMs = requests ferrocache could not serve. After the bar, PyTorch's own figures from the \
     recording; matching = how many of PyTorch's segment decisions ferrocache made identically \
     (same size, in the malloc of the same request)."
        .to_string()
}

/// The job rows as a table, the header first.
pub(super) fn job_table(jobs: &[JobRow]) -> Vec<Vec<String>> {
    let ranks = jobs.first().map_or(0, |j| j.summary.ranks);
    let mut table: Vec<Vec<String>> = vec![
        [
            &format!("job ({ranks} ranks)") as &str,
            "worst peak reserved",
            "worst rank",
            "spread (max/min)",
            "sum of peaks",
            "OOMs",
        ]
        .iter()
        .map(|h| h.to_string())
        .collect(),
    ];
    for job in jobs {
        let s = &job.summary;
        table.push(vec![
            conf_name(&job.conf),
            bytes(s.worst_peak_reserved),
            s.worst_rank.to_string(),
            if s.spread.is_finite() {
                format!("{:.2}x", s.spread)
            } else {
                "-".to_string()
            },
            bytes(s.sum_peak_reserved),
            grouped(job.ooms),
        ]);
    }
    table
}

pub(super) fn print_job_table(jobs: &[JobRow]) {
    print_aligned(&job_table(jobs), 1);
    say!(
        "{}",
        wrap(
            "The job row: the rank with the highest peak reserved (it decides whether the job \
             runs out of memory), the spread = highest / lowest peak over the ranks, and the sum \
             of the ranks' peaks.",
            100
        )
    );
}

/// Prints `table` (the header first) with its columns aligned: the first `left_columns` to the
/// left, the others (figures) to the right.
pub(super) fn print_aligned(table: &[Vec<String>], left_columns: usize) {
    for line in aligned_lines(table, left_columns) {
        say!("{line}");
    }
}

/// `table`'s lines with its columns aligned (see [`print_aligned`]), as `tune`'s tables are.
pub(super) fn aligned_lines(table: &[Vec<String>], left_columns: usize) -> Vec<String> {
    let mut text = String::new();
    write_rows(&mut text, table, left_columns);
    text.lines().map(str::to_string).collect()
}
