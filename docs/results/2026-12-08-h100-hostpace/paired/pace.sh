#!/usr/bin/env bash
# Issue 20: paired rounds of gpt2m_generate and resnet50_train (allocd against
# PyTorch's anchor, one core), then allocd with and without the shard lock
# on the hot path (a build for measurement only), alternating.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
EXT_BUILD=/tmp/anchor_build timeout 400 python3 scripts/paired_replays.py "$PWD/.devrun/bin/allocd" .devrun/tr .devrun/anchor \
	"$OUT/paired.json" --rounds 14 --core 3 --no-pair --budget 240 >"$OUT/paired.txt" 2>&1
echo "paired rc=$?"
T=.devrun/tr/gpt2m_generate.pickle.gz
for f in .devrun/bin/*.gz; do gunzip -f "$f"; chmod +x "${f%.gz}"; done
for r in 1 2 3 4 5 6; do
	for v in allocd allocd_nolock allocd_plainunlock; do
		taskset -c 3 ".devrun/bin/$v" bench --device sim --no-pair --no-mixed --json $T $T 2>/dev/null |
			python3 -c "import json,sys; d=json.load(sys.stdin); print('$r $v', *[round(x['warm_ns_per_op'],1) for x in d['replay']], '| driver', *[round(x['driver_ns_per_op'],2) for x in d['replay']])"
	done
done >"$OUT/ab.txt" 2>&1
tail -8 "$OUT/paired.txt"; cat "$OUT/ab.txt"
