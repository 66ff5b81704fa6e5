#!/usr/bin/env bash
# allocd's step-time cost in PyTorch, decided over interleaved runs, on a GPU machine, from the
# repository root:
#
#   scripts/device_torch_speed.sh [LIBDIR]
#
# LIBDIR (default .devrun) holds liballocd.so; the anchor workloads file is $ANCHOR (default
# .devrun/anchor/workloads.py). Results go to $OUT (default .devrun/out/speed).
#
# 1. scripts/torch_alloc_bench.py, native then allocd, twice: what one cached malloc+free
#    costs through torch.empty under each allocator.
# 2. scripts/torch_workloads.py, native and allocd alternately (ABBA order), $PAIRS times (default 3), on
#    $WORKLOADS (default gpt2_train,multistream_prefetch) with $STEPS timed steps (default 60).
#    BENCH=0 skips step 1.
# 3. scripts/compare_speed.py over all of them -> $OUT/speed.md.
set -uo pipefail

LIBDIR=${1:-.devrun}
OUT=${OUT:-.devrun/out/speed}
ANCHOR=${ANCHOR:-.devrun/anchor/workloads.py}
WORKLOADS=${WORKLOADS:-gpt2_train,multistream_prefetch}
STEPS=${STEPS:-60}
PAIRS=${PAIRS:-3}
BENCH=${BENCH:-1} # 0 skips step 1

[ -f "$LIBDIR/liballocd.so" ] || { echo "no liballocd.so in $LIBDIR" >&2; exit 2; }
mkdir -p "$OUT"
export ALLOCD_LIB
ALLOCD_LIB=$(realpath "$LIBDIR/liballocd.so")
export ALLOCD_TORCH_CACHE=${ALLOCD_TORCH_CACHE:-$PWD/.devrun/allocd_torch_cache}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset ALLOCD_DEVICE PYTORCH_CUDA_ALLOC_CONF ALLOCD_CONF ALLOCD_METRICS_LISTEN

rc=0
for i in $( [ "$BENCH" = 1 ] && echo 1 2 ); do
	for a in native allocd; do
		python3 scripts/torch_alloc_bench.py --allocator $a --out "$OUT/bench_${a}_$i.json" || rc=1
	done
done
results=()
for i in $(seq 1 "$PAIRS"); do
	# ABBA: odd pairs run native first, even pairs allocd first, so that a drift over the
	# session (clocks, temperature) does not always favour one side.
	order="native allocd"
	[ $((i % 2)) = 0 ] && order="allocd native"
	for a in $order; do
		f="$OUT/${a}_$i.json"
		python3 scripts/torch_workloads.py --allocator $a --workloads "$WORKLOADS" --anchor "$ANCHOR" \
			--steps "$STEPS" --out "$f" >"$OUT/${a}_$i.log" 2>&1 || { rc=1; tail -20 "$OUT/${a}_$i.log"; }
		grep -E '^\[..:..:..\] ' "$OUT/${a}_$i.log" | sed "s/^/  $a $i /"
		[ -f "$f" ] && results+=("$f")
	done
done
bench=()
[ "$BENCH" = 1 ] && bench=(--bench "$OUT/bench_native_2.json" "$OUT/bench_allocd_2.json")
python3 scripts/compare_speed.py "${results[@]}" "${bench[@]}" --md "$OUT/speed.md" || rc=1
exit $rc
