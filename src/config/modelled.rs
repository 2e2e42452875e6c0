//! The PyTorch being modelled: its constants, which version it is, and the rules that changed
//! between versions (how ties between equal cached blocks break, the out-of-memory wording, what
//! a run-time change of the settings resets).
//!
//! A leaf: it uses nothing of the crate, so that the settings ([`crate::config`]) and the rules
//! ([`crate::policy`], which re-exports the constants and the two enums under their old paths)
//! both build on it without depending on each other.

/// All sizes are rounded to at least 512 bytes.
pub const K_MIN_BLOCK_SIZE: usize = 512;
/// The largest "small" request is 1 MiB.
pub const K_SMALL_SIZE: usize = 1_048_576;
/// Small requests are packed into 2 MiB segments.
pub const K_SMALL_BUFFER: usize = 2_097_152;
/// Requests between 1 and 10 MiB are packed into 20 MiB segments.
pub const K_LARGE_BUFFER: usize = 20_971_520;
/// Requests of 10 MiB or more get a segment of their own size.
pub const K_MIN_LARGE_ALLOC: usize = 10_485_760;
/// Large segments are rounded up to 2 MiB.
pub const K_ROUND_LARGE: usize = 2_097_152;
/// `roundup_power2_divisions` has one entry per power of two from 1 MiB to 64 GiB.
pub const K_ROUNDUP_POWER_OF_TWO_INTERVALS: usize = 16;

/// The newest PyTorch whose rules ferrocache knows, and follows when no version is given.
pub const NEWEST_PYTORCH: (u32, u32) = (2, 15);

/// The first PyTorch whose parse has the large-segment pass
/// ([`ModelledPyTorch::after_large_segment_pass`]).
pub const LARGE_SEGMENT_PASS_SINCE: (u32, u32) = (2, 11);

/// How PyTorch orders the cached free blocks of one stream and size; its best fit takes the
/// first. The rule changed twice, so ferrocache follows the PyTorch it runs under
/// ([`tie_rule_of_pytorch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TieRule {
    /// The lower address first (`BlockComparatorSize`, PyTorch up to 2.11).
    Address,
    /// The block made first, then the lower address: every new `Block` takes a process-wide
    /// counter (a new segment, the front split off for a request, a piece left by mapping or
    /// unmapping pages), merged blocks keep the freed block's (PyTorch 2.12, pytorch#178362).
    BlockOrder,
    /// The segment made first, then the lower address: the counter is taken when backing memory
    /// is obtained (`cudaMalloc`, a new expandable segment) and inherited by every block carved
    /// from it (PyTorch 2.13 and later, pytorch#183591). Best fit then picks the same block in
    /// every process, whatever addresses the driver returned.
    #[default]
    SegmentOrder,
}

/// The tie rule of PyTorch `major.minor` (measured through each version's own allocator on the
/// fake CUDA: python/tests/real_torch/test_oracle.py, the tie programs).
pub fn tie_rule_of_pytorch(major: u32, minor: u32) -> TieRule {
    match (major, minor) {
        (0..=1, _) | (2, 0..=11) => TieRule::Address,
        (2, 12) => TieRule::BlockOrder,
        _ => TieRule::SegmentOrder,
    }
}

/// The advice at the end of PyTorch's out-of-memory message, which changed between versions
/// (read from each version's `libc10_cuda.so` and checked by running it on the fake CUDA; see
/// [`oom_wording_of_pytorch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OomWording {
    /// PyTorch 2.4 to 2.9: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` and the link
    /// `pytorch.org/docs/stable/notes/cuda.html#environment-variables`.
    EnvironmentVariablesLink,
    /// PyTorch 2.10: the same link, but the advice names `PYTORCH_ALLOC_CONF`.
    AllocConfVariable,
    /// PyTorch 2.11 to 2.14: the link
    /// `docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf`.
    AllocConfLink,
    /// PyTorch 2.15: as 2.11, except that with `expandable_segments:True` the advice is a note
    /// on virtual address space instead, and an allocation larger than the configured
    /// `expandable_segments_reserve` says so.
    #[default]
    ExpandableNote,
}

