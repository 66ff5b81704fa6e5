"""enable(): allocd installed as torch's CUDA allocator. torch is imported here only inside functions."""

import ctypes
import os
import sys
import threading

from . import _build, _lib

ALLOW_NO_HOOKS_ENV = "ALLOCD_TORCH_ALLOW_NO_HOOKS"
# Test-only: leave x.record_stream(s) unhooked, to show that the record_stream test can fail.
SKIP_RECORD_STREAM_ENV = "ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK"

TOO_LATE = (
    "allocd_torch.enable() must run before CUDA is initialised in this process, but {why}. "
    "Call it first thing, right after `import torch` and before anything touches CUDA "
    "(tensor.cuda(), model.to('cuda'), torch.cuda.current_device(), torch.cuda.synchronize(), "
    "a library that does so at import...). torch can swap its allocator only before its first CUDA allocation.")


class _State:
    def __init__(self, lib, args, hooks, allocator):
        self.lib = lib
        self.args = args              # (conf, metrics_listen)
        self.hooks = hooks            # ctypes.CDLL of _allocator.so, or None (fallback)
        self.allocator = allocator    # the fallback's torch.cuda.memory._CUDAAllocator, kept alive; else None


_state = None
_lock = threading.Lock()


def state():
    return _state


def require():
    if _state is None:
        raise RuntimeError("allocd_torch is not enabled in this process: call allocd_torch.enable() "
                           "before any CUDA use")
    return _state


def device_index(device):
    """The CUDA device index of device (None, int, "cuda", "cuda:N", torch.device).

    None means torch.cuda.current_device() when CUDA is initialised, else 0: asking
    torch for the current device would initialise CUDA.
    """
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, bool):
        raise TypeError(f"not a CUDA device: {device!r}")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind != "cuda" or (idx and not idx.isdigit()):
            raise ValueError(f"not a CUDA device: {device!r}")
        return int(idx) if idx else device_index(None)
    kind, idx = getattr(device, "type", None), getattr(device, "index", None)
    if kind == "cuda":
        return device_index(idx)
    raise ValueError(f"not a CUDA device: {device!r}")


def _torch_build_inputs(torch):
    """Include dirs, library dirs, libraries and defines for compiling against this torch."""
    base = os.path.join(os.path.dirname(torch.__file__), "include")
    includes = [base, os.path.join(base, "torch", "csrc", "api", "include")]
    try:
        from torch.utils import cpp_extension  # imports setuptools, which may be absent
    except ImportError:
        cpp_extension = None
    if cpp_extension is not None:
        # torch >= 2.6 takes device_type, older ones cuda=True; both fail without CUDA_HOME,
        # and then the torch headers alone do, with the CUDA ones searched below.
        for kwargs in ({"device_type": "cuda"}, {"cuda": True}, {}):
            try:
                includes = list(cpp_extension.include_paths(**kwargs))
                break
            except Exception:
                continue
    if not any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in includes):
        cands = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), "/usr/local/cuda/include"]
        for p in sys.path:  # the pip CUDA runtime beside torch (nvidia/cu13, nvidia/cuda_runtime)
            for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include"):
                cands.append(os.path.join(p, sub))
        found = next((d for d in cands if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))), None)
        if found is None:
            raise _build.BuildError("compiling allocd's C++ allocator needs the CUDA runtime headers "
                                    "(cuda_runtime_api.h): none in torch's include paths, CUDA_HOME, "
                                    "/usr/local/cuda/include or site-packages/nvidia/*/include. "
                                    "Set CUDA_HOME to a CUDA toolkit.")
        includes.append(found)
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return includes, [libdir], ["torch_cuda", "c10_cuda", "c10", "torch"], [f"_GLIBCXX_USE_CXX11_ABI={abi}"]


# liballocd.so's functions that the C++ allocator calls, in the order of allocd_torch::Lib
# in _allocator.cpp.
LIB_FUNCTIONS = ("allocd_torch_malloc", "allocd_torch_free", "allocd_torch_record_stream",
                 "allocd_torch_empty_cache", "allocd_torch_set_memory_fraction", "allocd_last_error",
                 "allocd_device_stats", "allocd_reset_peak_stats", "allocd_reset_accumulated_stats",
                 "allocd_memory_fraction", "allocd_largest_free_block", "allocd_snapshot_flat",
                 "allocd_record_history",
                 "allocd_torch_malloc_pool", "allocd_torch_create_pool", "allocd_torch_release_pool",
                 "allocd_torch_begin_pool", "allocd_torch_end_pool", "allocd_torch_empty_pool_cache",
                 "allocd_torch_pool_use_count", "allocd_torch_checkpoint_pool", "allocd_torch_checkpoint_free",
                 "allocd_torch_restore_pool")
_SETUP_IGNORE_RECORD_STREAM = 1


