#!/usr/bin/env bash
# allocd bench beside PyTorch's allocator on a GPU machine, in one command, from the
# repository root:
#
#   scripts/device_bench.sh TRACEDIR ANCHORDIR
#
# TRACEDIR holds the traces, *.pickle.gz or *.pickle (testdata/traces holds all ten);
# ANCHORDIR holds PyTorch's anchor (bench.py). Builds allocd into $BIN (default
# .devrun/bin) when Go is present, then runs, writing each stage's results to $OUT
# (default .devrun/bench) as it ends:
#   1. allocd bench --device cuda --json TRACES       -> allocd.json, allocd.err
#      (pair; mixed cold and warm at 1, 2, 4 and 8 goroutines; each trace cold, warm
#      and the replay driver alone)
#   2. PyTorch's anchor on the same traces              -> anchor.json, anchor.log
#   3. $ROUNDS rounds (default 5) of the replays and the pair, both sides one right
#      after the other on one CPU core, each side's timed replays of a trace after an
#      untimed one (scripts/paired_replays.py: it picks the fastest core of the host
#      and says why), and each side's replay loop alone (the anchor's from
#      scripts/anchor_driver.cpp)                            -> paired.json, paired.txt
#   4. each ratio beside the speed goal it is held to   -> compare.txt
#      (a replay's or a pair's ratio is the median over the paired rounds of the
#      round's ratio, with the ratio of the two sides' best rounds beside it: on a
#      shared host one core runs a replay up to 1.6x slower than another, and a core's
#      speed moves from minute to minute; mixed ratios come from stages 1 and 2)
#   5. what cudaMalloc costs a plain C program (scripts/cuda_malloc_probe.c, built
#      with nvcc where it is present) for the device-malloc sizes of the traces
#      $PROBE_TRACES names (default resnet50_train), in a fresh process and after
#      a pass freed them: the driver's own cost beside each side's per-call
#      figures in compare.txt                          -> probe.txt
#   6. CPU profiles of allocd's replays of the traces $PROF_TRACES names (default
#      gpt2m_generate, gpt2_train and resnet50_train, the remaining time shared
#      equally), each trace given $PROF_REPS times (default 100; 30 for
#      gpt2m_generate, twenty times longer) to one allocd bench --cpuprofile:
#      one profile per trace holds its cold and warm replays, told apart by label
#      (go tool pprof -tagfocus=bench=replay_cold, or -tagfocus=pass=second for the
#      warm replay's timed pass)                        -> profiles.tar.gz
#      (the profiles, their runs' JSON, a summary of the runs' spread, top lists
#      where Go is present, and the allocd binary for go tool pprof)
# plus gpu.txt: ten files in all. Both sides run in the same command, so that the
# ratios do not mix machines. Stages stop starting past $BUDGET_S seconds (default
# 420 here); each stage's timeout leaves time for the ones after it. No network is
# used. To check the script without a GPU: DEVICE=sim (allocd's stages on the
# simulated device; the anchor fails without torch, and the comparison prints
# allocd's side), BENCH_ARGS="--pair-iters 20000 --mixed-steps 20000" (added to
# stage 1) and PROF_REPS=5.
set -uo pipefail
. "$(dirname "$0")/device_lib.sh"
BUDGET_S=${BUDGET_S:-420}
PROF_REPS=${PROF_REPS:-100}
PROF_TRACES=${PROF_TRACES:-gpt2m_generate gpt2_train resnet50_train}
PROBE_TRACES=${PROBE_TRACES:-resnet50_train}
ROUNDS=${ROUNDS:-5}
DEVICE=${DEVICE:-cuda}
read -ra bench_args <<<"${BENCH_ARGS:-}"
device_setup device_bench "$@"
device_build

