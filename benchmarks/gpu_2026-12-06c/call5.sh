#!/usr/bin/env bash
# Twelfth session, fifth device call: the scatter by cuLaunchKernel now taken (71b45f5). First
# the CUDA unit shards and the GPU engine's CUDA-graph test side by side at the working tree (B),
# then against bf27e97's library (A, devrun/head built in place): M2 and M2p (four rounds),
# M2's call timing, M5e small model with CUDA graphs
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/head && python3 setup.py -q build_ext --inplace > $OUT/head-build.log 2>&1) || tail $OUT/head-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/c5
shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
         tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
        "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
        "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_cuda_launch.py")
for i in "${!shards[@]}"; do
  timeout -s INT -k 30 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      --durations=5 -m "not npu and not vllm" \
      -k "cuda or engine_thread or scatter_bounds or dma or launch" ${shards[$i]} \
      > $OUT/c5/units-$i.log 2>&1 &
done
( eval "$(bash .vllm-gpu/install.sh)"; timeout -k 10 400 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k graphs > $OUT/c5/gpu-engine-graphs.log 2>&1 ) &
wait
for i in "${!shards[@]}"; do echo "+ shard $i"; tail -4 $OUT/c5/units-$i.log; done
echo "+ graphs"; tail -3 $OUT/c5/gpu-engine-graphs.log
eval "$(bash .vllm-gpu/install.sh)"
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/head || echo $root; }
for r in 1 2 3 4; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/devrun/m2_once.py 2>&1 | tail -2)
  done
done
for t in B A; do
  (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 > $OUT/c5/m2-call-timing-$t.txt 2>&1)
  echo "[call timing $t]"; cat $OUT/c5/m2-call-timing-$t.txt | tail -28
done
for t in A B; do
  left=$((500 - SECONDS))
  [ $left -lt 60 ] && { echo "skipped M5e $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 130 ? left : 130)) env PYTHONPATH=.:$PYTHONPATH python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 5 --json $OUT/c5/m5e-small-graphs-$t.json > $OUT/c5/m5e-small-graphs-$t.log 2>&1)
  echo "[M5e $t]"; grep -E "^M5e" -A3 $OUT/c5/m5e-small-graphs-$t.log | cut -c1-110
done
tar -czf $OUT/c5.tar.gz -C $OUT c5 && rm -rf $OUT/c5
echo "total $SECONDS s"
