#!/usr/bin/env bash
# allocd as PyTorch's allocator on a GPU machine, in one command, from the repository root:
#
#   scripts/device_pytorch.sh [LIBDIR]
#
# LIBDIR (default .devrun) holds the built liballocd.so; the anchor workloads file is
# $ANCHOR (default .devrun/anchor/workloads.py). Logs, result JSON and compare.md go to
# $OUT (default .devrun/out). No network is used.
#
# Stages: the GPU unit tests (python/tests/test_gpu.py), then five workload processes
# (native, native again, allocd, native with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
# allocd with ALLOCD_CONF=expandable_segments:True), then the comparison.
#
# Overrides (environment):
#   WORKLOADS  comma-separated workloads (default: all four), e.g. to split over two calls
#   STEPS      timed steps for every workload (default: per workload, 20-40)
#   UNIT=0     skip the unit tests;   RUNS=native,native2,allocd,native_exp,allocd_exp  (subset)
#   BUDGET_S   stop starting new runs past this many seconds (default 540)
set -uo pipefail

LIBDIR=${1:-.devrun}
OUT=${OUT:-.devrun/out}
ANCHOR=${ANCHOR:-.devrun/anchor/workloads.py}
WORKLOADS=${WORKLOADS:-gpt2_train,resnet50_train,multistream_prefetch,gpt2m_generate}
STEPS=${STEPS:-}
UNIT=${UNIT:-1}
RUNS=${RUNS:-native,native2,allocd,native_exp,allocd_exp}
BUDGET_S=${BUDGET_S:-540}

START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[device_pytorch +$(elapsed)s] $*"; }
die() { echo "[device_pytorch +$(elapsed)s] FATAL: $*" >&2; exit 2; }

[ -f scripts/torch_workloads.py ] || die "run from the repository root (scripts/torch_workloads.py not found)"
[ -f "$LIBDIR/liballocd.so" ] || die "no liballocd.so in $LIBDIR (build: CGO_ENABLED=1 go build -buildmode=c-shared -o $LIBDIR/liballocd.so ./cmd/liballocd)"
[ -f "$ANCHOR" ] || die "anchor workloads file $ANCHOR not found (set ANCHOR)"
mkdir -p "$OUT" || die "cannot create $OUT"

export ALLOCD_LIB
ALLOCD_LIB=$(realpath "$LIBDIR/liballocd.so")
export ALLOCD_TORCH_CACHE=${ALLOCD_TORCH_CACHE:-$PWD/.devrun/allocd_torch_cache}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset ALLOCD_DEVICE # the real GPU, never the simulated device
# Each run sets its own allocator configuration.
unset PYTORCH_CUDA_ALLOC_CONF ALLOCD_CONF ALLOCD_METRICS_LISTEN

say "OUT=$OUT ALLOCD_LIB=$ALLOCD_LIB ANCHOR=$ANCHOR WORKLOADS=$WORKLOADS STEPS=${STEPS:-default} RUNS=$RUNS"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | sed 's/^/  gpu: /'
python3 -c 'import sys, torch, transformers, torchvision; print("  python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())' \
	|| die "python3 with torch, transformers and torchvision is needed"
command -v g++ >/dev/null || say "WARNING: no g++ on PATH: allocd_torch cannot build its hooks"

unit_rc=skipped
if [ "$UNIT" = 1 ]; then
	say "GPU unit tests (python/tests/test_gpu.py) -> $OUT/test_gpu.log"
	t=$(date +%s)
	timeout 240 python3 -m unittest -v python/tests/test_gpu.py >"$OUT/test_gpu.log" 2>&1
	unit_rc=$?
	grep -E '^GPU |^(FAIL|ERROR):|^Ran |^OK|^FAILED' "$OUT/test_gpu.log" | sed 's/^/  /'
	say "unit tests exit $unit_rc in $(( $(date +%s) - t )) s"
fi

steps_arg=()
[ -n "$STEPS" ] && steps_arg=(--steps "$STEPS")
declare -A run_rc
last_s=0
for run in ${RUNS//,/ }; do
	case $run in
	native | native2) alloc=native envs=() ;;
	allocd) alloc=allocd envs=() ;;
	native_exp) alloc=native envs=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
	allocd_exp) alloc=allocd envs=(ALLOCD_CONF=expandable_segments:True) ;;
	*) die "unknown run $run" ;;
	esac
	if (( $(elapsed) + last_s > BUDGET_S )); then
		say "SKIPPED run $run: $(elapsed) s spent, the last run took $last_s s, budget $BUDGET_S s"
		run_rc[$run]=skipped
		continue
	fi
	say "run $run: --allocator $alloc ${envs[*]:-} -> $OUT/$run.json, $OUT/$run.log"
	t=$(date +%s)
	env "${envs[@]}" timeout $(( BUDGET_S + 40 - $(elapsed) )) python3 scripts/torch_workloads.py --allocator "$alloc" \
		--workloads "$WORKLOADS" --anchor "$ANCHOR" --out "$OUT/$run.json" "${steps_arg[@]}" >"$OUT/$run.log" 2>&1
	run_rc[$run]=$?
	last_s=$(( $(date +%s) - t ))
	grep -E '^\[..:..:..\] ' "$OUT/$run.log" | sed 's/^/  /'
	[ "${run_rc[$run]}" = 0 ] || { say "run $run FAILED (exit ${run_rc[$run]}); its log ends:"; tail -25 "$OUT/$run.log" | sed 's/^/  | /'; }
	say "run $run exit ${run_rc[$run]} in $last_s s"
done

cmp_rc=skipped
if [ -f "$OUT/native.json" ] && [ -f "$OUT/native2.json" ] && [ -f "$OUT/allocd.json" ]; then
	extra=()
	[ -f "$OUT/native_exp.json" ] && [ -f "$OUT/allocd_exp.json" ] && extra=("$OUT/native_exp.json" "$OUT/allocd_exp.json")
	say "comparison -> $OUT/compare.md"
	python3 scripts/compare_workloads.py "$OUT/native.json" "$OUT/native2.json" "$OUT/allocd.json" "${extra[@]}" \
		--md "$OUT/compare.md" 2>&1 | tee "$OUT/compare.log"
	cmp_rc=${PIPESTATUS[0]}
else
	say "no comparison: native.json, native2.json and allocd.json are all needed"
fi

summary="unit tests: $unit_rc;"
for run in ${RUNS//,/ }; do summary+=" $run: ${run_rc[$run]:-?};"; done
say "DONE in $(elapsed) s. exit codes: $summary compare: $cmp_rc (0 = every criterion passed)"
ok=1
[ "$unit_rc" = 0 ] || [ "$unit_rc" = skipped ] || ok=0
for run in ${RUNS//,/ }; do [ "${run_rc[$run]:-?}" = 0 ] || ok=0; done
[ "$cmp_rc" = 0 ] || ok=0
[ $ok = 1 ] || exit 1
