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
#   2. allocd bench --device cuda --conf expandable_segments:True, replays only
#                                                          -> allocd.json
#   3. PyTorch's anchor replays with expandable_segments:True -> anchor.json
#   4. a side-by-side table: ns/op and peak reserved        -> compare.txt
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

shared=$(ls "$TRACES"/{gpt2_train,gpt2_train_varlen,gpt2m_generate,multistream_prefetch,resnet50_train}.pickle.gz 2>/dev/null)
say "allocd bench, expandable replays -> $OUT/allocd.json"
timeout "$(($(left) / 3))" "$BIN/allocd" bench --device cuda --no-pair --no-mixed --conf expandable_segments:True --json \
	$shared >"$OUT/allocd.json" 2>"$OUT/allocd.err"
echo "allocd bench rc=$?"

say "PyTorch anchor, expandable replays -> $OUT/anchor.json"
tr=$(mktemp -d)
for f in $shared; do gunzip -c "$f" >"$tr/$(basename "$f" .gz)"; done
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True BENCH_MODE=replay EXT_BUILD=/tmp/anchor_build \
	timeout "$(left)" python3 "$ANCHOR/bench.py" "$tr" "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
echo "anchor rc=$?"
rm -rf "$tr"

python3 - "$OUT/allocd.json" "$OUT/anchor.json" <<'PY' | tee "$OUT/compare.txt"
import json, sys
try:
    a = json.load(open(sys.argv[1]))
    t = json.load(open(sys.argv[2])).get("replay", {})
except Exception as e:
    sys.exit(f"no comparison: {e}")
print(f"{'trace':>22} | {'allocd ns/op':>12} {'torch ns/op':>11} {'speedup':>7} | {'allocd MiB':>10} {'torch MiB':>9} | {'maps':>5}")
for r in a.get("replay", []):
    name = r["trace"].removesuffix(".pickle.gz")
    q = t.get(name, {}).get("torch", {})
    tn, tm = q.get("ns_per_op", 0), (q.get("peak_reserved") or 0) / 2**20
    print(f"{name:>22} | {r['ns_per_op']:>12.0f} {tn:>11.0f} {tn / r['ns_per_op'] if tn else 0:>7.2f} |"
          f" {r['peak_reserved_bytes'] / 2**20:>10.0f} {tm:>9.0f} | {r['device_mallocs']:>5}")
PY
say "done"
