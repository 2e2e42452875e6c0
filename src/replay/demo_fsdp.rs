//! A built-in multi-stream workload for `ferrocache replay --demo`: the allocations of an
//! FSDP-style training step on four streams, generated deterministically.
//!
//! Each stream's demand peaks at a different moment, which is what makes per-stream caches
//! expensive:
//! - the **data** stream prefetches the next batch while the current one is in use (its peak:
//!   two batches, at the start of a step);
//! - the **all-gather** stream gathers every layer's full parameters in a burst before the
//!   forward pass (its peak: all layers' full parameters, at the start of forward); each
//!   layer's are freed once its forward is done, and gathered again, two layers at a time, in
//!   backward;
//! - the **compute** stream keeps each layer's activations for backward (its peak: the end of
//!   forward) and frees them in backward;
//! - the **reduce-scatter** stream takes each layer's full gradient into a bucket and keeps the
//!   buckets until the end of backward, when it reduce-scatters them into sharded gradients
//!   (its peak: the end of backward), which the optimizer (on compute) consumes.
//!
//! [`build`] makes the program on its four streams; [`on_one_stream`] puts the same program on
//! one stream, the reference that cross-stream reuse is measured against.

use super::op_list::OpList;
use super::workload::{DeviceWorkload, Op};

pub const COMPUTE_STREAM: u64 = 0;
pub const ALL_GATHER_STREAM: u64 = 0x10;
pub const REDUCE_SCATTER_STREAM: u64 = 0x20;
pub const DATA_STREAM: u64 = 0x30;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// The shape of the demo model and run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsdpSpec {
    pub layers: u64,
    /// Bytes of one layer's full (gathered) parameters, and of its full gradient.
    pub layer_parameters: u64,
    /// Ranks the parameters are sharded over.
    pub world_size: u64,
    /// Bytes of one layer's saved activations, split over five tensors.
    pub layer_activations: u64,
    /// Bytes of one batch.
    pub batch: u64,
    pub steps: u64,
}

impl Default for FsdpSpec {
    /// 16 layers of 64 MiB of parameters over 8 ranks, 96 MiB of activations per layer,
    /// 192 MiB batches, 4 steps.
    fn default() -> Self {
        FsdpSpec {
            layers: 16,
            layer_parameters: 64 * MIB,
            world_size: 8,
            layer_activations: 96 * MIB,
            batch: 192 * MIB,
            steps: 4,
        }
    }
}

impl FsdpSpec {
    /// A tiny version for tests: same structure, small sizes.
    pub fn tiny() -> Self {
        FsdpSpec {
            layers: 4,
            layer_parameters: 12 * MIB,
            world_size: 4,
            layer_activations: 20 * MIB,
            batch: 16 * MIB,
            steps: 2,
        }
    }
}

/// The demo workload with the default shape, on its four streams.
pub fn fsdp_training() -> DeviceWorkload {
    build(&FsdpSpec::default())
}

/// One layer's saved activations: five tensors of 1/8, 1/8, 1/4, 3/8 and 1/8 of the total
/// (norm output, attention output, QKV, MLP hidden, residual), in the order forward makes them.
fn activation_sizes(total: u64) -> [u64; 5] {
    let eighth = total / 8;
    [eighth, eighth, 2 * eighth, 3 * eighth, eighth]
}

