#!/usr/bin/env python3
"""Compare torch_workloads.py results: allocd against PyTorch's own allocator.

    python3 scripts/compare_workloads.py native1.json native2.json allocd.json \
        [native_exp.json allocd_exp.json] [--md compare.md]

Each argument may be a comma-separated list of result files (say, from two device calls
with different WORKLOADS); their workloads are merged. Prints a markdown table, writes it
to --md (default: compare.md beside allocd.json) and exits 1 if any criterion failed.

Criteria, per workload:
- results: the run-to-run noise of native is max |native2 - native1| over every step's loss
  (generation: the number of steps whose token ids differ). If native is bit-identical
  across runs, allocd must be bit-identical to native1. Otherwise allocd's max |allocd -
  native1| must be at most TOLERANCE_FACTOR x native's noise: one sample of native's
  noise underestimates its spread, and allocd vs native1 is, like native2 vs native1,
  the difference of two runs that share no allocation pattern.
- speed: allocd's median step time at most 1.02 x native's, where native's is the mean of
  the medians of native1 and native2 (each run's median is itself noisy).
- memory (default config): allocd's peak reserved <= native1's reserved_bytes.all.peak.
- memory (expandable_segments:True): allocd_exp's peak reserved <= native_exp's.
- metrics: the mid-run /metrics scrape under allocd showed allocated and reserved bytes > 0.
"""

import argparse
import math
import os
import sys

TOLERANCE_FACTOR = 2.0
SPEED_LIMIT = 1.02
MiB = 1 << 20


def load(spec):
    import json
    merged = None
    for path in spec.split(","):
        with open(path) as f:
            r = json.load(f)
        if merged is None:
            merged = r
        else:
            merged["workloads"].update(r["workloads"])
    return merged


def value_delta(a, b):
    """(max |a-b| over the common steps, compared steps) for losses; (differing steps, steps) for tokens."""
    va, vb = a["values"], b["values"]
    n = min(len(va), len(vb))
    if a["kind"] == "tokens":
        return sum(1 for x, y in zip(va[:n], vb[:n]) if x != y), n
    return max((_absdiff(x, y) for x, y in zip(va[:n], vb[:n])), default=0.0), n


def _absdiff(x, y):
    """|x - y|, with two NaNs equal (both runs diverged alike) and one NaN infinitely far."""
    if math.isnan(x) or math.isnan(y):
        return 0.0 if math.isnan(x) and math.isnan(y) else math.inf
    return abs(x - y)


def fmt_delta(d, kind):
    if kind == "tokens":
        return f"{d} steps differ"
    return "0 (bit-identical)" if d == 0 else f"{d:.3g}"


def mib(x):
    return "-" if x is None else f"{x / MiB:,.0f}"


def verdict(ok):
    return "PASS" if ok else "FAIL"


def compare(n1, n2, al, nx=None, ax=None):
    rows, checks = [], []
    names = [w for w in al["workloads"] if w in n1["workloads"]]
    for w in names:
        a, b1 = al["workloads"][w], n1["workloads"][w]
        b2 = n2["workloads"].get(w) if n2 else None
        kind = a["kind"]
        noise, _ = value_delta(b2, b1) if b2 else (None, 0)
        dal, nsteps = value_delta(a, b1)
        if noise is None:
            res_ok, res_note = False, "no second native run"
        elif noise == 0:
            res_ok, res_note = dal == 0, "native bit-identical: allocd must be too"
        else:
            res_ok, res_note = dal <= TOLERANCE_FACTOR * noise, f"tolerance {TOLERANCE_FACTOR:g} x native noise"
        native_ms = b1["median_ms"] if not b2 else (b1["median_ms"] + b2["median_ms"]) / 2
        ratio = a["median_ms"] / native_ms
        speed_ok = ratio <= SPEED_LIMIT
        mem_ok = a["peak_reserved"] <= b1["peak_reserved"]
        bx = nx["workloads"].get(w) if nx else None
        axw = ax["workloads"].get(w) if ax else None
        exp_ok = None if not (bx and axw) else axw["peak_reserved"] <= bx["peak_reserved"]
        m = a.get("metrics_mid_run") or {}
        met_ok = bool(m.get("allocd_reserved_bytes")) and bool(m.get("allocd_allocated_bytes"))
        rows.append({
            "workload": w, "steps": nsteps,
            "noise": "-" if noise is None else fmt_delta(noise, kind),
            "allocd_delta": fmt_delta(dal, kind), "results": verdict(res_ok),
            "ms_native": f"{native_ms:.2f}" + ("" if not b2 else f" ({b1['median_ms']:.2f}/{b2['median_ms']:.2f})"),
            "ms_allocd": f"{a['median_ms']:.2f}", "ratio": f"{ratio:.3f}", "speed": verdict(speed_ok),
            "res_native": mib(b1["peak_reserved"]), "res_allocd": mib(a["peak_reserved"]), "mem": verdict(mem_ok),
            "res_native_exp": mib(bx["peak_reserved"]) if bx else "-",
            "res_allocd_exp": mib(axw["peak_reserved"]) if axw else "-",
            "mem_exp": "-" if exp_ok is None else verdict(exp_ok),
            "metrics": (f"{mib(m.get('allocd_reserved_bytes'))} / {mib(m.get('allocd_allocated_bytes'))}"
                        if m and "error" not in m else (m.get("error", "none") if m else "none")),
            "metrics_ok": verdict(met_ok),
        })
        checks += [(w, "results", res_ok, res_note), (w, "speed", speed_ok, f"{ratio:.3f} x native"),
                   (w, "memory", mem_ok, f"{mib(a['peak_reserved'])} vs {mib(b1['peak_reserved'])} MiB"),
                   (w, "metrics", met_ok, "mid-run scrape")]
        if exp_ok is not None:
            checks.append((w, "memory expandable", exp_ok,
                           f"{mib(axw['peak_reserved'])} vs {mib(bx['peak_reserved'])} MiB"))
    return rows, checks


