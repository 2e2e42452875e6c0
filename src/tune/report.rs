//! What a search says: the ranked table, the lines to paste, the savings, and the same as one
//! JSON object. `ferrocache tune` prints [`text`] (or [`json`] with `--json`);
//! `ferrocache.advise()` returns both, its `str()` being [`text`].

use super::{CapacitySource, Evaluated, Tuning};
use crate::replay::StartState;
use serde_json::{Value, json};
use std::fmt::Write;

/// Candidates shown in the table, besides the defaults and the recorded setting.
pub const TOP: usize = 10;
const GIB: f64 = (1u64 << 30) as f64;

/// What the text needs beyond the search itself.
#[derive(Debug, Clone, Default)]
pub struct TextOptions {
    /// The trace files, for the line that checks the answer with `ferrocache replay`; `None`
    /// where there are none (advice from the running process).
    pub check_traces: Option<Vec<String>>,
    /// How many candidates the table shows (default [`TOP`]).
    pub top: Option<usize>,
}

pub use crate::replay::bytes;

/// 12345 as "12,345".
pub fn grouped(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A capacity in GiB as the command line takes it back: the shortest text that reads as the
/// same number of bytes.
pub fn capacity_gib_text(capacity: u64) -> String {
    // Exact: a division by a power of two, and f64's Display reads back as the same value.
    format!("{}", capacity as f64 / GIB)
}

/// `value` quoted for a POSIX shell where it needs it (`[`, `>` and spaces do).
pub fn shell_quote(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_:.,=-/+@%".contains(c));
    if plain {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// `(smaller - larger) / larger` as a signed percentage of `reference`.
fn change(value: u64, reference: u64) -> String {
    if reference == 0 {
        return "-".to_string();
    }
    let ratio = (value as f64 - reference as f64) / reference as f64;
    if ratio.abs() < 0.0005 {
        "0.0%".to_string()
    } else {
        format!("{:+.1}%", 100.0 * ratio)
    }
}

/// How much less `value` is than `reference`, in GiB and %.
fn saving(value: u64, reference: u64) -> String {
    let saved = reference.saturating_sub(value);
    let percent = if reference == 0 {
        0.0
    } else {
        100.0 * saved as f64 / reference as f64
    };
    format!("{} ({percent:.1}%)", bytes(saved))
}

fn capacity_phrase(tuning: &Tuning) -> String {
    let memory = bytes(tuning.options.capacity);
    match tuning.options.capacity_source {
        CapacitySource::Given => format!("a simulated GPU of {memory}"),
        CapacitySource::Recording => format!(
            "a simulated GPU of {memory} (the recording's: free memory at its out-of-memory \
             plus what was reserved then)"
        ),
        CapacitySource::Device => format!("a simulated GPU of {memory} (this process's device)"),
        CapacitySource::Default => format!(
            "a simulated GPU of {memory} (the default: the recording does not say its GPU's \
             memory; see --capacity-gib)"
        ),
    }
}

fn start_phrase(start: StartState) -> &'static str {
    match start {
        StartState::Reconstructed => "from the reconstructed start",
        StartState::Fresh => "from an empty GPU (--fresh)",
    }
}

/// The word for a subject: rank or trace.
fn subject_word(tuning: &Tuning) -> &'static str {
    if tuning.options.job { "rank" } else { "trace" }
}

fn worst_name(tuning: &Tuning, evaluated: &Evaluated) -> String {
    let subject = &tuning.subjects[evaluated.worst()];
    match subject.rank {
        Some(rank) => rank.to_string(),
        None => super::short_trace(&subject.name),
    }
}

/// The table, the recommendation and the savings, as `ferrocache tune` prints them.
pub fn text(tuning: &Tuning, options: &TextOptions) -> String {
    let mut out = String::new();
    let several = tuning.subjects.len() > 1;
    let events: u64 = tuning.subjects.iter().map(|s| s.events).sum();
    let what = if several {
        format!(
            "{} {}s ({} events)",
            tuning.subjects.len(),
            subject_word(tuning),
            grouped(events)
        )
    } else {
        format!(
            "{} ({} events)",
            super::short_trace(&tuning.subjects[0].name),
            grouped(events)
        )
    };
    let cut = if tuning.space_size > tuning.ranked.len() {
        format!(
            " (the simplest {} of {}: the search was bounded)",
            tuning.ranked.len(),
            tuning.space_size
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{} settings{cut} replayed on {what}, on {}, {}, in {:.2} s on {} thread(s).",
        tuning.ranked.len(),
        capacity_phrase(tuning),
        start_phrase(tuning.options.start),
        tuning.elapsed.as_secs_f64(),
        tuning.threads
    );
    let _ = writeln!(out);
    table(&mut out, tuning, options.top.unwrap_or(TOP));
    if several {
        let _ = writeln!(out);
        per_subject(&mut out, tuning);
    }
    let _ = writeln!(out);
    for subject in &tuning.subjects {
        let _ = writeln!(
            out,
            "{}",
            wrap(
                &format!(
                    "Self-check, {}: {}.",
                    subject.name,
                    subject.reproduction.describe()
                ),
                100
            )
        );
    }
    let _ = writeln!(out);
    answer(&mut out, tuning, options);
    out
}

/// Why no saving is claimed, when a recording's replay does not reproduce it; `None` when
/// every one does.
pub fn not_claimed_because(tuning: &Tuning) -> Option<String> {
    let unreproduced: Vec<&str> = tuning.unreproduced().map(|s| s.name.as_str()).collect();
    let first = tuning.unreproduced().next()?;
    Some(format!(
        "the replay of {} does not reproduce the recording under the setting it ran with \
         ({} of PyTorch's {} segment_alloc and {} of its {} segment_free made identically, \
         peak reserved {} against {} recorded{}), so what a setting would save there is not \
         known; the table shows what the replays did, not what PyTorch would do",
        unreproduced.join(", "),
        first.reproduction.matching_segment_allocs,
        first.reproduction.segment_allocs,
        first.reproduction.matching_segment_frees,
        first.reproduction.segment_frees,
        bytes(first.reproduction.peak_reserved),
        bytes(first.reproduction.recorded_peak_reserved),
        first
            .reproduction
            .first_difference
            .as_ref()
            .map(|d| format!("; the first difference: {d}"))
            .unwrap_or_default()
    ))
}

/// The ranked rows: the best `top`, then the defaults and the recorded setting where they are
/// further down.
fn table(out: &mut String, tuning: &Tuning, top: usize) {
    let several = tuning.subjects.len() > 1;
    let mut header: Vec<String> = vec!["#".into(), "setting".into()];
    if several {
        header.push("worst peak reserved".into());
        header.push(format!("worst {}", subject_word(tuning)));
        header.push("sum of peaks".into());
    } else {
        header.push("peak reserved".into());
    }
    header.extend(
        ["vs defaults", "device allocs", "retries", "OOMs"]
            .iter()
            .map(|s| s.to_string()),
    );
    let mut shown: Vec<usize> = (0..tuning.ranked.len().min(top)).collect();
    let mut extra = vec![tuning.defaults];
    extra.extend(tuning.recorded);
    for index in extra {
        if !shown.contains(&index) {
            shown.push(index);
        }
    }
    let defaults_peak = tuning.defaults().worst_peak_reserved();
    let mut rows: Vec<Vec<String>> = vec![header];
    let mut previous: Option<usize> = None;
    for index in shown {
        if previous.is_some_and(|p| index > p + 1) {
            let mut gap = vec!["...".to_string()];
            gap.resize(rows[0].len(), String::new());
            rows.push(gap);
        }
        previous = Some(index);
        let e = &tuning.ranked[index];
        let mut label = e.candidate.label();
        let mut marks = Vec::new();
        if index == tuning.defaults && !e.candidate.conf.is_empty() {
            marks.push("the defaults");
        }
        if Some(index) == tuning.recorded {
            marks.push(if tuning.recorded_differ {
                "the first recording's setting"
            } else {
                "the recording's setting"
            });
        }
        if !marks.is_empty() {
            label = format!("{label} ({})", marks.join(", "));
        }
        let mut row = vec![(index + 1).to_string(), label];
        row.push(bytes(e.worst_peak_reserved()));
        if several {
            row.push(worst_name(tuning, e));
            row.push(bytes(e.sum_peak_reserved()));
        }
        row.push(if index == tuning.defaults {
            "-".to_string()
        } else {
            change(e.worst_peak_reserved(), defaults_peak)
        });
        row.push(grouped(e.device_allocs()));
        row.push(grouped(e.retries()));
        row.push(grouped(e.ooms()));
        rows.push(row);
    }
    write_rows(out, &rows, 2);
}

/// Each subject's peak under the defaults, the recorded setting and the recommendation.
fn per_subject(out: &mut String, tuning: &Tuning) {
    let mut columns: Vec<(&str, &Evaluated)> = vec![("PyTorch defaults", tuning.defaults())];
    if let Some(recorded) = tuning.recorded()
        && tuning.recorded != Some(tuning.defaults)
    {
        columns.push(("recorded setting", recorded));
    }
    if let Some(best) = tuning.recommendation()
        && tuning.recommended != Some(tuning.defaults)
    {
        columns.push(("recommended", best));
    }
    let mut header = vec![format!("peak reserved per {}", subject_word(tuning))];
    header.extend(columns.iter().map(|(name, _)| name.to_string()));
    header.push("peak requested".to_string());
    let mut rows = vec![header];
    for (index, subject) in tuning.subjects.iter().enumerate() {
        let mut row = vec![match subject.rank {
            Some(rank) => format!("rank {rank} ({})", super::short_trace(&subject.name)),
            None => super::short_trace(&subject.name),
        }];
        row.extend(
            columns
                .iter()
                .map(|(_, e)| bytes(e.figures[index].peak_reserved)),
        );
        row.push(bytes(subject.peak_requested));
        rows.push(row);
    }
    write_rows(out, &rows, 1);
}

/// Writes rows as aligned columns: the first `left` columns left-aligned, the rest right.
/// The command line's tables use it too.
pub(crate) fn write_rows(out: &mut String, rows: &[Vec<String>], left: usize) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|row| row.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c < left {
                    format!("{cell:<width$}", width = widths[c])
                } else {
                    format!("{cell:>width$}", width = widths[c])
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
}

/// The lines to paste, what they save, and how to check them.
fn answer(out: &mut String, tuning: &Tuning, options: &TextOptions) {
    if let Some(reason) = not_claimed_because(tuning) {
        let _ = writeln!(
            out,
            "{}",
            wrap(&format!("No setting is recommended: {reason}."), 100)
        );
        return;
    }
    let capacity = bytes(tuning.options.capacity);
    let Some(best) = tuning.recommendation() else {
        let first = &tuning.ranked[0];
        let requested = tuning.peak_requested();
        if requested > tuning.options.capacity {
            let _ = writeln!(
                out,
                "No setting can serve this within {capacity}: the program itself holds {} at \
                 its peak (live tensors alone), more than the GPU's memory.",
                bytes(requested)
            );
        } else {
            let _ = writeln!(
                out,
                "No setting tried serves this within {capacity} without running out of \
                 memory; the fewest failures ({}) come with {}.",
                grouped(first.ooms()),
                first.candidate.label()
            );
        }
        return;
    };
    let _ = writeln!(
        out,
        "Recommended (the lowest peak reserved with no out-of-memory on {capacity}):"
    );
    let _ = writeln!(
        out,
        "  export PYTORCH_CUDA_ALLOC_CONF={}",
        if best.candidate.conf.is_empty() {
            String::new()
        } else {
            shell_quote(&best.candidate.conf)
        }
    );
    for (name, value) in best.candidate.env() {
        let _ = writeln!(out, "  export {name}={}", shell_quote(&value));
    }
    let peak = best.worst_peak_reserved();
    let defaults = tuning.defaults();
    let several = tuning.subjects.len() > 1;
    let peak_words = if several {
        format!(
            "Its worst {} ({}) reserves {} at the peak",
            subject_word(tuning),
            worst_name(tuning, best),
            bytes(peak)
        )
    } else {
        format!("It reserves {} at the peak", bytes(peak))
    };
    let mut sentence = peak_words;
    if Some(tuning.defaults) == tuning.recommended {
        sentence.push_str(": PyTorch's defaults are the best of the settings tried");
    } else if defaults.fits() {
        sentence.push_str(&format!(
            ": {} less than PyTorch's defaults ({})",
            saving(peak, defaults.worst_peak_reserved()),
            bytes(defaults.worst_peak_reserved())
        ));
    } else {
        sentence.push_str(&format!(
            ", where PyTorch's defaults run out of memory ({} time(s))",
            grouped(defaults.ooms())
        ));
    }
    match tuning.recorded() {
        None => sentence.push_str("; the recording does not say which setting it ran under."),
        Some(_) if tuning.recorded == Some(tuning.defaults) => {
            sentence.push_str("; the recording ran under PyTorch's defaults.")
        }
        Some(recorded) if tuning.recorded == tuning.recommended => sentence.push_str(&format!(
            "; it is the setting the recording ran under ({}): keep it.",
            recorded.candidate.label()
        )),
        Some(recorded) if recorded.fits() => sentence.push_str(&format!(
            "; and {} less than the setting the recording ran under ({}, {}).",
            saving(peak, recorded.worst_peak_reserved()),
            recorded.candidate.label(),
            bytes(recorded.worst_peak_reserved())
        )),
        Some(recorded) => sentence.push_str(&format!(
            "; the setting the recording ran under ({}) runs out of memory here ({} time(s)).",
            recorded.candidate.label(),
            grouped(recorded.ooms())
        )),
    }
    let _ = writeln!(out, "{}", wrap(&sentence, 100));
    if best.candidate.cross_stream {
        let _ = writeln!(
            out,
            "{}",
            wrap(
                &format!(
                    "{} is ferrocache's own (ferrocache.install() reads it): PyTorch's \
                     allocator has no such mode.",
                    crate::env::CROSS_STREAM.name
                ),
                100
            )
        );
    }
    if let Some(traces) = &options.check_traces {
        let mut command = vec!["ferrocache replay".to_string()];
        if tuning.options.job {
            command.push("--job".to_string());
        }
        command.extend(traces.iter().map(|t| shell_quote(t)));
        command.push(format!("--conf {}", shell_quote(&best.candidate.conf)));
        if best.candidate.cross_stream {
            command.push("--cross-stream".to_string());
        }
        if tuning.options.capacity != super::DEFAULT_CAPACITY {
            command.push(format!(
                "--capacity-gib {}",
                capacity_gib_text(tuning.options.capacity)
            ));
        }
        if tuning.options.start == StartState::Fresh {
            command.push("--fresh".to_string());
        }
        if tuning.subjects.iter().any(|s| s.served_oom.is_some()) {
            command.push("--serve-final-oom".to_string());
        }
        let _ = writeln!(out, "Check it: {}", command.join(" "));
    }
}

/// Wraps a paragraph at `width` characters.
pub fn wrap(text: &str, width: usize) -> String {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines.join("\n")
}

fn env_json(evaluated: &Evaluated) -> Value {
    Value::Object(
        evaluated
            .candidate
            .env()
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect(),
    )
}

fn percent_saved(value: u64, reference: u64) -> Option<f64> {
    (reference > 0).then(|| 100.0 * (reference as f64 - value as f64) / reference as f64)
}

/// The search as one JSON object (`ferrocache tune --json`; `ferrocache.advise()`'s data).
pub fn json(tuning: &Tuning) -> Value {
    // Nothing is recommended or saved where a replay does not reproduce its recording.
    let best = tuning.recommendation().filter(|_| tuning.claims_savings());
    let defaults = tuning.defaults();
    let recorded = tuning.recorded();
    let peak = best.map(Evaluated::worst_peak_reserved);
    let candidates: Vec<Value> = tuning
        .ranked
        .iter()
        .map(|e| {
            let worst = &tuning.subjects[e.worst()];
            json!({
                "conf": e.candidate.conf,
                "env": env_json(e),
                "peak_reserved_bytes": e.worst_peak_reserved(),
                "sum_peak_reserved_bytes": e.sum_peak_reserved(),
                "worst_trace": worst.name,
                "worst_rank": worst.rank,
                "device_allocs": e.device_allocs(),
                "retries": e.retries(),
                "ooms": e.ooms(),
                "peaks_reserved_bytes": e.figures.iter().map(|f| f.peak_reserved).collect::<Vec<_>>(),
            })
        })
        .collect();
    let subjects: Vec<Value> = tuning
        .subjects
        .iter()
        .map(|s| {
            json!({
                "trace": s.name,
                "rank": s.rank,
                "events": s.events,
                "peak_requested_bytes": s.peak_requested,
                "served_oom_bytes": s.served_oom,
                "self_check": s.reproduction.json(),
            })
        })
        .collect();
    let saving = |reference: Option<&Evaluated>| {
        let reference = reference.filter(|r| r.fits())?;
        let peak = peak?;
        Some(json!({
            "bytes": reference.worst_peak_reserved() as i128 - peak as i128,
            "percent": percent_saved(peak, reference.worst_peak_reserved()),
        }))
    };
    json!({
        "recommended_conf": best.map(|b| b.candidate.conf.clone()),
        "recommended_env": best.map_or(json!({}), env_json),
        "peak_reserved_bytes": peak,
        "defaults_peak_reserved_bytes": defaults.worst_peak_reserved(),
        "defaults_ooms": defaults.ooms(),
        "recorded_conf": recorded.map(|r| r.candidate.conf.clone()),
        "recorded_env": recorded.map_or(Value::Null, env_json),
        "recorded_peak_reserved_bytes": recorded.map(Evaluated::worst_peak_reserved),
        "saving_vs_defaults": saving(Some(defaults)),
        "saving_vs_recorded": saving(recorded),
        "savings_claimed": tuning.claims_savings(),
        "not_claimed_because": not_claimed_because(tuning),
        "capacity_bytes": tuning.options.capacity,
        "capacity_source": tuning.options.capacity_source.as_str(),
        "start": match tuning.options.start {
            StartState::Reconstructed => "reconstructed",
            StartState::Fresh => "fresh",
        },
        "job": tuning.options.job,
        "worst_rank": best.and_then(|b| tuning.subjects[b.worst()].rank),
        "traces": subjects,
        "candidates_tried": tuning.ranked.len(),
        "space_size": tuning.space_size,
        "candidates": candidates,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_quoted_only_where_a_shell_needs_it() {
        assert_eq!(
            shell_quote("expandable_segments:True,max_split_size_mb:128"),
            "expandable_segments:True,max_split_size_mb:128"
        );
        assert_eq!(
            shell_quote("roundup_power2_divisions:[256:1,>:8]"),
            "'roundup_power2_divisions:[256:1,>:8]'"
        );
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn capacities_read_back_as_the_same_bytes() {
        for capacity in [80u64 << 30, 8 << 30, 12_345_678_901, 1 << 20] {
            let text = capacity_gib_text(capacity);
            let back = (text.parse::<f64>().unwrap() * GIB) as u64;
            assert_eq!(back, capacity, "{text}");
        }
        assert_eq!(capacity_gib_text(80 << 30), "80");
    }

    #[test]
    fn changes_and_savings_read_plainly() {
        assert_eq!(change(90, 100), "-10.0%");
        assert_eq!(change(100, 100), "0.0%");
        assert_eq!(saving(3 << 30, 4 << 30), "1.00 GiB (25.0%)");
        assert_eq!(saving(108 << 20, 128 << 20), "20.0 MiB (15.6%)");
    }
}
