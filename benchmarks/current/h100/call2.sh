#!/usr/bin/env bash
# Fourteenth session, second device call, at HEAD: the quick bench (M1-M7, 5 runs) on a quiet
# machine, then the GPU engine tests with preemption (V1 and V2, an abort while preempted), every
# engine save by DMA
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader
s=$SECONDS
timeout -k 10 200 python3 -m prefix_cache bench --device cuda --quick --runs 5 \
    --json $OUT/bench-quick5.json > $OUT/bench-quick5.txt 2>&1
echo "= bench exit $? $((SECONDS - s)) s"; tail -40 $OUT/bench-quick5.txt
eval "$(bash .vllm-gpu/install.sh)"
s=$SECONDS
OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES=0 timeout -s INT -k 10 $((580 - SECONDS)) python3 -m pytest -v \
    -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py -k "preempted or v2-preempt" \
    > $OUT/gpu-engine-preempt.log 2>&1
echo "= preempt exit $? $((SECONDS - s)) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" $OUT/gpu-engine-preempt.log | tail -8
echo "total $SECONDS s"
