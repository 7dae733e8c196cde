#!/usr/bin/env bash
# Eleventh session, third device call: issue 30's engine figures at the session's tree, as
# `h200_session.sh perf` runs them (its graph test ran in call 1; no profiles): M5e four ways
# and M8 on the 7B-class model, 5 runs each
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
bench=(python3 -m prefix_cache.tools.pipeline_bench)
step() {  # step NAME LIMIT ARGS...: one pipeline_bench run, cut to what is left of $BUDGET_S (580 s)
  local name=$1 limit=$2 left=$((${BUDGET_S:-580} - SECONDS)) s=$SECONDS; shift 2
  [ $left -lt 45 ] && { echo "skipped $name: $left s left"; return; }
  [ $limit -gt $left ] && limit=$left
  timeout -k 10 $limit "${bench[@]}" "$@" --runs 5 --json $OUT/$name.json > $OUT/$name.log 2>&1
  echo "= $name: exit $? $((SECONDS - s)) s (limit $limit)"
  grep -E "^M5e|^M8" -A3 $OUT/$name.log | cut -c1-110
}
step m5e-7b-eager 120 --only M5e --model 7b
step m5e-7b-graphs 150 --only M5e --model 7b --cudagraphs
step m8-7b 230 --only M8 --model 7b
step m5e-small-eager 80 --only M5e --model small
step m5e-small-graphs 120 --only M5e --model small --cudagraphs
cp /tmp/omni-prefix-cache-pipeline-bench-*.log $OUT/ 2>/dev/null
echo "total $SECONDS s"
