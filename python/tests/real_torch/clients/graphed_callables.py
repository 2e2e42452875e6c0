"""CUDA graphs by hand, as training scripts use them: ``torch.cuda.make_graphed_callables`` on
an MLP (forward and backward captured into graphs of a private pool) for three SGD steps, then
inference of a second MLP captured with ``torch.cuda.graph`` and replayed three times with new
inputs copied in.
The addresses of every replay's output are written: a replay writes into the same memory each
time, and both allocators must place the graphs' memory alike.
"""

import torch

import _figures

torch.manual_seed(0)


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)
    ).cuda()


model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sample = torch.ones(8, 32, device="cuda", requires_grad=True)
graphed = torch.cuda.make_graphed_callables(model, (sample,))
_figures.step("graphed")

addresses = []
for step in range(3):
    out = graphed(torch.ones(8, 32, device="cuda", requires_grad=True))
    addresses.append({"graph": "training", "step": step, "output": out.data_ptr()})
    out.sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    _figures.step(f"train {step}")

inference = mlp()
static_input = torch.ones(16, 32, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side), torch.no_grad():
    for _ in range(2):  # warm-up on a side stream, as PyTorch's docs ask
        inference(static_input)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph), torch.no_grad():
    static_output = inference(static_input)
for step in range(3):
    static_input.copy_(torch.full((16, 32), float(step)))
    graph.replay()
    addresses.append({"graph": "inference", "step": step, "output": static_output.data_ptr()})
    _figures.step(f"replay {step}")
_figures.note("output_addresses", addresses)
_figures.write()
