#!/usr/bin/env bash
# CUDA graphs, private pools and torch.compile(mode="reduce-overhead") under allocd and
# PyTorch's allocator, on a GPU machine, in one command, from the repository root:
#
#   scripts/device_graphs.sh [LIBDIR]
#
# LIBDIR (default .devrun) holds the built liballocd.so; the anchor workloads file is $ANCHOR
# (default .devrun/anchor/workloads.py). Results go to $OUT (default .devrun/out): one JSON
# and one log per process, graphs_<allocator>_<group>.json / .log for the functional stages
# and graphs_decode_<allocator>_<pair>.json / .log for the decode timing, then compare.md
# (scripts/compare_graphs.py) and graphs.tgz (all of them). No network is used.
#
# 0. With WARM_COMPILE=1 (the default), one native process of the compile stages first, not
#    compared (graphs_warmup_native.json, tag "warmup"): it fills the inductor cache, so that
#    native's and allocd's compile processes below both compile warm and their peaks compare.
# 1. The functional stages (scripts/torch_graphs.py), each group of $FUNC_GROUPS in one
#    process per allocator, native first, then allocd. Default groups:
#    "capture_forward,two_graphs_pool,mempool" and "compile_generate,compile_resnet" (two
#    processes a side, so that a crash in one group does not lose the other).
# 2. The decode step's replay timing (stage decode_replay), $PAIRS pairs of processes (default
#    3) in ABBA order: native allocd, allocd native, native allocd, ...
# 3. python3 scripts/compare_graphs.py $OUT > $OUT/compare.md, then graphs.tgz.
#
# torch.compile's caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) are a fresh folder
# under /tmp for this run (removed at the end), shared by its processes: the first compile is
# cold, later ones reuse it. INDUCTOR_CACHE=DIR names another (kept). Not under $OUT: its many
# files would crowd the results out of a folder that is copied back.
#
# EXPANDABLE=1 runs every process with expandable segments: PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True for native, ALLOCD_CONF=expandable_segments:True for allocd (whose
# captures then map physical memory into private pools' ranges, and must take only memory whose
# earlier users have finished).
#
# Overrides (environment): FUNC_GROUPS (space-separated groups, "" for none), WARM_COMPILE, PAIRS,
# REPLAYS (capture_forward, default 100), DECODE_REPLAYS (default 300), DECODE_IMPL
# (auto|hf|manual), SYNC (torch_graphs.py --sync, default auto), PROC_S (the most a process
# may run, default 170), BUDGET_S (default 420: no process starts once the seconds spent plus
# the last duration of a process of its kind would pass it; it is reported SKIPPED),
# HARD_S (default BUDGET_S + 40: a process still running then is stopped).
set -uo pipefail

LIBDIR=${1:-.devrun}
OUT=${OUT:-.devrun/out}
ANCHOR=${ANCHOR:-.devrun/anchor/workloads.py}
FUNC_GROUPS=${FUNC_GROUPS-capture_forward,two_graphs_pool,mempool compile_generate,compile_resnet}
PAIRS=${PAIRS:-3}
REPLAYS=${REPLAYS:-100}
DECODE_REPLAYS=${DECODE_REPLAYS:-300}
DECODE_IMPL=${DECODE_IMPL:-auto}
WARM_COMPILE=${WARM_COMPILE:-1}
SYNC=${SYNC:-auto}
PROC_S=${PROC_S:-170}
BUDGET_S=${BUDGET_S:-420}
HARD_S=${HARD_S:-$((BUDGET_S + 40))}
EXPANDABLE=${EXPANDABLE:-0}

START=$(date +%s)
elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[device_graphs +$(elapsed)s] $*"; }
die() {
	echo "[device_graphs +$(elapsed)s] FATAL: $*" >&2
	exit 2
}

