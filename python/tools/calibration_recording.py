"""Recordings of a layer-by-layer LLM calibration run, made by PyTorch's own allocator.

    scripts/with-fake-cuda python python/tools/calibration_recording.py --out tests/data/calibration
    FERROCACHE_TORCH_VERSION=2.11.0 scripts/with-fake-cuda python python/tools/calibration_recording.py \
        --out tests/data/calibration --shape calibration_torch_2_11

A post-training quantization pass (GPTQ, AWQ and their kin) calibrates a model one decoder
layer at a time: the calibration inputs stay on the GPU all along, each layer is moved in,
run over the samples while hooks gather one Hessian per linear, quantized linear by linear,
run again to give the next layer its inputs, moved out, and ``torch.cuda.empty_cache()`` gives
its memory back before the next layer. History recording starts after the inputs are on the GPU
and the embedding pass has left its blocks in PyTorch's cache, as a recording made mid-run does:
the recording begins with blocks live and segments cached, every segment is freed and allocated
again, and a large request before the first ``empty_cache()`` is served from the cache.

Only ``torch.empty`` runs (no kernel runs on the fake CUDA): the program is the sequence of
allocations and frees of such a run, at the sizes of a small model. Each recording is written
without stack frames, so that it stays small enough to commit (tests/replay.rs reads them).

Shapes (``--shape``, all by default):
- ``calibration``: the run above under PyTorch's defaults;
- ``calibration_two_devices``: the same on ``cuda:1`` of a two-GPU machine, so that
  ``device_traces`` holds an empty list for device 0;
- ``calibration_expandable``: under ``expandable_segments:True``;
- ``calibration_torch_2_11``: recorded by PyTorch 2.11 from an empty GPU, whose best fit breaks
  ties between equal cached blocks by the lower address (2.13 and later: the segment made
  first), so that its own decisions tell its rule (``FERROCACHE_TORCH_VERSION=2.11.0``).
Every shape is run in a process of its own (the settings are read when CUDA starts); a shape
whose PyTorch version is not the one running is skipped, with a line saying so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20

#: name -> (device index, fake devices, PYTORCH_CUDA_ALLOC_CONF, layers, PyTorch version)
SHAPES = {
    "calibration": (0, 1, "", 3, "2.15"),
    "calibration_two_devices": (1, 2, "", 1, "2.15"),
    "calibration_expandable": (0, 1, "expandable_segments:True", 1, "2.15"),
    "calibration_torch_2_11": (0, 1, "", 1, "2.11"),
}


class Model:
    """The sizes of a small decoder-only model (bf16 weights) and of its calibration set."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    hidden = 2048
    intermediate = 5632
    heads = 16
    seqlen = 512
    #: the calibration samples, run through a layer in batches
    batches = 7
    batch = 14

    def activation(self) -> int:
        """One batch's hidden states (bf16)."""
        return self.batch * self.seqlen * self.hidden * 2

    def states(self) -> int:
        """Every sample's hidden states: a layer's inputs, or its outputs (196 MiB)."""
        return self.batches * self.activation()

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of one layer's linears."""
        h, i = self.hidden, self.intermediate
        return [("q", h, h), ("k", h, h), ("v", h, h), ("o", h, h), ("gate", i, h), ("up", i, h), ("down", h, i)]


