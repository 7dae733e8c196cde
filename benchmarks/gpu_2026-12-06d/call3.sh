#!/usr/bin/env bash
# Thirteenth session, third device call: the working tree (B) beside 2b99fef (A, devrun/base13
# built in place). The CUDA unit shards and the GPU engine tests call 2 did not reach (V2 main,
# multiprocess, the multimodal key) side by side at B; first M2 and M2p unprofiled in turn (three
# rounds) and M2's call timing in both, on a quiet machine; then the tests; M5e small model with
# CUDA graphs at B
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/base13 && python3 setup.py -q build_ext --inplace > $OUT/base-build.log 2>&1) || tail $OUT/base-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
c=$OUT/c3; mkdir -p $c
eval "$(bash .vllm-gpu/install.sh)"
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/base13 || echo $root; }
for r in 1 2 3; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/devrun/s13/m2_once.py > $c/m2-$t-$r.txt 2>&1)
    echo "$t: $(grep 'M2 ' $c/m2-$t-$r.txt)"
  done
done
for t in B A; do
  (cd $(tree $t) && t 60 env PYTHONPATH=.:$PYTHONPATH python3 $root/benchmarks/engine_call_timing.py --m2 --device cuda --steps 2000 > $c/m2-call-timing-$t.txt 2>&1)
  echo "[call timing $t]"; head -1 $c/m2-call-timing-$t.txt; grep -E "save_outputs|new_step_starts|sweep|of_step|discard_step|StepWriter.save" $c/m2-call-timing-$t.txt
done
shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
         tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
        "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
        "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_cuda_launch.py tests/test_cuda_events.py tests/test_staging.py")
for i in "${!shards[@]}"; do
  timeout -s INT -k 30 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      --durations=3 -m "not npu and not vllm" \
      -k "cuda or engine_thread or scatter_bounds or dma or launch or events or staging" ${shards[$i]} \
      > $c/units-$i.log 2>&1 &
done
( eval "$(bash .vllm-gpu/install.sh)"; timeout -s INT -k 10 250 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k "v2-main or multiprocess or multimodal" > $c/gpu-engine.log 2>&1 ) &
wait
for i in "${!shards[@]}"; do echo "+ shard $i"; tail -2 $c/units-$i.log; done
echo "+ gpu engine"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $c/gpu-engine.log | tail -8
echo "units and engine tests: $SECONDS s"
left=$((440 - SECONDS))
if [ $left -ge 60 ]; then
  t $((left < 90 ? left : 90)) python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 5 --json $c/m5e-small-graphs-B.json > $c/m5e-small-graphs-B.log 2>&1
  echo "[M5e B]"; grep -E "^M5e" -A4 $c/m5e-small-graphs-B.log | cut -c1-110
fi
tar -czf $OUT/c3.tar.gz -C $OUT c3 && rm -rf $c
echo "total $SECONDS s"
