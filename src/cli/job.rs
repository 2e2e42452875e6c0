//! `--job`: the snapshots as the ranks of one job.

#![forbid(unsafe_code)]

use super::USAGE_ERROR;
use crate::replay;
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
