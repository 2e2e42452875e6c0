//! PyTorch's memory snapshot as typed data.
//!
//! The format is the dict that `torch.cuda.memory._snapshot()` returns: `segments` (the state at
//! the END of recording), `device_traces` (one list per device, oldest event first) and, in newer
//! versions, `allocator_settings`. Stack frames and other keys are not kept.

use super::pickle::{Document, PickleErrorKind, ValueRef};
use super::{ReplayError, ReplayErrorKind};
use crate::config::Config;
use crate::policy::{K_ROUNDUP_POWER_OF_TWO_INTERVALS, K_SMALL_BUFFER};
use crate::trace::TraceAction;
use std::path::Path;

/// A recorded snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Segments held when the snapshot was taken (the END of recording).
    pub segments: Vec<Segment>,
    /// One trace per device, oldest event first.
    pub device_traces: Vec<Vec<TraceEvent>>,
    /// The allocator settings PyTorch recorded, when it did.
    pub allocator_settings: Option<AllocatorSettings>,
}

/// One segment (one `cudaMalloc`, or one mapped range of an expandable segment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub device: usize,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    /// `segment_type == "small"`: the segment belongs to the small pool.
    pub is_small: bool,
    pub is_expandable: bool,
    pub blocks: Vec<BlockState>,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockState {
    pub address: u64,
    /// The block's size (rounded, possibly with an unsplit remainder).
    pub size: u64,
    /// The size the program asked for.
    pub requested_size: u64,
    pub state: BlockStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStatus {
    /// Allocated to the program.
    ActiveAllocated,
    /// Freed by the program, waiting for other streams' events (`record_stream`).
    ActivePendingFree,
    /// Free, cached.
    Inactive,
}

impl BlockStatus {
    /// Allocated or waiting for its free to complete: the memory is in use either way.
    pub fn is_active(self) -> bool {
        !matches!(self, BlockStatus::Inactive)
    }
}

/// One trace entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// What the entry records; `None` for an action this reader does not know (counted by
    /// the reconstruction, otherwise ignored).
    pub action: Option<TraceAction>,
    /// Block or segment address; 0 for actions without one.
    pub addr: u64,
    /// Requested size for alloc/free, segment size for segment events, rounded size for oom.
    pub size: u64,
    /// The `cudaStream_t`, as PyTorch wrote it.
    pub stream: u64,
    pub time_us: i64,
    /// For `oom`: the free device memory CUDA reported.
    pub device_free: Option<u64>,
}

/// `allocator_settings` as PyTorch recorded them. Fields of an unexpected shape are left `None`:
/// the settings are advice for the replay, not part of the workload.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AllocatorSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF` as it was set.
    pub alloc_conf: Option<String>,
    /// In bytes; `None` when unlimited (PyTorch writes -1) or absent.
    pub max_split_size: Option<u64>,
    pub garbage_collection_threshold: Option<f64>,
    pub expandable_segments: Option<bool>,
    pub release_lock_on_cudamalloc: Option<bool>,
    /// One entry per power-of-two interval from 1 MiB up.
    pub roundup_power2_divisions: Option<[usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS]>,
}

impl AllocatorSettings {
    /// The settings as a ferrocache [`Config`]; what was not recorded keeps PyTorch's default.
    pub fn config(&self) -> Config {
        let mut config = Config::default();
        if let Some(size) = self.max_split_size {
            config.max_split_size = usize::try_from(size).unwrap_or(usize::MAX);
        }
        if let Some(threshold) = self.garbage_collection_threshold {
            config.garbage_collection_threshold = threshold;
        }
        if let Some(expandable) = self.expandable_segments {
            config.expandable_segments = expandable;
        }
        if let Some(release) = self.release_lock_on_cudamalloc {
            config.release_lock_on_cudamalloc = release;
        }
        if let Some(divisions) = self.roundup_power2_divisions {
            config.roundup_power2_divisions = divisions;
        }
        config
    }
}

impl Snapshot {
    /// Trace entries over all devices.
    pub fn event_count(&self) -> usize {
        self.device_traces.iter().map(Vec::len).sum()
    }

    /// The settings to replay with: the recorded ones, or PyTorch's defaults.
    pub fn config(&self) -> Config {
        self.allocator_settings
            .as_ref()
            .map(AllocatorSettings::config)
            .unwrap_or_default()
    }

