//! PyTorch's allocation rules, as pure functions.
//!
//! Each function is one rule of `c10/cuda/CUDACachingAllocator.cpp`, under PyTorch's name where it
//! has one, with PyTorch's constants. The allocator asks these functions and decides nothing about
//! sizes itself, so a rule can be read, tested and changed in one place.
//!
//! The rules read PyTorch's keys of [`Config`] alone, never ferrocache's opt-ins or where a
//! value came from. What changed between PyTorch versions (tie rule, out-of-memory wording)
//! lives with the PyTorch being modelled ([`crate::config::modelled`], a leaf), whose constants
//! and enums are re-exported here under their old paths.

#![forbid(unsafe_code)]

use crate::config::Config;
use crate::device::ProcessMemory;

pub use crate::config::modelled::{
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE,
    K_ROUNDUP_POWER_OF_TWO_INTERVALS, K_SMALL_BUFFER, K_SMALL_SIZE, OomWording, TieRule,
    oom_wording_of_pytorch, tie_rule_of_pytorch,
};

/// What PyTorch's out-of-memory message quotes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomFigures {
    /// The segment size that could not be obtained ("Tried to allocate").
    pub alloc_size: usize,
    pub device: i32,
    pub device_total: usize,
    pub device_free: usize,
    /// The memory-fraction limit, when one is set.
    pub allowed: Option<usize>,
    /// Bytes allocated to the program, free blocks cached in private pools included.
    pub allocated: usize,
    /// Free blocks cached in private pools (CUDA graphs), which count as allocated.
    pub in_private_pools: usize,
    /// Bytes held from the device.
    pub reserved: usize,
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// The address range an expandable segment of the request's stream may reserve, when
    /// `expandable_segments_reserve` or `expandable_segments_reserve_by_class` sets one
    /// ([`expandable_segment_reserve`]).
    pub configured_reserve: Option<usize>,
    /// The reserve class PyTorch's C++ API gave the request's stream; empty: none.
    pub reserve_class: String,
    /// The processes on the GPU and their memory, as NVML lists them; empty where NVML cannot
    /// answer ([`process_memory_sentences`]).
    pub processes: Vec<ProcessMemory>,
    /// This process's id, to tell its own entry in `processes`.
    pub own_pid: u32,
}

/// `DeviceCachingAllocator::malloc`'s out-of-memory message, in the wording of the PyTorch
/// ferrocache runs under.
pub fn out_of_memory_message(figures: &OomFigures, wording: OomWording) -> String {
    let fmt = |n: usize| format_size(n as u64);
    let allowed = figures
        .allowed
        .map(|a| format!("{} allowed; ", fmt(a)))
        .unwrap_or_default();
    let private_pools = if figures.in_private_pools > 0 {
        format!(
            "with {} allocated in private pools (e.g., CUDA Graphs), ",
            fmt(figures.in_private_pools)
        )
    } else {
        String::new()
    };
    format!(
        "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} \
         is free. {}{allowed}Of the allocated memory {} is allocated by PyTorch, \
         {private_pools}and {} is reserved by PyTorch but unallocated.{}",
        fmt(figures.alloc_size),
        figures.device,
        fmt(figures.device_total),
        fmt(figures.device_free),
        process_memory_sentences(&figures.processes, figures.own_pid),
        fmt(figures.allocated),
        fmt(figures.reserved.saturating_sub(figures.allocated)),
        out_of_memory_advice(figures, wording),
    )
}

/// `reportProcessMemoryInfo`: after "... is free. ", one sentence per process that NVML lists
/// on the GPU, in NVML's order, with the memory it uses, this process's own included (its CUDA
/// context and whatever it allocated outside the caching allocator); nothing where NVML does not
/// answer. The same words in PyTorch 2.11 to 2.15 (read from their `libc10_cuda.so`).
pub fn process_memory_sentences(processes: &[ProcessMemory], own_pid: u32) -> String {
    processes
        .iter()
        .map(|process| {
            let who = if process.pid == own_pid {
                "Including non-PyTorch memory, this process".to_string()
            } else {
                format!("Process {}", process.pid)
            };
            format!(
                "{who} has {} memory in use. ",
                format_size(process.used_bytes)
            )
        })
        .collect()
}

