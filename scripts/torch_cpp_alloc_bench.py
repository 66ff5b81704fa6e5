#!/usr/bin/env python3
"""What one allocation through torch's current CUDA allocator costs in C++, without Python in the loop.

    python3 scripts/torch_cpp_alloc_bench.py --allocator native|allocd --out result.json [--iters 100000] [--rounds 7]

Chooses the allocator before any CUDA use (under allocd: allocd_torch.enable(), as
torch_alloc_bench.py does), initialises CUDA with torch.empty(1, device="cuda"), then
calls scripts/torch_cpp_alloc_bench.cpp, compiled once with g++ against the installed torch
and loaded with ctypes. It times c10::cuda::CUDACachingAllocator::get()->allocate(n) with
the DataPtr dropped at once (one malloc + one free, a cache hit after warm-up) for each size,
and a window of 64 live blocks of mixed sizes where each iteration frees one and allocates
another. torch_alloc_bench.py measures the same through torch.empty, where Python and the
dispatcher add far more than the allocator; here the allocator (plug-in glue included) is
nearly all that is timed.

For each size and the window: the median and the min over --rounds rounds of --iters
iterations, in ns per iteration, printed and written to --out:

    {"allocator", "allocator_name", "torch", "device", "iters", "rounds",
     "ns_per_alloc": {"512": median, ...}, "ns_per_alloc_min": {...},
     "window64_ns": median, "window64_ns_min": min}

The compiled library is cached in $TORCH_CPP_ALLOC_BENCH_CACHE, else $ALLOCD_TORCH_CACHE,
else ~/.cache/allocd_torch, in a folder named by torch's version and a hash of the source and
the compiler command line. $CXX picks the compiler (default g++).
"""

import argparse
import ctypes
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_cpp_alloc_bench.cpp")
SIZES = [512, 4096, 65536, 1 << 20, 8 << 20, 64 << 20]
ITERS = 100_000
ROUNDS = 7
WINDOW_SEED = 12345


def log(msg):
    print(msg, flush=True)


