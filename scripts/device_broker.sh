#!/usr/bin/env bash
# The node broker on a GPU machine, from the repository root:
#
#   STAGE=go    scripts/device_broker.sh   # Go: grant and move latency, processes exchanging memory, kill -9
#   STAGE=torch scripts/device_broker.sh   # PyTorch: two jobs sharing one broker, each within its quota
#
# $BIN (default .devrun/bin) holds allocd and gputest.test (CGO_ENABLED=1 go build
# -ldflags='-s -w' -pgo=cmd/allocd/allocd.pgo -o $BIN/allocd ./cmd/allocd; go test -c -o $BIN/gputest.test ./gputest);
# $LIBDIR (default .devrun) liballocd.so; $ANCHOR the anchor workloads.py. Results go to
# $OUT (default .devrun/out), each stage's files as it ends.
#
# The torch stage starts `allocd serve --broker` on device 0 with two tenants (train:
# 24 GiB, gen: 8 GiB), runs GPT-2 training (train) and GPT-2 medium generation (gen)
# at the same time under allocd_torch with ALLOCD_BROKER, scraping the broker's
# /metrics every second; then both natively, twice, for their results and native's own
# run-to-run difference; then kill -9 of a
# process holding 4 GiB and a second one that takes it; then SIGTERM to the broker.
set -uo pipefail

STAGE=${STAGE:-go}
BIN=${BIN:-.devrun/bin}
LIBDIR=${LIBDIR:-.devrun}
OUT=${OUT:-.devrun/out}
ANCHOR=${ANCHOR:-.devrun/anchor/workloads.py}
START=$(date +%s)
say() { echo "[device_broker +$(( $(date +%s) - START ))s] $*"; }
mkdir -p "$OUT"
unset ALLOCD_DEVICE ALLOCD_CONF PYTORCH_CUDA_ALLOC_CONF ALLOCD_BROKER ALLOCD_TENANT
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | sed 's/^/  gpu: /'

if [ "$STAGE" = go ]; then
	say "gputest: shareable memory and the broker -> $OUT/gputest.log"
	timeout 300 "$BIN/gputest.test" -test.run 'TestGPUShareableMemory|TestGPUBroker' -test.v -test.count=1 >"$OUT/gputest.log" 2>&1
	rc=$?
	grep -E '^(--- |ok|FAIL|PASS)|broker: |share: ' "$OUT/gputest.log" | sed 's/^/  /'
	say "gputest exit $rc"
	exit $rc
fi

# STAGE=torch
export ALLOCD_LIB
ALLOCD_LIB=$(realpath "$LIBDIR/liballocd.so")
export ALLOCD_TORCH_CACHE=${ALLOCD_TORCH_CACHE:-$PWD/.devrun/allocd_torch_cache}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SOCKDIR=$(mktemp -d)
SOCK=$SOCKDIR/allocd.sock
cat >"$OUT/tenants.yaml" <<EOF
tenants:
  - name: train
    quota: 24GiB
  - name: gen
    quota: 8GiB
  - name: victim
  - name: heir
EOF
"$BIN/allocd" serve --broker --device cuda --broker-socket "$SOCK" --broker-tenants "$OUT/tenants.yaml" \
	--listen 127.0.0.1:0 --ready-file "$OUT/broker.ready" --broker-stop-timeout 20s >"$OUT/broker.log" 2>&1 &
BPID=$!
for _ in $(seq 100); do [ -s "$OUT/broker.ready" ] && break; sleep 0.1; done
[ -s "$OUT/broker.ready" ] || { say "the broker did not start"; tail "$OUT/broker.log"; exit 2; }
ADDR=$(cat "$OUT/broker.ready")
say "broker pid $BPID at $SOCK, metrics on $ADDR"
scrape() { curl -s "http://$ADDR/metrics" | grep '^allocd_broker_'; }
metric() { scrape | awk -v m="$1" -v l="$2" 'index($0, m "{") == 1 && index($0, l) { print $NF }' | head -1; }

say "two jobs at once under allocd_torch + the broker: gpt2_train (tenant train), gpt2m_generate (tenant gen)"
t=$(date +%s)
ALLOCD_BROKER=unix://$SOCK ALLOCD_TENANT=train timeout 300 python3 scripts/torch_workloads.py --allocator allocd \
	--workloads gpt2_train --anchor "$ANCHOR" --out "$OUT/broker_train.json" >"$OUT/broker_train.log" 2>&1 &
P1=$!
ALLOCD_BROKER=unix://$SOCK ALLOCD_TENANT=gen timeout 300 python3 scripts/torch_workloads.py --allocator allocd \
	--workloads gpt2m_generate --anchor "$ANCHOR" --out "$OUT/broker_gen.json" >"$OUT/broker_gen.log" 2>&1 &
P2=$!
: >"$OUT/broker_granted.tsv"
while kill -0 $P1 2>/dev/null || kill -0 $P2 2>/dev/null; do
	echo -e "$(( $(date +%s) - t ))\t$(metric allocd_broker_granted_bytes 'tenant="train"')\t$(metric allocd_broker_granted_bytes 'tenant="gen"')\t$(metric allocd_broker_device_bytes 'gpu="0"')" >>"$OUT/broker_granted.tsv"
	sleep 1
