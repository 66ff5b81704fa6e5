"""A stand-in for torch, enough for allocd_torch.enable() (test_enable_fake_torch.py).

Its lib/ holds libtorch_cuda.so built from ../stub_torch_cuda.cpp and empty libc10_cuda.so,
libc10.so, libtorch.so; its include/ the stub headers. FAKE_TORCH_CUDA_INITIALISED=1 plays a
process whose CUDA is already initialised.
"""
import ctypes
import os

__version__ = "0.0.0+fake"
_here = os.path.dirname(os.path.abspath(__file__))
stub = ctypes.CDLL(os.path.join(_here, "lib", "libtorch_cuda.so"))
stub.stub_malloc.restype = ctypes.c_void_p
stub.stub_malloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
stub.stub_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
stub.stub_change_current.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
stub.stub_record_stream.argtypes = [ctypes.c_void_p]


class _C:
    _GLIBCXX_USE_CXX11_ABI = 1

    @staticmethod
    def _cuda_customAllocator(alloc_fn, free_fn):
        return (alloc_fn, free_fn)


class _Memory:
    class _CUDAAllocator:
        def __init__(self, raw):
            self._raw = raw

        def allocator(self):
            return self._raw

    @staticmethod
    def change_current_allocator(a):
        stub.stub_change_current(*a.allocator())

    def memory_stats(device=None):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")


class cuda:
    memory = _Memory
    memory_stats = _Memory.memory_stats

    @staticmethod
    def is_initialized():
        return os.environ.get("FAKE_TORCH_CUDA_INITIALISED") == "1"

    @staticmethod
    def current_device():
        return 0
