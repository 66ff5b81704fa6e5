"""enable(): allocd installed as torch's CUDA allocator. torch is imported here only inside functions."""

import ctypes
import os
import sys
import threading

from . import _build, _lib

ALLOW_NO_HOOKS_ENV = "ALLOCD_TORCH_ALLOW_NO_HOOKS"
# Test-only: leave x.record_stream(s) unhooked, to show that the record_stream test can fail.
SKIP_RECORD_STREAM_ENV = "ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK"

_HOOK_RECORD_STREAM, _HOOK_RESET, _HOOK_FRACTION = 1, 2, 4

TOO_LATE = (
    "allocd_torch.enable() must run before CUDA is initialised in this process, but {why}. "
    "Call it first thing, right after `import torch` and before anything touches CUDA "
    "(tensor.cuda(), model.to('cuda'), torch.cuda.current_device(), torch.cuda.synchronize(), "
    "a library that does so at import...). torch can swap its allocator only before its first CUDA allocation.")


class _State:
    def __init__(self, lib, args, hooks, allocator, patched):
        self.lib = lib
        self.args = args              # (conf, metrics_listen)
        self.hooks = hooks            # ctypes.CDLL of _hooks.so, or None (fallback)
        self.allocator = allocator    # torch.cuda.memory._CUDAAllocator: kept alive
        self.patched = patched        # names patched in torch.cuda and torch.cuda.memory


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
            raise _build.BuildError("compiling allocd's hooks needs the CUDA runtime headers "
                                    "(cuda_runtime_api.h): none in torch's include paths, CUDA_HOME, "
                                    "/usr/local/cuda/include or site-packages/nvidia/*/include. "
                                    "Set CUDA_HOME to a CUDA toolkit.")
        includes.append(found)
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return includes, [libdir], ["torch_cuda", "c10_cuda", "c10", "torch"], [f"_GLIBCXX_USE_CXX11_ABI={abi}"]


def _load_hooks(torch):
    """The compiled _hooks.so as a ctypes.CDLL, or None under the ALLOCD_TORCH_ALLOW_NO_HOOKS fallback."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hooks.cpp")
    try:
        inc, libdirs, libs, defines = _torch_build_inputs(torch)
        path = _build.build(source, "_hooks.so", torch.__version__, inc, libdirs, libs, defines)
        dll = ctypes.CDLL(path)
    except (_build.BuildError, OSError) as e:
        if os.environ.get(ALLOW_NO_HOOKS_ENV) == "1":
            _loud(f"{e}\n{ALLOW_NO_HOOKS_ENV}=1: running WITHOUT allocd's C++ hooks. An out-of-memory "
                  "then gives a tensor at address 0 instead of torch.OutOfMemoryError; x.record_stream(), "
                  "torch.cuda.empty_cache() and set_per_process_memory_fraction() are NOT honoured "
                  "(memory may be reused while another stream still reads it; use allocd_torch.empty_cache()). "
                  "Install g++ to fix.")
            return None
        if isinstance(e, _build.BuildError):
            raise _build.BuildError(f"{e}\nallocd_torch needs g++ (or $CXX) once per torch version to build its "
                                    f"hooks; set {ALLOW_NO_HOOKS_ENV}=1 to run without them (see the docs for "
                                    "what is then lost).") from None
        raise _build.BuildError(f"loading the compiled hooks failed: {e}") from e
    dll.allocd_hooks_setup.restype = ctypes.c_int
    dll.allocd_hooks_setup.argtypes = [ctypes.c_void_p] * 6
    dll.allocd_hooks_attach.restype = ctypes.c_int
    dll.allocd_hooks_attach.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    dll.allocd_hooks_allocator_state.restype = ctypes.c_int
    dll.allocd_hooks_allocator_state.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return dll


def _loud(msg):
    bar = "=" * 78
    sys.stderr.write(f"\n{bar}\nallocd_torch WARNING: {msg}\n{bar}\n")
    sys.stderr.flush()


def _check_not_initialised(torch, hooks):
    if torch.cuda.is_initialized():
        raise RuntimeError(TOO_LATE.format(why="CUDA is already initialised (torch.cuda.is_initialized() is True)"))
    if hooks is not None:
        buf = ctypes.create_string_buffer(256)
        rc = hooks.allocd_hooks_allocator_state(buf, 256)
        name = buf.value.decode("utf-8", "replace")
        if rc < 0:
            raise RuntimeError(f"allocd_torch: reading torch's current allocator failed: {name}")
        if name == "pluggable":
            raise RuntimeError("allocd_torch.enable(): another pluggable CUDA allocator is already installed "
                               "in this process; torch can swap its allocator only once")
        if rc == 1:
            raise RuntimeError(TOO_LATE.format(why=f"torch's current CUDA allocator ({name!r}) is already initialised"))


def enable(conf, metrics_listen, *, patch_torch=True):
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
        if hooks is not None:
            rc = hooks.allocd_hooks_setup(lib.address("allocd_torch_malloc"), lib.address("allocd_torch_free"),
                                          lib.address("allocd_torch_record_stream"),
                                          lib.address("allocd_torch_empty_cache"),
                                          lib.address("allocd_torch_set_memory_fraction"),
                                          lib.address("allocd_last_error"))
            if rc != 0:
                raise RuntimeError("allocd_torch: allocd_hooks_setup failed (a null function pointer, or "
                                   "pthread_atfork failed)")
            alloc_addr = ctypes.cast(hooks.allocd_hooks_malloc, ctypes.c_void_p).value
            free_addr = ctypes.cast(hooks.allocd_hooks_free, ctypes.c_void_p).value
        else:
            alloc_addr, free_addr = lib.address("allocd_torch_malloc"), lib.address("allocd_torch_free")
        allocator = torch.cuda.memory._CUDAAllocator(torch._C._cuda_customAllocator(alloc_addr, free_addr))
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            raise RuntimeError(TOO_LATE.format(why=f"torch refused to swap its allocator ({e})")) from e
        if hooks is not None:
            flags = _HOOK_RECORD_STREAM | _HOOK_RESET | _HOOK_FRACTION
            if os.environ.get(SKIP_RECORD_STREAM_ENV) == "1":
                flags &= ~_HOOK_RECORD_STREAM
                _loud(f"{SKIP_RECORD_STREAM_ENV}=1 (a test switch): x.record_stream() is NOT honoured")
            err = ctypes.create_string_buffer(1024)
            if hooks.allocd_hooks_attach(flags, err, 1024) != 0:
                raise RuntimeError("allocd_torch: installing the record_stream/empty_cache/memory-fraction "
                                   f"hooks failed: {err.value.decode('utf-8', 'replace')}")
        patched = _patch(torch) if patch_torch else []
        _state = _State(lib, args, hooks, allocator, patched)


# torch.cuda names replaced by ours when patch_torch is True: under a pluggable allocator
# torch's own raise "CUDAPluggableAllocator does not yet support getDeviceStats".
PATCHED = ("memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "memory_reserved",
           "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "memory_summary")


def _patch(torch):
    import allocd_torch
    done = []
    for mod in (torch.cuda, torch.cuda.memory):
        for name in PATCHED:
            if hasattr(mod, name):
                setattr(mod, name, getattr(allocd_torch, name))
                done.append(f"{mod.__name__}.{name}")
    return done
