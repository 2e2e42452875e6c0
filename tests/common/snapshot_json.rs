//! A parsed snapshot written back as JSON, with the keys older PyTorch versions lacked left
//! out on request: tests feed it to the reader as such a version's snapshot.

use ferrocache::replay::{BlockStatus, Snapshot, TraceAction};
use serde_json::{Value, json};

/// `snapshot` written back as JSON, as a snapshot of older PyTorch would have it: without
/// `time_us` on its trace entries and without `device` on its segments, when asked; with the
/// `allocator_settings` given (none otherwise).
pub fn written_back(
    snapshot: &Snapshot,
    time_us: bool,
    device_key: bool,
    settings: Option<Value>,
) -> Vec<u8> {
    let segments: Vec<Value> = snapshot
        .segments
        .iter()
        .map(|s| {
            let blocks: Vec<Value> = s
                .blocks
                .iter()
                .map(|b| {
                    let state = match b.state {
                        BlockStatus::ActiveAllocated => "active_allocated",
                        BlockStatus::ActivePendingFree => "active_pending_free",
                        BlockStatus::Inactive => "inactive",
                    };
                    json!({"address": b.address, "size": b.size,
                           "requested_size": b.requested_size, "state": state})
                })
                .collect();
            let mut segment = json!({"address": s.address, "total_size": s.total_size,
                "stream": s.stream, "segment_type": if s.is_small { "small" } else { "large" },
                "is_expandable": s.is_expandable, "blocks": blocks});
            if device_key {
                segment["device"] = json!(s.device);
            }
            segment
        })
        .collect();
    let traces: Vec<Value> = snapshot
        .device_traces
        .iter()
        .map(|trace| {
            trace
                .iter()
                .map(|e| {
                    let mut entry = json!({"action": e.action.map_or("unknown", TraceAction::name), "addr": e.addr,
                                           "size": e.size, "stream": e.stream});
                    if time_us {
                        entry["time_us"] = json!(e.time_us);
                    }
                    entry
                })
                .collect()
        })
        .collect();
    let mut document = json!({"segments": segments, "device_traces": traces});
    if let Some(settings) = settings {
        document["allocator_settings"] = settings;
    }
    serde_json::to_vec(&document).unwrap()
}
