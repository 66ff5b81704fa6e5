#!/usr/bin/env python3
"""Step-time comparison over several interleaved runs of torch_workloads.py.

    python3 scripts/compare_speed.py RESULT.json... [--bench native_bench.json allocd_bench.json] [--md out.md]

Each RESULT.json is one torch_workloads.py process; its "allocator" field says which side
it is. One process's median step time moves by more than 2% from one process to the next
on a shared GPU machine, so a single pair of runs cannot decide a 2% criterion. This script
takes several runs of each side, run alternately, and reports per workload:

- every run's median step time, per side;
- the median over all timed steps of all runs of a side (pooled), and their ratio;
- the spread of native's own run medians (max/min), the noise the ratio must be read against;
- the ratio of run medians within each pair (the k-th allocd run over the k-th native run, the
  two run back to back) and the median of those ratios: a drift over the session cancels
  within a pair;
- with --bench (torch_alloc_bench.py results): the allocations a step times the difference
  in cost of one cached malloc+free (4 KiB) between the two allocators, as a share of
  native's step time: what the allocator itself adds, measured without the GPU's noise.
"""

import argparse
import json
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--bench", nargs=2, metavar=("NATIVE", "ALLOCD"))
    ap.add_argument("--md")
    args = ap.parse_args()
    runs = {"native": [], "allocd": []}
    for p in args.results:
        with open(p) as f:
            r = json.load(f)
        runs[r["allocator"]].append(r)
    if not runs["native"] or not runs["allocd"]:
        raise SystemExit("need at least one native and one allocd result")
    delta_ns = None
    if args.bench:
        with open(args.bench[0]) as f:
            bn = json.load(f)["ns_per_pair"]
        with open(args.bench[1]) as f:
            ba = json.load(f)["ns_per_pair"]
        delta_ns = ba["4096"] - bn["4096"]
    names = [w for w in runs["allocd"][0]["workloads"] if all(w in r["workloads"] for r in runs["native"] + runs["allocd"])]
    lines = ["| workload | runs native / allocd | run medians ms, native | run medians ms, allocd | "
             "native spread (max/min) | pooled median ms, native | pooled median ms, allocd | allocd / native | "
             "paired ratios | median paired ratio | allocations a step | allocator cost difference, share of step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in names:
        med = {s: [r["workloads"][w]["median_ms"] for r in runs[s]] for s in runs}
        pooled = {s: statistics.median([x for r in runs[s] for x in r["workloads"][w]["step_ms"]]) for s in runs}
        ratio = pooled["allocd"] / pooled["native"]
        spread = max(med["native"]) / min(med["native"])
        paired = [a / n for n, a in zip(med["native"], med["allocd"])]
        aps = runs["allocd"][0]["workloads"][w].get("allocs_per_step")
        share = "-"
        if delta_ns is not None and aps:
            share = f"{aps * delta_ns / (pooled['native'] * 1e6) * 100:+.2f}% ({delta_ns:+.0f} ns × {aps:.0f})"
        lines.append(f"| {w} | {len(med['native'])} / {len(med['allocd'])} | "
                     f"{', '.join(f'{x:.2f}' for x in med['native'])} | {', '.join(f'{x:.2f}' for x in med['allocd'])} | "
                     f"{spread:.3f} | {pooled['native']:.2f} | {pooled['allocd']:.2f} | {ratio:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in paired)} | {statistics.median(paired):.3f} | "
                     f"{'-' if aps is None else f'{aps:.0f}'} | {share} |")
    md = "\n".join(lines) + "\n"
    launch = [w for w in names if all("median_launch_ms" in r["workloads"][w] for r in runs["native"] + runs["allocd"])]
    if launch:
        md += ("\nLaunch time (step start until the Python code returns, before the synchronize), "
               "run medians ms:\n\n| workload | native | allocd |\n|---|---|---|\n")
        for w in launch:
            cols = [", ".join("%.2f" % r["workloads"][w]["median_launch_ms"] for r in runs[side]) for side in ("native", "allocd")]
            md += f"| {w} | {cols[0]} | {cols[1]} |\n"
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
