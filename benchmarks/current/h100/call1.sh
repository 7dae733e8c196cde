#!/usr/bin/env bash
# Fourteenth session, first device call, at HEAD (a529eab): the CUDA unit shards side by side
# with the GPU engine tests without preemption (in-process, v2-main, graphs, multiprocess, the
# multimodal key), every engine save by DMA
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
c=$OUT/c1; mkdir -p $c
shards=("tests/test_backend_conformance.py tests/test_output_buffers.py
         tests/test_manager_random.py tests/test_cuda_dma.py tests/test_engine_thread.py"
        "tests/test_reliability.py tests/test_devices.py tests/test_trace_replay.py"
        "tests/test_manager.py tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_cuda_launch.py tests/test_cuda_events.py tests/test_staging.py tests/test_committer.py")
for i in "${!shards[@]}"; do
  timeout -s INT -k 30 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      --durations=3 -m "not npu and not vllm" \
      -k "cuda or engine_thread or scatter_bounds or dma or launch or events or staging or committer" ${shards[$i]} \
      > $c/units-$i.log 2>&1 &
done
( eval "$(bash .vllm-gpu/install.sh)"; OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES=0 timeout -s INT -k 10 520 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k "v2-main or in-process or graphs or multiprocess or multimodal" > $c/gpu-engine.log 2>&1 ) &
wait
for i in "${!shards[@]}"; do echo "+ shard $i"; tail -3 $c/units-$i.log; done
echo "+ gpu engine"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $c/gpu-engine.log | tail -10
tar -czf $OUT/c1.tar.gz -C $OUT c1 && rm -rf $c
echo "total $SECONDS s"
