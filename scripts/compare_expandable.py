#!/usr/bin/env python3
"""Side by side: allocd's expandable replays on a GPU against PyTorch's anchor.

    compare_expandable.py ALLOCD_JSON ANCHOR_JSON GPUTEST_LOG [PYTORCH_CALLS_JSONL]

ALLOCD_JSON is `allocd bench --json` with expandable segments, ANCHOR_JSON the anchor's
bench.py output with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, GPUTEST_LOG a log of
TestGPUVirtualMemoryCost from the same machine (its 20 MiB line gives the cost of each call).
PyTorch's allocator cannot time its own device calls, so its VMM time is estimated: from its
peak reserved (one 20 MiB page a handle, created and mapped once), and, when
PYTORCH_CALLS_JSONL is given (`allocd replay --device sim --pytorch-expandable --json`, which
reproduces PyTorch's expandable segments and counts their calls, small-pool pages included),
from those exact counts. allocd's calls are given both as timed and modelled with the same
per-call costs, so the two sides can be compared on one scale.

A third scale needs no model and times both sides alike: a replay's cold ns/op minus its warm
ns/op (the second pass on the same pool), times its operations, is what the cold pass spent
beyond the warm one: its device calls, and whatever else only a cold pass does (new blocks,
first touches of memory). Both sides' figures come from the same command, so the columns
"cold - warm ms" compare what growth cost each, device calls included. PyTorch's second pass
makes no device call; allocd's may, where reclaim moves memory at every step: the last column
is the time of its second pass's virtual memory calls (bench's warm_vmm), what a workload that
repeats its steps pays in each pass.
"""
import json
import re
import sys


def costs(log):
    """Per-call µs of a 20 MiB page: create, map in a range, unmap in one call, release."""
    for line in open(log, errors="replace"):
        m = re.search(r"gpu-vmm: page 20 MiB: create ([0-9.]+) µs, map\+access [0-9.]+ µs, map in a range ([0-9.]+) µs, "
                      r"unmap [0-9.]+ µs, unmap in one call ([0-9.]+) µs, release ([0-9.]+) µs", line)
        if m:
            return tuple(float(x) for x in m.groups())
    return None


def modelled(v, c):
    """The modelled ms of the calls in v (a vmm object) at the per-call costs c."""
    return (v.get("creates", 0) * c[0] + v.get("maps", 0) * c[1] + v.get("unmaps", 0) * c[2] + v.get("releases", 0) * c[3]) / 1e3


def pytorch_calls(path):
    """PyTorch's exact calls per trace: the vmm objects of `allocd replay --pytorch-expandable --json`'s lines."""
    calls = {}
    for line in open(path):
        r = json.loads(line)
        calls[r["trace"].removesuffix(".pickle.gz")] = r.get("vmm") or {}
    return calls


def beyond_warm(r, ops):
    """What the cold replay r spent beyond its warm one, in ms ("-" without a warm figure)."""
    if not r.get("warm_ns_per_op") or not ops:
        return "-"
    return f"{(r['ns_per_op'] - r['warm_ns_per_op']) * ops / 1e6:.1f}"


def warm_vmm(r):
    """The ms of the virtual memory calls of r's warm pass ("-" where bench gave no warm figures)."""
    if "warm_ns_per_op" not in r:
        return "-"
    return f"{(r.get('warm_vmm') or {}).get('total_ns', 0) / 1e6:.1f}"


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    try:
        a = json.load(open(sys.argv[1]))
        t = json.load(open(sys.argv[2])).get("replay", {})
    except Exception as e:
        sys.exit(f"no comparison: {e}")
    c = costs(sys.argv[3])
    calls = pytorch_calls(sys.argv[4]) if len(sys.argv) == 5 else {}
    print(f"allocd: {sys.argv[1]}")
    if c:
        print(f"per call (TestGPUVirtualMemoryCost, 20 MiB): create {c[0]} us, map {c[1]} us, unmap {c[2]} us, release {c[3]} us")
    print("torch est. ms: its handles (peak reserved / 20 MiB) x (create + map); torch calls and modelled ms: its exact calls"
          " from the simulated device (multistream_prefetch on its two recorded streams; the anchor replays one)")
    print(f"{'trace':>22} | {'allocd ns/op':>12} {'torch ns/op':>11} {'speedup':>7} | {'allocd MiB':>10} {'torch MiB':>9} |"
          f" {'creates':>7} {'maps':>5} {'unmaps':>6} {'releases':>8} {'VMM ms':>7} {'modelled':>8} |"
          f" {'torch est. ms':>13} {'torch calls':>11} {'modelled':>8} |"
          f" {'cold - warm ms: allocd':>22} {'torch':>6} | {'allocd warm VMM ms':>18}")
    for r in a.get("replay", []):
        name = r["trace"].removesuffix(".pickle.gz")
        q = t.get(name, {}).get("torch", {})
        tn, tr = q.get("ns_per_op", 0), (q.get("peak_reserved") or 0)
        v = r.get("vmm") or {}
        est = tr / 2**20 / 20 * (c[0] + c[1]) / 1e3 if c else 0
        pv = calls.get(name)
        tcalls = sum(pv.get(k, 0) for k in ("creates", "maps", "unmaps", "releases")) if pv is not None else 0
        print(f"{name:>22} | {r['ns_per_op']:>12.0f} {tn:>11.0f} {tn / r['ns_per_op'] if tn else 0:>7.2f} |"
              f" {r['peak_reserved_bytes'] / 2**20:>10.0f} {tr / 2**20:>9.0f} |"
              f" {v.get('creates', 0):>7} {v.get('maps', 0):>5} {v.get('unmaps', 0):>6} {v.get('releases', 0):>8}"
              f" {v.get('total_ns', 0) / 1e6:>7.1f} {modelled(v, c) if c else 0:>8.1f} |"
              f" {est:>13.1f} {tcalls:>11} {modelled(pv, c) if c and pv is not None else 0:>8.1f} |"
              f" {beyond_warm(r, r.get('ops', 0)):>22} {beyond_warm(q, t.get(name, {}).get('ops', 0)):>6} |"
              f" {warm_vmm(r):>18}")


if __name__ == "__main__":
    main()