    /// Reads the snapshot out of a parsed document; the error says what is not a snapshot.
    /// `max_entries` bounds the segments, blocks and events together, with the keys of their
    /// dicts: a pickle can refer to one value many times, and expanding such references must not
    /// outgrow the file.
    pub fn from_document(document: &Document<'_>, max_entries: usize) -> Result<Snapshot, String> {
        let mut budget = Budget(max_entries);
        let root = document.root();
        if !root.is_dict() {
            return Err(format!("the top level is {}, not a dict", root.type_name()));
        }
        let segments_value = root
            .get("segments")
            .ok_or("missing `segments` (the allocator state)")?;
        let traces_value = root
            .get("device_traces")
            .ok_or("missing `device_traces` (the recorded trace)")?;

        let segment_items = seq(segments_value, "segments")?;
        let mut segments = Vec::with_capacity(segment_items.len().min(max_entries));
        let mut devices_named = false;
        for (i, item) in segment_items.enumerate() {
            budget.take(item)?;
            devices_named |= item.get("device").is_some();
            segments.push(segment(item, &format!("segments[{i}]"), &mut budget)?);
        }

        let trace_items = seq(traces_value, "device_traces")?;
        let mut device_traces = Vec::with_capacity(trace_items.len().min(max_entries));
        for (d, trace_value) in trace_items.enumerate() {
            let path = format!("device_traces[{d}]");
            let entries = seq(trace_value, &path)?;
            let mut trace = Vec::with_capacity(entries.len().min(budget.0));
            for (i, entry) in entries.enumerate() {
                budget.take(entry)?;
                trace.push(trace_event(entry, &path, i)?);
            }
            device_traces.push(trace);
        }

        if !devices_named {
            attribute_segments_to_the_traced_device(&mut segments, &device_traces);
        }

        let allocator_settings = root
            .get("allocator_settings")
            .filter(|v| !v.is_none())
            .map(allocator_settings);

        Ok(Snapshot {
            segments,
            device_traces,
            allocator_settings,
        })
    }
}

/// Segments that do not say their device (older snapshots) belong to the one device whose trace
/// is filled, when only one is: a snapshot of `cuda:1` lists an empty trace for device 0.
fn attribute_segments_to_the_traced_device(segments: &mut [Segment], traces: &[Vec<TraceEvent>]) {
    let mut filled = traces.iter().enumerate().filter(|(_, t)| !t.is_empty());
    if let (Some((device, _)), None) = (filled.next(), filled.next()) {
        for segment in segments {
            segment.device = device;
        }
    }
}

/// Reads a snapshot file: a pickle (protocol 2 to 5) or the same structure as JSON.
pub fn load(path: &Path) -> Result<Snapshot, ReplayError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path)
        .map_err(|e| ReplayError::new(&file, ReplayErrorKind::Io, format!("cannot read: {e}")))?;
    parse_snapshot(&bytes, &file)
}

/// Reads a snapshot from bytes; `file` names it in errors. JSON when the first non-space byte
/// is `{`, else a pickle. A snapshot without trace events is an error: there is nothing to replay.
pub fn parse_snapshot(bytes: &[u8], file: &str) -> Result<Snapshot, ReplayError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    let document = match first {
        None => {
            return Err(ReplayError::new(
                file,
                ReplayErrorKind::NotPickleOrJson,
                "empty file: neither a pickle nor JSON",
            ));
        }
        Some(b'{') => Document::from_json_bytes(bytes).map_err(|e| json_error(&e, file))?,
        Some(_) => Document::parse(bytes).map_err(|e| {
            let kind = match e.kind {
                PickleErrorKind::NotPickle => ReplayErrorKind::NotPickleOrJson,
                PickleErrorKind::Truncated => ReplayErrorKind::Truncated,
                PickleErrorKind::Refused { .. } => ReplayErrorKind::Refused,
                _ => ReplayErrorKind::Malformed,
            };
            let detail = match e.kind {
                PickleErrorKind::NotPickle => {
                    "neither a pickle (protocol 2 to 5) nor JSON".to_string()
                }
                _ => e.to_string(),
            };
            ReplayError::new(file, kind, detail)
        })?,
    };
    let snapshot = Snapshot::from_document(&document, bytes.len()).map_err(|detail| {
        ReplayError::new(
            file,
            ReplayErrorKind::NotSnapshot,
            format!("not a PyTorch memory snapshot: {detail}"),
        )
    })?;
    if snapshot.event_count() == 0 {
        return Err(ReplayError::new(
            file,
            ReplayErrorKind::NoTraceEvents,
            "holds no trace events: record with torch.cuda.memory._record_memory_history() \
             before dumping the snapshot",
        ));
    }
    Ok(snapshot)
}

