#!/usr/bin/env bash
# Issue 54's second device call: the GPU engine tests the reliability changes run through
# (in-process V1, V2's main case, CUDA graphs, multiprocess; every save by DMA), then M11 on
# CUDA (benchmarks/peer_vllm_omni.py, the peer in its threaded mode). Needs .vllm-gpu/ (a copy
# of shared/tools/vllm-gpu) and .whl/ (vllm-omni 0.30.0's wheel) carried. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
out=${OUT:-gpu-out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
eval "$(bash .vllm-gpu/install.sh)" || { echo "vllm-gpu install failed"; exit 1; }
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/install.log" 2>&1 \
    || { tail "$out/install.log"; exit 1; }
echo "+ GPU engine tests"
OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES=0 timeout -s INT -k 15 380 python3 -m pytest -v \
    -p no:cacheprovider -rfE --tb=short tests/test_gpu_engine.py \
    -k "in-process or v2-main or graphs or multiprocess" > "$out/engine.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/engine.log" | tail -12
echo "+ M11 on CUDA"
PYTHONPATH=. timeout -k 10 150 python3 benchmarks/peer_vllm_omni.py --device cuda \
    --peer-wheel .whl --runs 5 --json "$out/m11_cuda.json" > "$out/m11_cuda.txt" 2>&1
tail -25 "$out/m11_cuda.txt"
echo "total $SECONDS s"
