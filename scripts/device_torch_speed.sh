#!/usr/bin/env bash
# allocd's step-time and CPU-time cost in PyTorch, decided over interleaved runs, on a GPU
# machine, from the repository root:
#
#   scripts/device_torch_speed.sh [LIBDIR]
#
# LIBDIR (default .devrun) holds liballocd.so; the anchor workloads file is $ANCHOR (default
# .devrun/anchor/workloads.py). Results go to $OUT (default .devrun/out/speed).
#
# 1. scripts/torch_cpp_alloc_bench.py (the allocator's cost in C++, no Python in the loop),
#    in ABBA order, $CPPPAIRS pairs (default 2) -> $OUT/cpp_<alloc>_<i>.json. CPPBENCH=0
#    skips it.
# 2. scripts/torch_alloc_bench.py (the same through torch.empty in Python), native then
#    allocd, twice -> $OUT/bench_<alloc>_<i>.json. Off unless BENCH=1.
# 3. scripts/torch_workloads.py, native and allocd alternately (ABBA order), $PAIRS times
#    (default 8), on $WORKLOADS (default gpt2_train,multistream_prefetch) with $STEPS timed
#    steps (default 60) -> $OUT/<alloc>_<i>.json and .log.
# 4. scripts/compare_speed.py over the C++ benches and the complete pairs -> $OUT/speed.md,
#    written after stage 1 and again after every pair, so a run cut short keeps what finished;
#    it tables the step times and what each allocator did a timed step (device calls, and
#    allocd's reclaims, loans and virtual memory time: torch_workloads.py's per_step).
#
# EXPANDABLE (default empty): fine or coarse runs stage 3 with expandable segments on both
# sides: native with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, allocd with
# ALLOCD_CONF=expandable_segments:True,expandable_reclaim:$EXPANDABLE.
#
# PIN (default empty): a CPU list (taskset -c) every benchmark process runs on, the same for
# both allocators, so that which cores a process lands on does not pass for a difference
# between allocators. SYNC (default blocking) is torch_workloads.py's --sync.
#
# BUDGET_S (default 450): no process starts once the seconds spent plus the last duration of a
# process of its stage (for a stage's first process, of the last process) would pass it; it
# is reported SKIPPED. A process still running at HARD_S (default BUDGET_S + 90) seconds is
# stopped. Every line this script prints carries the seconds since it started.
set -uo pipefail

LIBDIR=${1:-.devrun}
OUT=${OUT:-.devrun/out/speed}
ANCHOR=${ANCHOR:-.devrun/anchor/workloads.py}
WORKLOADS=${WORKLOADS:-gpt2_train,multistream_prefetch}
STEPS=${STEPS:-60}
PAIRS=${PAIRS:-8}
CPPBENCH=${CPPBENCH:-1} # 0 skips stage 1
CPPPAIRS=${CPPPAIRS:-2}
PIN=${PIN:-}
SYNC=${SYNC:-blocking}
BENCH=${BENCH:-0}       # 1 runs stage 2
EXPANDABLE=${EXPANDABLE:-}
case $EXPANDABLE in
"" | fine | coarse) ;;
*) echo "EXPANDABLE=$EXPANDABLE: expected fine or coarse" >&2; exit 2 ;;
esac
BUDGET_S=${BUDGET_S:-450}
HARD_S=${HARD_S:-$((BUDGET_S + 90))}

START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[device_torch_speed +$(elapsed)s] $*"; }

[ -f scripts/torch_workloads.py ] || { say "run from the repository root" >&2; exit 2; }
[ -f "$LIBDIR/liballocd.so" ] || { say "no liballocd.so in $LIBDIR" >&2; exit 2; }
mkdir -p "$OUT" || exit 2
export ALLOCD_LIB
ALLOCD_LIB=$(realpath "$LIBDIR/liballocd.so")
export ALLOCD_TORCH_CACHE=${ALLOCD_TORCH_CACHE:-$PWD/.devrun/allocd_torch_cache}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset ALLOCD_DEVICE PYTORCH_CUDA_ALLOC_CONF ALLOCD_CONF ALLOCD_METRICS_LISTEN

say "OUT=$OUT ALLOCD_LIB=$ALLOCD_LIB WORKLOADS=$WORKLOADS STEPS=$STEPS PAIRS=$PAIRS CPPBENCH=$CPPBENCH" \
	"CPPPAIRS=$CPPPAIRS BENCH=$BENCH EXPANDABLE=${EXPANDABLE:-off} PIN=${PIN:-none} SYNC=$SYNC BUDGET_S=$BUDGET_S HARD_S=$HARD_S"
pin=()
if [ -n "$PIN" ]; then
	command -v taskset >/dev/null || { say "PIN=$PIN but no taskset" >&2; exit 2; }
	pin=(taskset -c "$PIN")
fi
command -v lscpu >/dev/null && lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|NUMA node\(s\)|CPU max MHz)' | sed 's/^/  cpu: /'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/  gpu: /'

rc=0
skipped=0
last_s=0
declare -A stage_last

