"""Random programs with the shapes real training has (issue 20, item 4), beside the
log-uniform ones of :func:`oracle.harness.random_program`: those rarely make two free blocks of
the same size, where ties between equal blocks are decided, and they never grow step by step.

A shaped program (:func:`shaped_program`):
- starts with live blocks, kept to the end: weights, most of them of one of a few layer sizes;
- then runs training steps whose activations grow step by step (a sequence length that grows),
  each layer's activations of identical sizes, with bursts of tens to hundreds of blocks of one
  size (128 KiB, 720 KiB, 2 MiB, 20 MiB, and the 704 KiB and 256 KiB of issue 20) of which some
  are freed (the last, every other one, a random few) and allocated again; gradients of the
  weights' sizes; now and then ``empty_cache()``;
- sometimes contains the shape of issue 20: a small segment cut into 16 blocks of 128 KiB, a
  second one filled but for a 128 KiB tail, the first one's last block freed, 128 KiB asked for;
- runs under a memory limit relative to its own peak requested bytes, set as a fraction by its
  first op: 0.85 of it (it runs out of memory: retries, releases of cached blocks, out-of-memory
  errors), 1.1 of it (cached blocks are released to make room; garbage collection, under a
  setting with a threshold), or none. A setting's own fraction (``harness.SETTINGS``) is
  replaced by one of the first two, since garbage collection acts only under a fraction.

:func:`fixed_programs` are short fixed cases of ties between equal free blocks: issue 20's
ten-line program in both address orders, and a large-pool tie between an older and a younger
segment (an allocation, and ``empty_cache()``'s order).
"""

from __future__ import annotations

import random
from typing import Any, Optional

from .harness import GIB, MIB, Case, capacity_for_peak

KIB = 1 << 10
#: Sizes real training asks for again and again.
IDENTICAL_SIZES = (128 * KIB, 720 * KIB, 720_896, 262_144, 2 * MIB, 20 * MIB)


