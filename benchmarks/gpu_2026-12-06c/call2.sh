#!/usr/bin/env bash
# Twelfth session, second device call: the CUDA save's trims (int-pointer Triton launch,
# recycled done events, slot page take) in the working tree (B) against bf27e97's library
# (A, devrun/head built in place): the touched code's CUDA tests, M2 and M2p side by side,
# M2's call timing in both, then M5e small model with CUDA graphs in both
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/head && python3 setup.py -q build_ext --inplace > $OUT/head-build.log 2>&1) || tail $OUT/head-build.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/head || echo $root; }
mkdir -p $OUT/c2
t 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m "not npu and not vllm" \
  tests/test_devices.py tests/test_scatter_bounds.py tests/test_cuda_dma.py tests/test_engine_thread.py \
  -k "cuda or scatter or dma or engine_thread" > $OUT/c2/units-touched.log 2>&1
tail -15 $OUT/c2/units-touched.log
for r in 1 2 3; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/devrun/m2_once.py 2>&1 | tail -2)
  done
done
for t in B A; do
  (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 > $OUT/c2/m2-call-timing-$t.txt 2>&1)
  echo "[call timing $t]"; cat $OUT/c2/m2-call-timing-$t.txt | tail -28
done
for t in A B; do
  left=$((585 - SECONDS))
  [ $left -lt 60 ] && { echo "skipped M5e $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 130 ? left : 130)) env PYTHONPATH=.:$PYTHONPATH python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 5 --json $OUT/c2/m5e-small-graphs-$t.json > $OUT/c2/m5e-small-graphs-$t.log 2>&1)
  echo "[M5e $t]"; grep -E "^M5e" -A3 $OUT/c2/m5e-small-graphs-$t.log | cut -c1-110
done
tar -czf $OUT/c2.tar.gz -C $OUT c2 && rm -rf $OUT/c2
echo "total $SECONDS s"
