"""A training loop written for PyTorch's own CUDA allocator, run unchanged on ferrocache.

The only ferrocache line is ``ferrocache.install()`` at the top (``FERROCACHE=0`` leaves it out,
to run the same script on PyTorch's allocator). Everything else is plain ``torch.cuda``: it logs
``max_memory_allocated()`` each step and resets the peak, records the allocation history with
Python stacks and dumps a snapshot for https://pytorch.org/memory_viz, and on
``torch.cuda.OutOfMemoryError`` halves its batch and retries, as batch-size finders do.

No kernel runs (it also runs on the project's fake CUDA): a "layer" only allocates its output.

    python examples/drop_in.py                    # ferrocache
    FERROCACHE=0 python examples/drop_in.py       # PyTorch's allocator
    python -m torch.cuda._memory_viz trace_plot drop-in-out/snapshot.pickle -o trace.html
"""

import os

import torch

if os.environ.get("FERROCACHE", "1") != "0":
    import ferrocache

    ferrocache.install()  # before the first CUDA tensor

MIB = 1 << 20
LAYERS = 4
BYTES_PER_SAMPLE = MIB  # activation memory per sample and layer
STEPS = 4


def layer(inputs: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.empty(batch * BYTES_PER_SAMPLE, dtype=torch.uint8, device=inputs.device)


def train_step(batch: int) -> None:
    activations = [torch.empty(batch * 1024, dtype=torch.uint8, device="cuda")]
    for _ in range(LAYERS):
        activations.append(layer(activations[-1], batch))
    # "backward": activations are released last to first
    while activations:
        activations.pop()


def main() -> None:
    out_dir = os.environ.get("DROP_IN_OUT", "drop-in-out")
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    batch = 64
    step = 0
    while step < STEPS:
        try:
            train_step(batch)
        except torch.cuda.OutOfMemoryError:
            print(f"out of memory at batch {batch}; retrying with {batch // 2}")
            batch //= 2
            if batch == 0:
                raise
            continue
        peak = torch.cuda.max_memory_allocated()
        print(f"step {step} batch {batch}: peak {peak / MIB:.1f} MiB allocated, "
              f"{torch.cuda.memory_reserved() / MIB:.1f} MiB reserved")
        torch.cuda.reset_peak_memory_stats()
        step += 1
    torch.cuda.memory._dump_snapshot(os.path.join(out_dir, "snapshot.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    print(torch.cuda.memory_summary(abbreviated=True))


if __name__ == "__main__":
    main()