/// The out-of-memory wording of PyTorch `major.minor`.
pub fn oom_wording_of_pytorch(major: u32, minor: u32) -> OomWording {
    match (major, minor) {
        (0..=1, _) | (2, 0..=9) => OomWording::EnvironmentVariablesLink,
        (2, 10) => OomWording::AllocConfVariable,
        (2, 11..=14) => OomWording::AllocConfLink,
        _ => OomWording::ExpandableNote,
    }
}

/// The first PyTorch whose allocator tells a graph capture from a recording private pool by
/// the current stream ([`CaptureContextRule::CurrentStreamCapturing`]). 2.15.0's
/// `libc10_cuda.so` has `is_capture_context()` (called from `malloc`, `free_locked`,
/// `recordStream`, `release_cached_blocks`, `synchronize_and_free_events`,
/// `mallocWithAddress`); 2.11.0's has none. pytorch#175374 was merged on 2026-05-13, after the
/// 2.12 branch and before pytorch#183591 (2.13): 2.13 by that chronology, not measured.
pub const CAPTURE_CONTEXT_SINCE: (u32, u32) = (2, 13);

/// When PyTorch's allocator acts as during a CUDA graph capture: skips processing events,
/// defers the events of a freed block used on other streams, notes `record_stream` uses as the
/// capture's, and leaves the ordinary pools alone in `empty_cache` and in the out-of-memory
/// retry that releases every cached block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureContextRule {
    /// Whenever a private pool records (`!captures_underway.empty()`): during a capture and
    /// inside `torch.cuda.use_mem_pool` alike (PyTorch up to 2.12).
    AnyPoolRecording,
    /// Only while the current stream is capturing a graph (`is_capture_context()`,
    /// pytorch#175374, merged 2026-05-13): inside `use_mem_pool` the allocator acts as outside
    /// any capture (PyTorch 2.13 and later).
    #[default]
    CurrentStreamCapturing,
}

/// The capture-context rule of PyTorch `major.minor`.
pub fn capture_context_rule_of_pytorch(major: u32, minor: u32) -> CaptureContextRule {
    if (major, minor) >= CAPTURE_CONTEXT_SINCE {
        CaptureContextRule::CurrentStreamCapturing
    } else {
        CaptureContextRule::AnyPoolRecording
    }
}

/// What a parse does to `max_non_split_rounding_mb` after its large-segment pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterLargeSegmentPass {
    /// It becomes `large_segment_size_mb` (then a later key in the text may set it).
    RoundingFollowsLargeSegment,
    /// It keeps its value: the PyTorch has no large-segment pass.
    RoundingKept,
}

/// The PyTorch ferrocache runs under (`FERROCACHE_PYTORCH_VERSION`, which
/// `ferrocache.install()` sets from `torch.__version__`), and the rules of that version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelledPyTorch {
    /// `(major, minor)`; [`NEWEST_PYTORCH`] by default.
    pub version: (u32, u32),
    /// How ties between equal cached blocks break.
    pub tie_rule: TieRule,
    /// The wording of the out-of-memory message.
    pub oom_wording: OomWording,
    /// When the allocator acts as during a graph capture.
    pub capture_context: CaptureContextRule,
}

impl Default for ModelledPyTorch {
    fn default() -> Self {
        ModelledPyTorch::of_version(NEWEST_PYTORCH)
    }
}

impl ModelledPyTorch {
    /// PyTorch `(major, minor)` and its rules.
    pub fn of_version((major, minor): (u32, u32)) -> Self {
        ModelledPyTorch {
            version: (major, minor),
            tie_rule: tie_rule_of_pytorch(major, minor),
            oom_wording: oom_wording_of_pytorch(major, minor),
            capture_context: capture_context_rule_of_pytorch(major, minor),
        }
    }

    /// The PyTorch a version string names (`2.12`, `2.12.1+cu128`, `2.16.0a0`): `major.minor`
    /// counts; `None` when it is not a version.
    pub fn of_version_text(text: &str) -> Option<Self> {
        parse_major_minor(text).map(ModelledPyTorch::of_version)
    }