def _load_hooks(torch):
    """The compiled _allocator.so as a ctypes.CDLL, or None under the ALLOCD_TORCH_ALLOW_NO_HOOKS fallback."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_allocator.cpp")
    try:
        inc, libdirs, libs, defines = _torch_build_inputs(torch)
        path = _build.build(source, "_allocator.so", torch.__version__, inc, libdirs, libs, defines)
        dll = ctypes.CDLL(path)
    except (_build.BuildError, OSError) as e:
        if os.environ.get(ALLOW_NO_HOOKS_ENV) == "1":
            _loud(f"{e}\n{ALLOW_NO_HOOKS_ENV}=1: running WITHOUT allocd's C++ allocator, behind torch's "
                  "CUDAPluggableAllocator. An out-of-memory then gives a tensor at address 0 instead of "
                  "torch.OutOfMemoryError; x.record_stream(), torch.cuda.empty_cache() and "
                  "set_per_process_memory_fraction() are NOT honoured (memory may be reused while another "
                  "stream still reads it; use allocd_torch.empty_cache()); torch.cuda.memory_stats() and "
                  "the snapshot APIs raise (use allocd_torch's). Install g++ to fix.")
            return None
        if isinstance(e, _build.BuildError):
            raise _build.BuildError(f"{e}\nallocd_torch needs g++ (or $CXX) once per torch version to build its "
                                    f"C++ allocator; set {ALLOW_NO_HOOKS_ENV}=1 to run without it (see the docs "
                                    "for what is then lost).") from None
        raise _build.BuildError(f"loading the compiled allocator failed: {e}") from e
    dll.allocd_alloc_setup.restype = ctypes.c_int
    dll.allocd_alloc_setup.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                       ctypes.c_int]
    dll.allocd_alloc_install.restype = ctypes.c_int
    dll.allocd_alloc_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    dll.allocd_alloc_state.restype = ctypes.c_int
    dll.allocd_alloc_state.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return dll


def _expandable(conf):
    """Whether allocd's configuration string asks for expandable segments."""
    for item in (conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


def _loud(msg):
    bar = "=" * 78
    sys.stderr.write(f"\n{bar}\nallocd_torch WARNING: {msg}\n{bar}\n")
    sys.stderr.flush()


def _check_not_initialised(torch, hooks):
    if torch.cuda.is_initialized():
        raise RuntimeError(TOO_LATE.format(why="CUDA is already initialised (torch.cuda.is_initialized() is True)"))
    if hooks is not None:
        buf = ctypes.create_string_buffer(256)
        rc = hooks.allocd_alloc_state(buf, 256)
        name = buf.value.decode("utf-8", "replace")
        if rc < 0:
            raise RuntimeError(f"allocd_torch: reading torch's current allocator failed: {name}")
        if name not in ("native", "cudaMallocAsync", ""):
            raise RuntimeError(f"allocd_torch.enable(): another CUDA allocator ({name!r}) is already installed "
                               "in this process; torch can swap its allocator only once")
        if rc == 1:
            raise RuntimeError(TOO_LATE.format(why=f"torch's current CUDA allocator ({name!r}) is already initialised"))


def enable(conf, metrics_listen):
    global _state
    with _lock:
        args = (conf, metrics_listen)
        if _state is not None:
            if _state.args == args:
                return
            raise RuntimeError(f"allocd_torch.enable() already ran with conf={_state.args[0]!r}, "
                               f"metrics_listen={_state.args[1]!r}; it cannot run again with conf={conf!r}, "
                               f"metrics_listen={metrics_listen!r}")
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"allocd_torch.enable() needs torch: {e}") from e
        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError(f"this torch ({torch.__version__}) has no CUDA pluggable allocator "
                               "(torch._C._cuda_customAllocator): a CUDA build of torch is needed")
        if torch.cuda.is_initialized():  # before compiling anything: the cheap, common mistake
            _check_not_initialised(torch, None)
        lib = _lib.load()
        hooks = _load_hooks(torch)
        _check_not_initialised(torch, hooks)
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            _loud(f"PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']!r} is ignored under allocd; "
                  "configure allocd with ALLOCD_CONF (same syntax) or enable(conf=...)")
        lib.init(conf, metrics_listen)
        allocator = None
        if hooks is not None:
            flags = 0
            if os.environ.get(SKIP_RECORD_STREAM_ENV) == "1":
                flags |= _SETUP_IGNORE_RECORD_STREAM
                _loud(f"{SKIP_RECORD_STREAM_ENV}=1 (a test switch): x.record_stream() is NOT honoured")
            fns = (ctypes.c_void_p * len(LIB_FUNCTIONS))(*[lib.address(n) for n in LIB_FUNCTIONS])
            settings = conf if conf is not None else os.environ.get("ALLOCD_CONF", "")
            if hooks.allocd_alloc_setup(fns, len(LIB_FUNCTIONS), settings.encode(), int(_expandable(settings)),
                                        flags) != 0:
                raise RuntimeError("allocd_torch: allocd_alloc_setup failed (a null function pointer, or "
                                   "pthread_atfork failed)")
            err = ctypes.create_string_buffer(1024)
            if hooks.allocd_alloc_install(err, 1024) != 0:
                raise RuntimeError(TOO_LATE.format(why="torch refused to swap its allocator "
                                                       f"({err.value.decode('utf-8', 'replace')})"))
        else:
            alloc_addr, free_addr = lib.address("allocd_torch_malloc"), lib.address("allocd_torch_free")
            allocator = torch.cuda.memory._CUDAAllocator(torch._C._cuda_customAllocator(alloc_addr, free_addr))
            try:
                torch.cuda.memory.change_current_allocator(allocator)
            except RuntimeError as e:
                raise RuntimeError(TOO_LATE.format(why=f"torch refused to swap its allocator ({e})")) from e
        _state = _State(lib, args, hooks, allocator)
