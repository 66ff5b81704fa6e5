"""allocd as PyTorch's CUDA allocator.

Switch it on before any CUDA use in the process::

    import allocd_torch
    allocd_torch.enable()

Then torch's allocations go through allocd (liballocd.so, a caching allocator in the
style of PyTorch's own), installed as torch's own CUDA allocator: a C++ class derived from
c10's CUDAAllocator, compiled once per torch version. torch's own APIs answer from allocd,
unpatched: torch.cuda.memory_stats() and its relatives, memory_summary(),
reset_peak_memory_stats() and reset_accumulated_memory_stats(), torch.cuda.memory._snapshot()
and _dump_snapshot(), _record_memory_history() (with Python frames), empty_cache(),
set_per_process_memory_fraction(), x.record_stream(s) and caching_allocator_alloc(). An
out-of-memory raises torch.OutOfMemoryError with allocd's message.

The functions below are allocd's own views, with allocd's extra statistics.

Importing this package does not import torch; enable() does.
"""

from ._lib import LibraryError, find_library
from ._build import BuildError

__all__ = [
    "enable", "is_enabled", "memory_stats", "memory_stats_as_nested_dict", "memory_summary",
    "memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
    "reset_peak_memory_stats", "empty_cache", "release_stream", "record_memory_history", "dump_snapshot",
    "metrics_address", "hooks_installed", "LibraryError", "BuildError", "find_library",
]


def enable(conf=None, metrics_listen=None, *, patch_torch=None):
    """Make allocd torch's CUDA allocator. Must run before CUDA is initialised in the process.

    conf: allocd's configuration, written like PYTORCH_CUDA_ALLOC_CONF
    ("expandable_segments:True,garbage_collection_threshold:0.8"); None reads ALLOCD_CONF.
    metrics_listen: "host:port" to serve /metrics and the debug pages from inside the
    process ("127.0.0.1:0" picks a free port, see metrics_address()); None reads
    ALLOCD_METRICS_LISTEN; "" serves nothing.
    patch_torch: ignored (torch's functions are no longer replaced: they answer from allocd
    through torch's own code); kept so that existing calls keep working.

    A second call with the same arguments does nothing; with others it raises.
    Raises RuntimeError when CUDA (or torch's allocator) is already initialised,
    LibraryError when liballocd.so is missing or fails, BuildError when the C++ allocator
    cannot be compiled (see ALLOCD_TORCH_ALLOW_NO_HOOKS in the docs).
    """
    from . import _torch
    _torch.enable(conf, metrics_listen)


def is_enabled():
    """Whether enable() succeeded in this process."""
    from . import _torch
    return _torch.state() is not None


def hooks_installed():
    """Whether allocd's C++ allocator is torch's allocator (False only under the
    ALLOCD_TORCH_ALLOW_NO_HOOKS=1 fallback, behind torch's CUDAPluggableAllocator)."""
    from . import _torch
    st = _torch.state()
    return bool(st and st.hooks is not None)


def _library():
    from . import _torch
    return _torch.require().lib


def _device(device):
    from . import _torch
    return _torch.device_index(device)


def memory_stats(device=None):
    """allocd's statistics under torch.cuda.memory_stats()'s flat keys, as an OrderedDict of int
    sorted by key (as torch sorts them), plus "num_bad_frees". device=None: the current device."""
    return _library().memory_stats(_device(device))


def memory_stats_as_nested_dict(device=None):
    """memory_stats() nested at its dots, like torch.cuda.memory_stats_as_nested_dict()."""
    nested = {}
    for key, value in memory_stats(device).items():
        node = nested
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return nested


def memory_summary(device=None, abbreviated=False):
    """allocd's table of memory statistics, in the layout of torch.cuda.memory_summary()."""
    return _library().memory_summary(_device(device), abbreviated)


def memory_allocated(device=None):
    """Bytes of live allocations (rounded sizes) on the device."""
    return _library().memory_allocated(_device(device))


def memory_reserved(device=None):
    """Bytes of segments allocd holds from the device."""
    return _library().memory_reserved(_device(device))


def max_memory_allocated(device=None):
    """Peak of memory_allocated() since the start or the last reset_peak_memory_stats()."""
    return _library().max_memory_allocated(_device(device))


def max_memory_reserved(device=None):
    """Peak of memory_reserved() since the start or the last reset_peak_memory_stats()."""
    return _library().max_memory_reserved(_device(device))


def reset_peak_memory_stats(device=None):
    """Set every peak of the device to its current value."""
    _library().reset_peak_stats(_device(device))


def empty_cache():
    """Release the cached, unused segments of every device to the driver
    (what torch.cuda.empty_cache() does through the installed hook)."""
    _library().empty_cache()


def release_stream(stream, device=None):
    """Tell allocd that stream is destroyed (or will not be used again): its cached segments
    go back to the driver at once, or once nothing allocated on it is live. torch gives a
    pluggable allocator no hook for a destroyed stream, so a program that creates and drops
    streams calls this after dropping one. stream: a torch.cuda.Stream, or its cuda_stream
    handle as an int. device=None: the current device."""
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"release_stream: expected a torch.cuda.Stream or an int handle, got {stream!r}")
    _library().release_stream(_device(device), handle)


def record_memory_history(enabled=True, max_entries=100_000, stacks=0):
    """Switch allocd's own allocation history (for dump_snapshot) on or off, on every device.

    For Python frames use torch's own torch.cuda.memory._record_memory_history(stacks="python")
    and torch.cuda.memory._snapshot() / _dump_snapshot(): they work under allocd.

    enabled: True/False, or torch's spellings "all"/"state" (on) and None (off).
    max_entries: the length of the trace ring per device.
    stacks: the number of Go stack frames kept per event (0: none). A string (torch's
    "python"/"all") is accepted for compatibility and records no stacks here.
    """
    import warnings
    on = enabled not in (None, False, 0)
    if isinstance(stacks, str):
        warnings.warn("allocd_torch.record_memory_history records no Python stacks; use torch's "
                      f"torch.cuda.memory._record_memory_history(stacks={stacks!r}), which does under allocd",
                      stacklevel=2)
        stacks = 0
    _library().record_history(on, max_entries, stacks)


def dump_snapshot(path):
    """Write a PyTorch memory snapshot pickle of every device to path: viewable in PyTorch's
    memory_viz (https://pytorch.org/memory_viz) and readable by torch.cuda._memory_viz."""
    _library().dump_snapshot(path)


def metrics_address():
    """The address the /metrics server is bound to ("127.0.0.1:9612"), "" when there is none."""
    return _library().metrics_address()