COLUMNS = [
    ("workload", "workload"), ("steps", "steps compared"),
    ("noise", "native run-to-run max \\|Δ\\|"), ("allocd_delta", "allocd vs native max \\|Δ\\|"),
    ("results", "results"),
    ("ms_native", "median step ms, native (run 1/run 2)"), ("ms_allocd", "median step ms, allocd"),
    ("ratio", "allocd / native"), ("speed", "speed ≤ 1.02"),
    ("res_native", "peak reserved MiB, native"), ("res_allocd", "peak reserved MiB, allocd"), ("mem", "reserved ≤"),
    ("res_native_exp", "peak reserved MiB, native expandable"),
    ("res_allocd_exp", "peak reserved MiB, allocd expandable"), ("mem_exp", "reserved ≤ (expandable)"),
    ("metrics", "/metrics mid-run reserved / allocated MiB"), ("metrics_ok", "metrics"),
]


def markdown(rows, n1, al, nx, ax):
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |")
    conf = [f"torch {n1.get('torch')} on {n1.get('device')}",
            f"native: PYTORCH_CUDA_ALLOC_CONF={n1.get('pytorch_cuda_alloc_conf')!r}",
            f"allocd: ALLOCD_CONF={al.get('allocd_conf')!r}"]
    if nx:
        conf.append(f"native expandable: PYTORCH_CUDA_ALLOC_CONF={nx.get('pytorch_cuda_alloc_conf')!r}")
    if ax:
        conf.append(f"allocd expandable: ALLOCD_CONF={ax.get('allocd_conf')!r}")
    return "\n".join(lines) + "\n\n" + "; ".join(conf) + ".\n"


def main():
    ap = argparse.ArgumentParser(description="compare torch_workloads.py results")
    ap.add_argument("native1")
    ap.add_argument("native2")
    ap.add_argument("allocd")
    ap.add_argument("native_exp", nargs="?")
    ap.add_argument("allocd_exp", nargs="?")
    ap.add_argument("--md", help="markdown output (default: compare.md beside the allocd result)")
    args = ap.parse_args()
    n1, n2, al = load(args.native1), load(args.native2), load(args.allocd)
    nx = load(args.native_exp) if args.native_exp else None
    ax = load(args.allocd_exp) if args.allocd_exp else None
    rows, checks = compare(n1, n2, al, nx, ax)
    if not rows:
        raise SystemExit("no workload is in both the native and the allocd results")
    md = markdown(rows, n1, al, nx, ax)
    failed = [c for c in checks if not c[2]]
    summary = "\n".join(f"- {w}: {what}: {verdict(ok)} ({note})" for w, what, ok, note in checks)
    summary += (f"\n\n{len(checks) - len(failed)} of {len(checks)} criteria pass"
                + (f"; FAILED: {', '.join(f'{w} {what}' for w, what, _, _ in failed)}" if failed else "") + ".\n")
    out = args.md or os.path.join(os.path.dirname(os.path.abspath(args.allocd.split(",")[0])), "compare.md")
    with open(out, "w") as f:
        f.write(md + "\n" + summary)
    print(md)
    print(summary)
    print(f"(written to {out})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
