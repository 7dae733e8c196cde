#!/usr/bin/env bash
# Thirteenth session, second device call: the working tree (B: the engine thread's save path
# trimmed) beside 2b99fef (A, devrun/base13 built in place). First the CUDA unit shards and the
# GPU engine tests (graphs, in-process, preempted, V2) side by side at B; then M2 and M2p in
# turn (three rounds), M2's call timing in both, M5e small model with CUDA graphs in both, and
# the engine-thread call timing of M5e small eager at B
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/base13 && python3 setup.py -q build_ext --inplace > $OUT/base-build.log 2>&1) || tail $OUT/base-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
c=$OUT/c2; mkdir -p $c
shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
         tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
        "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
        "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_cuda_launch.py tests/test_cuda_events.py")
for i in "${!shards[@]}"; do
  timeout -s INT -k 30 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      --durations=5 -m "not npu and not vllm" \
      -k "cuda or engine_thread or scatter_bounds or dma or launch or events" ${shards[$i]} \
      > $c/units-$i.log 2>&1 &
done
( eval "$(bash .vllm-gpu/install.sh)"; timeout -s INT -k 10 330 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k "graphs or in-process or preempted or v2-main" > $c/gpu-engine.log 2>&1 ) &
wait
for i in "${!shards[@]}"; do echo "+ shard $i"; tail -3 $c/units-$i.log; done
echo "+ gpu engine"; tail -4 $c/gpu-engine.log
echo "units and engine tests: $SECONDS s"
eval "$(bash .vllm-gpu/install.sh)"
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/base13 || echo $root; }
for r in 1 2 3; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/devrun/s13/m2_once.py 2>&1 | tail -1)
  done
done
for t in B A; do
  (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 > $c/m2-call-timing-$t.txt 2>&1)
  echo "[call timing $t]"; tail -30 $c/m2-call-timing-$t.txt
done
for t in A B; do
  left=$((560 - SECONDS))
  [ $left -lt 60 ] && { echo "skipped M5e $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 100 ? left : 100)) env PYTHONPATH=.:$PYTHONPATH python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 3 --json $c/m5e-small-graphs-$t.json > $c/m5e-small-graphs-$t.log 2>&1)
  echo "[M5e $t]"; grep -E "^M5e" -A4 $c/m5e-small-graphs-$t.log | cut -c1-110
done
left=$((575 - SECONDS))
if [ $left -ge 50 ]; then
  t $left env PYTHONPATH=.:$PYTHONPATH python3 devrun/m5e_call_timing.py --only M5e --model small --runs 2 > $c/m5e-small-eager-call-timing-B.txt 2>&1
  tail -26 $c/m5e-small-eager-call-timing-B.txt
fi
tar -czf $OUT/c2.tar.gz -C $OUT c2 && rm -rf $c
echo "total $SECONDS s"