    /// What this PyTorch's `setAllocatorSettings` (`torch.cuda.memory._set_allocator_settings`)
    /// does to `max_non_split_rounding_mb` around reading a run-time text.
    ///
    /// - Every version from 2.4 on first puts `max_split_size_mb`, `roundup_power2_divisions`
    ///   and `garbage_collection_threshold` back to their defaults: 2.4 to 2.8 at the top of
    ///   `CUDAAllocatorConfig::parseArgs` (c10/cuda/CUDAAllocatorConfig.cpp, "If empty, set the
    ///   default values": `m_max_split_size = ...max()`, `m_roundup_power2_divisions.assign(...)`,
    ///   `m_garbage_collection_threshold = 0`), later ones at the top of
    ///   `AcceleratorAllocatorConfig::parseArgs` (c10/core/AllocatorConfig.cpp, "reset to its
    ///   default value if not explicitly set each time"). Every other key keeps its value unless
    ///   the text names it.
    /// - From [`LARGE_SEGMENT_PASS_SINCE`] on, the parse begins with a pass over
    ///   `large_segment_size_mb`, which then sets `max_non_split_rounding_mb` to
    ///   `large_segment_size_mb` (so a run-time text that does not name it puts it back). Older
    ///   versions have neither key nor pass: `max_non_split_rounding_mb` keeps its value.
    ///
    /// Measured on each version's own allocator on the fake CUDA (docs/python.md, "Settings
    /// changed at run time"): 2.8.0 and 2.10.0 keep `max_non_split_rounding_mb:40` across
    /// `_set_allocator_settings("max_split_size_mb:30")`; 2.11.0, 2.13.0, 2.14.1 and 2.15.0 put
    /// it back; `large_segment_size_mb` is in the strings of 2.11.0's `libc10.so`, not 2.10.0's.
    /// The keys a version accepts at all are its parser's business: it runs before ferrocache's
    /// and refuses what it lacks (2.8 and 2.10 refuse `large_segment_size_mb`).
    pub fn after_large_segment_pass(&self) -> AfterLargeSegmentPass {
        if self.version >= LARGE_SEGMENT_PASS_SINCE {
            AfterLargeSegmentPass::RoundingFollowsLargeSegment
        } else {
            AfterLargeSegmentPass::RoundingKept
        }
    }
}

/// `major.minor` of a version string such as `2.12.1+cu128` or `2.16.0a0`.
fn parse_major_minor(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oom_wording_follows_the_pytorch_version() {
        assert_eq!(
            oom_wording_of_pytorch(2, 4),
            OomWording::EnvironmentVariablesLink
        );
        assert_eq!(
            oom_wording_of_pytorch(2, 9),
            OomWording::EnvironmentVariablesLink
        );
        assert_eq!(oom_wording_of_pytorch(2, 10), OomWording::AllocConfVariable);
        assert_eq!(oom_wording_of_pytorch(2, 11), OomWording::AllocConfLink);
        assert_eq!(oom_wording_of_pytorch(2, 14), OomWording::AllocConfLink);
        assert_eq!(oom_wording_of_pytorch(2, 15), OomWording::ExpandableNote);
        assert_eq!(oom_wording_of_pytorch(3, 0), OomWording::ExpandableNote);
        assert_eq!(OomWording::default(), OomWording::ExpandableNote);
    }

    #[test]
    fn version_strings_give_major_and_minor() {
        for (text, version) in [
            ("2.12", (2, 12)),
            ("2.12.1+cu128", (2, 12)),
            (" 2.16.0a0 ", (2, 16)),
            ("3.0", (3, 0)),
        ] {
            let modelled = ModelledPyTorch::of_version_text(text);
            assert_eq!(modelled.map(|m| m.version), Some(version), "{text}");
        }
        for text in ["", "nightly", "2", "2.x", "v2.12"] {
            assert_eq!(ModelledPyTorch::of_version_text(text), None, "{text}");
        }
    }

    #[test]
    fn without_a_version_the_newest_pytorchs_rules_apply() {
        let newest = ModelledPyTorch::default();
        assert_eq!(newest.version, NEWEST_PYTORCH);
        assert_eq!(newest.tie_rule, TieRule::default());
        assert_eq!(newest.oom_wording, OomWording::default());
        assert_eq!(newest.capture_context, CaptureContextRule::default());
        assert_eq!(
            ModelledPyTorch::of_version((2, 12)).capture_context,
            CaptureContextRule::AnyPoolRecording
        );
        assert_eq!(
            newest.after_large_segment_pass(),
            AfterLargeSegmentPass::RoundingFollowsLargeSegment
        );
        assert_eq!(
            ModelledPyTorch::of_version((2, 10)).after_large_segment_pass(),
            AfterLargeSegmentPass::RoundingKept
        );
    }
}
