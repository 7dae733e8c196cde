#!/usr/bin/env bash
# One H200 session's measurements in two device calls of under 10 minutes each, from the
# repository root of the device machine's copy (outputs under $OUT, default ./h200-out):
#
#   bash benchmarks/h200_session.sh units    # CUDA unit suites, then the quick bench, 5 runs
#   bash benchmarks/h200_session.sh engine   # the GPU engine tests (every save by DMA), then
#                                            # pipeline_bench (M5e, M8); needs .vllm-gpu/,
#                                            # a copy of ../shared/tools/vllm-gpu (carry it)
#
# Each part installs the package (editable, no build isolation: the machine has no registry)
# and writes what it ran and printed to $OUT/<part>.log.
set -uo pipefail
part=${1:?usage: h200_session.sh units|engine}
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
log="$out/$part.log"
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -25; }

if [ "$part" = engine ]; then
    eval "$(bash .vllm-gpu/install.sh)" || { echo "vllm-gpu install failed" | tee -a "$log"; exit 1; }
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1 \
    || { tail -20 "$out/install.log"; exit 1; }

case "$part" in
units)
    run timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not npu and not vllm" \
        -k "cuda or engine_thread or scatter_bounds or dma" --ignore tests/test_gpu_engine.py tests
    run timeout 150 python3 -m prefix_cache bench --device cuda --quick --runs 5 \
        --json "$out/bench_quick5.json"
    ;;
engine)
    run env OMNI_PREFIX_CACHE_CUDA_DMA_MIN_BYTES=0 timeout 300 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_engine.py -k "in-process or preempted or v2-main"
    run timeout 260 python3 -m prefix_cache.tools.pipeline_bench --runs 3 \
        --json "$out/pipeline_bench.json"
    ;;
*)
    echo "unknown part $part (units or engine)"; exit 2 ;;
esac