shopt -s nullglob
traces=("$TRACES"/*.pickle.gz "$TRACES"/*.pickle)
[ ${#traces[@]} -gt 0 ] || { say "no *.pickle.gz or *.pickle in $TRACES"; exit 2; }
say "${#traces[@]} traces in $TRACES"

say "allocd bench -> $OUT/allocd.json"
timeout "$(($(left) * 2 / 5))" "$BIN/allocd" bench --device "$DEVICE" --json "${bench_args[@]}" "${traces[@]}" >"$OUT/allocd.json" 2>"$OUT/allocd.err"
echo "allocd bench rc=$?"

say "PyTorch anchor -> $OUT/anchor.json"
tr=$(mktemp -d)
for f in "${traces[@]}"; do
	case $f in
	*.gz) gunzip -c "$f" >"$tr/$(basename "$f" .gz)" ;;
	*) cp "$f" "$tr/" ;;
	esac
done
limit=$(($(left) - 60))
[ "$limit" -gt 0 ] || limit=1
EXT_BUILD=/tmp/anchor_build timeout "$limit" python3 "$ANCHOR/bench.py" "$tr" "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
echo "anchor rc=$?"

say "paired rounds on one core -> $OUT/paired.json"
limit=$(($(left) - 60))
[ "$limit" -gt 0 ] || limit=1
EXT_BUILD=/tmp/anchor_build timeout "$limit" python3 "$(dirname "$0")/paired_replays.py" "$BIN/allocd" "$tr" "$ANCHOR" \
	"$OUT/paired.json" --rounds "$ROUNDS" --device "$DEVICE" --budget "$((limit * 2 / 3))" >"$OUT/paired.txt" 2>&1
echo "paired rc=$?"
rm -rf "$tr"

python3 - "$OUT/allocd.json" "$OUT/anchor.json" "$OUT/paired.json" <<'PY' | tee "$OUT/compare.txt"
import json, statistics, sys

def load(path, who):
    try:
        return json.load(open(path))
    except Exception as e:
        print(f"no {who} figures ({path}): {e}")
        return {}

a, t, paired = load(sys.argv[1], "allocd"), load(sys.argv[2], "PyTorch"), load(sys.argv[3], "paired")
micro, rep = t.get("micro", {}), t.get("replay", {})
rounds = paired.get("rounds") or []
print(f"replays and pairs: {len(rounds)} paired round(s) on core {paired.get('core', 'n/a')}; a ratio is the median"
      " of the rounds' ratios (PyTorch / allocd), with the best round against the best round beside it")

def line(what, ratio, goal, best=None):
    mark = "met" if ratio >= goal else "NOT met"
    extra = f"; best/best {best:.2f}x" if best else ""
    print(f"{what:<66} {ratio:>7.2f}x  (goal {goal}x: {mark}{extra})")

def na(what, goal):
    print(f"{what:<66} {'n/a':>8}  (goal {goal}x)")

def pairs(get):
    """The rounds' (PyTorch, allocd) figures that get finds."""
    out = []
    for r in rounds:
        try:
            out.append(get(r))
        except KeyError:
            pass
    return out

def judged(what, v, goal):
    """A ratio line from paired figures: the median of the rounds' ratios."""
    if not v:
        na(what, goal)
        return
    t, al = [x for x, _ in v], [y for _, y in v]
    line(f"{what}: PyTorch {statistics.median(t):.0f} / allocd {statistics.median(al):.0f}",
         statistics.median(x / y for x, y in v), goal, min(t) / min(al))
    if len(v) > 1:
        print(f"  round by round: PyTorch {' '.join(f'{x:.0f}' for x in t)}; allocd {' '.join(f'{y:.0f}' for y in al)}")

for size in sorted(a.get("pair_ns", {}), key=int):
    judged(f"pair/{size} ns", pairs(lambda r: (r["pair"]["torch"][size], r["pair"]["allocd"][size])), 5)
runs = {(kind, r["threads"]): r for kind in ("mixed", "mixed_warm") for r in a.get(kind) or []}
w1, w8 = runs.get(("mixed_warm", 1)), runs.get(("mixed_warm", 8))
if w1 and w8:
    line(f"mixed warm t8 / own t1: {w8['mops_per_s']:.2f} / {w1['mops_per_s']:.2f} Mops/s", w8["mops_per_s"] / w1["mops_per_s"], 5)
    if w8.get("first_done_ms") and w1.get("last_done_ms"):
        # The wall time ends with the slowest goroutine: on a host whose cores differ
        # in speed, the spread says how much of the ratio the slowest core took.
        print(f"  t8's goroutines finished their steps from {w8['first_done_ms']:.0f} to {w8['last_done_ms']:.0f} ms"
              f" (t1's one goroutine, taking as many steps, in {w1['last_done_ms']:.0f} ms);"
              f" t8 / t1 at the first goroutine's pace {8 * w1['last_done_ms'] / w8['first_done_ms']:.2f}x, at the last's"
              f" {8 * w1['last_done_ms'] / w8['last_done_ms']:.2f}x")
    if "timed_cap_borrows" in w8:
        # What keeping the peaks exact cost the eight goroutines in memory they share.
        n = w8["ops"]
        print(f"  t8's timed pass: {w8['timed_cap_borrows'] / n:.4f} borrows, {w8['timed_cap_steals'] / n:.4f} steals"
              f" and {w8['timed_escalations'] / n:.5f} escalations a step")
tw8 = micro.get("mixed_warm_torch_t8", {}).get("mops_per_s")
if w8 and tw8:
    line(f"mixed warm t8: allocd {w8['mops_per_s']:.2f} / PyTorch {tw8:.2f} Mops/s", w8["mops_per_s"] / tw8, 20)
c8, tc8 = runs.get(("mixed", 8)), micro.get("mixed_torch_t8", {})
if c8 and tc8.get("mops_per_s"):
    line(f"mixed cold t8: allocd {c8['mops_per_s']:.2f} / PyTorch {tc8['mops_per_s']:.2f} Mops/s", c8["mops_per_s"] / tc8["mops_per_s"], 10)
    pr = tc8.get("peak_reserved") or 0
    print(f"{'mixed cold t8 peak reserved, MiB: allocd / PyTorch':<66} {c8['peak_reserved_bytes'] / 2**20:>7.0f} / {pr / 2**20:.0f}"
          f"  (goal: no higher: {'met' if c8['peak_reserved_bytes'] <= pr else 'NOT met'})")

# Replays, per trace: warm (the second of two passes on one pool) against 3x (5x on
# gpt2m_generate), cold against 1.5x, from the paired rounds; and, from stages 1 and 2,
# what one cudaMalloc costs each side: allocd measures its device mallocs
# (device_malloc_ns_per_op x ops / device mallocs); PyTorch's is estimated as
# (cold - warm) x ops / device allocs, and allocd's by the same formula beside it.
def per_malloc(ns_per_op, ops, mallocs):
    return f"{ns_per_op * ops / mallocs / 1000:.1f} us" if ns_per_op is not None and mallocs else "n/a"

for r in a.get("replay") or []:
    name = r["trace"].removesuffix(".pickle.gz").removesuffix(".pickle")
    tr = rep.get(name, {})
    q = tr.get("torch", {})
    print()
    goal = 5 if name == "gpt2m_generate" else 3
    for kind, key, g in (("warm", "warm_ns_per_op", goal), ("cold", "ns_per_op", 1.5)):
        judged(f"replay {name} {kind} ns/op",
               pairs(lambda x: (x["replay"][name]["torch"][key], x["replay"][name]["allocd"][key])), g)
    ac, aw = r.get("ns_per_op"), r.get("warm_ns_per_op")
    tc, tw = q.get("ns_per_op"), q.get("warm_ns_per_op")
    ops, mallocs = r["ops"], r["device_mallocs"]
    print(f"  stage 1 and 2, one run each: ns per cudaMalloc: allocd {per_malloc(r.get('device_malloc_ns_per_op'), ops, mallocs)} measured,"
          f" {per_malloc(ac - aw if ac and aw else None, ops, mallocs)} as (cold - warm) x ops / {mallocs};"
          f" PyTorch {per_malloc(tc - tw if tc and tw else None, tr.get('ops', 0), q.get('num_device_alloc'))}"
          f" as (cold - warm) x {tr.get('ops', 'n/a')} / {q.get('num_device_alloc', 'n/a')}")
    tnew = q.get("warm_num_device_alloc", 0) - q.get("num_device_alloc", 0) if "warm_num_device_alloc" in q else "n/a"
    ad = r.get("driver_ns_per_op")
    td = (paired.get("torch_driver_ns_per_op") or {}).get(name)
    print(f"  device mallocs in the warm pass: allocd {r.get('warm_device_mallocs', 'n/a')}, PyTorch {tnew};"
          f" the replay loop alone: allocd's {ad if ad is not None else float('nan'):.1f} ns/op,"
          f" the anchor's {td if td is not None else float('nan'):.1f} ns/op;"
          f" allocd's cold in cudaMalloc {r.get('device_malloc_ns_per_op', 0):.0f} ns/op")
PY

say "cudaMalloc in a plain C program -> $OUT/probe.txt"
if command -v nvcc >/dev/null && [ "$(left)" -gt 40 ] &&
	timeout 60 nvcc -O2 -o "$BIN/cuda_malloc_probe" "$(dirname "$0")/cuda_malloc_probe.c" >"$OUT/probe.txt" 2>&1; then
	read -r -a probe_traces <<<"$PROBE_TRACES"
	for name in "${probe_traces[@]}"; do
		f=$(ls "$TRACES/$name".pickle.gz "$TRACES/$name".pickle 2>/dev/null | head -1)
		[ -n "$f" ] || continue
		python3 - "$f" "$BIN/$name.sizes" <<'PY'
import gzip, pickle, sys
path = sys.argv[1]
snap = pickle.load(gzip.open(path) if path.endswith(".gz") else open(path, "rb"))
sizes = [e["size"] for e in snap["device_traces"][0] if e["action"] == "segment_alloc"]
open(sys.argv[2], "w").write("".join(f"{s}\n" for s in sizes))
PY
		echo "$name: $(wc -l <"$BIN/$name.sizes") sizes" >>"$OUT/probe.txt"
		timeout 30 "$BIN/cuda_malloc_probe" "$BIN/$name.sizes" 3 >>"$OUT/probe.txt" 2>&1
	done
else
	echo "no probe: no nvcc, no time left, or the build failed" >>"$OUT/probe.txt"
fi
cat "$OUT/probe.txt"

say "CPU profiles of allocd's replays -> $OUT/profiles.tar.gz"
prof=$(mktemp -d)
mkdir "$prof/profiles"
cp "$BIN/allocd" "$prof/profiles/allocd"
read -r -a prof_traces <<<"$PROF_TRACES"
remaining=${#prof_traces[@]}
for name in "${prof_traces[@]}"; do
	f=$(ls "$TRACES/$name".pickle.gz "$TRACES/$name".pickle 2>/dev/null | head -1)
	remaining=$((remaining - 1))
	[ -n "$f" ] || { say "no $name trace in $TRACES"; continue; }
	[ "$(left)" -gt 20 ] || { say "no time left for the $name profile"; break; }
	reps=$PROF_REPS
	[ "$name" = gpt2m_generate ] && reps=$(((PROF_REPS * 3 + 9) / 10))
	args=()
	for _ in $(seq "$reps"); do args+=("$f"); done
	limit=$((($(left) - 10) / (remaining + 1)))
	timeout "$limit" "$BIN/allocd" bench --device "$DEVICE" --no-pair --no-mixed --json \
		--cpuprofile "$prof/profiles/$name.prof" "${args[@]}" >"$prof/profiles/$name.json" 2>"$prof/profiles/$name.err"
	echo "allocd bench --cpuprofile $name rc=$?"
	if command -v go >/dev/null && [ -s "$prof/profiles/$name.prof" ]; then
		for sel in bench=replay_cold pass=second; do
			go tool pprof -top -nodecount 40 -tagfocus="$sel" "$prof/profiles/allocd" "$prof/profiles/$name.prof" \
				>"$prof/profiles/$name.${sel#*=}.top.txt" 2>&1
		done
	fi
done
python3 - "$prof/profiles"/*.json <<'PY' | tee "$prof/profiles/summary.txt"
import json, statistics, sys
for path in sys.argv[1:]:
    try:
        rows = json.load(open(path)).get("replay") or []
    except Exception as e:
        print(f"{path}: no runs: {e}")
        continue
    if not rows:
        continue
    print(f"{rows[0]['trace']}: {len(rows)} runs, ns/op min / median / max")
    for key in ("ns_per_op", "warm_ns_per_op", "device_malloc_ns_per_op", "driver_ns_per_op"):
        v = sorted(r[key] for r in rows if key in r)
        if v:
            print(f"  {key:<26} {v[0]:8.1f} {statistics.median(v):8.1f} {v[-1]:8.1f}")
PY
tar -czf "$OUT/profiles.tar.gz" -C "$prof" profiles
rm -rf "$prof"
ls -la "$OUT"
say "done"
exit 0
