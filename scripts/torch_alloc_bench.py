#!/usr/bin/env python3
"""What one cached allocation costs a PyTorch program, under PyTorch's allocator or allocd.

    python3 scripts/torch_alloc_bench.py --allocator native|allocd [--out result.json]

Times `t = torch.empty(n, dtype=torch.uint8, device="cuda"); del t` in a Python loop, for
each size, after a warm-up that fills the cache: every timed allocation is a cache hit. The
Python and torch dispatch around the allocator cost the same under both allocators, so the
difference between the two figures is the difference in allocator cost per malloc+free,
plug-in glue included (under allocd: torch's CUDAPluggableAllocator, allocd_torch's C++
hook and the call into Go). Multiplied by a workload's allocations a step, it bounds what
the allocator can add to that workload's step time.
"""

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [512, 4096, 1 << 20, 8 << 20, 64 << 20]
ITERS = 100_000
ROUNDS = 5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "allocd"], required=True)
    ap.add_argument("--out", help="result JSON path")
    ap.add_argument("--iters", type=int, default=ITERS)
    args = ap.parse_args()
    if args.allocator == "allocd":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import allocd_torch
        allocd_torch.enable()
    import torch
    torch.empty(1, device="cuda")
    res = {"allocator": args.allocator, "torch": torch.__version__, "iters": args.iters, "ns_per_pair": {}}
    for n in SIZES:
        for _ in range(1000):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            del t
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter_ns()
            for _ in range(args.iters):
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
                del t
            rounds.append((time.perf_counter_ns() - t0) / args.iters)
        res["ns_per_pair"][str(n)] = statistics.median(rounds)
        print(f"{args.allocator} size={n}: {statistics.median(rounds):.0f} ns per torch.empty+del "
              f"(median of {ROUNDS} rounds of {args.iters}; min {min(rounds):.0f})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
