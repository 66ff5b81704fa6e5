"""A stand-in for torch, enough for allocd_torch.enable() (test_enable_fake_torch.py).

Its lib/ holds libtorch_cuda.so built from ../stub_torch_cuda.cpp and ../../hooks_stub/fake_runtime.cpp,
and empty libc10_cuda.so, libc10.so, libtorch.so; its include/ the stub headers. `fake` plays
torch's code that calls the current CUDA allocator (a tensor's allocation and drop,
record_stream, empty_cache, _record_memory_history, _snapshot, the current stream, and the
private pool calls of CUDA graphs and MemPool); torch.cuda.memory_stats is
torch's own, built from getDeviceStats as torch's is.

FAKE_TORCH_CUDA_INITIALISED=1 plays a process whose CUDA is already initialised;
FAKE_TORCH_ALLOCATOR_INITIALISED=1 one whose native allocator is initialised while
torch.cuda.is_initialized() still says False.
"""
import ctypes
import os

__version__ = "0.0.0+fake"
_here = os.path.dirname(os.path.abspath(__file__))
stub = ctypes.CDLL(os.path.join(_here, "lib", "libtorch_cuda.so"))
_ERR = (ctypes.c_char_p, ctypes.c_size_t)
stub.stub_current_name.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
stub.stub_change_current.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *_ERR]
stub.stub_alloc.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), *_ERR]
stub.stub_drop.argtypes = [ctypes.c_void_p]
stub.stub_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_longlong, *_ERR]
stub.stub_empty_cache.argtypes = [*_ERR]
stub.stub_device_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), *_ERR]
stub.stub_record_history.argtypes = [ctypes.c_int, *_ERR]
stub.stub_snapshot.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong), *_ERR]
stub.stub_set_stream.argtypes = [ctypes.c_longlong]
_ID = (ctypes.c_ulonglong, ctypes.c_ulonglong)
stub.stub_begin_pool.argtypes = [*_ID, ctypes.c_longlong, *_ERR]
for _f in (stub.stub_end_pool, stub.stub_release_pool, stub.stub_create_pool, stub.stub_empty_pool):
    _f.argtypes = [*_ID, *_ERR]
stub.stub_pool_use_count.argtypes = [*_ID, ctypes.POINTER(ctypes.c_int), *_ERR]
stub.stub_pool_snapshot.argtypes = [*_ID, ctypes.c_void_p, ctypes.POINTER(ctypes.c_longlong), *_ERR]
stub.stub_checkpoint.argtypes = [*_ID, ctypes.POINTER(ctypes.c_int), *_ERR]
stub.stub_restore.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), *_ERR]
stub.stub_drop_checkpoint.argtypes = [ctypes.c_int]

if os.environ.get("FAKE_TORCH_ALLOCATOR_INITIALISED") == "1":
    stub.stub_init_current()


def _call(fn, *args):
    """Calls a stub entry point that takes (..., err, n); raises RuntimeError with its error."""
    err = ctypes.create_string_buffer(8192)
    if fn(*args, err, len(err)) != 0:
        raise RuntimeError(err.value.decode("utf-8", "replace"))


class fake:
    """torch's code paths into the current CUDA allocator."""

    @staticmethod
    def allocator_name():
        buf = ctypes.create_string_buffer(64)
        stub.stub_current_name(buf, len(buf))
        return buf.value.decode()

    @staticmethod
    def alloc(nbytes):
        """A tensor's allocation: its address (an int), or RuntimeError("OutOfMemoryError: ...")."""
        p = ctypes.c_void_p()
        _call(stub.stub_alloc, nbytes, ctypes.byref(p))
        return p.value or 0

    @staticmethod
    def drop(ptr):
        if stub.stub_drop(ptr) != 0:
            raise KeyError(ptr)

    @staticmethod
    def record_stream(ptr, stream):
        _call(stub.stub_record_stream, ptr, stream)

    @staticmethod
    def empty_cache():
        _call(stub.stub_empty_cache)

    @staticmethod
    def record_history(enabled):
        _call(stub.stub_record_history, 1 if enabled else 0)

    @staticmethod
    def set_stream(stream):
        """torch.cuda.stream(s): the current stream's cudaStream_t is stream (an int)."""
        stub.stub_set_stream(stream)

    # Private pools of device 0, named by their MempoolId_t pair.
    @staticmethod
    def begin_pool(pool, stream=-1):
        """beginAllocateToPool with a filter that takes stream (-1: every stream)."""
        _call(stub.stub_begin_pool, *pool, stream)

    @staticmethod
    def end_pool(pool):
        _call(stub.stub_end_pool, *pool)

    @staticmethod
    def release_pool(pool):
        _call(stub.stub_release_pool, *pool)

    @staticmethod
    def create_pool(pool):
        _call(stub.stub_create_pool, *pool)

    @staticmethod
    def empty_pool(pool):
        _call(stub.stub_empty_pool, *pool)

    @staticmethod
    def pool_use_count(pool):
        out = ctypes.c_int()
        _call(stub.stub_pool_use_count, *pool, ctypes.byref(out))
        return out.value

    @staticmethod
    def pool_snapshot(pool, ptr):
        out = (ctypes.c_longlong * 4)()
        _call(stub.stub_pool_snapshot, *pool, ptr, out)
        return dict(zip(("segments", "owned", "holds", "in_whole"), out))

    @staticmethod
    def checkpoint(pool):
        """getCheckpointState: the checkpoint's index."""
        out = ctypes.c_int()
        _call(stub.stub_checkpoint, *pool, ctypes.byref(out))
        return out.value

    @staticmethod
    def restore(index):
        """setCheckpointPoolState, with torch's handling of the delta: (blocks freed, allocated)."""
        out = (ctypes.c_longlong * 2)()
        _call(stub.stub_restore, index, out)
        return tuple(out)

    @staticmethod
    def drop_checkpoint(index):
        stub.stub_drop_checkpoint(index)

    @staticmethod
    def snapshot(ptr):
        out = (ctypes.c_longlong * 8)()
        _call(stub.stub_snapshot, ptr, out)
        keys = ("segments", "block_size", "allocated", "has_context", "segment_size", "alloc_entries",
                "segment_alloc_entries", "entries")
        return dict(zip(keys, out))


def memory_stats(device=None):
    """torch.cuda.memory_stats: getDeviceStats of the current allocator, in torch's flat keys."""
    vals = (ctypes.c_longlong * 122)()
    _call(stub.stub_device_stats, 0 if device is None else device, vals)
    names = [f"{s}.{p}.{c}" for s in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                      "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
             for p in ("all", "small_pool", "large_pool") for c in ("current", "peak", "allocated", "freed")]
    names += [f"oversize_{k}.{c}" for k in ("allocations", "segments") for c in ("current", "peak", "allocated", "freed")]
    names += ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
              "max_split_size"]
    return dict(zip(names, vals))


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
        _call(stub.stub_change_current, *a.allocator())

    memory_stats = staticmethod(memory_stats)


class cuda:
    memory = _Memory
    memory_stats = staticmethod(memory_stats)

    @staticmethod
    def is_initialized():
        return os.environ.get("FAKE_TORCH_CUDA_INITIALISED") == "1"

    @staticmethod
    def current_device():
        return 0
