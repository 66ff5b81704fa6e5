#!/usr/bin/env python3
"""PyTorch's side of `allocd bench --copies`: host<->device copy bandwidth from
pageable and pinned memory, and the cost of a cached pinned allocation, measured
the way bench/copies.go measures allocd's, on the same sizes. Prints one JSON
object (keys as in bench.CopyReport, plus torch-only ones).

    python3 scripts/pinned_anchor.py [--trials 3] [--bytes 1073741824] [--sizes 4096,1048576]

- pageable_h2d/d2h: dst.copy_(src) with a pageable CPU tensor (torch.empty(n,
  dtype=torch.uint8)), synchronised once per run, as allocd times cudaMemcpy
  from Go memory.
- pinned_h2d: dst.copy_(src, non_blocking=True) from torch.empty(n,
  dtype=torch.uint8, pin_memory=True) into a preallocated device tensor, one
  stream, synchronised once per run: the same work as pinned.CopyToDevice.
- pinned_h2d_to: src.to("cuda", non_blocking=True), which also allocates the
  device tensor (from PyTorch's caching allocator, so cached after the first).
- pinned_d2h: pinned_dst.copy_(src_dev, non_blocking=True).
- alloc: cached_pin_memory_ns is torch.empty(n, dtype=torch.uint8,
  pin_memory=True) and its release, served by CachingHostAllocator's cache
  (Python's per-call overhead included, as it is what a caller pays);
  uncached_pin_memory_ns forces cudaHostAlloc+cudaFreeHost by emptying the
  host cache after each release (torch._accelerator_emptyHostCache or
  torch._C._host_emptyCache; null when this torch has neither).
"""
import argparse
import json
import sys
import time

import torch

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
ALLOC_SIZES = [4 << 10, 1 << 20, 64 << 20]


def host_empty_cache():
    """Release PyTorch's cached pinned blocks; False when this torch has no way to."""
    for f in (getattr(torch, "_accelerator_emptyHostCache", None), getattr(torch._C, "_host_emptyCache", None)):
        if f is not None:
            f()
            return True
    return False


def best_gbps(n, reps, trials, run, stream):
    run()  # warm-up
    torch.cuda.synchronize()
    best = None
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        stream.synchronize()
        el = time.perf_counter() - t0
        best = el if best is None or el < best else best
    return n * reps / best / 1e9


def copy_row(n, args, stream):
    reps = int(min(max(args.bytes // n, 3), 2000))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    page = torch.ones(n, dtype=torch.uint8)  # pages touched before timing
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pin.copy_(page)
    row = {"bytes": n}
    with torch.cuda.stream(stream):
        row["pageable_h2d_gbps"] = best_gbps(n, reps, args.trials, lambda: dev.copy_(page), stream)
        row["pageable_d2h_gbps"] = best_gbps(n, reps, args.trials, lambda: page.copy_(dev), stream)
        row["pinned_h2d_gbps"] = best_gbps(n, reps, args.trials, lambda: dev.copy_(pin, non_blocking=True), stream)
        row["pinned_d2h_gbps"] = best_gbps(n, reps, args.trials, lambda: pin.copy_(dev, non_blocking=True), stream)
        row["pinned_h2d_to_gbps"] = best_gbps(n, reps, args.trials, lambda: pin.to("cuda", non_blocking=True), stream)
    del dev, page, pin
    torch.cuda.synchronize()
    host_empty_cache()
    return row


def alloc_row(n, args):
    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # warm the cache
    del t
    t0 = time.perf_counter()
    for _ in range(args.cached_iters):
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        del t
    cached = (time.perf_counter() - t0) / args.cached_iters * 1e9
    row = {"bytes": n, "cached_pin_memory_ns": cached, "uncached_pin_memory_ns": None, "uncached_pairs": 0, "speedup": None}
    if not host_empty_cache():
        return row  # this torch cannot release its host cache: no uncached figure
    pairs = 0
    t0 = time.perf_counter()
    while pairs < 5 or time.perf_counter() - t0 < args.host_alloc_seconds:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        del t
        host_empty_cache()
        pairs += 1
    uncached = (time.perf_counter() - t0) / pairs * 1e9
    row.update(uncached_pin_memory_ns=uncached, uncached_pairs=pairs, speedup=uncached / cached if cached else None)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--bytes", type=int, default=1 << 30, help="bytes one timed run moves at least (3..2000 copies)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--alloc-sizes", default=",".join(map(str, ALLOC_SIZES)))
    p.add_argument("--cached-iters", type=int, default=100_000)
    p.add_argument("--host-alloc-seconds", type=float, default=1.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    torch.cuda.init()
    stream = torch.cuda.Stream()
    rep = {
        "device": torch.cuda.get_device_name(0),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "copies": [copy_row(int(n), args, stream) for n in args.sizes.split(",") if n],
        "alloc": [alloc_row(int(n), args) for n in args.alloc_sizes.split(",") if n],
    }
    try:
        rep["host_memory_stats"] = dict(torch.cuda.host_memory_stats())
    except (AttributeError, RuntimeError) as e:  # older torch
        rep["host_memory_stats"] = {"error": str(e)}
    json.dump(rep, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
