#!/usr/bin/env bash
# Nineteenth session's device calls: `bash call1.sh SECTION...` in the repository root.
#   engine   the GPU engine's capped-pool cases and its main case (in-process, multiprocess);
#            ENGINE_K="..." narrows them (pytest -k)
#   engine2  the GPU engine's other cases (preemption, multimodal key, graphs, V2)
#   start    the host pool's cost at start: mirror against a 2 GiB cap, 7B-class at 0.9;
#            START_ROUNDS=N rounds (default 1)
#   m10      M10 on the GPU (M8's small model, pool capped at 25% of the mirror)
#   m10-steps  M10's engines in this process: steps, schedule() and the cache's calls per run
#            (M10_PROFILE=1: and the top 30 of the cache's functions under cProfile)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
# runs "$@" under `timeout`, within what is left of the call's 570 s (skipped under 45 s)
t() { local s=$SECONDS limit=$1; shift; local left=$((570 - SECONDS))
      [ $left -lt 45 ] && { echo "= skipped (${left} s left): ${*:1:8}"; return; }
      timeout $((limit < left ? limit : left)) "$@"; echo "= exit $? $((SECONDS - s)) s: ${*:1:8}"; }
for section in "$@"; do
  case $section in
    engine)
      t 330 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_engine.py \
        -k "${ENGINE_K:-capped or entries_match_with}" --basetemp=/tmp/engine > $OUT/engine.log 2>&1
      mkdir -p $OUT/engine-logs && find /tmp/engine -name '*.log' -exec cp {} $OUT/engine-logs/ \;
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/engine.log | tail -15 ;;
    engine2)
      t 560 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_engine.py \
        -k "not capped and not entries_match_with" --basetemp=/tmp/engine2 > $OUT/engine2.log 2>&1
      mkdir -p $OUT/engine2-logs && find /tmp/engine2 -name '*.log' -exec cp {} $OUT/engine2-logs/ \;
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/engine2.log | tail -15 ;;
    start)
      t 300 python3 benchmarks/pool_start_cost.py --model 7b --cap-gib 2 --rounds ${START_ROUNDS:-1} \
        --json $OUT/start.json > $OUT/start.log 2>&1
      tail -12 $OUT/start.log ;;
    m10)
      t 300 python3 -m prefix_cache.tools.pipeline_bench --only M10 --runs 3 \
        --json $OUT/m10.json > $OUT/m10.log 2>&1
      tail -12 $OUT/m10.log ;;
    m10-steps)
      t 240 python3 benchmarks/m10_steps.py --model small --runs 5 ${M10_PROFILE:+--profile 30} \
        > $OUT/m10-steps.log 2>&1
      tail -${M10_PROFILE:+4}12 $OUT/m10-steps.log ;;
  esac
done
echo "total $SECONDS s"