/// The sentences after "... is reserved by PyTorch but unallocated.": PyTorch 2.15 explains an
/// allocation larger than the configured expandable-segment reserve (when the device could hold
/// it), else with expandable segments on it notes that they reserve address space; otherwise,
/// and in every older PyTorch, it suggests expandable segments.
fn out_of_memory_advice(figures: &OomFigures, wording: OomWording) -> String {
    const SUGGESTION: &str = " If reserved but unallocated memory is large try setting";
    const FRAGMENTATION: &str = "=expandable_segments:True to avoid fragmentation.  See \
                                 documentation for Memory Management  ";
    match wording {
        OomWording::EnvironmentVariablesLink | OomWording::AllocConfVariable => {
            let variable = if wording == OomWording::AllocConfVariable {
                "PYTORCH_ALLOC_CONF"
            } else {
                "PYTORCH_CUDA_ALLOC_CONF"
            };
            return format!(
                "{SUGGESTION} {variable}{FRAGMENTATION}\
                 (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
            );
        }
        OomWording::AllocConfLink => {}
        OomWording::ExpandableNote if figures.expandable_segments => {
            if let Some(reserve) = figures.configured_reserve
                && reserve < figures.alloc_size
                && figures.alloc_size <= figures.device_total
            {
                let stream = if figures.reserve_class.is_empty() {
                    "this stream".to_string()
                } else {
                    format!("stream reserve class '{}'", figures.reserve_class)
                };
                return format!(
                    " This allocation exceeds the expandable-segment reserve of {} for {stream}, \
                     and a single allocation cannot span expandable segments. Raise \
                     PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve or \
                     expandable_segments_reserve_by_class (or unset it) so that a segment is at \
                     least {}.",
                    format_size(reserve as u64),
                    format_size(figures.alloc_size as u64)
                );
            }
            return " expandable_segments is enabled. If instead the process is running out of \
                    virtual address space (VSZ), expandable segments may be over-reserving VA \
                    (each segment reserves ~9/8 of device memory, times the number of streams); \
                    reduce it via PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve / \
                    expandable_segments_reserve_by_class."
                .to_string();
        }
        OomWording::ExpandableNote => {}
    }
    format!(
        "{SUGGESTION} PYTORCH_CUDA_ALLOC_CONF{FRAGMENTATION}\
         (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )
}

/// What PyTorch 2.15 decides about the address range of a new expandable segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveDecision {
    /// The range in bytes, before rounding to whole pages.
    pub bytes: usize,
    /// Whether `expandable_segments_reserve` or the stream's class set it (else the default).
    pub configured: bool,
    /// Whether the stream's class has an entry in `expandable_segments_reserve_by_class`.
    pub class_known: bool,
}

/// `growableReserveBytes`: the address range each expandable segment of a stream reserves. By
/// default 9/8 of the device's memory (so pages unmapped early in the range can be mapped again
/// at its end); PyTorch 2.15 asks for less when the stream's reserve class (given by PyTorch's
/// C++ API, `setExpandableSegmentReserveClassForStream`; empty for untagged streams) has an
/// entry in `expandable_segments_reserve_by_class`, or else when `expandable_segments_reserve`
/// is set, capped at the default either way.
pub fn expandable_segment_reserve(
    config: &Config,
    device_total: usize,
    reserve_class: &str,
) -> ReserveDecision {
    let full = device_total + device_total / 8;
    let by_class = config
        .expandable_segments_reserve_by_class
        .iter()
        .find(|(class, _)| class == reserve_class)
        .map(|(_, reserve)| *reserve);
    let reserve = by_class.or(config.expandable_segments_reserve);
    ReserveDecision {
        bytes: reserve.map_or(full, |r| r.resolve_bytes(device_total).min(full)),
        configured: reserve.is_some(),
        class_known: by_class.is_some(),
    }
}

/// The warning PyTorch 2.15 gives (once per class) when a tagged stream's class has no entry in
/// `expandable_segments_reserve_by_class`.
pub fn unknown_reserve_class_warning(reserve_class: &str) -> String {
    format!(
        "expandable_segments reserve class '{reserve_class}' has no configured reserve in \
         expandable_segments_reserve_by_class; using the default reserve."
    )
}