def build_inputs(torch):
    """Include dirs, library dirs, libraries and defines for compiling against this torch."""
    tdir = os.path.dirname(torch.__file__)
    includes = None
    try:
        from torch.utils import cpp_extension  # imports setuptools, which may be absent
        # device_type= is torch >= 2.6's spelling; it fails without CUDA_HOME, and then the
        # torch headers alone do, with the CUDA ones searched below.
        includes = list(cpp_extension.include_paths(device_type="cuda"))
    except Exception:
        pass
    if not includes:
        base = os.path.join(tdir, "include")
        includes = [base, os.path.join(base, "torch", "csrc", "api", "include")]
    if not any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in includes):
        cands = [os.path.join(os.environ["CUDA_HOME"], "include")] if os.environ.get("CUDA_HOME") else []
        cands.append("/usr/local/cuda/include")
        for p in sys.path:  # the pip CUDA runtime beside torch
            for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
                cands.append(os.path.join(p, sub))
        found = next((d for d in cands if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))), None)
        if found is None:
            raise SystemExit("no CUDA runtime headers (cuda_runtime_api.h) in torch's include paths, "
                             "$CUDA_HOME/include, /usr/local/cuda/include or site-packages/nvidia/*/include: "
                             "set CUDA_HOME")
        includes.append(found)
    libdir = os.path.join(tdir, "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return includes, [libdir], ["c10_cuda", "c10"], [f"_GLIBCXX_USE_CXX11_ABI={abi}"]


def compile_command(cxx, source, output, includes, libdirs, libs, defines):
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17"]
    cmd += [f"-D{d}" for d in defines] + [f"-I{d}" for d in includes]
    cmd += [source, "-o", output]
    cmd += [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs] + [f"-l{x}" for x in libs]
    return cmd


def cache_root():
    for var in ("TORCH_CPP_ALLOC_BENCH_CACHE", "ALLOCD_TORCH_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    return os.path.join(os.path.expanduser("~"), ".cache", "allocd_torch")


def build(torch):
    """The path of the compiled bench library, compiling it unless the cache holds it."""
    cxx = os.environ.get("CXX") or "g++"
    includes, libdirs, libs, defines = build_inputs(torch)
    with open(SOURCE, "rb") as f:
        src = f.read()
    probe = compile_command(cxx, "SOURCE", "OUTPUT", includes, libdirs, libs, defines)
    h = hashlib.sha256(src + b"\0" + "\0".join(probe).encode()).hexdigest()[:16]
    tag = "".join(c if c.isalnum() or c in ".+_-" else "_" for c in torch.__version__)
    folder = os.path.join(cache_root(), f"cpp_alloc_bench-{tag}-{h}")
    out = os.path.join(folder, "torch_cpp_alloc_bench.so")
    if os.path.isfile(out):
        return out
    if shutil.which(cxx) is None:
        raise SystemExit(f"the C++ compiler {cxx!r} is not on PATH (set CXX)")
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".torch_cpp_alloc_bench.", suffix=".tmp", dir=folder)
    os.close(fd)
    cmd = compile_command(cxx, SOURCE, tmp, includes, libdirs, libs, defines)
    t = time.time()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        if r.returncode != 0:
            tail = "\n".join(r.stdout.decode("utf-8", "replace").strip().splitlines()[-30:])
            raise SystemExit(f"compiling {SOURCE} failed (exit {r.returncode})\ncommand: "
                             f"{' '.join(shlex.quote(c) for c in cmd)}\n{tail}")
        os.replace(tmp, out)  # atomic: a process starting at the same time never loads half a file
        tmp = None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    log(f"compiled {os.path.basename(SOURCE)} in {time.time() - t:.1f} s -> {out}")
    return out


def load(path):
    lib = ctypes.CDLL(path)
    lib.bench_size.restype = ctypes.c_double
    lib.bench_size.argtypes = [ctypes.c_size_t, ctypes.c_long]
    lib.bench_window.restype = ctypes.c_double
    lib.bench_window.argtypes = [ctypes.c_long, ctypes.c_uint]
    for fn in (lib.bench_allocator_name, lib.bench_last_error):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib


def text(lib, fn):
    buf = ctypes.create_string_buffer(4096)
    fn(buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def checked(lib, ns, what):
    if ns < 0:
        raise SystemExit(f"{what} failed: {text(lib, lib.bench_last_error)}")
    return ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "allocd"], required=True)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--iters", type=int, default=ITERS, help=f"iterations a round (default {ITERS})")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per figure (default {ROUNDS})")
    args = ap.parse_args()
    if args.iters < 1 or args.rounds < 1:
        raise SystemExit("--iters and --rounds must be at least 1")
    if args.allocator == "allocd":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import allocd_torch
        allocd_torch.enable()
    import torch
    torch.empty(1, device="cuda")
    lib = load(build(torch))
    name = text(lib, lib.bench_allocator_name)
    log(f"{args.allocator}: torch {torch.__version__}, current CUDA allocator {name!r}, "
        f"{args.rounds} rounds of {args.iters} iterations per figure")
    if args.allocator == "allocd" and name == "native":
        raise SystemExit("allocd_torch.enable() ran but torch's current CUDA allocator is still 'native'")
    res = {"allocator": args.allocator, "allocator_name": name, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0), "iters": args.iters, "rounds": args.rounds,
           "ns_per_alloc": {}, "ns_per_alloc_min": {}}

    def write():  # after every figure, so a killed process keeps what finished
        with open(args.out, "w") as f:
            json.dump(res, f)

    for n in SIZES:
        rounds = [checked(lib, lib.bench_size(n, args.iters), f"bench_size({n})") for _ in range(args.rounds)]
        res["ns_per_alloc"][str(n)] = statistics.median(rounds)
        res["ns_per_alloc_min"][str(n)] = min(rounds)
        log(f"{args.allocator} size={n}: {statistics.median(rounds):.1f} ns per allocate+free "
            f"(median of {args.rounds} rounds of {args.iters}; min {min(rounds):.1f})")
        write()
    rounds = [checked(lib, lib.bench_window(args.iters, WINDOW_SEED), "bench_window") for _ in range(args.rounds)]
    res["window64_ns"] = statistics.median(rounds)
    res["window64_ns_min"] = min(rounds)
    log(f"{args.allocator} window64: {statistics.median(rounds):.1f} ns per free+allocate among 64 live blocks "
        f"(median of {args.rounds} rounds of {args.iters}; min {min(rounds):.1f})")
    write()


if __name__ == "__main__":
    main()
