#!/usr/bin/env python3
"""Step-time comparison over several interleaved runs of torch_workloads.py.

    python3 scripts/compare_speed.py [RESULT.json...] [--bench native_bench.json allocd_bench.json]
                                     [--cpp CPP.json...] [--md out.md]

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
- the same for the launching thread's CPU time a step (cpu_ms) and the whole process's
  (proc_cpu_ms; the goal on both is a pooled ratio allocd / native of at most 1.01), and for
  the launch's CPU time (launch_cpu_ms); the runs' synchronize mode (torch_workloads.py
  --sync) is stated, since a spinning synchronize makes CPU time track waiting;
- with --bench (torch_alloc_bench.py results): the allocations a step times the difference
  in cost of one cached malloc+free (4 KiB) between the two allocators, as a share of
  native's step time: what the allocator itself adds, measured without the GPU's noise;
- with --cpp (torch_cpp_alloc_bench.py results, any number of processes of each side): per
  size and for the 64-block window, the median over processes of each process's median ns,
  and their ratio allocd / native; then per workload the window's difference times the
  allocations a step, as a share of native's pooled CPU and wall step time.

With --cpp alone (no RESULT.json) only the C++ table is written.
"""

import argparse
import json
import statistics
import sys

CPU_GOAL = 1.01


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def figures(runs, w, steps_key, median_key):
    """Per-run medians, pooled medians, ratio, native spread and paired ratios of one per-step series."""
    med = {s: [r["workloads"][w][median_key] for r in runs[s]] for s in runs}
    pooled = {s: statistics.median([x for r in runs[s] for x in r["workloads"][w][steps_key]]) for s in runs}
    paired = [a / n for n, a in zip(med["native"], med["allocd"])]
    return {"med": med, "pooled": pooled, "ratio": pooled["allocd"] / pooled["native"],
            "spread": max(med["native"]) / min(med["native"]), "paired": paired}


def has(runs, w, *keys):
    return all(k in r["workloads"][w] for r in runs["native"] + runs["allocd"] for k in keys)


def series_table(runs, names, steps_key, median_key, title, goal=None):
    names = [w for w in names if has(runs, w, steps_key, median_key)]
    if not names:
        return ""
    goal_col = f" | ≤ {goal}?" if goal else ""
    md = (f"\n{title}\n\n| workload | runs native / allocd | run medians ms, native | run medians ms, allocd | "
          f"native spread (max/min) | pooled median ms, native | pooled median ms, allocd | allocd / native"
          f"{goal_col} | paired ratios | median paired ratio |\n"
          "|---|---|---|---|---|---|---|---|" + ("---|" if goal else "") + "---|---|\n")
    for w in names:
        f = figures(runs, w, steps_key, median_key)
        ok = (" | " + ("yes" if f["ratio"] <= goal else "NO")) if goal else ""
        md += (f"| {w} | {len(f['med']['native'])} / {len(f['med']['allocd'])} | "
               f"{', '.join(f'{x:.2f}' for x in f['med']['native'])} | "
               f"{', '.join(f'{x:.2f}' for x in f['med']['allocd'])} | {f['spread']:.3f} | "
               f"{f['pooled']['native']:.2f} | {f['pooled']['allocd']:.2f} | {f['ratio']:.3f}{ok} | "
               f"{', '.join(f'{x:.3f}' for x in f['paired'])} | {statistics.median(f['paired']):.3f} |\n")
    return md


def load_cpp(paths):
    """{"native": [result...], "allocd": [...]} from torch_cpp_alloc_bench.py JSON files."""
    cpp = {"native": [], "allocd": []}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        cpp[r["allocator"]].append(r)
    return cpp


def cpp_median(results, size):
    """The median over processes of each process's median ns for size (a str) or "window64"."""
    if size == "window64":
        xs = [r["window64_ns"] for r in results if "window64_ns" in r]
    else:
        xs = [r["ns_per_alloc"][size] for r in results if size in r.get("ns_per_alloc", {})]
    return (statistics.median(xs) if xs else None), xs


