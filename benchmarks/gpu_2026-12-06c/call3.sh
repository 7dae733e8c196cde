#!/usr/bin/env bash
# Twelfth session, third device call: the CUDA unit shards (as h200_session.sh units, cut at
# 420 s) and the GPU engine's CUDA-graph test, side by side, at the working tree
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/c3
shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
         tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
        "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
        "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_cuda_launch.py")
for i in "${!shards[@]}"; do
  timeout -s INT -k 30 420 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      --durations=5 -m "not npu and not vllm" \
      -k "cuda or engine_thread or scatter_bounds or dma or launch" ${shards[$i]} \
      > $OUT/c3/units-$i.log 2>&1 &
done
( eval "$(bash .vllm-gpu/install.sh)"; timeout -k 10 400 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k graphs > $OUT/c3/gpu-engine-graphs.log 2>&1 ) &
wait
for i in "${!shards[@]}"; do echo "+ shard $i"; tail -12 $OUT/c3/units-$i.log; done
echo "+ graphs"; tail -8 $OUT/c3/gpu-engine-graphs.log
tar -czf $OUT/c3.tar.gz -C $OUT c3 && rm -rf $OUT/c3
echo "total $SECONDS s"
