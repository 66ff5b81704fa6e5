#!/usr/bin/env bash
# Issue 20 diagnostics on the GPU host: hardware counters of gpt2m_generate's
# warm replay, and four builds' warm replays alternating on one core.
set -u
OUT=${OUT:?set OUT to a results folder}; mkdir -p "$OUT"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
for f in .devrun/bin/*.gz; do gunzip -c "$f" >"$W/$(basename "$f" .gz)"; chmod +x "$W/$(basename "$f" .gz)"; done
T=testdata/traces/gpt2m_generate.pickle.gz
{ lscpu; echo; nproc; cat /proc/sys/kernel/perf_event_paranoid; which perf && perf --version; } >"$OUT/host.txt" 2>&1
CORE=${CORE:-3}
# 1. counters: 1 warm pass vs 11 (the difference is 10 warm passes and their FreeLive)
if command -v perf >/dev/null; then
  EV=cycles,instructions,branches,branch-misses,L1-dcache-loads,L1-dcache-load-misses,LLC-loads,LLC-load-misses,dTLB-load-misses
  for n in 1 11 1 11; do
    (cd bench && taskset -c $CORE perf stat -x, -e $EV -o "$OUT/stat_$n.$RANDOM.csv" "$W/bench_base.test" -test.run '^$' \
      -test.bench 'BenchmarkReplayWarm$/gpt2m' -test.benchtime ${n}x >>"$OUT/stat_runs.txt" 2>&1)
  done
  (cd bench && taskset -c $CORE perf stat --topdown -o "$OUT/topdown.txt" "$W/bench_base.test" -test.run '^$' \
      -test.bench 'BenchmarkReplayWarm$/gpt2m' -test.benchtime 11x >>"$OUT/stat_runs.txt" 2>&1)
  (cd bench && taskset -c $CORE perf record -F 4999 -o "$W/perf.data" "$W/bench_base.test" -test.run '^$' \
      -test.bench 'BenchmarkReplayWarm$/gpt2m' -test.benchtime 31x >>"$OUT/stat_runs.txt" 2>&1 &&
   perf report -i "$W/perf.data" --stdio --sort symbol 2>/dev/null | head -80 >"$OUT/report.txt"
   perf annotate -i "$W/perf.data" --stdio -s 'github.com/allocd/allocd/allocator.(*Allocator).fitsOrBorrow' 2>/dev/null | head -300 >"$OUT/annot_fits.txt")
  tar czf "$OUT/stat.tgz" -C "$OUT" $(cd "$OUT" && ls stat_*.csv topdown.txt 2>/dev/null) && rm -f "$OUT"/stat_*.csv "$OUT/topdown.txt"
fi
# 2. four builds, alternating, warm replays of gpt2m_generate (three per run)
for r in 1 2 3 4 5; do
  for v in base base_v3 fused fused_v3; do
    taskset -c $CORE "$W/allocd_$v" bench --device sim --no-pair --no-mixed --json $T $T $T 2>/dev/null |
      python3 -c "import json,sys; d=json.load(sys.stdin); print('$r $v', *[round(x['warm_ns_per_op'],1) for x in d['replay']], '| cold', *[round(x['ns_per_op'],1) for x in d['replay']])"
  done
done >"$OUT/ab.txt" 2>&1
cat "$OUT/ab.txt"; head -20 "$OUT/report.txt" 2>/dev/null
