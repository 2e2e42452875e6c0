//! Several snapshots as the ranks of one job (`torchrun`): which rank a snapshot is, from its
//! file name, and the figures that judge the job as a whole (the worst rank decides whether it
//! runs out of memory).
//!
//! **The rank of a file** ([`rank_of_path`]), the first rule that applies:
//! 1. the file name holds `rank` and a number, optionally joined by `-`, `_` or `.`
//!    (case-insensitive; the last such number counts): `snapshot_rank3.pickle`,
//!    `mem.rank-12.pickle`, `rank0.pickle`;
//! 2. else the nearest folder named that way: `rank3/snapshot.pickle`, `out/rank_3/mem.pickle`;
//! 3. else the file name without its extension ends in `-`, `_` or `.` and a number:
//!    `snapshot-3.pickle`, `mem_3.pickle`, `snapshot.3.pickle`.
//!
//! A name that none of these fits, and two files of the same rank, are errors that name the
//! files ([`assign_ranks`]).

use std::fmt;
use std::path::{Path, PathBuf};

/// The rank a snapshot's path names, by the rules of the module docs; `None` when it names none.
pub fn rank_of_path(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_string_lossy();
    if let Some(rank) = rank_word(&name) {
        return Some(rank);
    }
    let folders = path.parent().into_iter().flat_map(Path::ancestors);
    for folder in folders {
        if let Some(rank) = folder
            .file_name()
            .and_then(|n| whole_rank_word(&n.to_string_lossy()))
        {
            return Some(rank);
        }
    }
    let stem = path.file_stem()?.to_string_lossy();
    trailing_number(&stem)
}

/// The number after the last `rank` in `text` (`rank3`, `rank_3`, `rank-3`, `rank.3`).
fn rank_word(text: &str) -> Option<u32> {
    let lower = text.to_ascii_lowercase();
    lower
        .match_indices("rank")
        .filter_map(|(at, word)| {
            let rest = &lower[at + word.len()..];
            let rest = rest.strip_prefix(['-', '_', '.']).unwrap_or(rest);
            leading_number(rest)
        })
        .last()
}

/// A folder named exactly `rank3` (or `rank_3`, `rank-3`, `rank.3`, any case).
fn whole_rank_word(name: &str) -> Option<u32> {
    let lower = name.to_ascii_lowercase();
    let rest = lower.strip_prefix("rank")?;
    let rest = rest.strip_prefix(['-', '_', '.']).unwrap_or(rest);
    (!rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        .then(|| rest.parse().ok())
        .flatten()
}

/// The digits at the start of `text`, as a number.
fn leading_number(text: &str) -> Option<u32> {
    let digits: &str = &text[..text.bytes().take_while(u8::is_ascii_digit).count()];
    digits.parse().ok()
}

/// The number at the end of `stem`, after a `-`, `_` or `.`.
fn trailing_number(stem: &str) -> Option<u32> {
    let digits = stem.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits == 0 || digits == stem.len() {
        return None;
    }
    let (head, number) = stem.split_at(stem.len() - digits);
    head.ends_with(['-', '_', '.'])
        .then(|| number.parse().ok())
        .flatten()
}

/// Why a set of files is not a job's ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankError {
    /// No rule of [`rank_of_path`] fits this file's name.
    Unnamed(PathBuf),
    /// Two files name the same rank.
    Duplicate {
        rank: u32,
        first: PathBuf,
        second: PathBuf,
    },
}

impl fmt::Display for RankError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankError::Unnamed(path) => write!(
                f,
                "{}: cannot tell which rank this snapshot is: name it with the rank, e.g. \
                 snapshot_rank3.pickle, rank3/snapshot.pickle or snapshot-3.pickle",
                path.display()
            ),
            RankError::Duplicate {
                rank,
                first,
                second,
            } => write!(
                f,
                "{} and {} are both rank {rank}: give each rank's snapshot once",
                first.display(),
                second.display()
            ),
        }
    }
}

impl std::error::Error for RankError {}

/// The rank of each path, in the order given; every problem, not only the first.
pub fn assign_ranks(paths: &[PathBuf]) -> Result<Vec<u32>, Vec<RankError>> {
    let mut ranks = Vec::with_capacity(paths.len());
    let mut errors = Vec::new();
    for (index, path) in paths.iter().enumerate() {
        match rank_of_path(path) {
            Some(rank) => {
                if let Some(earlier) = ranks
                    .iter()
                    .position(|&(r, _): &(u32, usize)| r == rank)
                    .map(|at| ranks[at].1)
                {
                    errors.push(RankError::Duplicate {
                        rank,
                        first: paths[earlier].clone(),
                        second: path.clone(),
                    });
                }
                ranks.push((rank, index));
            }
            None => errors.push(RankError::Unnamed(path.clone())),
        }
    }
    if errors.is_empty() {
        Ok(ranks.into_iter().map(|(rank, _)| rank).collect())
    } else {
        Err(errors)
    }
}