class Builder:
    """A program under construction, with its requested bytes and their peak."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []
        self.live: dict[int, int] = {}
        self.next_id = 0
        self.requested = 0
        self.peak = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        i = self.next_id
        self.next_id += 1
        self.ops.append({"op": "alloc", "id": i, "size": size, "stream": stream})
        self.live[i] = size
        self.requested += size
        self.peak = max(self.peak, self.requested)
        return i

    def free(self, i: int) -> None:
        self.ops.append({"op": "free", "id": i})
        self.requested -= self.live.pop(i)

    def free_all(self, ids: list[int]) -> None:
        for i in ids:
            self.free(i)


def burst(b: Builder, rng: random.Random, stream: int) -> list[int]:
    """Tens to hundreds of blocks of one size; some freed and asked for again. The ids kept."""
    size = rng.choice(IDENTICAL_SIZES[:4]) if rng.random() < 0.8 else rng.choice(IDENTICAL_SIZES)
    count = rng.randint(8, 24) if size >= 2 * MIB else int(rng.triangular(16, 300, 24))
    ids = [b.alloc(size, stream) for _ in range(count)]
    pattern = rng.choice(["last", "every_other", "random", "none"])
    if pattern == "last":
        freed = ids[-rng.randint(1, 3) :]
    elif pattern == "every_other":
        freed = ids[rng.randint(0, 1) :: 2]
    elif pattern == "random":
        freed = rng.sample(ids, rng.randint(1, max(1, count // 4)))
    else:
        freed = []
    b.free_all(freed)
    kept = [i for i in ids if i not in set(freed)]
    for _ in range(rng.randint(0, len(freed))):
        kept.append(b.alloc(size, stream))
    return kept


def issue_20_shape(b: Builder, stream: int) -> list[int]:
    """Segment B cut into 16 blocks of 128 KiB; segment A filled but for a 128 KiB tail; B's last
    block freed; 128 KiB asked for (two free blocks of exactly that size tie)."""
    b_blocks = [b.alloc(128 * KIB, stream) for _ in range(16)]
    a_blocks = [b.alloc(size, stream) for size in (720_896, 720_896, 262_144, 262_144)]
    b.free(b_blocks.pop())
    return b_blocks + a_blocks + [b.alloc(128 * KIB, stream)]


def shaped_program(seed: int, setting: tuple[str, str, Optional[float]]) -> Case:
    name, conf, fraction = setting
    rng = random.Random(f"shapes/{seed}/{name}")
    b = Builder()
    streams = 1 if rng.random() < 0.75 else 2
    layer_sizes = [rng.choice(IDENTICAL_SIZES + (rng.randint(1, 64) * 4096, rng.randint(1, 40) * MIB)) for _ in range(rng.randint(1, 4))]
    weights = [b.alloc(layer_sizes[i % len(layer_sizes)]) for i in range(rng.randint(8, 120))]
    layers = rng.randint(2, 6)
    unit = rng.choice([128 * KIB, 512 * KIB, 2 * MIB, 6 * MIB])
    length = rng.randint(1, 4)
    growth = rng.choice([1, 1, 2, 3])
    kept: list[int] = []
    for step in range(rng.randint(3, 5)):
        stream = rng.randrange(streams)
        tokens = length + step * growth  # grows step by step
        activations = []
        bursts = rng.choice([0, 1, 1, 2])
        for layer in range(layers):
            activations.append(b.alloc(unit * tokens + rng.choice([0, 0, 512, 4096]), stream))
            if bursts and rng.random() < 2 / layers:
                bursts -= 1
                activations += burst(b, rng, stream)
        if rng.random() < 0.25:
            kept += issue_20_shape(b, stream)
        gradients = []
        for a in reversed(activations):
            b.free(a)
            if rng.random() < 0.5:
                gradients.append(b.alloc(rng.choice(layer_sizes), stream))
        b.free_all(gradients)
        if kept and rng.random() < 0.5:
            b.free_all(kept)
            kept = []
        if rng.random() < 0.15:
            b.ops.append({"op": "empty_cache"})
    del weights
    limit = rng.choice([None, 0.85, 1.1]) if fraction is None else rng.choice([0.85, 1.1])
    capacity = capacity_for_peak(b.peak)
    if limit is not None:
        b.ops.insert(0, {"op": "fraction", "value": limit * b.peak / capacity})
    what = f"shaped seed {seed}" + (f", limit {limit} x its peak" if limit else "")
    return Case(seed, name, conf, capacity, streams, 0, b.ops, program=what, layout="changes")


def fixed_programs() -> list[Case]:
    """Issue 20's ten-line program under the defaults: 16 blocks of 128 KiB fill small segment
    B, then 720,896, 720,896, 262,144 and 262,144 bytes fill segment A but for a 128 KiB tail,
    B's last block is freed and 128 KiB asked for. Once as written (the fake's first fit puts A
    above B), once with A below B, as in the recording: a 20 MiB segment made first and given
    back (``empty_cache()``) before A leaves the hole at the bottom that A then takes."""
    cases = []
    for order in ("B below A", "A below B"):
        b = Builder()
        hole = b.alloc(2 * MIB) if order == "A below B" else None
        b_blocks = [b.alloc(128 * KIB) for _ in range(16)]
        if hole is not None:
            b.free(hole)
            b.ops.append({"op": "empty_cache"})
        for size in (720_896, 720_896, 262_144, 262_144):
            b.alloc(size)
        b.free(b_blocks[-1])
        b.alloc(128 * KIB)
        cases.append(Case(0, "defaults", "", GIB, 1, 0, b.ops, program=f"issue 20 tie, {order}"))
    # Two free 12 MiB segments: the older one (made first) above the younger (made in the hole
    # that empty_cache() left at the bottom).
    for what, last in (("large tie", {"op": "alloc", "id": 3, "size": 12 * MIB, "stream": 0}), ("empty_cache order", {"op": "empty_cache"})):
        b = Builder()
        older, gone = b.alloc(12 * MIB), b.alloc(12 * MIB)
        b.free(older)
        b.ops.append({"op": "empty_cache"})
        younger = b.alloc(12 * MIB)
        b.free(gone)
        b.free(younger)
        b.ops.append(last)
        cases.append(Case(0, "defaults", "", GIB, 1, 0, b.ops, program=what))
    return cases