[ -f scripts/torch_graphs.py ] || die "run from the repository root (scripts/torch_graphs.py not found)"
[ -f "$LIBDIR/liballocd.so" ] || die "no liballocd.so in $LIBDIR (build: CGO_ENABLED=1 go build -buildmode=c-shared -o $LIBDIR/liballocd.so ./cmd/liballocd)"
[ -f "$ANCHOR" ] || die "anchor workloads file $ANCHOR not found (set ANCHOR)"
mkdir -p "$OUT" || die "cannot create $OUT"

export ALLOCD_LIB
ALLOCD_LIB=$(realpath "$LIBDIR/liballocd.so")
export ALLOCD_TORCH_CACHE=${ALLOCD_TORCH_CACHE:-$PWD/.devrun/allocd_torch_cache}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
unset ALLOCD_DEVICE # the real GPU, never the simulated device
# Each run sets its own allocator configuration: none here.
unset PYTORCH_CUDA_ALLOC_CONF ALLOCD_CONF ALLOCD_METRICS_LISTEN

own_cache=0
if [ -z "${INDUCTOR_CACHE:-}" ]; then
	INDUCTOR_CACHE=$(mktemp -d -t graphs_inductor.XXXXXX) || die "mktemp failed"
	own_cache=1
fi
export TORCHINDUCTOR_CACHE_DIR=$INDUCTOR_CACHE TRITON_CACHE_DIR=$INDUCTOR_CACHE/triton
cleanup() { [ "$own_cache" = 1 ] && rm -rf "$INDUCTOR_CACHE"; }
trap cleanup EXIT

say "OUT=$OUT ALLOCD_LIB=$ALLOCD_LIB ANCHOR=$ANCHOR FUNC_GROUPS='$FUNC_GROUPS' PAIRS=$PAIRS REPLAYS=$REPLAYS" \
	"DECODE_REPLAYS=$DECODE_REPLAYS DECODE_IMPL=$DECODE_IMPL SYNC=$SYNC PROC_S=$PROC_S BUDGET_S=$BUDGET_S HARD_S=$HARD_S" \
	"EXPANDABLE=$EXPANDABLE"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | sed 's/^/  gpu: /'
python3 -c 'import sys, torch, transformers, torchvision; print("  python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "torchvision", torchvision.__version__, "cuda", torch.cuda.is_available())' ||
	die "python3 with torch, transformers and torchvision is needed"
command -v g++ >/dev/null || say "WARNING: no g++ on PATH: allocd_torch cannot build its hooks"

# Only this script's files: an earlier run's would be compared with this one's.
rm -f "$OUT"/graphs_*.json "$OUT"/graphs_*.log "$OUT"/graphs_*.json.tmp "$OUT/compare.md" "$OUT/graphs.tgz"

rc=0
skipped=0
last_s=0
declare -A kind_last
results=()

# proc KIND NAME JSON LOG ARGS...: one torch_graphs.py process unless the budget forbids it
# (then returns 3). Returns its exit status.
proc() {
	local kind=$1 name=$2 json=$3 logf=$4 t r est lim
	shift 4
	est=${kind_last[$kind]:-$last_s}
	if (($(elapsed) + est > BUDGET_S || $(elapsed) + 5 >= HARD_S)); then
		say "SKIPPED $name: $(elapsed) s spent + $est s (the last such process) would pass BUDGET_S $BUDGET_S s (or HARD_S $HARD_S s)"
		skipped=$((skipped + 1))
		return 3
	fi
	lim=$((HARD_S - $(elapsed)))
	((lim > PROC_S)) && lim=$PROC_S
	local conf=()
	if [ "$EXPANDABLE" = 1 ]; then
		case " $* " in
		*" --allocator native "*) conf=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
		*" --allocator allocd "*) conf=(ALLOCD_CONF=expandable_segments:True) ;;
		esac
	fi
	say "$name -> $json (limit $lim s)${conf:+ with ${conf[*]}}"
	t=$(date +%s)
	env "${conf[@]}" timeout -k 10 "$lim" python3 scripts/torch_graphs.py --anchor "$ANCHOR" --out "$json" --sync "$SYNC" "$@" >"$logf" 2>&1
	r=$?
	last_s=$(($(date +%s) - t))
	kind_last[$kind]=$last_s
	grep -E '^\[..:..:..\] ' "$logf" | sed "s/^/  $name /"
	if [ $r != 0 ]; then
		[ "$kind" = warm ] || rc=1
		say "$name FAILED (exit $r$( ((r == 124 || r == 137)) && echo ": stopped at its $lim s limit")); its log ends:"
		tail -25 "$logf" | sed 's/^/  | /'
	fi
	[ -f "$json" ] && [ "$kind" != warm ] && results+=("$json") # a partial file (cut short) holds the stages that finished
	say "$name exit $r in $last_s s"
	return $r
}