def cpp_table(cpp):
    sizes = sorted({k for s in cpp.values() for r in s for k in r.get("ns_per_alloc", {})}, key=int)
    torch = sorted({r.get("torch", "?") for s in cpp.values() for r in s})
    names = sorted({f"{r['allocator']}: {r.get('allocator_name', '?')}" for s in cpp.values() for r in s})
    md = (f"\nC++ allocator cost (torch_cpp_alloc_bench.py: c10 CUDAAllocator::allocate + free, no Python; torch "
          f"{', '.join(torch)}; allocators {', '.join(names)}), ns an iteration; per side the median over "
          f"processes of each process's median:\n\n"
          "| figure | processes native / allocd | process medians, native | process medians, allocd | "
          "native | allocd | allocd − native | allocd / native |\n|---|---|---|---|---|---|---|---|\n")
    for size in sizes + ["window64"]:
        mn, xn = cpp_median(cpp["native"], size)
        ma, xa = cpp_median(cpp["allocd"], size)
        label = "64-block window (free + malloc)" if size == "window64" else f"{int(size)} B"
        diff = ma - mn if mn is not None and ma is not None else None
        ratio = ma / mn if mn and ma is not None else None
        md += (f"| {label} | {len(xn)} / {len(xa)} | {', '.join(f'{x:.1f}' for x in xn) or '-'} | "
               f"{', '.join(f'{x:.1f}' for x in xa) or '-'} | {fmt(mn, '.1f')} | {fmt(ma, '.1f')} | "
               f"{fmt(diff, '+.1f')} | {fmt(ratio, '.3f')} |\n")
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*")
    ap.add_argument("--bench", nargs=2, metavar=("NATIVE", "ALLOCD"))
    ap.add_argument("--cpp", nargs="+", metavar="FILE", default=[],
                    help="torch_cpp_alloc_bench.py result JSON files, native and allocd")
    ap.add_argument("--md")
    args = ap.parse_args()
    runs = {"native": [], "allocd": []}
    for p in args.results:
        with open(p) as f:
            r = json.load(f)
        runs[r["allocator"]].append(r)
    cpp = load_cpp(args.cpp) if args.cpp else None
    if args.results and (not runs["native"] or not runs["allocd"]):
        raise SystemExit("need at least one native and one allocd result")
    if not args.results and cpp is None:
        raise SystemExit("give RESULT.json files (native and allocd), --cpp files, or both")
    md = ""
    if args.results:
        md += workload_tables(args, runs, cpp)
    if cpp is not None:
        md += cpp_table(cpp)
        if args.results:
            md += cpp_share(runs, cpp)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


