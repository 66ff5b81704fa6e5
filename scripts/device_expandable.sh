#!/usr/bin/env bash
# Expandable segments on a GPU machine, in one command, from the repository root:
#
#   scripts/device_expandable.sh TRACEDIR ANCHORDIR
#
# TRACEDIR holds the *.pickle.gz traces to replay (testdata/traces holds the
# ten: the shared five, and for the GPU tests the project's five); ANCHORDIR holds PyTorch's anchor
# (bench.py). Builds allocd and gputest.test into $BIN (default .devrun/bin)
# when Go is present, then runs, writing logs and results to $OUT (default
# .devrun/expandable):
#   1. the GPU tests of mapping: TestGPUVirtualMemoryCost (the device calls'
#      costs), TestGPUPatternExpandable (every block's bytes checked on three
#      streams with RecordStream) and TestGPUReplayMatchesSim (every trace's
#      peaks on the GPU equal the simulated device's)     -> gputest.log
#   2. allocd bench --device cuda --conf expandable_segments:True, replays only,
#      every trace in TRACEDIR, with the driver's VMM calls    -> allocd.json;
#      then with expandable_reclaim:coarse                     -> allocd_coarse.json
#   3. PyTorch's anchor replays with expandable_segments:True -> anchor.json
#   4. a side-by-side table: ns/op, peak reserved, and VMM calls and time;
#      PyTorch's VMM time is estimated from its handles (one per 20 MiB of
#      its peak reserved: it never unmaps in a replay) and stage 1's
#      measured cost of creating and mapping a 20 MiB page  -> compare.txt,
#      compare_coarse.txt
# Stages stop starting past $BUDGET_S seconds (default 560). No network is used.
set -uo pipefail
. "$(dirname "$0")/device_lib.sh"
device_setup device_expandable "$@"
device_build gputest

say "GPU tests -> $OUT/gputest.log"
(cd gputest && ALLOCD_TRACES="$TRACES" ALLOCD_GPU_OPS=200000 timeout "$(($(left) / 2))" "$BIN/gputest.test" \
	-test.run 'VirtualMemoryCost|PatternExpandable|ReplayMatchesSim' -test.v) >"$OUT/gputest.log" 2>&1
echo "gputest rc=$?" | tee -a "$OUT/gputest.log"
grep -E '^(--- |ok|FAIL|PASS)|corrupt|peak' "$OUT/gputest.log" | head -40

shared=$(ls "$TRACES"/*.pickle.gz)
say "allocd bench, expandable replays -> $OUT/allocd.json"
timeout "$(($(left) / 3))" "$BIN/allocd" bench --device cuda --no-pair --no-mixed --conf expandable_segments:True --json \
	$shared >"$OUT/allocd.json" 2>"$OUT/allocd.err"
echo "allocd bench rc=$?"

say "allocd bench, expandable_reclaim:coarse -> $OUT/allocd_coarse.json"
timeout "$(($(left) / 3))" "$BIN/allocd" bench --device cuda --no-pair --no-mixed --conf expandable_segments:True,expandable_reclaim:coarse --json \
	$shared >"$OUT/allocd_coarse.json" 2>"$OUT/allocd_coarse.err"
echo "allocd bench (coarse) rc=$?"

say "PyTorch anchor, expandable replays -> $OUT/anchor.json"
tr=$(mktemp -d)
for f in $shared; do gunzip -c "$f" >"$tr/$(basename "$f" .gz)"; done
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True BENCH_MODE=replay EXT_BUILD=/tmp/anchor_build \
	timeout "$(left)" python3 "$ANCHOR/bench.py" "$tr" "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
echo "anchor rc=$?"
rm -rf "$tr"

for mode in "" _coarse; do
python3 - "$OUT/allocd$mode.json" "$OUT/anchor.json" "$OUT/gputest.log" <<'PY' | tee "$OUT/compare$mode.txt"
import json, re, sys
try:
    a = json.load(open(sys.argv[1]))
    t = json.load(open(sys.argv[2])).get("replay", {})
except Exception as e:
    sys.exit(f"no comparison: {e}")
print(f"allocd: {sys.argv[1]}")
# One 20 MiB handle created and mapped in a range, from TestGPUVirtualMemoryCost.
per = None
for line in open(sys.argv[3], errors="replace"):
    m = re.search(r"gpu-vmm: page 20 MiB: create ([0-9.]+) µs, map\+access [0-9.]+ µs, map in a range ([0-9.]+) µs", line)
    if m:
        per = float(m.group(1)) + float(m.group(2))
print(f"PyTorch's VMM time: its handles (peak reserved / 20 MiB) x {per} us (create + map of a 20 MiB page, stage 1)")
print(f"{'trace':>22} | {'allocd ns/op':>12} {'torch ns/op':>11} {'speedup':>7} | {'allocd MiB':>10} {'torch MiB':>9} |"
      f" {'creates':>7} {'maps':>5} {'unmaps':>6} {'releases':>8} {'VMM ms':>7} | {'torch handles':>13} {'est. ms':>7}")
for r in a.get("replay", []):
    name = r["trace"].removesuffix(".pickle.gz")
    q = t.get(name, {}).get("torch", {})
    tn, tr = q.get("ns_per_op", 0), (q.get("peak_reserved") or 0)
    v = r.get("vmm") or {}
    th = tr / 2**20 / 20
    print(f"{name:>22} | {r['ns_per_op']:>12.0f} {tn:>11.0f} {tn / r['ns_per_op'] if tn else 0:>7.2f} |"
          f" {r['peak_reserved_bytes'] / 2**20:>10.0f} {tr / 2**20:>9.0f} |"
          f" {v.get('creates', 0):>7} {v.get('maps', 0):>5} {v.get('unmaps', 0):>6} {v.get('releases', 0):>8} {v.get('total_ns', 0) / 1e6:>7.1f} |"
          f" {th:>13.0f} {th * per / 1e3 if per else 0:>7.1f}")
PY
done
say "done"
