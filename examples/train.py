#!/usr/bin/env python3
"""A small transformer language model, trained for a few steps with ferrocache as PyTorch's
CUDA allocator; prints ferrocache's memory summary at the end.

    pip install .                        # from the repository root
    python examples/train.py             # --steps 20 --conf expandable_segments:True
    python examples/train.py --snapshot run.pickle   # then open it at pytorch.org/memory_viz

Needs PyTorch and a CUDA GPU; says so and exits with status 2 where either is missing.
scripts/gpu-check uses this file's model and training loop (``--allocator native`` trains the
same model with PyTorch's own allocator, for comparison).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

VOCAB = 1024
SEQUENCE = 128
BATCH = 16


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--conf", default=None, help="a PYTORCH_CUDA_ALLOC_CONF value for ferrocache")
    parser.add_argument("--snapshot", default=None, help="write a memory snapshot (pickle) here")
    parser.add_argument(
        "--allocator",
        choices=("ferrocache", "native"),
        default="ferrocache",
        help="ferrocache (default), or PyTorch's native allocator for comparison",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(torch: Any, d_model: int = 256, heads: int = 4, layers: int = 4) -> Any:
    """A decoder-only transformer: embeddings, causal encoder layers, a vocabulary head."""
    nn = torch.nn

    class TinyLM(nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d_model)
            self.position = nn.Parameter(torch.zeros(SEQUENCE, d_model))
            layer = nn.TransformerEncoderLayer(
                d_model, heads, 4 * d_model, dropout=0.1, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(d_model, VOCAB)

        def forward(self, tokens: Any) -> Any:
            length = tokens.shape[1]
            mask = torch.triu(
                torch.full((length, length), float("-inf"), device=tokens.device), diagonal=1
            )
            hidden = self.embed(tokens) + self.position[:length]
            return self.head(self.encoder(hidden, mask=mask))

    return TinyLM()


def batch(torch: Any, step: int, seed: int, device: Any) -> tuple[Any, Any]:
    """Token sequences that count up from a random start (so the model has something to learn),
    made on the CPU from a seeded generator: the same on every run."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    tokens = (starts + torch.arange(SEQUENCE + 1)) % VOCAB
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train(torch: Any, steps: int, seed: int = 0) -> tuple[list[float], list[float]]:
    """Trains a fresh model for ``steps`` steps on the current CUDA device; returns the losses
    and the wall-clock seconds of each step (synchronised)."""
    torch.manual_seed(seed)
    device = torch.device("cuda")
    model = build_model(torch).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, seconds = [], []
    for step in range(steps):
        started = time.perf_counter()
        inputs, targets = batch(torch, step, seed, device)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))  # .item() synchronises
        seconds.append(time.perf_counter() - started)
    return losses, seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as err:
        print(f"examples/train.py needs PyTorch with CUDA ({err}); install torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "examples/train.py needs a CUDA GPU: torch.cuda.is_available() is False here",
            file=sys.stderr,
        )
        return 2
    if args.allocator == "ferrocache":
        import ferrocache

        ferrocache.install(conf=args.conf)  # before the first CUDA tensor
        if args.snapshot:
            ferrocache.record_memory_history(max_entries=100_000)
    elif args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    losses, seconds = train(torch, args.steps, args.seed)
    for step, (loss, took) in enumerate(zip(losses, seconds)):
        print(f"step {step:3d}  loss {loss:.4f}  {took * 1000:7.1f} ms")

    if args.allocator == "ferrocache":
        print(ferrocache.memory_summary())
        if args.snapshot:
            ferrocache.dump_snapshot(args.snapshot)
    else:
        print(torch.cuda.memory_summary())
        if args.snapshot:
            torch.cuda.memory._dump_snapshot(args.snapshot)
    if args.snapshot:
        print(f"snapshot written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
