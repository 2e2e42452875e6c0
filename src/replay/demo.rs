//! A built-in workload for `ferrocache replay --demo`: the allocations of a GPT-style transformer
//! training loop, as PyTorch's allocator would see them, generated deterministically.
//!
//! What it models (fp32, no activation checkpointing, attention without a fused kernel):
//! - **weights** made once (embedding shared with the output layer, per layer: QKV, output
//!   projection, two MLP matrices, their biases, two layer norms) and a persistent cuBLAS
//!   workspace per stream;
//! - per step, a **batch** prefetched on a side stream (token ids and targets). The sequence
//!   length grows from 256 to 1024 tokens over the steps (sequence-length warmup, a common
//!   recipe for GPT-style training), so each step's activations are larger than the blocks the
//!   step before left in the cache: the shape changes that fragment a caching allocator;
//! - the **forward pass** keeps what backward needs (layer-norm outputs, QKV, attention
//!   probabilities, MLP activations) and frees temporaries (attention scores), with a few
//!   odd-sized kernel workspaces along the way; then logits and log-softmax over the vocabulary;
//! - the **backward pass** walks the layers in reverse: gradients of activations appear and die,
//!   saved activations are freed, parameter gradients are made (`zero_grad(set_to_none=True)`
//!   frees them after each step), and gradients are gathered in 25 MiB communication buckets on
//!   the side stream, as DDP does, each freed once its all-reduce is done;
//! - the **optimizer** (Adam, foreach): both moments made at the first step and kept, a
//!   temporary list as large as the parameters for the update's denominator.

use super::op_list::OpList;
use super::workload::DeviceWorkload;

/// The default stream, where the model runs.
pub const MAIN_STREAM: u64 = 0;
/// A side stream for data prefetch and gradient communication.
pub const SIDE_STREAM: u64 = 1;

const FLOAT: u64 = 4;
const INDEX: u64 = 8;
const MIB: u64 = 1 << 20;
/// DDP's default bucket size (`bucket_cap_mb=25`).
const BUCKET_BYTES: u64 = 25 * MIB;
/// cuBLAS workspace PyTorch keeps per handle and stream (`:4096:8` is 8 x 4 MiB; one here).
const CUBLAS_WORKSPACE: u64 = 4 * MIB + 16 * 1024;

/// The shape of the demo model and run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoSpec {
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub vocab: u64,
    pub batch: u64,
    /// Padded sequence length of each step's batch; one step per entry.
    pub sequence_lengths: Vec<u64>,
}

impl Default for DemoSpec {
    /// About a 0.67-billion-parameter model (2.5 GiB of fp32 weights), 8 sequences of 256 growing to 1024 tokens, 8 steps.
    fn default() -> Self {
        DemoSpec {
            layers: 12,
            hidden: 2048,
            heads: 16,
            vocab: 32_000,
            batch: 8,
            sequence_lengths: vec![256, 384, 512, 640, 768, 896, 1024, 1024],
        }
    }
}

impl DemoSpec {
    /// A tiny version for tests: same structure, small sizes.
    pub fn tiny() -> Self {
        DemoSpec {
            layers: 2,
            hidden: 256,
            heads: 4,
            vocab: 1000,
            batch: 2,
            sequence_lengths: vec![128, 96, 112],
        }
    }
}

/// The demo workload with the default shape.
pub fn transformer_training() -> DeviceWorkload {
    build(&DemoSpec::default())
}

/// A linear congruential generator: the workspaces' odd sizes, the same on every run.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

/// A kernel's scratch space of an odd size between `low` and `high` bytes, freed at once.
fn workspace(p: &mut OpList, random: &mut Lcg, low: u64, high: u64) {
    let size = low + random.next() % (high - low);
    let id = p.alloc(size, MAIN_STREAM);
    p.free(id);
}

/// One transformer layer's parameters, as (size in bytes) in registration order.
fn layer_parameter_sizes(d: u64) -> [u64; 12] {
    [
        d * FLOAT,         // ln1 weight
        d * FLOAT,         // ln1 bias
        3 * d * d * FLOAT, // qkv weight
        3 * d * FLOAT,     // qkv bias
        d * d * FLOAT,     // output projection weight
        d * FLOAT,         // output projection bias
        d * FLOAT,         // ln2 weight
        d * FLOAT,         // ln2 bias
        4 * d * d * FLOAT, // fc1 weight
        4 * d * FLOAT,     // fc1 bias
        4 * d * d * FLOAT, // fc2 weight
        d * FLOAT,         // fc2 bias
    ]
}

/// What the forward pass of one layer keeps for backward.
struct Saved {
    input: u32,
    ln1: u32,
    qkv: u32,
    probabilities: u32,
    attention: u32,
    residual: u32,
    ln2: u32,
    fc1: u32,
    gelu: u32,
}

