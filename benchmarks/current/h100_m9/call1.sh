#!/usr/bin/env bash
# Eleventh session, first device call: M2/M2p's engine-thread loop profiled (cProfile), the
# GPU engine's graph case, M5e small model with graphs (the worst M5e), stream_bench (M9c and
# the engine thread's µs a step beside it)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 2>/dev/null
t() { local s=$SECONDS; timeout "$@"; echo "= exit $? $((SECONDS - s)) s: ${*:2:6}"; }
t 60 env PYTHONPATH=. python3 benchmarks/engine_thread_profile.py --device cuda --top 45 > $OUT/m2-profile.txt 2>&1
head -1 $OUT/m2-profile.txt
t 60 env PYTHONPATH=. python3 benchmarks/engine_thread_profile.py --device cuda --requests 1 --tokens 2048 --top 45 > $OUT/m2p-profile.txt 2>&1
head -1 $OUT/m2p-profile.txt
t 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_engine.py -k graphs > $OUT/graphs-test.log 2>&1
tail -3 $OUT/graphs-test.log
t 140 python3 -m prefix_cache.tools.pipeline_bench --only M5e --model small --cudagraphs --runs 5 --json $OUT/m5e-small-graphs.json > $OUT/m5e-small-graphs.log 2>&1
grep -E "M5e|engine-thread" $OUT/m5e-small-graphs.log | tail -6
left=$((585 - SECONDS))
[ $left -gt 90 ] && t $left python3 -m prefix_cache.tools.stream_bench --runs 3 --json $OUT/stream_bench.json > $OUT/stream_bench.log 2>&1
grep -E "^M9" -A1 $OUT/stream_bench.log
echo "total $SECONDS s"