/// Builds the workload for `spec`, on its four streams.
pub fn build(spec: &FsdpSpec) -> DeviceWorkload {
    let mut p = OpList::default();
    let shard = spec.layer_parameters / spec.world_size;
    // The sharded parameters and the optimizer's moments, made once and kept.
    for _ in 0..spec.layers {
        p.alloc(shard, COMPUTE_STREAM);
        p.alloc(shard, COMPUTE_STREAM); // exp_avg
        p.alloc(shard, COMPUTE_STREAM); // exp_avg_sq
    }
    let mut batch = p.alloc(spec.batch, DATA_STREAM);
    for _ in 0..spec.steps {
        // The next batch is prefetched while this one is in use.
        let next_batch = p.alloc(spec.batch, DATA_STREAM);
        let labels = p.alloc(64 * KIB, DATA_STREAM);

        // Forward: every layer's parameters gathered in a burst, then the layers in order.
        let gathered: Vec<u32> = (0..spec.layers)
            .map(|_| p.alloc(spec.layer_parameters, ALL_GATHER_STREAM))
            .collect();
        let mut saved = Vec::new();
        for (layer, &parameters) in gathered.iter().enumerate() {
            let workspace = p.alloc(3 * MIB + 128 * KIB, COMPUTE_STREAM);
            saved.push(
                activation_sizes(spec.layer_activations)
                    .iter()
                    .map(|&size| p.alloc(size, COMPUTE_STREAM))
                    .collect::<Vec<u32>>(),
            );
            p.free(workspace);
            p.free(parameters); // resharded after forward
            if layer == 0 {
                p.free(batch); // the embedding has read it
            }
        }
        batch = next_batch;
        let loss = p.alloc(4 * KIB, COMPUTE_STREAM);

        // Backward: the layers in reverse, parameters gathered again two at a time.
        let mut buckets = Vec::new();
        let mut in_flight = vec![p.alloc(spec.layer_parameters, ALL_GATHER_STREAM)];
        for layer in (0..spec.layers as usize).rev() {
            if layer > 0 {
                in_flight.push(p.alloc(spec.layer_parameters, ALL_GATHER_STREAM));
            }
            let gradient = p.alloc(spec.layer_parameters, COMPUTE_STREAM);
            let activation_gradient = p.alloc(spec.layer_activations / 4, COMPUTE_STREAM);
            p.free_all(saved.pop().unwrap_or_default());
            p.free(activation_gradient);
            // The full gradient moves into a bucket of the reduce-scatter stream.
            buckets.push(p.alloc(spec.layer_parameters, REDUCE_SCATTER_STREAM));
            p.free(gradient);
            let parameters = in_flight.remove(0);
            p.free(parameters);
        }
        p.free(loss);
        p.free(labels);
        // Reduce-scatter at the end of backward: sharded gradients, then the buckets go.
        let sharded: Vec<u32> = (0..spec.layers)
            .map(|_| p.alloc(shard, REDUCE_SCATTER_STREAM))
            .collect();
        p.free_all(buckets);
        // The optimizer step, sharded, on compute.
        for _ in 0..spec.layers {
            let update = p.alloc(shard, COMPUTE_STREAM);
            p.free(update);
        }
        p.free_all(sharded);
    }
    p.into_workload()
}

/// The same program with every allocation on one stream: the reference for what several
/// streams cost.
pub fn on_one_stream(workload: &DeviceWorkload) -> DeviceWorkload {
    let mut one = workload.clone();
    for op in &mut one.ops {
        if let Op::Alloc { stream, .. } = op {
            *stream = COMPUTE_STREAM;
        }
    }
    for allocation in &mut one.allocations {
        allocation.stream = COMPUTE_STREAM;
    }
    one
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::replay::engine::{ReplayOptions, StartState, replay};

    fn options() -> ReplayOptions {
        ReplayOptions {
            capacity: 80 << 30,
            start: StartState::Fresh,
            record_timeline: false,
        }
    }

    #[test]
    fn the_fsdp_demo_is_well_formed_and_uses_four_streams() {
        let w = build(&FsdpSpec::tiny());
        let mut freed = vec![false; w.allocations.len()];
        let mut streams = std::collections::BTreeSet::new();
        for op in &w.ops {
            match *op {
                Op::Alloc { stream, .. } => {
                    streams.insert(stream);
                }
                Op::Free { id } => {
                    assert!(!freed[id as usize], "allocation {id} freed twice");
                    freed[id as usize] = true;
                }
                _ => {}
            }
        }
        assert_eq!(streams.len(), 4);
        assert_eq!(build(&FsdpSpec::tiny()), w, "deterministic");
    }

    #[test]
    fn cross_stream_reuse_brings_four_streams_near_one() {
        let w = build(&FsdpSpec::tiny());
        let one = on_one_stream(&w);
        for expandable_segments in [false, true] {
            let base = Config {
                expandable_segments,
                ..Config::default()
            };
            let cross = Config {
                opt_in: crate::config::OptIns {
                    cross_stream: true,
                    ..base.opt_in
                },
                ..base.clone()
            };
            let per_stream = replay(&w, &base, &options());
            let shared = replay(&w, &cross, &options());
            let reference = replay(&one, &base, &options());
            assert!(shared.cross_stream_reuses > 0);
            assert!(
                per_stream.peak_reserved as f64 > 1.3 * reference.peak_reserved as f64,
                "{} vs {}",
                per_stream.peak_reserved,
                reference.peak_reserved
            );
            assert!(
                shared.peak_reserved as f64 <= 1.05 * reference.peak_reserved as f64,
                "expandable {expandable_segments}: {} vs {}",
                shared.peak_reserved,
                reference.peak_reserved
            );
        }
    }
}
