"""The stand-in's torch.cuda.memory: CUDAPluggableAllocator and change_current_allocator.

``FAKE_TORCH_NO_POOL_HOOKS=1`` stands for a PyTorch whose allocator object lacks the CUDA graph
pool hooks.
"""

import ctypes
import os


class _NativeAllocator:
    """Stands for torch._C._cuda_CUDAAllocator: records the hook addresses it is given."""

    def __init__(self) -> None:
        self.hooks: dict = {}

    def _setter(name):
        def set_fn(self, address: int) -> None:
            if not isinstance(address, int):
                raise TypeError(f"{name} takes a function address (int), not {address!r}")
            self.hooks[name] = address

        return set_fn

    set_init_fn = _setter("set_init_fn")
    set_reset_fn = _setter("set_reset_fn")
    set_memory_fraction_fn = _setter("set_memory_fraction_fn")
    set_base_alloc_fn = _setter("set_base_alloc_fn")
    set_record_stream_fn = _setter("set_record_stream_fn")
    if os.environ.get("FAKE_TORCH_NO_POOL_HOOKS") != "1":
        set_begin_allocate_to_pool = _setter("set_begin_allocate_to_pool")
        set_end_allocate_to_pool_fn = _setter("set_end_allocate_to_pool_fn")
        set_release_pool = _setter("set_release_pool")
    del _setter


class CUDAPluggableAllocator:
    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        library = ctypes.CDLL(path_to_so_file)
        self.path = path_to_so_file
        self.alloc_fn = ctypes.cast(getattr(library, alloc_fn_name), ctypes.c_void_p).value
        self.free_fn = ctypes.cast(getattr(library, free_fn_name), ctypes.c_void_p).value
        assert self.alloc_fn and self.free_fn
        self._allocator = _NativeAllocator()

    def allocator(self) -> _NativeAllocator:
        return self._allocator


current = None
changes = 0


def change_current_allocator(allocator: CUDAPluggableAllocator) -> None:
    global current, changes
    from . import is_initialized

    if is_initialized():
        raise RuntimeError("Can't swap an already initialized allocator")
    current = allocator
    changes += 1
