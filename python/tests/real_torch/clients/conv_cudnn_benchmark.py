"""A convolutional network of ``torch.nn`` layers with ``torch.backends.cudnn.benchmark = True``:
two steps of forward and backward with SGD. In benchmark mode cuDNN tries its algorithms with
workspaces from the allocator, sized by the largest cached block (``cacheInfo``).
"""

import torch

import _figures

torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10),
).cuda()  # fmt: skip
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
_figures.step("model")
for step in range(2):
    x = torch.ones(4, 3, 32, 32, device="cuda")
    target = torch.zeros(4, dtype=torch.long, device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _figures.step(f"step {step}")
_figures.write()