fn json_error(e: &serde_json::Error, file: &str) -> ReplayError {
    let (kind, what) = if e.is_eof() {
        (ReplayErrorKind::Truncated, "truncated JSON")
    } else {
        (ReplayErrorKind::Malformed, "invalid JSON")
    };
    ReplayError::new(file, kind, format!("{what}: {e}"))
}

type V<'d> = ValueRef<'d, 'd>;

/// What the reader may still visit: one unit per segment, block or event and one per key of its
/// dict. A pickle can refer to one value many times (two bytes a reference), so counting the
/// keys too keeps the work linear in the file's size, however large a shared dict is.
struct Budget(usize);

impl Budget {
    /// Takes the cost of reading `value`: 1, plus its keys when it is a dict.
    fn take(&mut self, value: V<'_>) -> Result<(), String> {
        let cost = 1 + value.entries().map_or(0, |entries| entries.len());
        if cost > self.0 {
            return Err(
                "more entries than the file's size allows (one value referred to many times)"
                    .into(),
            );
        }
        self.0 -= cost;
        Ok(())
    }
}

fn seq<'d>(
    value: V<'d>,
    path: &str,
) -> Result<impl ExactSizeIterator<Item = V<'d>> + use<'d>, String> {
    value
        .items()
        .ok_or_else(|| format!("`{path}` is {}, not a list", value.type_name()))
}

fn required<'d>(dict: V<'d>, key: &str, path: &str) -> Result<V<'d>, String> {
    dict.get(key)
        .ok_or_else(|| format!("`{path}` has no `{key}`"))
}

fn unsigned(value: V<'_>, key: &str, path: &str) -> Result<u64, String> {
    match value.as_int() {
        Some(i) => u64::try_from(i)
            .map_err(|_| format!("`{path}.{key}` is {i}, not a non-negative 64-bit integer")),
        None => Err(format!(
            "`{path}.{key}` is {}, not an integer",
            value.type_name()
        )),
    }
}

fn signed(value: V<'_>, key: &str, path: &str) -> Result<i64, String> {
    match value.as_int() {
        Some(i) => {
            i64::try_from(i).map_err(|_| format!("`{path}.{key}` is {i}, not a 64-bit integer"))
        }
        None => Err(format!(
            "`{path}.{key}` is {}, not an integer",
            value.type_name()
        )),
    }
}

/// Streams are `cudaStream_t` pointers that PyTorch writes as int64: negative ones wrap.
fn stream_from_int(i: i128) -> Option<u64> {
    if i < 0 {
        i64::try_from(i).ok().map(|i| i as u64)
    } else {
        u64::try_from(i).ok()
    }
}

fn stream_id(value: V<'_>, path: &str) -> Result<u64, String> {
    if value.is_none() {
        return Ok(0);
    }
    match value.as_int() {
        Some(i) => {
            stream_from_int(i).ok_or_else(|| format!("`{path}.stream` is {i}, out of range"))
        }
        None => Err(format!(
            "`{path}.stream` is {}, not an integer",
            value.type_name()
        )),
    }
}

fn optional<'d, T>(
    dict: V<'d>,
    key: &str,
    default: T,
    read: impl FnOnce(V<'d>) -> Result<T, String>,
) -> Result<T, String> {
    match dict.get(key) {
        None => Ok(default),
        Some(value) => read(value),
    }
}

fn expect_dict(value: V<'_>, path: &str) -> Result<(), String> {
    if value.is_dict() {
        Ok(())
    } else {
        Err(format!("`{path}` is {}, not a dict", value.type_name()))
    }
}