/// `throw_on_cudamalloc_oom` (PyTorch 2.12 and later): the limit above which a device
/// allocation is refused before the driver is asked, with no release and retry: the device's
/// memory times the `per_process_memory_fraction` of `PYTORCH_CUDA_ALLOC_CONF` (1 when not
/// given), whatever `set_per_process_memory_fraction` set since. `None` when the setting is off.
pub fn preemptive_rejection_limit(config: &Config, device_total: usize) -> Option<usize> {
    config.throw_on_cudamalloc_oom.then(|| {
        let fraction = config.per_process_memory_fraction.unwrap_or(1.0);
        (device_total as f64 * fraction) as usize
    })
}

/// The message of the exception a preemptive rejection raises; `requested` is what the
/// program asked for.
pub fn preemptive_rejection_message(requested: usize) -> String {
    format!(
        "CUDA out of memory. Allocation was preemptively rejected because it would exceed \
         per_process_memory_fraction limit. Requested size: {}",
        format_size(requested as u64)
    )
}

/// The warning PyTorch logs when it rejects an allocation preemptively.
pub fn preemptive_rejection_warning(
    alloc_size: usize,
    total_allocated_memory: usize,
    limit: usize,
    fraction: f64,
    device_total: usize,
) -> String {
    let fmt = |n: usize| format_size(n as u64);
    format!(
        "Preemptively rejecting allocation: requested {} but total_allocated_memory ({}) + \
         requested size would exceed memory limit ({} = {}% of {}). Set \
         throw_on_cudamalloc_oom:false to disable.",
        fmt(alloc_size),
        fmt(total_allocated_memory),
        fmt(limit),
        format_cpp_double(fraction * 100.0),
        fmt(device_total)
    )
}

/// A double as C++'s `ostream << double` writes it by default (`%g`, six significant digits):
/// `50`, `33.3333`, `1e+06`.
pub fn format_cpp_double(value: f64) -> String {
    if !value.is_finite() {
        return if value.is_nan() {
            "nan".to_string()
        } else if value > 0.0 {
            "inf".to_string()
        } else {
            "-inf".to_string()
        };
    }
    if value == 0.0 {
        return if value.is_sign_negative() { "-0" } else { "0" }.to_string();
    }
    // Rounded to six significant digits first: the exponent is that of the rounded value.
    let scientific = format!("{value:.5e}");
    let (mantissa, exponent) = scientific.split_once('e').expect("`{:e}` has an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes an integer exponent");
    let trim = |digits: &str| -> String {
        if digits.contains('.') {
            digits
                .trim_end_matches('0')
                .trim_end_matches('.')
                .to_string()
        } else {
            digits.to_string()
        }
    };
    if !(-4..6).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{}e{sign}{:02}", trim(mantissa), exponent.abs());
    }
    let decimals = (5 - exponent) as usize;
    trim(&format!("{value:.decimals$}"))
}

/// Which of the two free-block pools a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// Requests up to 1 MiB, served from 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// PyTorch's name for the pool in statistics keys (`small_pool`, `large_pool`).
    pub fn stat_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }

    /// PyTorch's name for the segment type in snapshots (`small`, `large`).
    pub fn segment_type(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }

    /// The page size of an expandable segment of this pool: 2 MiB small, `large_segment_size`
    /// (20 MiB by default) large. A `large_segment_size_mb` that is not a multiple of 2 MiB is
    /// rounded up to one, because physical pages come in multiples of the device granularity.
    pub fn expandable_page_size(self, config: &Config) -> usize {
        match self {
            PoolKind::Small => K_SMALL_BUFFER,
            PoolKind::Large => config.large_segment_size.div_ceil(K_SMALL_BUFFER) * K_SMALL_BUFFER,
        }
    }
}

