//! A recording as a program for a real allocator: what `ferrocache ops` writes and the oracle
//! (`python/tools/oracle`, `scripts/oracle --trace`) drives through real PyTorch. There is one
//! reconstruction of a recording, [`DeviceWorkload`]'s; this only writes it out.
//!
//! The program starts on an empty GPU, as [`StartState::Fresh`](super::StartState::Fresh)
//! replays: the allocations live when recording began are made first, in address order (the
//! closest guess to the order PyTorch made them in), then the workload's ops in trace order.

use super::workload::{DeviceWorkload, Op};
use serde_json::{Value, json};

/// The ops of a fresh start: an `Alloc` per allocation live at the start, in address order,
/// then the workload's ops.
pub fn fresh_start_ops(workload: &DeviceWorkload) -> impl Iterator<Item = Op> + '_ {
    workload
        .start_allocations
        .iter()
        .map(|allocation| Op::Alloc {
            id: allocation.id,
            size: allocation.requested_size,
            stream: allocation.stream,
        })
        .chain(workload.ops.iter().copied())
}

/// One op as JSON: `{"op": "alloc", "id", "size", "stream"}` (requested bytes, the recorded
/// stream handle; 0 is the default stream), `{"op": "free", "id"}`, `{"op": "empty_cache"}`,
/// `{"op": "oom", "size", "stream"}` (a request PyTorch could not serve; `size` is rounded).
fn op_json(op: Op) -> Value {
    match op {
        Op::Alloc { id, size, stream } => {
            json!({"op": "alloc", "id": id, "size": size, "stream": stream})
        }
        Op::Free { id } => json!({"op": "free", "id": id}),
        Op::EmptyCache => json!({"op": "empty_cache"}),
        Op::Oom { size, stream } => json!({"op": "oom", "size": size, "stream": stream}),
    }
}

/// The program of one device of a recording, with PyTorch's own figures for it.
pub fn program_json(trace: &str, workload: &DeviceWorkload) -> Value {
    let figures = &workload.figures;
    json!({
        "trace": trace,
        "device": workload.device,
        "start_allocations": workload.start_allocations.len(),
        "consistent": workload.diagnostics.is_consistent(figures),
        "figures": {
            "live_at_start_blocks": figures.live_at_start_blocks,
            "live_at_start_requested": figures.live_at_start_requested,
            "live_at_start_size": figures.live_at_start_size,
            "reserved_at_start": figures.reserved_at_start,
            "peak_requested": figures.peak_requested,
            "peak_reserved": figures.peak_reserved,
            "allocs": figures.allocs,
            "frees": figures.frees,
            "segment_allocs": figures.segment_allocs,
            "ooms": figures.ooms,
            "empty_caches": figures.empty_caches,
        },
        "ops": fresh_start_ops(workload).map(op_json).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::demo;

    #[test]
    fn a_fresh_program_is_the_start_allocations_then_the_ops() {
        let mut workload = demo::build(&demo::DemoSpec::tiny());
        let ops = workload.ops.len();
        // Pretend the first allocation was live before recording began.
        let first = workload.ops.remove(0);
        let Op::Alloc { id, size, stream } = first else {
            panic!("the demo begins with an allocation, not {first:?}");
        };
        workload
            .start_allocations
            .push(crate::replay::StartAllocation {
                id,
                address: 0,
                size,
                requested_size: size,
                stream,
                segment: None,
                offset: 0,
                size_source: crate::replay::BlockSizeSource::EndState,
                pending_free: false,
            });
        let program = program_json("demo", &workload);
        assert_eq!(program["start_allocations"], 1);
        let listed = program["ops"].as_array().unwrap();
        assert_eq!(listed.len(), ops);
        assert_eq!(
            listed[0],
            json!({"op": "alloc", "id": id, "size": size, "stream": stream})
        );
        assert_eq!(listed[1], op_json(workload.ops[0]));
    }
}