# proc STAGE NAME LOG CMD...: runs CMD with its output in LOG unless the budget forbids it
# (then returns 3). Returns CMD's exit status.
proc() {
	local stage=$1 name=$2 logf=$3 t r est lim
	shift 3
	est=${stage_last[$stage]:-$last_s}
	if (($(elapsed) + est > BUDGET_S || $(elapsed) + 1 >= HARD_S)); then
		say "SKIPPED $name: $(elapsed) s spent + $est s (the last such process) would pass BUDGET_S $BUDGET_S s (or HARD_S $HARD_S s)"
		skipped=$((skipped + 1))
		return 3
	fi
	say "$name -> $logf"
	t=$(date +%s)
	lim=$((HARD_S - $(elapsed)))
	((lim > 0)) || lim=1
	timeout -k 10 "$lim" "$@" >"$logf" 2>&1
	r=$?
	last_s=$(($(date +%s) - t))
	stage_last[$stage]=$last_s
	if [ $r != 0 ]; then
		rc=1
		say "$name FAILED (exit $r$([ $r = 124 ] && echo ": stopped at HARD_S")); its log ends:"
		tail -20 "$logf" | sed 's/^/  | /'
	fi
	say "$name exit $r in $last_s s"
	return $r
}

cpp=()
results=()
rm -f "$OUT/speed.md" "$OUT/compare.log" # from an earlier run
# compare writes $OUT/speed.md from what has finished so far.
compare() {
	local bench=()
	[ "$BENCH" = 1 ] && [ -f "$OUT/bench_native_2.json" ] && [ -f "$OUT/bench_allocd_2.json" ] &&
		bench=(--bench "$OUT/bench_native_2.json" "$OUT/bench_allocd_2.json")
	local cpparg=()
	((${#cpp[@]})) && cpparg=(--cpp "${cpp[@]}")
	if ((${#results[@]} + ${#cpp[@]} == 0)); then
		say "nothing to compare yet"
		return 0
	fi
	python3 scripts/compare_speed.py "${results[@]}" "${bench[@]}" "${cpparg[@]}" --md "$OUT/speed.md" \
		>"$OUT/compare.log" 2>&1 || { rc=1; say "compare_speed.py FAILED:"; tail -20 "$OUT/compare.log"; return 1; }
	say "wrote $OUT/speed.md (${#results[@]} workload runs, ${#cpp[@]} C++ bench runs)"
}

# 1. the C++ allocator bench, interleaved: native, allocd, allocd, native, ...
if [ "$CPPBENCH" = 1 ]; then
	order=()
	for p in $(seq 1 "$CPPPAIRS"); do
		if ((p % 2)); then order+=(native:$p allocd:$p); else order+=(allocd:$p native:$p); fi
	done
	for ai in "${order[@]}"; do
		a=${ai%:*} i=${ai#*:}
		f="$OUT/cpp_${a}_$i.json" logf="$OUT/cpp_${a}_$i.log"
		rm -f "$f" "$logf"
		proc cpp "cpp bench $a $i" "$logf" \
			"${pin[@]}" python3 scripts/torch_cpp_alloc_bench.py --allocator "$a" --out "$f"
		[ -f "$logf" ] && sed "s/^/  cpp $a $i: /" "$logf"
		[ -f "$f" ] && cpp+=("$f") # a partial file (cut short) holds the figures that finished
	done
	compare
fi

# 2. the Python torch.empty bench.
if [ "$BENCH" = 1 ]; then
	for i in 1 2; do
		for a in native allocd; do
			f="$OUT/bench_${a}_$i.json" logf="$OUT/bench_${a}_$i.log"
			rm -f "$f" "$logf"
			proc bench "torch.empty bench $a $i" "$logf" \
				"${pin[@]}" python3 scripts/torch_alloc_bench.py --allocator "$a" --out "$f"
			[ -f "$logf" ] && sed "s/^/  bench $a $i: /" "$logf"
		done
	done
fi

# 3. the workloads, in pairs; only a pair whose two runs both finished is compared.
for i in $(seq 1 "$PAIRS"); do
	# ABBA: odd pairs run native first, even pairs allocd first, so that a drift over the
	# session (clocks, temperature) does not always favour one side.
	order="native allocd"
	[ $((i % 2)) = 0 ] && order="allocd native"
	pair=()
	for a in $order; do
		f="$OUT/${a}_$i.json" logf="$OUT/${a}_$i.log"
		rm -f "$f" "$logf"
		conf=()
		if [ -n "$EXPANDABLE" ]; then
			conf=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
			[ "$a" = allocd ] && conf=(env ALLOCD_CONF=expandable_segments:True,expandable_reclaim:$EXPANDABLE)
		fi
		proc workloads "workloads $a $i" "$logf" \
			"${conf[@]}" "${pin[@]}" python3 scripts/torch_workloads.py --allocator "$a" --workloads "$WORKLOADS" --anchor "$ANCHOR" \
			--steps "$STEPS" --sync "$SYNC" --out "$f" && [ -f "$f" ] && pair+=("$f")
		[ -f "$logf" ] && grep -E '^\[..:..:..\] ' "$logf" | sed "s/^/  $a $i /"
	done
	if ((${#pair[@]} == 2)); then
		results+=("${pair[@]}")
		compare
	else
		say "pair $i incomplete: left out of the comparison"
	fi
done

[ -f "$OUT/speed.md" ] && cat "$OUT/speed.md"
say "DONE in $(elapsed) s: ${#results[@]} workload runs and ${#cpp[@]} C++ bench runs compared," \
	"$skipped processes SKIPPED for the budget; exit $rc"
exit $rc