/// Builds the workload for `spec`.
pub fn build(spec: &DemoSpec) -> DeviceWorkload {
    let mut p = OpList::default();
    let mut random = Lcg(0x5eed);
    let d = spec.hidden;

    // Parameters: embedding (tied with the output layer), the layers, the final layer norm.
    let mut parameter_sizes = vec![spec.vocab * d * FLOAT];
    for _ in 0..spec.layers {
        parameter_sizes.extend(layer_parameter_sizes(d));
    }
    parameter_sizes.extend([d * FLOAT, d * FLOAT]);
    for &size in &parameter_sizes {
        p.alloc(size, MAIN_STREAM);
    }
    p.alloc(CUBLAS_WORKSPACE, MAIN_STREAM);
    p.alloc(CUBLAS_WORKSPACE, SIDE_STREAM);

    let mut adam_moments_made = false;
    let mut next_batch = None;
    for (step, &t) in spec.sequence_lengths.iter().enumerate() {
        // The batch for this step was prefetched during the last one (the first one now).
        let (tokens, targets) = next_batch.take().unwrap_or_else(|| {
            let tokens = p.alloc(spec.batch * t * INDEX, SIDE_STREAM);
            (tokens, p.alloc(spec.batch * t * INDEX, SIDE_STREAM))
        });
        let activation = spec.batch * t * d * FLOAT;
        let scores = spec.batch * spec.heads * t * t * FLOAT;

        // Forward.
        let embedded = p.alloc(activation, MAIN_STREAM);
        let mut x = p.alloc(activation, MAIN_STREAM); // + positional embedding
        p.free(embedded);
        let mut saved = Vec::with_capacity(spec.layers as usize);
        for _ in 0..spec.layers {
            let ln1 = p.alloc(activation, MAIN_STREAM);
            let qkv = p.alloc(3 * activation, MAIN_STREAM);
            let raw_scores = p.alloc(scores, MAIN_STREAM);
            workspace(&mut p, &mut random, 64 * 1024, 3 * MIB); // softmax reduction scratch
            let probabilities = p.alloc(scores, MAIN_STREAM);
            p.free(raw_scores);
            let attention = p.alloc(activation, MAIN_STREAM);
            let projected = p.alloc(activation, MAIN_STREAM);
            let residual = p.alloc(activation, MAIN_STREAM);
            p.free(projected);
            let ln2 = p.alloc(activation, MAIN_STREAM);
            let fc1 = p.alloc(4 * activation, MAIN_STREAM);
            let gelu = p.alloc(4 * activation, MAIN_STREAM);
            let fc2 = p.alloc(activation, MAIN_STREAM);
            let output = p.alloc(activation, MAIN_STREAM);
            p.free(fc2);
            saved.push(Saved {
                input: x,
                ln1,
                qkv,
                probabilities,
                attention,
                residual,
                ln2,
                fc1,
                gelu,
            });
            x = output;
        }
        let final_ln = p.alloc(activation, MAIN_STREAM);
        let logits_bytes = spec.batch * t * spec.vocab * FLOAT;
        let logits = p.alloc(logits_bytes, MAIN_STREAM);
        let log_probabilities = p.alloc(logits_bytes, MAIN_STREAM);
        p.free(logits);
        let loss = p.alloc(FLOAT, MAIN_STREAM);

        // Prefetch the next batch on the side stream while the GPU computes.
        if let Some(&next_t) = spec.sequence_lengths.get(step + 1) {
            let tokens = p.alloc(spec.batch * next_t * INDEX, SIDE_STREAM);
            next_batch = Some((tokens, p.alloc(spec.batch * next_t * INDEX, SIDE_STREAM)));
        }

        // Backward.
        let mut gradients: Vec<u32> = Vec::with_capacity(parameter_sizes.len());
        let mut bucket_fill = 0u64;
        let mut open_bucket: Option<u32> = None;
        let mut parameter_gradient = |p: &mut OpList, size: u64, gradients: &mut Vec<u32>| {
            gradients.push(p.alloc(size, MAIN_STREAM));
            // Gradients are copied into the current bucket; a full bucket is all-reduced on
            // the side stream and the previous one, finished by now, is freed.
            bucket_fill += size;
            if bucket_fill >= BUCKET_BYTES {
                bucket_fill = 0;
                let bucket = p.alloc(BUCKET_BYTES, SIDE_STREAM);
                if let Some(previous) = open_bucket.replace(bucket) {
                    p.free(previous);
                }
            }
        };
        let grad_logits = p.alloc(logits_bytes, MAIN_STREAM);
        p.free_all([loss, log_probabilities]);
        let mut grad_x = p.alloc(activation, MAIN_STREAM);
        parameter_gradient(&mut p, parameter_sizes[0], &mut gradients); // embedding / output
        // The final layer norm kept its input (the last layer's output) for backward.
        p.free_all([grad_logits, final_ln, x]);
        for (layer, s) in saved.into_iter().enumerate().rev() {
            let base = 1 + 12 * layer;
            let size = |i: usize| parameter_sizes[base + i];
            // MLP.
            let grad_gelu = p.alloc(4 * activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(10), &mut gradients);
            parameter_gradient(&mut p, size(11), &mut gradients);
            p.free(s.gelu);
            let grad_fc1 = p.alloc(4 * activation, MAIN_STREAM);
            p.free_all([grad_gelu, s.fc1]);
            let grad_ln2 = p.alloc(activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(8), &mut gradients);
            parameter_gradient(&mut p, size(9), &mut gradients);
            p.free_all([grad_fc1, s.ln2]);
            let grad_residual = p.alloc(activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(6), &mut gradients);
            parameter_gradient(&mut p, size(7), &mut gradients);
            p.free_all([grad_ln2, s.residual, grad_x]);
            // Attention.
            let grad_attention = p.alloc(activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(4), &mut gradients);
            parameter_gradient(&mut p, size(5), &mut gradients);
            p.free(s.attention);
            let grad_probabilities = p.alloc(scores, MAIN_STREAM);
            let grad_scores = p.alloc(scores, MAIN_STREAM);
            workspace(&mut p, &mut random, 64 * 1024, 3 * MIB);
            p.free_all([grad_probabilities, s.probabilities]);
            let grad_qkv = p.alloc(3 * activation, MAIN_STREAM);
            p.free_all([grad_scores, grad_attention, s.qkv]);
            let grad_ln1 = p.alloc(activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(2), &mut gradients);
            parameter_gradient(&mut p, size(3), &mut gradients);
            p.free_all([grad_qkv, s.ln1]);
            grad_x = p.alloc(activation, MAIN_STREAM);
            parameter_gradient(&mut p, size(0), &mut gradients);
            parameter_gradient(&mut p, size(1), &mut gradients);
            p.free_all([grad_ln1, grad_residual, s.input]);
        }
        p.free(grad_x);
        let tail = parameter_sizes.len();
        parameter_gradient(&mut p, parameter_sizes[tail - 2], &mut gradients);
        parameter_gradient(&mut p, parameter_sizes[tail - 1], &mut gradients);
        if let Some(last) = open_bucket.take() {
            p.free(last);
        }
        p.free_all([tokens, targets]);

        // Optimizer: Adam's moments at the first step, then a foreach update whose denominator
        // (sqrt(v) / bias correction + eps) is a temporary list as large as the parameters.
        if !adam_moments_made {
            adam_moments_made = true;
            for &size in &parameter_sizes {
                p.alloc(size, MAIN_STREAM); // exp_avg
                p.alloc(size, MAIN_STREAM); // exp_avg_sq
            }
        }
        let denominators: Vec<u32> = parameter_sizes
            .iter()
            .map(|&size| p.alloc(size, MAIN_STREAM))
            .collect();
        workspace(&mut p, &mut random, 512, 64 * 1024); // the foreach kernels' tensor-list metadata
        p.free_all(denominators);
        // zero_grad(set_to_none=True).
        p.free_all(gradients);
    }

    p.into_workload()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::workload::Op;

    /// Every allocation is freed at most once and only after it was made.
    fn check_well_formed(w: &DeviceWorkload) {
        let mut live = vec![false; w.allocations.len()];
        for op in &w.ops {
            match *op {
                Op::Alloc { id, size, .. } => {
                    assert!(!live[id as usize]);
                    assert_eq!(w.allocations[id as usize].requested_size, size);
                    live[id as usize] = true;
                }
                Op::Free { id } => {
                    assert!(live[id as usize], "free of {id} which is not live");
                    live[id as usize] = false;
                }
                Op::EmptyCache | Op::Oom { .. } => panic!("the demo makes neither"),
            }
        }
    }

    #[test]
    fn the_demo_is_well_formed_and_deterministic() {
        let w = transformer_training();
        check_well_formed(&w);
        assert_eq!(w, transformer_training());
        check_well_formed(&build(&DemoSpec::tiny()));
        // Both streams are used.
        assert!(
            w.ops
                .iter()
                .any(|op| matches!(op, Op::Alloc { stream, .. } if *stream == SIDE_STREAM))
        );
    }

    #[test]
    fn what_stays_live_is_weights_moments_and_workspaces() {
        let spec = DemoSpec::default();
        let w = build(&spec);
        let d = spec.hidden;
        let parameters = spec.vocab * d * FLOAT
            + spec.layers * layer_parameter_sizes(d).iter().sum::<u64>()
            + 2 * d * FLOAT;
        // Weights plus two Adam moments, plus the two cuBLAS workspaces.
        assert_eq!(
            w.figures.end_requested,
            3 * parameters + 2 * CUBLAS_WORKSPACE
        );
        assert!(w.ops.len() > 5_000, "{} ops", w.ops.len());
    }
}
