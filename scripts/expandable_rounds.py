#!/usr/bin/env python3
"""The rounds of one scripts/device_expandable.sh command (ROUNDS > 1 or PAIRED > 0), trace by trace, against the goals.

    expandable_rounds.py OUTDIR

OUTDIR holds the command's results: allocd.json and anchor.json for round 1, allocd_rR.json and
anchor_rR.json for round R, gputest.log and pytorch_calls.jsonl. For every trace it prints each
round's speed (PyTorch's expandable ns/op over allocd's default, above 1: allocd faster) and
their median; the virtual memory calls of both sides modelled at the per-call costs stage 1
measured (allocd's calls are the same in every round, PyTorch's exact calls come from the
simulated device); allocd's peak reserved beside PyTorch's; and a verdict on each goal:
speed median >= 1, modelled calls <= PyTorch's, peak <= PyTorch's. Then the pattern test's
corruptions and whether TestGPUReplayMatchesSim passed. It exits 0 whatever the verdicts.

With paired.json (PAIRED > 0: scripts/paired_replays.py's rounds, both sides on one core, one
right after the other) the speed columns are its rounds' cold ratios instead, the more
trustworthy figure; the rest still comes from round 1's allocd.json and anchor.json. When those
rounds timed PyTorch's virtual memory calls too (--vmm-timer), a second table gives both sides'
measured call time per round and its median, and whether allocd's median is at most PyTorch's.
"""
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_expandable import costs, modelled, pytorch_calls  # noqa: E402


def rounds(out):
    """The (allocd JSON, anchor JSON) paths of every complete round, in order."""
    found, r = [], 1
    while True:
        sfx = "" if r == 1 else f"_r{r}"
        a, t = os.path.join(out, f"allocd{sfx}.json"), os.path.join(out, f"anchor{sfx}.json")
        if not (os.path.exists(a) and os.path.exists(t)):
            return found
        found.append((a, t))
        r += 1


def load(path, key="replay"):
    try:
        return json.load(open(path)).get(key) or {}
    except (OSError, ValueError):
        return {}


def gputest(log):
    """The corruptions the pattern tests found (None without a figure) and whether ReplayMatchesSim passed."""
    corrupt, matched = None, False
    for line in open(log, errors="replace"):
        m = re.match(r"gpu-pattern: .*corruptions=(\d+)", line)  # the summary line, not the t.Logf copy
        if m:
            corrupt = (corrupt or 0) + int(m.group(1))
        if line.startswith("--- PASS: TestGPUReplayMatchesSim"):
            matched = True
    return corrupt, matched


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    rs = rounds(out)
    if not rs:
        sys.exit(f"no complete round in {out}")
    log = os.path.join(out, "gputest.log")
    c = costs(log) if os.path.exists(log) else None
    path = os.path.join(out, "pytorch_calls.jsonl")
    calls = pytorch_calls(path) if os.path.exists(path) else {}
    speeds, ours, theirs = {}, {}, {}
    for a, t in rs:
        anchor = load(t)
        for r in load(a):
            name = r["trace"].removesuffix(".pickle.gz")
            q = anchor.get(name, {}).get("torch", {})
            if q.get("ns_per_op") and r.get("ns_per_op"):
                speeds.setdefault(name, []).append(q["ns_per_op"] / r["ns_per_op"])
            ours.setdefault(name, r)
            theirs.setdefault(name, q)
    source = f"{len(rs)} rounds of allocd bench and the anchor"
    paired = load(os.path.join(out, "paired.json"), "rounds")
    timed = {}  # name: [(allocd's ms, PyTorch's ms)], both sides' calls measured (paired_replays.py --vmm-timer)
    if paired:
        speeds = {}
        for rnd in paired:
            for name, sides in rnd.get("replay", {}).items():
                a, t = sides["allocd"].get("ns_per_op"), sides["torch"].get("ns_per_op")
                if a and t:
                    speeds.setdefault(name, []).append(t / a)
                va, vt = sides["allocd"].get("vmm"), sides["torch"].get("vmm")
                if va and vt:
                    timed.setdefault(name, []).append((va["total_ns"] / 1e6, vt["total_ns"] / 1e6))
        source = f"speed from {len(paired)} paired rounds (paired.json)"
    print(f"{source}; per call (20 MiB): " + (f"create {c[0]} us, map {c[1]} us, unmap {c[2]} us, release {c[3]} us" if c else "no costs in gputest.log"))
    print("| trace | speed, each round | median | modelled ms: allocd / PyTorch | peak MiB: allocd / PyTorch | speed ≥ 1 | calls ≤ | peak ≤ |")
    print("|---|---|---|---|---|---|---|---|")
    met = {"speed": 0, "calls": 0, "peak": 0}
    for name in sorted(ours):
        s = speeds.get(name, [])
        med = statistics.median(s) if s else None
        mo = modelled(ours[name].get("vmm") or {}, c) if c else None
        mt = modelled(calls[name], c) if c and name in calls else None
        pa, pt = ours[name].get("peak_reserved_bytes", 0) >> 20, (theirs[name].get("peak_reserved") or 0) >> 20
        ok = {"speed": med is not None and med >= 1, "calls": mo is not None and mt is not None and mo <= mt, "peak": 0 < pa <= pt}
        for k, v in ok.items():
            met[k] += v
        cell = lambda v: "yes" if v else "no"
        fmt = lambda v: "-" if v is None else f"{v:.1f}"
        fmt2 = lambda v: "-" if v is None else f"{v:.2f}"
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in s) or '-'} | {fmt2(med)} | {fmt(mo)} / {fmt(mt)} | {pa:,} / {pt:,} |"
              f" {cell(ok['speed'])} | {cell(ok['calls'])} | {cell(ok['peak'])} |")
    n = len(ours)
    if timed:
        hooked = json.load(open(os.path.join(out, "paired.json"))).get("torch_vmm_hooked", 0)
        print(f"virtual memory calls measured on both sides in the paired rounds (PyTorch's lookups hooked: {hooked}):")
        print("| trace | ms, each round: allocd / PyTorch | medians | measured ≤ |")
        print("|---|---|---|---|")
        ok = 0
        for name in sorted(timed):
            ma, mt = statistics.median(x for x, _ in timed[name]), statistics.median(y for _, y in timed[name])
            ok += hooked > 0 and ma <= mt
            print(f"| {name} | {', '.join(f'{x:.1f} / {y:.1f}' for x, y in timed[name])} | {ma:.1f} / {mt:.1f} |"
                  f" {'yes' if hooked > 0 and ma <= mt else 'no'} |")
        print(f"measured calls at most PyTorch's on {ok}/{len(timed)} traces")
    corrupt, matched = gputest(log) if os.path.exists(log) else (None, False)
    print(f"goals met on {met['speed']}/{n} traces for speed, {met['calls']}/{n} for calls, {met['peak']}/{n} for peaks;"
          f" pattern test corruptions: {'-' if corrupt is None else corrupt}; GPU peaks equal the simulated device's: {'yes' if matched else 'no'}")


if __name__ == "__main__":
    main()