fn segment(value: V<'_>, path: &str, budget: &mut Budget) -> Result<Segment, String> {
    expect_dict(value, path)?;
    let device = optional(value, "device", 0, |v| {
        let d = unsigned(v, "device", path)?;
        usize::try_from(d)
            .ok()
            .filter(|&d| d <= u32::MAX as usize)
            .ok_or_else(|| format!("`{path}.device` is {d}, out of range"))
    })?;
    let address = unsigned(required(value, "address", path)?, "address", path)?;
    let total_size = unsigned(required(value, "total_size", path)?, "total_size", path)?;
    let stream = optional(value, "stream", 0, |v| stream_id(v, path))?;
    let is_expandable = optional(value, "is_expandable", false, |v| {
        v.as_bool()
            .ok_or_else(|| format!("`{path}.is_expandable` is {}, not a bool", v.type_name()))
    })?;
    // Older snapshots lack `segment_type`; small segments are always 2 MiB there.
    let is_small = optional(
        value,
        "segment_type",
        total_size == K_SMALL_BUFFER as u64 && !is_expandable,
        |v| match v.as_str() {
            Some("small") => Ok(true),
            Some("large") => Ok(false),
            _ => Err(format!(
                "`{path}.segment_type` is {}, not \"small\" or \"large\"",
                describe(v)
            )),
        },
    )?;
    let block_items = seq(required(value, "blocks", path)?, &format!("{path}.blocks"))?;
    let mut blocks = Vec::with_capacity(block_items.len().min(budget.0));
    let mut next_address = address;
    for (i, item) in block_items.enumerate() {
        budget.take(item)?;
        let block = block(item, &format!("{path}.blocks[{i}]"), next_address)?;
        next_address = block.address.saturating_add(block.size);
        blocks.push(block);
    }
    Ok(Segment {
        device,
        address,
        total_size,
        stream,
        is_small,
        is_expandable,
        blocks,
    })
}

fn block(value: V<'_>, path: &str, implied_address: u64) -> Result<BlockState, String> {
    expect_dict(value, path)?;
    // Very old snapshots omit block addresses: blocks tile their segment in order.
    let address = optional(value, "address", implied_address, |v| {
        unsigned(v, "address", path)
    })?;
    let size = unsigned(required(value, "size", path)?, "size", path)?;
    let requested_size = optional(value, "requested_size", size, |v| {
        unsigned(v, "requested_size", path)
    })?;
    let state_value = required(value, "state", path)?;
    let state = match state_value.as_str() {
        Some("active_allocated") => BlockStatus::ActiveAllocated,
        Some("active_pending_free") => BlockStatus::ActivePendingFree,
        Some("inactive") => BlockStatus::Inactive,
        _ => {
            return Err(format!(
                "`{path}.state` is {}, not active_allocated, active_pending_free or inactive",
                describe(state_value)
            ));
        }
    };
    Ok(BlockState {
        address,
        size,
        requested_size,
        state,
    })
}

/// One trace entry. Reads the dict in one pass over its entries (events dominate the file; their
/// stack frames are skipped unread); `path` and `index` name it only when something is wrong.
fn trace_event(value: V<'_>, trace_path: &str, index: usize) -> Result<TraceEvent, String> {
    let path = || format!("{trace_path}[{index}]");
    let entries = value
        .entries()
        .ok_or_else(|| format!("`{}` is {}, not a dict", path(), value.type_name()))?;
    let (mut action, mut addr, mut size, mut stream, mut time_us, mut device_free) =
        (None, None, None, None, None, None);
    // Later duplicates win, as in a Python dict.
    for (key, v) in entries {
        match key.as_str() {
            Some("action") => action = Some(v),
            Some("addr") => addr = Some(v),
            Some("size") => size = Some(v),
            Some("stream") => stream = Some(v),
            Some("time_us") => time_us = Some(v),
            Some("device_free") => device_free = Some(v),
            _ => {}
        }
    }
    let action_value = action.ok_or_else(|| format!("`{}` has no `action`", path()))?;
    let action = TraceAction::from_name(action_value.as_str().ok_or_else(|| {
        format!(
            "`{}.action` is {}, not a str",
            path(),
            action_value.type_name()
        )
    })?);
    let (addr, size) = if action.is_some_and(TraceAction::names_a_block_or_segment) {
        let field = |v: Option<V<'_>>, key: &str| -> Result<u64, String> {
            let v = v.ok_or_else(|| format!("`{}` has no `{key}`", path()))?;
            unsigned(v, key, &path())
        };
        (field(addr, "addr")?, field(size, "size")?)
    } else {
        // Entries that describe no block: their fields vary between versions; keep what fits.
        let lenient = |v: Option<V<'_>>| {
            v.and_then(|v| v.as_int())
                .and_then(|i| u64::try_from(i).ok())
        };
        (lenient(addr).unwrap_or(0), lenient(size).unwrap_or(0))
    };
    let stream = match stream {
        None => 0,
        Some(v) => stream_id(v, &path())?,
    };
    let time_us = match time_us {
        None => 0,
        Some(v) => signed(v, "time_us", &path())?,
    };
    let device_free = device_free
        .and_then(|v| v.as_int())
        .and_then(|i| u64::try_from(i).ok());
    Ok(TraceEvent {
        action,
        addr,
        size,
        stream,
        time_us,
        device_free,
    })
}