def run_calibration(device: int, path: str, model: Model, other_device: bool, record_all: bool) -> None:
    import torch

    cuda = torch.device("cuda", device)
    torch.cuda.set_device(cuda)

    def empty(size: int) -> "torch.Tensor":
        return torch.empty(size, dtype=torch.uint8, device=cuda)

    m = model
    states = m.states()
    if other_device:
        # A tensor on the other GPU, made before recording and left alone: that device's
        # segment is in the snapshot, its trace stays empty.
        parked = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda:0")

    def record() -> None:
        torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=1_000_000)

    if record_all:
        record()
    # The embedding pass, in two tries (the first at twice the batch, given up with an
    # empty_cache()). The second try's segment is made after the logits' and lies below it: the
    # driver hands the freed range out again. What stays: the calibration inputs at the front of
    # that newer segment, a free block of the inputs' size behind them, and the logits'
    # segment, older, cached whole; the attention mask and the position ids.
    first_try = empty(2 * states)
    logits = empty(states)
    del first_try
    torch.cuda.empty_cache()
    second_try = empty(2 * states)
    del second_try
    inputs = empty(states)
    mask = empty(m.seqlen * m.seqlen * 2)
    positions = empty(m.seqlen * 8)
    del logits
    if not record_all:
        record()

    for _layer in range(m.layers):
        # The residual stream: the inputs copied in, then freed. At the first layer it takes
        # one of two equal cached blocks: from PyTorch 2.13 the older one, the logits'
        # segment; up to 2.11 the one at the lower address, behind the inputs.
        outputs = empty(states)
        del inputs
        # The layer's inputs in fp32, the target of its reconstruction loss (384 MiB): at the
        # first layer PyTorch 2.13+ serves it from its cache, the whole segment the inputs left.
        target = empty(2 * states - 8 * MIB)
        weights = {name: empty(rows * cols * 2) for name, rows, cols in m.linears()}
        norms = [empty(m.hidden * 2), empty(m.hidden * 2)]
        hessians: dict[str, torch.Tensor] = {}
        for _ in range(m.batches):
            forward_one(empty, m, hessians)
        for name, rows, cols in m.linears():
            quantize_one(empty, rows, cols)
            weights[name] = empty(rows * cols * 2)  # the quantized weight replaces the float one
        del hessians
        for _ in range(m.batches):
            forward_one(empty, m, None)
        del target, weights, norms
        torch.cuda.empty_cache()
        inputs, outputs = outputs, None
    del inputs, mask, positions
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    if other_device:
        del parked


def forward_one(empty, m: Model, hessians) -> None:
    """One batch through one layer; with ``hessians``, each linear's input adds to its Hessian
    (made at first use, fp32, columns x columns)."""
    activation = m.activation()
    normed = empty(activation)
    if hessians is not None:
        for name, _rows, cols in m.linears():
            if name not in hessians:
                hessians[name] = empty(cols * cols * 4)
    q, k, v = empty(activation), empty(activation), empty(activation)
    scores = empty(m.heads * m.batch * m.seqlen * m.seqlen * 2)
    probs = empty(m.heads * m.batch * m.seqlen * m.seqlen * 2)
    del scores
    attended = empty(activation)
    del probs, q, k, v
    out = empty(activation)
    del attended, normed
    gate, up = empty(m.batch * m.seqlen * m.intermediate * 2), empty(m.batch * m.seqlen * m.intermediate * 2)
    act = empty(m.batch * m.seqlen * m.intermediate * 2)
    del gate, up
    down = empty(activation)
    del act, down, out


def quantize_one(empty, rows: int, cols: int) -> None:
    """GPTQ on one linear: the fp32 weight, the damped Hessian, its inverse's Cholesky factor,
    the quantized weight and the losses, then the columns in two halves."""
    weight = empty(rows * cols * 4)
    damped = empty(cols * cols * 4)
    inverse = empty(cols * cols * 4)
    del damped
    quantized = empty(rows * cols * 4)
    losses = empty(rows * cols * 4)
    for _half in range(2):
        block = empty(rows * cols * 2)
        errors = empty(rows * cols * 2)
        del block, errors
    del weight, inverse, quantized, losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for SHAPE.pickle")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one shape, in this process
    args = parser.parse_args()
    if args.run:
        device, count, _conf, layers, version = SHAPES[args.run]
        import torch

        if not torch.__version__.startswith(version + "."):
            raise SystemExit(f"{args.run} is recorded by torch {version}; this is torch {torch.__version__}")
        path = str(Path(args.out) / f"{args.run}.pickle")
        # Recorded from an empty GPU under 2.11: the tie is then made while recording.
        run_calibration(device, path, Model(layers), count > 1, record_all=version == "2.11")
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from importlib.metadata import version as installed

    for shape in args.shape or sorted(SHAPES):
        _device, count, conf, _layers, version = SHAPES[shape]
        if not installed("torch").startswith(version + "."):
            print(f"{shape}: skipped, it needs torch {version} (FERROCACHE_TORCH_VERSION={version}.0)")
            continue
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, FAKE_LIBCUDA_DEVICE_COUNT=str(count))
        subprocess.run([sys.executable, __file__, "--out", args.out, "--run", shape], env=env, check=True)
        print(f"{args.out}/{shape}.pickle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
