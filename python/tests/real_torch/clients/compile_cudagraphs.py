"""``torch.compile(backend="cudagraphs")``: a small MLP trained for three steps at one input
shape, then three at a second shape, so that the CUDA graph tree records a second branch, with
backward. The addresses of the outputs of each replay are written: a graph replays into the
same memory each time, and both allocators must place it alike.

Recording the second branch after replaying the first restores the graph pool to a checkpoint
(``torch._C._cuda_setCheckpointPoolState``); the restores are counted, so that a run that never
restored a checkpoint is seen. ``CLIENT_COMPILE_MODE`` compiles with that ``mode`` instead
(``reduce-overhead``: Inductor's kernels under the same CUDA graph trees; it needs Triton).
"""

import os

import torch

import _figures

restores = 0
_set_checkpoint_pool_state = torch._C._cuda_setCheckpointPoolState


def _counted_set_checkpoint_pool_state(*args):
    global restores
    restores += 1
    return _set_checkpoint_pool_state(*args)


torch._C._cuda_setCheckpointPoolState = _counted_set_checkpoint_pool_state

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)
).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
mode = os.environ.get("CLIENT_COMPILE_MODE")
compiled = torch.compile(model, mode=mode) if mode else torch.compile(model, backend="cudagraphs")
_figures.step("model")

addresses = []
for batch in (8, 16):
    for step in range(3):
        x = torch.ones(batch, 32, device="cuda")
        out = compiled(x)
        addresses.append({"batch": batch, "step": step, "output": out.data_ptr()})
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _figures.step(f"batch {batch} step {step}")
_figures.note("output_addresses", addresses)
_figures.note("checkpoint_restores", restores)
_figures.write()
