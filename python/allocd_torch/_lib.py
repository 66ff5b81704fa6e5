"""The ctypes layer over liballocd.so. It never imports torch.

liballocd.so is allocd built with ``go build -buildmode=c-shared``. Its C ABI:
``allocd_init``, ``allocd_last_error``, the PyTorch allocator entry points
(``allocd_torch_malloc``, ``allocd_torch_free``, ``allocd_torch_record_stream``,
``allocd_torch_empty_cache``, ``allocd_torch_set_memory_fraction``), the private pool
functions of CUDA graphs and torch.cuda.MemPool (``allocd_torch_*_pool``, which the C++
allocator calls) and the queries behind memory_stats, memory_summary and the snapshot.

The Go runtime does not survive fork(): a child process has only the thread that
forked, and a call into Go there can hang. Every method of Library therefore
refuses to run in a process other than the one that loaded the library.
"""

import collections
import ctypes
import json
import os
import threading

LIB_ENV = "ALLOCD_LIB"
LIB_NAME = "liballocd.so"
BUILD_HINT = "CGO_ENABLED=1 go build -buildmode=c-shared -o liballocd.so ./cmd/liballocd"


class LibraryError(RuntimeError):
    """liballocd.so could not be found or loaded, or one of its calls failed."""


def beside_path():
    """The path of liballocd.so beside this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIB_NAME)


def find_library(environ=None):
    """Return the path of liballocd.so: $ALLOCD_LIB when set, else the copy beside the package.

    Raises LibraryError naming both places when neither holds the file. A set but wrong
    ALLOCD_LIB is an error even when a copy lies beside the package: the caller asked
    for that file.
    """
    env = os.environ if environ is None else environ
    beside = beside_path()
    want = env.get(LIB_ENV, "")
    if want:
        if os.path.isfile(want):
            return want
        raise LibraryError(
            f"{LIB_ENV}={want!r} does not name a file. Point {LIB_ENV} at liballocd.so, "
            f"or unset it to use the copy beside the package ({beside}). "
            f"Build the library from the allocd repository root with: {BUILD_HINT}")
    if os.path.isfile(beside):
        return beside
    raise LibraryError(
        f"liballocd.so not found: {LIB_ENV} is not set and there is no {beside}. "
        f"Set {LIB_ENV} to the library's path, or copy it to {beside}. "
        f"Build it from the allocd repository root with: {BUILD_HINT}")


_c_size = ctypes.c_size_t
_c_ll = ctypes.c_longlong
_c_u64 = ctypes.c_uint64

# name: (restype, argtypes)
_PROTOTYPES = {
    "allocd_init": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]),
    "allocd_last_error": (_c_size, [ctypes.c_char_p, _c_size]),
    "allocd_torch_malloc": (ctypes.c_void_p, [_c_size, ctypes.c_int, ctypes.c_void_p]),
    "allocd_torch_free": (None, [ctypes.c_void_p, _c_size, ctypes.c_int, ctypes.c_void_p]),
    "allocd_torch_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "allocd_torch_empty_cache": (None, []),
    "allocd_torch_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "allocd_release_stream": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "allocd_memory_stats_json": (_c_size, [ctypes.c_int, ctypes.c_char_p, _c_size]),
    "allocd_memory_summary": (_c_size, [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, _c_size]),
    "allocd_memory_allocated": (_c_ll, [ctypes.c_int]),
    "allocd_memory_reserved": (_c_ll, [ctypes.c_int]),
    "allocd_max_memory_allocated": (_c_ll, [ctypes.c_int]),
    "allocd_max_memory_reserved": (_c_ll, [ctypes.c_int]),
    "allocd_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
    "allocd_record_history": (ctypes.c_int, [ctypes.c_int, _c_ll, ctypes.c_int]),
    "allocd_dump_snapshot": (ctypes.c_int, [ctypes.c_char_p]),
    "allocd_metrics_address": (_c_size, [ctypes.c_char_p, _c_size]),
    # Private pools (CUDA graphs, torch.cuda.MemPool): only the C++ allocator calls them, through
    # their addresses; listed so that a liballocd.so without them is refused at load.
    "allocd_torch_malloc_pool": (ctypes.c_void_p, [_c_size, ctypes.c_int, ctypes.c_void_p, _c_u64, _c_u64]),
    "allocd_torch_create_pool": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_release_pool": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_begin_pool": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_end_pool": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_empty_pool_cache": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_pool_use_count": (ctypes.c_int, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_checkpoint_pool": (ctypes.c_void_p, [ctypes.c_int, _c_u64, _c_u64]),
    "allocd_torch_checkpoint_free": (None, [ctypes.c_void_p]),
    "allocd_torch_restore_pool": (_c_ll, [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(_c_ll))]),
}


def _opt_bytes(s):
    return None if s is None else os.fsencode(s)


class Library:
    """liballocd.so loaded into this process, with typed wrappers of its C functions.

    Device arguments are CUDA device indices (int). Errors of the library raise
    LibraryError carrying allocd's message.
    """

    def __init__(self, path):
        self.path = path
        try:
            self._dll = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryError(f"cannot load {path}: {e}") from e
        missing = []
        for name, (res, args) in _PROTOTYPES.items():
            try:
                fn = getattr(self._dll, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.restype, fn.argtypes = res, args
        if missing:
            raise LibraryError(f"{path} lacks the functions {', '.join(missing)}: it is not a "
                               f"liballocd.so of this allocd_torch version. Rebuild it with: {BUILD_HINT}")
        self.pid = os.getpid()
        self._init_args = None
        self._init_lock = threading.Lock()

    # --- plumbing -----------------------------------------------------------------------

    def _fn(self, name):
        if os.getpid() != self.pid:
            raise LibraryError(
                f"allocd cannot be used in a forked child process (pid {os.getpid()}; liballocd.so "
                f"was loaded in pid {self.pid}): the Go runtime does not survive fork. Use CUDA "
                f"only in the parent, or start workers with the 'spawn' method.")
        return getattr(self._dll, name)

    def address(self, name):
        """The address of the exported C function name, as an int."""
        return ctypes.cast(self._fn(name), ctypes.c_void_p).value

    def _string(self, name, *args):
        """Call a function of the (args..., char* buf, size_t n) -> full length kind."""
        fn = self._fn(name)
        n = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(n)
            full = fn(*args, buf, n)
            if full < n:
                return buf.value.decode("utf-8", "replace")
            n = full + 1

    def last_error(self):
        """The most recent error message of liballocd (of the calling thread where it tracks that)."""
        return self._string("allocd_last_error")

    def _check(self, rc, what):
        if rc != 0:
            raise LibraryError(f"{what}: {self.last_error() or 'failed (no message)'}")

    # --- lifecycle ----------------------------------------------------------------------

    def init(self, conf=None, metrics_listen=None, log_level=None):
        """allocd_init: None for an argument means its environment variable
        (ALLOCD_CONF, ALLOCD_METRICS_LISTEN, ALLOCD_LOG_LEVEL). Idempotent for the same
        arguments; other arguments after the first call raise LibraryError.
        """
        args = (conf, metrics_listen, log_level)
        with self._init_lock:
            if self._init_args is not None:
                if self._init_args == args:
                    return
                raise LibraryError(f"allocd is already initialised with conf={self._init_args[0]!r}, "
                                   f"metrics_listen={self._init_args[1]!r}; it cannot be initialised "
                                   f"again with conf={conf!r}, metrics_listen={metrics_listen!r}")
            rc = self._fn("allocd_init")(_opt_bytes(conf), _opt_bytes(metrics_listen), _opt_bytes(log_level))
            self._check(rc, f"allocd_init(conf={conf!r}, metrics_listen={metrics_listen!r})")
            self._init_args = args

    # --- the pluggable hooks, for tests and the no-hooks fallback -------------------------

    def malloc(self, size, device, stream=None):
        """allocd_torch_malloc; returns the pointer as an int, 0 on failure."""
        return self._fn("allocd_torch_malloc")(size, device, stream) or 0

    def free(self, ptr, size, device, stream=None):
        self._fn("allocd_torch_free")(ptr, size, device, stream)

    def record_stream(self, ptr, stream):
        self._fn("allocd_torch_record_stream")(ptr, stream)

    def empty_cache(self):
        self._fn("allocd_torch_empty_cache")()

    def set_memory_fraction(self, fraction, device):
        self._fn("allocd_torch_set_memory_fraction")(float(fraction), device)

    def release_stream(self, device, stream):
        """allocd_release_stream: stream (a cudaStream_t as an int) of device is destroyed;
        its cached segments go back to the device."""
        self._check(self._fn("allocd_release_stream")(device, stream), f"allocd_release_stream({device}, {stream!r})")

    # --- queries ------------------------------------------------------------------------

    def memory_stats(self, device):
        """torch.cuda.memory_stats()'s flat keys as an OrderedDict of int, sorted by key as torch sorts them."""
        text = self._string("allocd_memory_stats_json", device)
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise LibraryError(f"allocd_memory_stats_json({device}) gave no JSON object: {text[:200]!r}") from e
        if not isinstance(raw, dict):
            raise LibraryError(f"allocd_memory_stats_json({device}) gave {type(raw).__name__}, not an object")
        return collections.OrderedDict(sorted((k, int(v)) for k, v in raw.items()))

    def memory_summary(self, device, abbreviated=False):
        return self._string("allocd_memory_summary", device, 1 if abbreviated else 0)

    def memory_allocated(self, device):
        return int(self._fn("allocd_memory_allocated")(device))

    def memory_reserved(self, device):
        return int(self._fn("allocd_memory_reserved")(device))

    def max_memory_allocated(self, device):
        return int(self._fn("allocd_max_memory_allocated")(device))

    def max_memory_reserved(self, device):
        return int(self._fn("allocd_max_memory_reserved")(device))

    def reset_peak_stats(self, device):
        self._check(self._fn("allocd_reset_peak_stats")(device), f"allocd_reset_peak_stats({device})")

    def record_history(self, enabled, max_entries, stack_depth):
        rc = self._fn("allocd_record_history")(1 if enabled else 0, int(max_entries), int(stack_depth))
        self._check(rc, f"allocd_record_history(enabled={enabled}, max_entries={max_entries}, "
                        f"stack_depth={stack_depth})")

    def dump_snapshot(self, path):
        self._check(self._fn("allocd_dump_snapshot")(os.fsencode(path)), f"allocd_dump_snapshot({path!r})")

    def metrics_address(self):
        return self._string("allocd_metrics_address")


_loaded = None
_load_lock = threading.Lock()


def load(environ=None):
    """The process's Library, loaded on first call from find_library()."""
    global _loaded
    with _load_lock:
        if _loaded is None:
            _loaded = Library(find_library(environ))
        return _loaded


def loaded():
    """The process's Library if load() ran, else None."""
    return _loaded
