#!/usr/bin/env bash
# Twelfth session, fourth device call: the CUDA save's trims (recycled done events, the slot
# page take, the scatter by cuLaunchKernel) in the working tree (B) against bf27e97's library
# (A, devrun/head built in place): M2 and M2p side by side (four rounds), M2's call timing in
# both, then M5e small model with CUDA graphs in both
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/head && python3 setup.py -q build_ext --inplace > $OUT/head-build.log 2>&1) || tail $OUT/head-build.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/head || echo $root; }
mkdir -p $OUT/c4
for r in 1 2 3 4; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/devrun/m2_once.py 2>&1 | tail -2)
  done
done
for t in B A; do
  (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 > $OUT/c4/m2-call-timing-$t.txt 2>&1)
  echo "[call timing $t]"; cat $OUT/c4/m2-call-timing-$t.txt | tail -28
done
for t in A B; do
  left=$((470 - SECONDS))
  [ $left -lt 60 ] && { echo "skipped M5e $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 130 ? left : 130)) env PYTHONPATH=.:$PYTHONPATH python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 5 --json $OUT/c4/m5e-small-graphs-$t.json > $OUT/c4/m5e-small-graphs-$t.log 2>&1)
  echo "[M5e $t]"; grep -E "^M5e" -A3 $OUT/c4/m5e-small-graphs-$t.log | cut -c1-110
done
tar -czf $OUT/c4.tar.gz -C $OUT c4 && rm -rf $OUT/c4
echo "total $SECONDS s"