/// `get_pool`: requests of up to 1 MiB (after rounding) go to the small pool.
pub fn pool_for(rounded_size: usize) -> PoolKind {
    if rounded_size <= K_SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// `CUDAAllocatorConfig::roundup_power2_divisions(size)`: the number of divisions configured for
/// the power-of-two interval that holds `size`. Intervals start at 1 MiB (everything below uses
/// the first) and end at 64 GiB (everything above uses the last).
pub fn roundup_power2_divisions(
    size: usize,
    divisions: &[usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS],
) -> usize {
    const INTERVAL_START: usize = 20; // log2(1 MiB)
    let log_size = (usize::BITS - 1 - size.max(1).leading_zeros()) as usize;
    let index = log_size
        .saturating_sub(INTERVAL_START)
        .min(K_ROUNDUP_POWER_OF_TWO_INTERVALS - 1);
    divisions[index]
}

/// `roundup_power2_next_division`: rounds `size` up to the next of `divisions` equal steps
/// between the powers of two around it (1200 with 4 divisions -> 1280).
pub fn roundup_power2_next_division(size: usize, divisions: usize) -> usize {
    if size.is_power_of_two() {
        return size;
    }
    let power2_floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    // Divisions are powers of two (the config guarantees it); a division count larger than the
    // interval rounds to the next power of two.
    let divisions_log2 = usize::BITS - 1 - divisions.max(1).leading_zeros();
    let power2_division = power2_floor >> divisions_log2;
    if power2_division == 0 {
        return power2_floor << 1;
    }
    let round_size_floor = size & !(power2_division - 1);
    if round_size_floor == size {
        size
    } else {
        round_size_floor + power2_division
    }
}

/// `round_size`: the size a request is served at. At least 512 bytes; a multiple of 512, or of
/// the power-of-two division when `roundup_power2_divisions` applies to the size.
pub fn round_size(size: usize, config: &Config) -> usize {
    if size < K_MIN_BLOCK_SIZE {
        return K_MIN_BLOCK_SIZE;
    }
    let divisions = roundup_power2_divisions(size, &config.roundup_power2_divisions);
    if divisions > 1 && size > K_MIN_BLOCK_SIZE * divisions {
        roundup_power2_next_division(size, divisions)
    } else {
        K_MIN_BLOCK_SIZE * size.div_ceil(K_MIN_BLOCK_SIZE)
    }
}

/// `get_allocation_size`: the size of the segment to ask the driver for when no cached block fits
/// a request of `rounded_size`: 2 MiB for small requests, `large_segment_size_mb` (20 MiB by
/// default, `kLargeBuffer`) for requests under 10 MiB, else the request rounded up to 2 MiB.
pub fn allocation_size(rounded_size: usize, config: &Config) -> usize {
    if rounded_size <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if rounded_size < K_MIN_LARGE_ALLOC {
        config.large_segment_size
    } else {
        K_ROUND_LARGE * rounded_size.div_ceil(K_ROUND_LARGE)
    }
}

/// `should_split`: whether serving `rounded_size` from a free block of `block_size` leaves the
/// rest as a free block of its own. Small-pool and expandable blocks split whenever at least
/// 512 bytes remain; other large blocks only when more than 1 MiB remains and the request is
/// below `max_split_size`.
pub fn should_split(
    block_size: usize,
    rounded_size: usize,
    pool: PoolKind,
    config: &Config,
) -> bool {
    should_split_in(
        block_size,
        rounded_size,
        pool,
        config.expandable_segments,
        config,
    )
}

/// [`should_split`] with PyTorch's `is_expandable_segments_active` given: off for a private
/// pool with its own allocator, whose segments are never expandable (PyTorch's `malloc`).
#[inline(always)]
pub fn should_split_in(
    block_size: usize,
    rounded_size: usize,
    pool: PoolKind,
    expandable_segments_active: bool,
    config: &Config,
) -> bool {
    let remaining = block_size - rounded_size;
    if pool == PoolKind::Small || expandable_segments_active {
        remaining >= K_MIN_BLOCK_SIZE
    } else {
        rounded_size < config.max_split_size && remaining > K_SMALL_SIZE
    }
}

/// The oversize rules of `get_free_block`: whether the best-fitting cached block (of
/// `block_size`) may serve a request of `rounded_size`. A request below `max_split_size` never
/// takes an oversize block; a request at or above it takes one only if the block is less than
/// `max_non_split_rounding_mb` larger.
pub fn may_serve(block_size: usize, rounded_size: usize, config: &Config) -> bool {
    if rounded_size < config.max_split_size {
        block_size < config.max_split_size
    } else {
        block_size < rounded_size.saturating_add(config.max_non_split_rounding_size)
    }
}

/// Whether a block counts as oversize (`size >= max_split_size`): never split, counted in
/// `oversize_allocations` / `oversize_segments`, the first released on a failed allocation.
pub fn is_oversize(size: usize, config: &Config) -> bool {
    size >= config.max_split_size
}

/// `setMemoryFraction`: the most this allocator may hold on a device of `total_memory` bytes,
/// or `None` for no limit. A fraction of 1 sets no limit: PyTorch 2.15 then calls `cudaMalloc`
/// beyond the device's total, as the oracle shows (`python/tools/oracle`).
pub fn memory_fraction_limit(fraction: f64, total_memory: usize) -> Option<usize> {
    (fraction < 1.0).then_some((fraction * total_memory as f64) as usize)
}

/// `format_size`: PyTorch's human-readable size in OOM messages ("20.00 MiB").
pub fn format_size(size: u64) -> String {
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1_048_576 {
        format!("{:.2} KiB", size as f64 / 1024.0)
    } else if size <= 1_073_741_824 {
        format!("{:.2} MiB", size as f64 / 1_048_576.0)
    } else {
        format!("{:.2} GiB", size as f64 / 1_073_741_824.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn with_divisions(divisions: usize) -> Config {
        Config {
            roundup_power2_divisions: [divisions; K_ROUNDUP_POWER_OF_TWO_INTERVALS],
            ..Config::default()
        }
    }

    #[test]
    fn round_size_is_at_least_512_and_a_multiple_of_512() {
        let c = Config::default();
        assert_eq!(round_size(0, &c), 512);
        assert_eq!(round_size(1, &c), 512);
        assert_eq!(round_size(511, &c), 512);
        assert_eq!(round_size(512, &c), 512);
        assert_eq!(round_size(513, &c), 1024);
        assert_eq!(round_size(7_864_320, &c), 7_864_320);
        assert_eq!(round_size(1_000_000, &c), 1_000_448);
    }

    #[test]
    fn round_size_uses_power2_divisions() {
        // PyTorch's own example: 1200 with 4 divisions -> 1280 (between 1024 and 2048).
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(roundup_power2_next_division(1024, 4), 1024);
        assert_eq!(roundup_power2_next_division(1280, 4), 1280);
        assert_eq!(roundup_power2_next_division(1281, 4), 1536);
        // More divisions than the interval has steps: the next power of two.
        assert_eq!(roundup_power2_next_division(3, 4), 4);
        let c = with_divisions(4);
        // 1200 is not above 512 * 4, so plain 512 rounding applies.
        assert_eq!(round_size(1200, &c), 1536);
        assert_eq!(round_size(5 * MIB + 1, &c), 5 * MIB + MIB);
        assert_eq!(round_size(33 * MIB, &c), 40 * MIB);
        let c = with_divisions(1);
        assert_eq!(round_size(33 * MIB + 1, &c), 33 * MIB + 512);
    }

    #[test]
    fn divisions_are_looked_up_by_power_of_two_interval() {
        let mut d = [0; K_ROUNDUP_POWER_OF_TWO_INTERVALS];
        for (i, v) in d.iter_mut().enumerate() {
            *v = i + 100;
        }
        assert_eq!(roundup_power2_divisions(1, &d), 100);
        assert_eq!(roundup_power2_divisions(MIB - 1, &d), 100);
        assert_eq!(roundup_power2_divisions(MIB, &d), 100);
        assert_eq!(roundup_power2_divisions(2 * MIB, &d), 101);
        assert_eq!(roundup_power2_divisions(256 * MIB, &d), 108);
        assert_eq!(roundup_power2_divisions(32 << 30, &d), 115);
        assert_eq!(roundup_power2_divisions(1 << 40, &d), 115);
    }

    #[test]
    fn small_pool_is_up_to_one_mib() {
        assert_eq!(pool_for(512), PoolKind::Small);
        assert_eq!(pool_for(MIB), PoolKind::Small);
        assert_eq!(pool_for(MIB + 512), PoolKind::Large);
    }

    #[test]
    fn allocation_sizes_follow_pytorch() {
        let c = Config::default();
        assert_eq!(allocation_size(512, &c), 2 * MIB);
        assert_eq!(allocation_size(MIB, &c), 2 * MIB);
        assert_eq!(allocation_size(MIB + 512, &c), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB - 512, &c), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB, &c), 10 * MIB);
        assert_eq!(allocation_size(10 * MIB + 512, &c), 12 * MIB);
        assert_eq!(allocation_size(100_000_000, &c), 100_663_296);
        // large_segment_size_mb:64 packs 1-10 MiB requests into 64 MiB segments.
        let c = Config {
            large_segment_size: 64 * MIB,
            ..Config::default()
        };
        assert_eq!(allocation_size(MIB + 512, &c), 64 * MIB);
        assert_eq!(allocation_size(10 * MIB, &c), 10 * MIB);
        assert_eq!(PoolKind::Large.expandable_page_size(&c), 64 * MIB);
        let c = Config {
            large_segment_size: 11 * MIB,
            ..Config::default()
        };
        assert_eq!(PoolKind::Large.expandable_page_size(&c), 12 * MIB);
        assert_eq!(PoolKind::Small.expandable_page_size(&c), 2 * MIB);
    }

    #[test]
    fn split_rules() {
        let c = Config::default();
        // Small pool: any remainder of at least 512 bytes.
        assert!(should_split(2 * MIB, 512, PoolKind::Small, &c));
        assert!(!should_split(1024, 1024, PoolKind::Small, &c));
        assert!(should_split(1024, 512, PoolKind::Small, &c));
        // Large pool: more than 1 MiB must remain.
        assert!(!should_split(20 * MIB, 19 * MIB, PoolKind::Large, &c));
        assert!(should_split(20 * MIB, 19 * MIB - 512, PoolKind::Large, &c));
        // Requests at or above max_split_size are never split off.
        let c = Config {
            max_split_size: 64 * MIB,
            ..Config::default()
        };
        assert!(!should_split(200 * MIB, 64 * MIB, PoolKind::Large, &c));
        assert!(should_split(200 * MIB, 63 * MIB, PoolKind::Large, &c));
        // Expandable segments split large blocks like small ones.
        let c = Config {
            expandable_segments: true,
            ..Config::default()
        };
        assert!(should_split(20 * MIB, 20 * MIB - 512, PoolKind::Large, &c));
    }

    #[test]
    fn oversize_blocks_serve_only_close_requests() {
        let c = Config::default();
        assert!(may_serve(1 << 40, 512, &c));
        let c = Config {
            max_split_size: 64 * MIB,
            ..Config::default()
        };
        assert!(may_serve(63 * MIB, 2 * MIB, &c));
        assert!(!may_serve(64 * MIB, 2 * MIB, &c));
        assert!(may_serve(64 * MIB, 64 * MIB, &c));
        assert!(may_serve(84 * MIB - 512, 64 * MIB, &c));
        assert!(!may_serve(84 * MIB, 64 * MIB, &c));
        let c = Config {
            max_split_size: 64 * MIB,
            max_non_split_rounding_size: 1024 * MIB,
            ..Config::default()
        };
        assert!(may_serve(1024 * MIB, 512 * MIB, &c));
        assert!(!may_serve(1536 * MIB, 512 * MIB, &c));
    }

    #[test]
    fn cpp_doubles_print_like_ostream() {
        for (value, text) in [
            (50.0, "50"),
            (100.0, "100"),
            (0.7 * 100.0, "70"),
            (100.0 / 3.0, "33.3333"),
            (12.5, "12.5"),
            (99.999_999, "100"),
            (1e6, "1e+06"),
            (123_456.0, "123456"),
            (1_234_567.0, "1.23457e+06"),
            (0.0001, "0.0001"),
            (0.000_012_5, "1.25e-05"),
            (0.0, "0"),
        ] {
            assert_eq!(format_cpp_double(value), text, "{value}");
        }
    }

    #[test]
    fn expandable_reserves_are_capped_at_nine_eighths() {
        let reserve_of = |conf: &str, class: &str| {
            let config = Config::parse(conf).unwrap();
            let d = expandable_segment_reserve(&config, 1 << 30, class);
            (d.bytes, d.configured, d.class_known)
        };
        let reserve = |conf: &str| {
            let (bytes, configured, _) = reserve_of(conf, "");
            (bytes, configured)
        };
        assert_eq!(reserve(""), (1_207_959_552, false));
        assert_eq!(reserve("expandable_segments_reserve:0.5"), (1 << 29, true));
        assert_eq!(
            reserve("expandable_segments_reserve:2.0"),
            (1_207_959_552, true)
        );
        assert_eq!(
            reserve("expandable_segments_reserve:0.05"),
            (53_687_091, true)
        );
        assert_eq!(
            reserve("expandable_segments_reserve:1e20G"),
            (1_207_959_552, true)
        );
        // A tagged stream: its class's entry, else the global reserve, else the default.
        let both =
            "expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[a:0.25,b:2G]";
        assert_eq!(reserve_of(both, "a"), (1 << 28, true, true));
        assert_eq!(reserve_of(both, "b"), (1_207_959_552, true, true));
        assert_eq!(reserve_of(both, "c"), (1 << 29, true, false));
        assert_eq!(reserve_of(both, ""), (1 << 29, true, false));
        let by_class = "expandable_segments_reserve_by_class:[a:0.25]";
        assert_eq!(reserve_of(by_class, "c"), (1_207_959_552, false, false));
    }

    #[test]
    fn preemptive_rejection_limit_is_the_configured_fraction_of_the_device() {
        let limit = |conf: &str| preemptive_rejection_limit(&Config::parse(conf).unwrap(), 1 << 30);
        assert_eq!(limit(""), None);
        assert_eq!(limit("per_process_memory_fraction:0.5"), None);
        assert_eq!(limit("throw_on_cudamalloc_oom:True"), Some(1 << 30));
        assert_eq!(
            limit("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5"),
            Some(1 << 29)
        );
        assert_eq!(
            preemptive_rejection_warning(802 << 20, 300 << 20, 1 << 30, 1.0, 1 << 30),
            "Preemptively rejecting allocation: requested 802.00 MiB but total_allocated_memory \
             (300.00 MiB) + requested size would exceed memory limit (1024.00 MiB = 100% of \
             1024.00 MiB). Set throw_on_cudamalloc_oom:false to disable."
        );
    }

    #[test]
    fn format_size_matches_pytorch() {
        assert_eq!(format_size(1024), "1024 bytes");
        assert_eq!(format_size(1025), "1.00 KiB");
        assert_eq!(format_size(20 * MIB as u64), "20.00 MiB");
        assert_eq!(format_size(1 << 30), "1024.00 MiB");
        assert_eq!(format_size(80 << 30), "80.00 GiB");
    }

    fn process(pid: u32, used_bytes: u64) -> ProcessMemory {
        ProcessMemory { pid, used_bytes }
    }

    #[test]
    fn each_process_nvml_lists_gets_pytorchs_sentence_in_nvmls_order() {
        let processes = [
            process(1_246_069, 577 * MIB as u64),
            process(4242, 15_000 * MIB as u64),
            process(7, 1000),
        ];
        assert_eq!(
            process_memory_sentences(&processes, 4242),
            "Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory, this \
             process has 14.65 GiB memory in use. Process 7 has 1000 bytes memory in use. "
        );
        assert_eq!(process_memory_sentences(&[], 4242), "");
        // NVML_VALUE_NOT_AVAILABLE (no per-process figure, as under Windows' WDDM), printed as
        // PyTorch prints it.
        assert_eq!(
            process_memory_sentences(&[process(4242, u64::MAX)], 4242),
            "Including non-PyTorch memory, this process has 17179869184.00 GiB memory in use. "
        );
    }

    #[test]
    fn the_process_sentences_follow_the_free_memory_before_the_allowed_memory() {
        let figures = OomFigures {
            alloc_size: 2 << 30,
            device: 0,
            device_total: 1 << 30,
            device_free: 900 * MIB,
            allowed: Some(512 * MIB),
            allocated: 0,
            in_private_pools: 0,
            reserved: 0,
            expandable_segments: false,
            configured_reserve: None,
            reserve_class: String::new(),
            processes: vec![process(99, 64 * MIB as u64), process(5, 60 * MIB as u64)],
            own_pid: 5,
        };
        let message = out_of_memory_message(&figures, OomWording::ExpandableNote);
        assert!(
            message.starts_with(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
                 1024.00 MiB of which 900.00 MiB is free. Process 99 has 64.00 MiB memory in use. \
                 Including non-PyTorch memory, this process has 60.00 MiB memory in use. 512.00 \
                 MiB allowed; Of the allocated memory 0 bytes is allocated by PyTorch, and 0 \
                 bytes is reserved by PyTorch but unallocated. If reserved"
            ),
            "{message}"
        );
        let without_nvml = OomFigures {
            processes: Vec::new(),
            ..figures
        };
        assert!(
            out_of_memory_message(&without_nvml, OomWording::ExpandableNote)
                .contains("900.00 MiB is free. 512.00 MiB allowed; Of the allocated")
        );
    }
}