done
wait $P1; rc1=$?
wait $P2; rc2=$?
say "jobs exit $rc1 (train) $rc2 (gen) in $(( $(date +%s) - t )) s; granted over time (s, train, gen, broker device bytes) in $OUT/broker_granted.tsv"
grep -E '^\[..:..:..\] ' "$OUT/broker_train.log" "$OUT/broker_gen.log" | sed 's/^/  /'
sort -t$'\t' -k2 -g "$OUT/broker_granted.tsv" | tail -1 | sed 's/^/  max train row: /'
sort -t$'\t' -k3 -g "$OUT/broker_granted.tsv" | tail -1 | sed 's/^/  max gen row:   /'
scrape >"$OUT/broker_metrics_after_jobs.txt"

for run in native native2; do
	say "$run: both workloads natively, one after the other, for their results"
	timeout 300 python3 scripts/torch_workloads.py --allocator native --workloads gpt2_train,gpt2m_generate --anchor "$ANCHOR" \
		--out "$OUT/$run.json" >"$OUT/$run.log" 2>&1
	say "$run exit $?"
done
python3 - "$OUT" <<'PY' | tee "$OUT/compare.txt"
import json, sys
out = sys.argv[1]
nat = json.load(open(f"{out}/native.json"))["workloads"]
nat2 = json.load(open(f"{out}/native2.json"))["workloads"]
def delta(a, b):
    n = min(len(a["values"]), len(b["values"]))
    if a["kind"] == "tokens":
        return f"{sum(x != y for x, y in zip(a['values'][:n], b['values'][:n]))} of {n} steps differ"
    return f"max |loss difference| {max(abs(x - y) for x, y in zip(a['values'][:n], b['values'][:n])):.3g} over {n} steps"
for name, f in (("gpt2_train", "broker_train.json"), ("gpt2m_generate", "broker_gen.json")):
    b = json.load(open(f"{out}/{f}"))["workloads"][name]
    n, n2 = nat[name], nat2[name]
    print(f"{name}: under the broker vs native: {delta(b, n)}; native vs native: {delta(n2, n)}; "
          f"median step {b['median_ms']:.2f} ms under the broker (both jobs sharing the GPU) vs {n['median_ms']:.2f} / {n2['median_ms']:.2f} native alone; "
          f"peak reserved {b['peak_reserved'] / 2**20:.0f} MiB vs native {n['peak_reserved'] / 2**20:.0f} MiB")
PY

say "kill -9 of a process holding 4 GiB (tenant victim), then a process of another tenant (heir) takes 4 GiB"
cat >"$OUT/holder.py" <<'PY'
import os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "python"))
import allocd_torch
allocd_torch.enable()
import torch
hold = sys.argv[1] == "hold"
# 16 x 256 MiB: the victim writes 7s; the heir takes memory as it comes and looks for them.
xs = [torch.full((256 << 20,), 7, dtype=torch.int8, device="cuda") if hold else
      torch.empty((256 << 20,), dtype=torch.int8, device="cuda") for _ in range(16)]
torch.cuda.synchronize()
if hold:
    print("holding", flush=True)
    time.sleep(600)
# Looked at 16 MiB at a time, so that the check itself takes little memory.
sevens = sum(int((x[i:i + (16 << 20)] == 7).sum()) for x in xs for i in range(0, x.numel(), 16 << 20))
free, total = torch.cuda.mem_get_info()
print(f"heir: got 4 GiB; bytes reading 7 (the victim's): {sevens}; mem_get_info free {free >> 20} MiB", flush=True)
PY
ALLOCD_BROKER=unix://$SOCK ALLOCD_TENANT=victim python3 "$OUT/holder.py" hold >"$OUT/victim.log" 2>&1 &
VP=$!
for _ in $(seq 300); do grep -q holding "$OUT/victim.log" 2>/dev/null && break; sleep 0.1; done
say "victim holds: granted $(metric allocd_broker_granted_bytes 'tenant="victim"') bytes; device bytes $(metric allocd_broker_device_bytes 'gpu="0"')"
before_dev=$(metric allocd_broker_device_bytes 'gpu="0"')
python3 -c 'import torch; f,t=torch.cuda.mem_get_info(); print(f"  mem_get_info before the kill: free {f>>20} MiB")'
kill -9 $VP
t0=$(date +%s%N)
while :; do
	g=$(metric allocd_broker_granted_bytes 'tenant="victim"')
	[ "${g:-1}" = 0 ] && break
	(( ($(date +%s%N) - t0) > 5000000000 )) && { say "victim's memory not back after 5 s"; break; }
	sleep 0.005
done
say "victim's memory back in the broker's cache after $(( ($(date +%s%N) - t0) / 1000000 )) ms (reclaimed $(metric allocd_broker_reclaimed_bytes_total 'tenant="victim"') bytes)"
ALLOCD_BROKER=unix://$SOCK ALLOCD_TENANT=heir timeout 120 python3 "$OUT/holder.py" take >"$OUT/heir.log" 2>&1
say "heir exit $?: $(grep heir: "$OUT/heir.log"); broker device bytes before $before_dev, after $(metric allocd_broker_device_bytes 'gpu="0"') (the heir's 4 GiB went to the victim's chunks); scrubbed $(metric allocd_broker_scrubbed_bytes_total 'gpu="0"') bytes in $(metric allocd_broker_scrub_seconds_total 'gpu="0"') s"
scrape >"$OUT/broker_metrics_end.txt"
kill -TERM $BPID
wait $BPID
say "broker exit $?; its log: $OUT/broker.log"
grep -E '"msg":"(client went away|still holding|allocd broker stopped)' "$OUT/broker.log" | head -5 | sed 's/^/  /'
rm -rf "$SOCKDIR"
say "DONE"