# 0. A compile of the compile stages' models, not compared, so that native's and allocd's
# compile processes both find a warm inductor cache: a cold compile's autotuning holds more
# memory, which would make the first process's peak look worse than the second's.
if [ "$WARM_COMPILE" = 1 ] && [[ " $FUNC_GROUPS " == *compile_* ]]; then
	wstages=$(echo "$FUNC_GROUPS" | tr ' ,' '\n\n' | grep -E '^compile_' | paste -sd, -)
	proc warm "compile warm-up (native, not compared)" "$OUT/graphs_warmup_native.json" "$OUT/graphs_warmup_native.log" \
		--allocator native --stage "$wstages" --tag warmup
fi

# 1. The functional stages, native then allocd, group by group.
gi=0
for group in $FUNC_GROUPS; do
	gi=$((gi + 1))
	case $group in
	capture_forward,two_graphs_pool,mempool) gname=basic ;;
	compile_generate,compile_resnet) gname=compile ;;
	*) gname=group$gi ;;
	esac
	for a in native allocd; do
		proc "func_$gname" "$a $gname" "$OUT/graphs_${a}_$gname.json" "$OUT/graphs_${a}_$gname.log" \
			--allocator "$a" --stage "$group" --replays "$REPLAYS" --tag "$gname"
	done
done

# 2. The decode replay timing, ABBA: odd pairs native first, even pairs allocd first, so a
# drift over the session does not always favour one side.
for i in $(seq 1 "$PAIRS"); do
	order="native allocd"
	[ $((i % 2)) = 0 ] && order="allocd native"
	for a in $order; do
		proc decode "decode $a $i" "$OUT/graphs_decode_${a}_$i.json" "$OUT/graphs_decode_${a}_$i.log" \
			--allocator "$a" --stage decode_replay --decode-replays "$DECODE_REPLAYS" --decode-impl "$DECODE_IMPL" \
			--tag "decode_$i"
	done
done

# 3. The comparison and the archive.
cmp_rc=skipped
if ((${#results[@]})); then
	say "comparison -> $OUT/compare.md"
	python3 scripts/compare_graphs.py "$OUT" >"$OUT/compare.md" 2>"$OUT/graphs_compare.log"
	cmp_rc=$?
	cat "$OUT/compare.md"
	[ -s "$OUT/graphs_compare.log" ] && sed 's/^/  compare: /' "$OUT/graphs_compare.log"
else
	say "no results to compare"
fi
(cd "$OUT" && tar -czf graphs.tgz --exclude=graphs.tgz graphs_* $([ -f compare.md ] && echo compare.md)) 2>&1 &&
	say "archive: $OUT/graphs.tgz" || say "WARNING: the archive $OUT/graphs.tgz failed"

say "DONE in $(elapsed) s: ${#results[@]} result files, $skipped processes SKIPPED for the budget, a process" \
	"failed: $([ $rc = 0 ] && echo no || echo yes), compare exit $cmp_rc (0 = every criterion passed)"
[ $rc = 0 ] && [ "$cmp_rc" = 0 ] || exit 1
