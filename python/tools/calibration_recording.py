"""Recordings of a layer-by-layer LLM calibration run, made by PyTorch's own allocator.

    scripts/with-fake-cuda python python/tools/calibration_recording.py --out tests/data/calibration

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
- ``calibration_expandable``: under ``expandable_segments:True``.
Every shape is run in a process of its own (the settings are read when CUDA starts).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20

#: name -> (device index, fake devices, PYTORCH_CUDA_ALLOC_CONF)
SHAPES = {
    "calibration": (0, 1, ""),
    "calibration_two_devices": (1, 2, ""),
    "calibration_expandable": (0, 1, "expandable_segments:True"),
}


class Model:
    """The sizes of a small decoder-only model (bf16 weights) and of its calibration set."""

    layers = 6
    hidden = 1024
    intermediate = 2816
    heads = 16
    vocab = 32000
    samples = 8
    seqlen = 512
    #: the lm_head's fp32 logits of the embedding pass, freed before recording: its cached
    #: block later serves the first layer's large temporary
    logits = 392 * MIB + 768 * 1024

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of one layer's linears."""
        h, i = self.hidden, self.intermediate
        return [("q", h, h), ("k", h, h), ("v", h, h), ("o", h, h), ("gate", i, h), ("up", i, h), ("down", h, i)]


def run_calibration(device: int, path: str, model: Model) -> None:
    import torch

    cuda = torch.device("cuda", device)
    torch.cuda.set_device(cuda)

    def empty(size: int) -> "torch.Tensor":
        return torch.empty(size, dtype=torch.uint8, device=cuda)

    m = model
    activation = m.seqlen * m.hidden * 2

    # Before recording: the calibration inputs, the attention mask and the position ids stay
    # on the GPU all along; the embedding pass (embedding and lm_head on the GPU, logits) leaves
    # its memory in PyTorch's cache.
    inputs = empty(m.samples * activation)
    mask = empty(m.seqlen * m.seqlen * 2)
    positions = empty(m.seqlen * 8)
    embedding = empty(m.vocab * m.hidden * 2)
    logits = empty(m.logits)
    caught = [empty(activation) for _ in range(m.samples)]
    del logits, caught
    del embedding

    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=1_000_000)

    outputs = empty(m.samples * activation)
    for layer in range(m.layers):
        weights = {name: empty(rows * cols * 2) for name, rows, cols in m.linears()}
        norms = [empty(m.hidden * 2), empty(m.hidden * 2)]
        if layer == 0:
            # The first layer's rotary cache, as fp32, made once: served by the cached logits.
            rotary = empty(m.logits - 512 * 1024)
        hessians: dict[str, torch.Tensor] = {}
        for _ in range(m.samples):
            forward_one(empty, m, activation, hessians)
        for name, rows, cols in m.linears():
            quantize_one(empty, rows, cols)
            weights[name] = empty(rows * cols * 2)  # the quantized weight replaces the float one
        del hessians
        for _ in range(m.samples):
            forward_one(empty, m, activation, None)
        if layer == 0:
            del rotary
        del weights, norms
        torch.cuda.empty_cache()
        inputs, outputs = outputs, inputs
    del inputs, outputs, mask, positions
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def forward_one(empty, m: Model, activation: int, hessians) -> None:
    """One sample through one layer; with ``hessians``, each linear's input adds to its Hessian
    (made at first use, fp32, columns x columns)."""
    normed = empty(activation)
    if hessians is not None:
        for name, _rows, cols in m.linears():
            if name not in hessians:
                hessians[name] = empty(cols * cols * 4)
    q, k, v = empty(activation), empty(activation), empty(activation)
    scores = empty(m.heads * m.seqlen * m.seqlen * 2)
    probs = empty(m.heads * m.seqlen * m.seqlen * 2)
    del scores
    attended = empty(activation)
    del probs, q, k, v
    out = empty(activation)
    del attended, normed
    gate, up = empty(m.seqlen * m.intermediate * 2), empty(m.seqlen * m.intermediate * 2)
    act = empty(m.seqlen * m.intermediate * 2)
    del gate, up
    down = empty(activation)
    del act, down, out


def quantize_one(empty, rows: int, cols: int) -> None:
    """GPTQ on one linear: the fp32 weight, the damped Hessian, its inverse's Cholesky factor,
    the quantized weight and the losses, block by block."""
    weight = empty(rows * cols * 4)
    damped = empty(cols * cols * 4)
    inverse = empty(cols * cols * 4)
    del damped
    quantized = empty(rows * cols * 4)
    losses = empty(rows * cols * 4)
    for start in range(0, cols, 512):
        width = min(512, cols - start)
        block = empty(rows * width * 4)
        errors = empty(rows * width * 4)
        del block, errors
    del weight, inverse, quantized, losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for SHAPE.pickle")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one shape, in this process
    args = parser.parse_args()
    if args.run:
        device, _count, _conf = SHAPES[args.run]
        run_calibration(device, str(Path(args.out) / f"{args.run}.pickle"), Model())
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for shape in args.shape or sorted(SHAPES):
        _device, count, conf = SHAPES[shape]
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, FAKE_LIBCUDA_DEVICE_COUNT=str(count))
        subprocess.run([sys.executable, __file__, "--out", args.out, "--run", shape], env=env, check=True)
        print(f"{args.out}/{shape}.pickle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