/// The job's figures under one setting, from each rank's peak reserved bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobSummary {
    pub ranks: usize,
    /// The rank with the highest peak (the lowest rank among equals).
    pub worst_rank: u32,
    pub worst_peak_reserved: u64,
    /// Highest peak over lowest peak (1.0 when all are equal; infinite when a rank reserved
    /// nothing and another did).
    pub spread: f64,
    pub sum_peak_reserved: u64,
}

impl JobSummary {
    /// The summary of `(rank, peak reserved)` pairs; `None` for no ranks.
    pub fn of(peaks: &[(u32, u64)]) -> Option<JobSummary> {
        let &(worst_rank, worst_peak_reserved) = peaks
            .iter()
            .min_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)))?;
        let lowest = peaks.iter().map(|&(_, peak)| peak).min()?;
        let spread = if lowest == worst_peak_reserved {
            1.0
        } else if lowest == 0 {
            f64::INFINITY
        } else {
            worst_peak_reserved as f64 / lowest as f64
        };
        Some(JobSummary {
            ranks: peaks.len(),
            worst_rank,
            worst_peak_reserved,
            spread,
            sum_peak_reserved: peaks
                .iter()
                .fold(0u64, |sum, &(_, p)| sum.saturating_add(p)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(path: &str) -> Option<u32> {
        rank_of_path(Path::new(path))
    }

    #[test]
    fn a_rank_in_the_file_name_counts_first() {
        assert_eq!(rank("snapshot_rank3.pickle"), Some(3));
        assert_eq!(rank("out/mem.rank-12.pickle"), Some(12));
        assert_eq!(rank("RANK0.pickle"), Some(0));
        assert_eq!(rank("rank_7_step_100.pickle"), Some(7));
        // The last `rank<n>` of the name, and the name before the folders.
        assert_eq!(rank("rank1/snap_rank2.pickle"), Some(2));
        assert_eq!(rank("ranking_rank4.pickle"), Some(4));
    }

    #[test]
    fn then_the_nearest_rank_folder() {
        assert_eq!(rank("rank3/snapshot.pickle"), Some(3));
        assert_eq!(rank("/tmp/job/rank_5/step/snapshot.pickle"), Some(5));
        assert_eq!(rank("rank1/rank2/snapshot.pickle"), Some(2));
        // A folder must be named just that: `ranking` or `rank3x` are not ranks.
        assert_eq!(rank("ranks/snapshot.pickle"), None);
        assert_eq!(rank("rank3x/snapshot.pickle"), None);
    }

    #[test]
    fn then_a_number_ending_the_name() {
        assert_eq!(rank("snapshot-3.pickle"), Some(3));
        assert_eq!(rank("mem_11.pickle"), Some(11));
        assert_eq!(rank("snapshot.3.pickle"), Some(3));
        assert_eq!(rank("snapshot3.pickle"), None, "no separator");
        assert_eq!(rank("3.pickle"), None, "a number alone is not a name");
        assert_eq!(rank("eor_nn.pickle"), None);
        assert_eq!(rank("cs336_memory_ctx128_forward.pickle"), None);
    }

    #[test]
    fn duplicates_and_unnamed_files_are_all_reported() {
        let paths: Vec<PathBuf> = ["a_rank0.pickle", "b-0.pickle", "c.pickle", "d_rank1.pickle"]
            .iter()
            .map(PathBuf::from)
            .collect();
        let errors = assign_ranks(&paths).unwrap_err();
        assert_eq!(errors.len(), 2);
        assert_eq!(
            errors[0].to_string(),
            "a_rank0.pickle and b-0.pickle are both rank 0: give each rank's snapshot once"
        );
        assert!(
            errors[1]
                .to_string()
                .starts_with("c.pickle: cannot tell which rank")
        );
        let ok: Vec<PathBuf> = ["x_rank1.pickle", "rank0/x.pickle"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(assign_ranks(&ok).unwrap(), vec![1, 0]);
    }

    #[test]
    fn the_job_is_judged_by_its_worst_rank() {
        let job = JobSummary::of(&[(0, 100), (1, 300), (2, 300), (3, 150)]).unwrap();
        assert_eq!(job.worst_rank, 1, "the lowest of equal worst ranks");
        assert_eq!(job.worst_peak_reserved, 300);
        assert_eq!(job.spread, 3.0);
        assert_eq!(job.sum_peak_reserved, 850);
        assert_eq!(job.ranks, 4);
        assert_eq!(JobSummary::of(&[(2, 5)]).unwrap().spread, 1.0);
        assert!(
            JobSummary::of(&[(0, 0), (1, 5)])
                .unwrap()
                .spread
                .is_infinite()
        );
        assert!(JobSummary::of(&[]).is_none());
    }
}
