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
#      streams with RecordStream), TestGPUExpandableReclaimWaits (a reclaim
#      of queued memory waits for it) and TestGPUReplayMatchesSim (every trace's
#      peaks on the GPU equal the simulated device's)     -> gputest.log
#   2. allocd bench --device cuda --conf expandable_segments:True, replays only,
#      every trace in TRACEDIR, with the driver's VMM calls    -> allocd.json;
#      then with expandable_reclaim:coarse                     -> allocd_coarse.json
#   3. PyTorch's anchor replays with expandable_segments:True -> anchor.json
#   4. PyTorch's calls, counted by replaying with --pytorch-expandable on the
#      simulated device (which reproduces its expandable segments; this stage
#      runs once, before stage 2)                          -> pytorch_calls.jsonl
#   5. a side-by-side table (scripts/compare_expandable.py): ns/op, peak
#      reserved, and VMM calls and time; PyTorch's VMM time is estimated from
#      its handles (one per 20 MiB of its peak reserved: it never unmaps in a
#      replay) and from its exact calls, at stage 1's measured cost of each
#      call, as allocd's calls are modelled too; and, with no model, each
#      side's cold replay minus its warm one, times its operations (what
#      growth cost it, device calls included)   -> compare.txt, compare_coarse.txt
# With BASE_BIN set to another build of allocd (the commit before a change,
# built elsewhere with CGO_ENABLED=1), stage 2 also replays the default policy
# with it, right after the build under test -> allocd_base.json, and stage 5
# compares it too -> compare_base.txt: a before/after in the same command.
# ROUNDS=N (default 1) runs stages 2, 3 and 5 N times; round 1's files are
# named as above, round r's carry _rR (allocd_r2.json, anchor_r2.json,
# compare_r2.txt, ...). One cold replay a trace a round, so the host's pace
# moves each round's figures on both sides; scripts/expandable_rounds.py then
# takes the median of the rounds and says, trace by trace, whether each goal
# is met (speed, modelled VMM time and peak reserved against PyTorch's, the
# pattern test's corruptions, GPU peaks equal to the simulated device's)
# -> rounds.txt. PAIRED=N (default 0) first times the replays as
# scripts/paired_replays.py does for the default configuration, N rounds on
# the host's fastest core, each trace replayed by allocd and by PyTorch one
# right after the other (with expandable_segments:True on both sides)
# -> paired.json, paired.txt; expandable_rounds.py then judges speed on those
# rounds' ratios instead. Those rounds also count and time PyTorch's virtual
# memory calls in its own process (--vmm-timer, scripts/vmm_timer.c), so that
# both sides' call time is measured, not modelled. PACK=1 (device_lib.sh) returns everything as one
# archive.
# Stages stop starting past $BUDGET_S seconds (default 560). No network is used.
set -uo pipefail
. "$(dirname "$0")/device_lib.sh"
device_setup device_expandable "$@"
device_build gputest
ROUNDS=${ROUNDS:-1}

say "GPU tests -> $OUT/gputest.log"
(cd gputest && ALLOCD_TRACES="$TRACES" ALLOCD_GPU_OPS=200000 timeout "$(($(left) / 2))" "$BIN/gputest.test" \
	-test.run 'VirtualMemoryCost|PatternExpandable|ReclaimWaits|ReplayMatchesSim' -test.v) >"$OUT/gputest.log" 2>&1
echo "gputest rc=$?" | tee -a "$OUT/gputest.log"
grep -E '^(--- |ok|FAIL|PASS)|corrupt|peak' "$OUT/gputest.log" | head -40
device_pack

shared=$(ls "$TRACES"/*.pickle.gz)
say "PyTorch's calls, reproduced on the simulated device -> $OUT/pytorch_calls.jsonl"
"$BIN/allocd" replay --device sim --pytorch-expandable --json --conf expandable_segments:True $shared \
	>"$OUT/pytorch_calls.jsonl" 2>"$OUT/pytorch_calls.err"
echo "replay rc=$?"

tr=$(mktemp -d)
for f in $shared; do gunzip -c "$f" >"$tr/$(basename "$f" .gz)"; done
if ((${PAIRED:-0} > 0)); then
	say "paired replays, $PAIRED rounds, expandable_segments:True -> $OUT/paired.json, $OUT/paired.txt"
	EXT_BUILD=/tmp/anchor_build timeout "$(($(left) * 2 / 3))" python3 scripts/paired_replays.py "$BIN/allocd" "$tr" "$ANCHOR" \
		"$OUT/paired.json" --rounds "$PAIRED" --conf expandable_segments:True --no-pair --vmm-timer --budget "$(($(left) / 2))" \
		>"$OUT/paired.txt" 2>&1
	echo "paired rc=$?"
	grep -E 'cold|core' "$OUT/paired.txt"
	device_pack
fi
for ((r = 1; r <= ROUNDS; r++)); do
	sfx=""
	((r > 1)) && sfx=_r$r
	if (($(left) < 60)); then
		say "round $r not started: $(left) s of the budget left"
		break
	fi
	# The default (allocd.json), the base build's default (allocd_base.json),
	# then expandable_reclaim:coarse (allocd_coarse.json).
	for mode in "" _coarse; do
		conf=expandable_segments:True
		[ -n "$mode" ] && conf+=,expandable_reclaim:coarse
		say "round $r: allocd bench, $conf -> $OUT/allocd$mode$sfx.json"
		timeout "$(($(left) / 3))" "$BIN/allocd" bench --device cuda --no-pair --no-mixed --conf "$conf" --json \
			$shared >"$OUT/allocd$mode$sfx.json" 2>"$OUT/allocd$mode$sfx.err"
		echo "allocd bench ($conf) rc=$?"
		if [ -z "$mode" ] && [ -n "${BASE_BIN:-}" ]; then
			say "round $r: allocd bench, $conf, with $BASE_BIN -> $OUT/allocd_base$sfx.json"
			timeout "$(($(left) / 3))" "$BASE_BIN" bench --device cuda --no-pair --no-mixed --conf "$conf" --json \
				$shared >"$OUT/allocd_base$sfx.json" 2>"$OUT/allocd_base$sfx.err"
			echo "allocd bench ($conf, base) rc=$?"
		fi
	done
	say "round $r: PyTorch anchor, expandable replays -> $OUT/anchor$sfx.json"
	PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True BENCH_MODE=replay EXT_BUILD=/tmp/anchor_build \
		timeout "$(left)" python3 "$ANCHOR/bench.py" "$tr" "$OUT/anchor$sfx.json" >"$OUT/anchor$sfx.log" 2>&1
	echo "anchor rc=$?"

	modes=("" _coarse)
	[ -n "${BASE_BIN:-}" ] && modes+=(_base)
	for mode in "${modes[@]}"; do
		python3 scripts/compare_expandable.py "$OUT/allocd$mode$sfx.json" "$OUT/anchor$sfx.json" "$OUT/gputest.log" \
			"$OUT/pytorch_calls.jsonl" | tee "$OUT/compare$mode$sfx.txt"
	done
	device_pack
done
rm -rf "$tr"
if ((ROUNDS > 1 || ${PAIRED:-0} > 0)); then
	python3 scripts/expandable_rounds.py "$OUT" | tee "$OUT/rounds.txt"
	device_pack
fi
say "done"
