#!/usr/bin/env bash
# Live steps under the default expandable policy: where the extra CPU goes. Stages write to $OUT as they end.
set -u
R=$OUT
S=$(date +%s); el() { echo $(( $(date +%s) - S )); }; say() { echo "[+$(el)s] $*" | tee -a $R/diag.log; }
export ALLOCD_LIB=$(realpath .devrun/liballocd.so)
export ALLOCD_TORCH_CACHE=$PWD/.devrun/allocd_torch_cache
export PYTHONPATH="$PWD/python" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset ALLOCD_DEVICE ALLOCD_CONF ALLOCD_METRICS_LISTEN PYTORCH_CUDA_ALLOC_CONF
say "perf: $(command -v perf || echo none); nproc $(nproc); $(lscpu | grep 'Model name')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $R/diag.log
PIN="taskset -c 2-7"
W=.devrun/anchor/workloads.py
WL=${WL:-gpt2m_generate,multistream_prefetch}
run() { # name alloc conf steps extra...
  local n=$1 a=$2 c=$3 st=$4; shift 4
  if [ $a = native ]; then e=PYTORCH_CUDA_ALLOC_CONF=$c; else e=ALLOCD_CONF=$c; fi
  env $e timeout 100 $PIN python3 scripts/torch_workloads.py --allocator $a --workloads $WL \
    --anchor $W --steps $st --warmup 2 --out $R/$n.json "$@" > $R/$n.log 2>&1
  local rc=$?
  say "$n rc=$rc"
  python3 - "$R/$n.json" >> $R/diag.log 2>&1 <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))['workloads']
for w,x in d.items():
    print('   ', w, 'cpu', round(x['median_cpu_ms'],2), 'wall', round(x['median_ms'],2), 'peak', x['peak_reserved']>>20,
          {k:round(v,2) for k,v in x.get('per_step',{}).items() if v})
PY
  tail -4 $R/diag.log
}
i=0
for cfg in "nexp native expandable_segments:True" "fine allocd expandable_segments:True" \
           "coarse allocd expandable_segments:True,expandable_reclaim:coarse" "aplain allocd -" "nplain native -" \
           "fine allocd expandable_segments:True" "nexp native expandable_segments:True" \
           "coarse allocd expandable_segments:True,expandable_reclaim:coarse"; do
  set -- $cfg; i=$((i+1))
  c=$3; [ "$c" = "-" ] && c=""
  [ $(el) -gt ${STOP1:-330} ] && { say "skip ${i}_$1 (time)"; continue; }
  run "${i}_$1" $2 "$c" 10
done
if [ $(el) -lt ${STOP2:-400} ]; then
  WL=gpt2_train,resnet50_train run histrn allocd expandable_segments:True 4 --history /tmp/histrn.pickle
  gzip -c /tmp/histrn.pickle > $R/hist_gpt2_resnet_fine.pickle.gz 2>/dev/null; say "history $(ls -la $R/hist_gpt2_resnet_fine.pickle.gz 2>&1)"
fi
if command -v perf >/dev/null && [ $(el) -lt ${STOP3:-450} ]; then
  ALLOCD_CONF=expandable_segments:True timeout 80 perf record -F 499 -o /tmp/perf_fine.data $PIN python3 scripts/torch_workloads.py \
    --allocator allocd --workloads gpt2m_generate --anchor $W --steps 6 --warmup 2 --out $R/perf_fine.json > $R/perf_fine.log 2>&1
  say "perf fine rc=$?"
  perf report -i /tmp/perf_fine.data --stdio --sort dso 2>/dev/null | head -40 > $R/perf_fine_dso.txt
  perf report -i /tmp/perf_fine.data --stdio --sort dso,sym 2>/dev/null | head -150 > $R/perf_fine_sym.txt
  say "perf reported"
fi
if [ $(el) -lt ${STOP4:-490} ]; then
  WL=gpt2m_generate run hist allocd expandable_segments:True 4 --history /tmp/hist.pickle
  gzip -c /tmp/hist.pickle > $R/hist_gpt2m_fine.pickle.gz 2>/dev/null; say "history $(ls -la $R/hist_gpt2m_fine.pickle.gz 2>&1)"
fi
say done