fn allocator_settings(value: V<'_>) -> AllocatorSettings {
    let get = |key| value.get(key);
    let max_split_size = get("max_split_size")
        .and_then(|v| v.as_int())
        // PyTorch writes SIZE_MAX (no limit) as int64 -1.
        .and_then(|i| u64::try_from(i).ok())
        .filter(|&s| s < i64::MAX as u64);
    AllocatorSettings {
        alloc_conf: get("PYTORCH_CUDA_ALLOC_CONF")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        max_split_size,
        garbage_collection_threshold: get("garbage_collection_threshold").and_then(|v| v.as_f64()),
        expandable_segments: get("expandable_segments").and_then(|v| v.as_bool()),
        release_lock_on_cudamalloc: get("release_lock_on_cudamalloc").and_then(|v| v.as_bool()),
        roundup_power2_divisions: get("roundup_power2_divisions").and_then(roundup_divisions),
    }
}

/// `{"1": d, "2": d, ..., "32768": d}` (keys in MiB) or a list of 16 counts.
fn roundup_divisions(value: V<'_>) -> Option<[usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS]> {
    let mut divisions = [0usize; K_ROUNDUP_POWER_OF_TWO_INTERVALS];
    let count = |v: V<'_>| v.as_int().and_then(|i| usize::try_from(i).ok());
    if let Some(entries) = value.entries() {
        for (key, v) in entries {
            let mib: u64 = key.as_str()?.parse().ok()?;
            if !mib.is_power_of_two() {
                return None;
            }
            let index = mib.trailing_zeros() as usize;
            *divisions.get_mut(index)? = count(v)?;
        }
        Some(divisions)
    } else if let Some(items) = value.items() {
        if items.len() != K_ROUNDUP_POWER_OF_TWO_INTERVALS {
            return None;
        }
        for (slot, v) in divisions.iter_mut().zip(items) {
            *slot = count(v)?;
        }
        Some(divisions)
    } else {
        None
    }
}

/// A short, one-line rendering of a value for error messages.
fn describe(value: V<'_>) -> String {
    match value.as_str() {
        Some(s) => {
            let shown: String = s.chars().take(40).collect();
            format!("{shown:?}")
        }
        None => value.type_name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn document(json: serde_json::Value) -> Document<'static> {
        Document::from_json(&json)
    }

    #[test]
    fn settings_become_a_config() {
        let settings = AllocatorSettings {
            max_split_size: Some(64 << 20),
            expandable_segments: Some(true),
            roundup_power2_divisions: Some([4; K_ROUNDUP_POWER_OF_TWO_INTERVALS]),
            ..AllocatorSettings::default()
        };
        let config = settings.config();
        assert_eq!(config.max_split_size, 64 << 20);
        assert!(config.expandable_segments);
        assert_eq!(config.roundup_power2_divisions[3], 4);
        assert_eq!(AllocatorSettings::default().config(), Config::default());
    }

    #[test]
    fn roundup_divisions_by_mib_key() {
        let doc = document(serde_json::json!({"1": 2, "32768": 8}));
        let d = roundup_divisions(doc.root()).unwrap();
        assert_eq!((d[0], d[1], d[15]), (2, 0, 8));
        let doc = document(serde_json::json!({"3": 2}));
        assert_eq!(roundup_divisions(doc.root()), None);
        let settings = document(serde_json::json!({"max_split_size": -1}));
        assert_eq!(allocator_settings(settings.root()).max_split_size, None);
    }

    #[test]
    fn negative_streams_wrap_like_pointers() {
        assert_eq!(stream_from_int(-1), Some(u64::MAX));
        assert_eq!(stream_from_int(7), Some(7));
        assert_eq!(stream_from_int(1 << 70), None);
    }
}
