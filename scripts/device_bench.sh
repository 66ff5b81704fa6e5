#!/usr/bin/env bash
# allocd bench beside PyTorch's allocator on a GPU machine, in one command, from the
# repository root:
#
#   scripts/device_bench.sh TRACEDIR ANCHORDIR
#
# TRACEDIR holds the shared *.pickle.gz traces; ANCHORDIR holds PyTorch's anchor
# (bench.py). Builds allocd into $BIN (default .devrun/bin) when Go is present, then
# runs, writing results to $OUT (default .devrun/bench):
#   1. allocd bench --device cuda --json TRACEDIR/*.pickle.gz -> allocd.json
#      (pair, mixed cold and warm at 1, 2, 4 and 8 goroutines, replays)
#   2. PyTorch's anchor on the same traces                   -> anchor.json
#   3. the ratios, each beside the speed goal it is held to   -> compare.txt
# Both sides run in the same command, so that the ratios do not mix machines.
# Stages stop starting past $BUDGET_S seconds (default 560). No network is used.
set -uo pipefail
. "$(dirname "$0")/device_lib.sh"
device_setup device_bench "$@"
device_build

say "allocd bench -> $OUT/allocd.json"
timeout "$(($(left) / 2))" "$BIN/allocd" bench --device cuda --json "$TRACES"/*.pickle.gz >"$OUT/allocd.json" 2>"$OUT/allocd.err"
echo "allocd bench rc=$?"

say "PyTorch anchor -> $OUT/anchor.json"
tr=$(mktemp -d)
for f in "$TRACES"/*.pickle.gz; do gunzip -c "$f" >"$tr/$(basename "$f" .gz)"; done
EXT_BUILD=/tmp/anchor_build timeout "$(left)" python3 "$ANCHOR/bench.py" "$tr" "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
echo "anchor rc=$?"
rm -rf "$tr"

python3 - "$OUT/allocd.json" "$OUT/anchor.json" <<'PY' | tee "$OUT/compare.txt"
import json, sys
try:
    a = json.load(open(sys.argv[1]))
    t = json.load(open(sys.argv[2]))
except Exception as e:
    sys.exit(f"no comparison: {e}")
micro, rep = t.get("micro", {}), t.get("replay", {})

def line(what, ratio, goal):
    mark = "met" if ratio >= goal else "NOT met"
    print(f"{what:<58} {ratio:>7.2f}x  (goal {goal}x: {mark})")

for size, ns in sorted(a.get("pair_ns", {}).items(), key=lambda kv: int(kv[0])):
    tn = micro.get(f"pair_torch_{size}")
    if tn:
        line(f"pair/{size}: PyTorch {tn:.0f} ns / allocd {ns:.0f} ns", tn / ns, 5)
runs = {(kind, r["threads"]): r for kind in ("mixed", "mixed_warm") for r in a.get(kind, [])}
w1, w8 = runs.get(("mixed_warm", 1)), runs.get(("mixed_warm", 8))
if w1 and w8:
    line(f"mixed warm t8 / own t1: {w8['mops_per_s']:.2f} / {w1['mops_per_s']:.2f} Mops/s", w8["mops_per_s"] / w1["mops_per_s"], 5)
tw8 = micro.get("mixed_warm_torch_t8", {}).get("mops_per_s")
if w8 and tw8:
    line(f"mixed warm t8: allocd {w8['mops_per_s']:.2f} / PyTorch {tw8:.2f} Mops/s", w8["mops_per_s"] / tw8, 20)
c8, tc8 = runs.get(("mixed", 8)), micro.get("mixed_torch_t8", {})
if c8 and tc8.get("mops_per_s"):
    line(f"mixed cold t8: allocd {c8['mops_per_s']:.2f} / PyTorch {tc8['mops_per_s']:.2f} Mops/s", c8["mops_per_s"] / tc8["mops_per_s"], 10)
    pr = tc8.get("peak_reserved") or 0
    print(f"{'mixed cold t8 peak reserved, MiB: allocd / PyTorch':<58} {c8['peak_reserved_bytes'] / 2**20:>7.0f} / {pr / 2**20:.0f}"
          f"  (goal: no higher: {'met' if c8['peak_reserved_bytes'] <= pr else 'NOT met'})")
for r in a.get("replay", []):
    name = r["trace"].removesuffix(".pickle.gz")
    tn = rep.get(name, {}).get("torch", {}).get("ns_per_op")
    if tn:
        line(f"replay {name}: PyTorch {tn:.0f} / allocd {r['ns_per_op']:.0f} ns/op", tn / r["ns_per_op"], 5 if name == "gpt2m_generate" else 3)
PY
say "done"
