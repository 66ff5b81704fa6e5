#!/usr/bin/env bash
# Pinned host memory on a GPU machine, in one command, from the repository root:
#
#   scripts/device_pinned.sh
#
# Builds allocd and the test binaries into $BIN (default .devrun/bin), then
# runs, writing logs and results to $OUT (default .devrun/pinned):
#   1. the pinned GPU tests (gputest: TestGPUPinned*, TestHostMemory in cudart);
#   2. allocd bench --device cuda --copies --json  -> allocd_copies.json
#   3. scripts/pinned_anchor.py (PyTorch, same sizes) -> torch_copies.json
#   4. a side-by-side table of the two                -> compare.txt
# Needs a CUDA driver and python3 with torch, and Go with gcc unless $BIN already holds
# the three binaries. No network is used.
set -uo pipefail
OUT=${OUT:-.devrun/pinned}
BIN=${BIN:-.devrun/bin}
mkdir -p "$OUT" "$BIN" || exit 2
OUT=$(realpath "$OUT")
BIN=$(realpath "$BIN")
say() { echo "[device_pinned] $*"; }
unset ALLOCD_DEVICE ALLOCD_CONF

if command -v go >/dev/null; then
	say "building"
	go build -pgo=cmd/allocd/allocd.pgo -o "$BIN/allocd" ./cmd/allocd || exit 2
	go test -c -o "$BIN/gputest.test" ./gputest/ || exit 2
	go test -c -o "$BIN/cudart.test" ./cudart/ || exit 2
else
	# A GPU machine without Go runs binaries built elsewhere (CGO_ENABLED=1).
	for b in allocd gputest.test cudart.test; do
		[ -x "$BIN/$b" ] || { say "no Go here and no $BIN/$b: build it first"; exit 2; }
	done
fi

say "GPU tests -> $OUT/gputest.log"
(cd gputest && "$BIN/gputest.test" -test.run 'Pinned' -test.v -test.timeout 600s) >"$OUT/gputest.log" 2>&1
echo "gputest rc=$?" | tee -a "$OUT/gputest.log"
(cd cudart && "$BIN/cudart.test" -test.run 'TestHostMemory|TestABI' -test.v) >"$OUT/cudart.log" 2>&1
echo "cudart rc=$?" | tee -a "$OUT/cudart.log"

say "allocd bench --copies -> $OUT/allocd_copies.json"
"$BIN/allocd" bench --device cuda --copies --json >"$OUT/allocd_copies.json" 2>"$OUT/allocd_copies.err"
echo "allocd bench rc=$?"
say "PyTorch anchor -> $OUT/torch_copies.json"
python3 scripts/pinned_anchor.py >"$OUT/torch_copies.json" 2>"$OUT/torch_copies.err"
echo "anchor rc=$?"

python3 - "$OUT/allocd_copies.json" "$OUT/torch_copies.json" <<'PY' | tee "$OUT/compare.txt"
import json, sys
a, t = (json.load(open(f)) for f in sys.argv[1:3])
tc = {r["bytes"]: r for r in t.get("copies", [])}
print(f"allocd on {a['device']}; torch {t.get('torch_version')} on {t.get('device')}")
print(f"{'size':>10} | {'pageable H2D':>12} {'allocd pin H2D':>14} {'torch pin H2D':>13} {'ratio':>6} | {'pageable D2H':>12} {'allocd pin D2H':>14} {'torch pin D2H':>13} {'ratio':>6}")
for r in a["copies"]:
    n, q = r["bytes"], tc.get(r["bytes"], {})
    th, td = q.get("pinned_h2d_gbps", 0), q.get("pinned_d2h_gbps", 0)
    print(f"{n:>10} | {r['pageable_h2d_gbps']:>12.2f} {r['pinned_h2d_gbps']:>14.2f} {th:>13.2f} {r['pinned_h2d_gbps']/th if th else 0:>6.3f} |"
          f" {r['pageable_d2h_gbps']:>12.2f} {r['pinned_d2h_gbps']:>14.2f} {td:>13.2f} {r['pinned_d2h_gbps']/td if td else 0:>6.3f}")
ta = {r["bytes"]: r for r in t.get("alloc", [])}
print(f"\n{'size':>10} | {'allocd cached ns':>16} {'cudaHostAlloc+Free ns':>22} {'speedup':>8} | {'torch cached ns':>15} {'torch uncached ns':>17}")
for r in a["alloc"]:
    q = ta.get(r["bytes"], {})
    print(f"{r['bytes']:>10} | {r['cached_alloc_free_ns']:>16.0f} {r['cuda_host_alloc_free_ns']:>22.0f} {r['speedup']:>8.0f} |"
          f" {q.get('cached_pin_memory_ns', 0):>15.0f} {(q.get('uncached_pin_memory_ns') or 0):>17.0f}")
big = [r for r in a["copies"] if r["bytes"] >= 64 << 20 and r["bytes"] in tc]
ok = all(r[k] >= 0.95 * tc[r["bytes"]][k] for r in big for k in ("pinned_h2d_gbps", "pinned_d2h_gbps"))
print(f"\npinned H2D and D2H at >= 64 MiB within 5% of torch (or faster): {ok}")
ok2 = all(r["speedup"] >= 100 and r["cached_alloc_free_ns"] <= ta.get(r["bytes"], {}).get("cached_pin_memory_ns", float("inf")) for r in a["alloc"])
print(f"cached alloc+free >= 100x cheaper than cudaHostAlloc+cudaFreeHost and no slower than torch's cached pin_memory: {ok2}")
PY
