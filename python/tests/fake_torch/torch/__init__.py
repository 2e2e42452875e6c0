"""A stand-in for PyTorch, for ferrocache's tests: just what ferrocache.install() touches.

``torch.cuda.memory.CUDAPluggableAllocator`` loads the library with ctypes and takes the
function addresses as PyTorch does; the allocator object's ``set_*_fn`` methods record the
addresses they are given; ``change_current_allocator`` records the allocator and refuses, as
PyTorch does, once CUDA is initialised (``FAKE_TORCH_CUDA_INITIALIZED=1``).
"""

import os

__version__ = "0.0+fake"


class version:  # noqa: N801 - torch.version
    cuda = os.environ.get("FAKE_TORCH_CUDA_VERSION", "12.8") or None


from . import cuda  # noqa: E402,F401