def workload_tables(args, runs, cpp):
    delta_ns = None
    if args.bench:
        with open(args.bench[0]) as f:
            bn = json.load(f)["ns_per_pair"]
        with open(args.bench[1]) as f:
            ba = json.load(f)["ns_per_pair"]
        delta_ns = ba["4096"] - bn["4096"]
    names = [w for w in runs["allocd"][0]["workloads"] if all(w in r["workloads"] for r in runs["native"] + runs["allocd"])]
    lines = ["Wall time a step (synchronize to synchronize):", "",
             "| workload | runs native / allocd | run medians ms, native | run medians ms, allocd | "
             "native spread (max/min) | pooled median ms, native | pooled median ms, allocd | allocd / native | "
             "paired ratios | median paired ratio | allocations a step | allocator cost difference, share of step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in names:
        f = figures(runs, w, "step_ms", "median_ms")
        med, pooled, paired = f["med"], f["pooled"], f["paired"]
        aps = runs["allocd"][0]["workloads"][w].get("allocs_per_step")
        share = "-"
        if delta_ns is not None and aps:
            share = f"{aps * delta_ns / (pooled['native'] * 1e6) * 100:+.2f}% ({delta_ns:+.0f} ns × {aps:.0f})"
        lines.append(f"| {w} | {len(med['native'])} / {len(med['allocd'])} | "
                     f"{', '.join(f'{x:.2f}' for x in med['native'])} | {', '.join(f'{x:.2f}' for x in med['allocd'])} | "
                     f"{f['spread']:.3f} | {pooled['native']:.2f} | {pooled['allocd']:.2f} | {f['ratio']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in paired)} | {statistics.median(paired):.3f} | "
                     f"{'-' if aps is None else f'{aps:.0f}'} | {share} |")
    md = "\n".join(lines) + "\n"
    modes = sorted({r.get("sync", {}).get("mode", "auto") for side in runs.values() for r in side})
    if modes != ["blocking"]:
        sync = ("its final synchronize included, which spins (CUDA's default scheduling): a launch that ends "
                "sooner spins longer" if modes == ["auto"] else
                f"its final synchronize included; MIXED synchronize modes {modes}: not comparable")
    else:
        sync = "its final synchronize included, which sleeps (CU_CTX_SCHED_BLOCKING_SYNC): CPU time is work"
    md += f"\nSynchronize: {', '.join(modes)}.\n"
    md += series_table(runs, names, "cpu_ms", "median_cpu_ms",
                       "CPU time a step of the launching thread (time.thread_time() over the same span as the wall "
                       f"time, {sync}; backward()'s autograd thread not included):",
                       goal=CPU_GOAL)
    md += series_table(runs, names, "launch_cpu_ms", "median_launch_cpu_ms",
                       "CPU time of the launch (the launching thread, step start until the Python code returns, "
                       "before the synchronize):")
    md += series_table(runs, names, "proc_cpu_ms", "median_proc_cpu_ms",
                       "CPU time a step of the whole process (time.process_time() over the same span: all threads, "
                       "the autograd thread that runs backward() and allocd's own included):", goal=CPU_GOAL)
    md += per_step_table(runs, names)
    launch = [w for w in names if has(runs, w, "median_launch_ms")]
    if launch:
        md += ("\nLaunch time (step start until the Python code returns, before the synchronize), "
               "run medians ms:\n\n| workload | native | allocd |\n|---|---|---|\n")
        for w in launch:
            cols = [", ".join("%.2f" % r["workloads"][w]["median_launch_ms"] for r in runs[side]) for side in ("native", "allocd")]
            md += f"| {w} | {cols[0]} | {cols[1]} |\n"
    return md


# The per-step counters (torch_workloads.py's per_step) the table shows, and their headings.
PER_STEP = (("num_device_alloc", "device allocs"), ("num_device_free", "device frees"),
            ("num_reclaims", "reclaims"), ("num_small_from_large", "small from large"),
            ("num_lends", "loans"), ("num_reclaim_waits", "reclaim waits"),
            ("vmm_total_ns", "VMM ms"), ("vmm_sync_ns", "sync ms"))


def per_step_table(runs, names):
    """What each allocator did a timed step (torch_workloads.py's per_step), the median of its runs;
    empty when no run recorded it. ns counters are shown in ms."""
    rows = []
    for w in names:
        for side in ("native", "allocd"):
            steps = [r["workloads"][w].get("per_step") for r in runs[side]]
            steps = [x for x in steps if x is not None]
            if not steps:
                continue
            cells = []
            for key, _ in PER_STEP:
                vals = [x[key] for x in steps if key in x]
                if not vals:
                    cells.append("-")
                    continue
                v = statistics.median(vals)
                cells.append(f"{v / 1e6:.3f}" if key.endswith("_ns") else f"{v:.1f}")
            rows.append(f"| {w} | {side} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return ("\nWhat the allocator did a timed step, the median of each side's runs (allocd's reclaim and virtual "
            "memory counters; - where the allocator has none):\n\n| workload | allocator | "
            + " | ".join(h for _, h in PER_STEP) + " |\n|---|---|" + "---|" * len(PER_STEP) + "\n"
            + "\n".join(rows) + "\n")


def cpp_share(runs, cpp):
    """Per workload: the C++ window's allocd − native difference times the allocations a step."""
    mn, _ = cpp_median(cpp["native"], "window64")
    ma, _ = cpp_median(cpp["allocd"], "window64")
    if mn is None or ma is None:
        return ""
    delta = ma - mn
    names = [w for w in runs["allocd"][0]["workloads"] if all(w in r["workloads"] for r in runs["native"] + runs["allocd"])]
    md = (f"\nWhat the allocator adds a step, from the C++ window ({delta:+.1f} ns a free + malloc, allocd − native) "
          f"times allocd's allocations a step:\n\n| workload | allocations a step | added ms | share of native's "
          f"pooled CPU ms | share of native's pooled wall ms |\n|---|---|---|---|---|\n")
    for w in names:
        aps = runs["allocd"][0]["workloads"][w].get("allocs_per_step")
        if not aps:
            continue
        added = aps * delta / 1e6
        wall = figures(runs, w, "step_ms", "median_ms")["pooled"]["native"]
        cpu = (figures(runs, w, "cpu_ms", "median_cpu_ms")["pooled"]["native"]
               if has(runs, w, "cpu_ms", "median_cpu_ms") else None)
        md += (f"| {w} | {aps:.0f} | {added:+.4f} | "
               f"{'-' if not cpu else f'{added / cpu * 100:+.2f}%'} | {added / wall * 100:+.2f}% |\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
