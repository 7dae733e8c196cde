#!/usr/bin/env bash
# Fourteenth session, fourth device call, at 0bbac29 (a529eab's library; pipeline_bench prints the
# device's work from its traces): M5e on the small model with CUDA graphs and eager, 5 runs each,
# profiled (vLLM's worker traces under graphs, torch's in-process eager), a second reading of
# call 3's rows; carry .vllm-gpu, .profilers and devrun
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
python3 -m pip install -q --no-index --no-deps .profilers/py_spy-*.whl >> $OUT/install.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
end=$((SECONDS + ${BUDGET_S:-300}))
step() {
  local name=$1 limit=$2 left=$((end - SECONDS)) s=$SECONDS; shift 2
  [ $left -lt 40 ] && { echo "skipped ($left s left): $name"; return; }
  [ $limit -gt $left ] && limit=$left
  timeout -k 10 $limit python3 -m prefix_cache.tools.pipeline_bench --only M5e --runs 5 "$@" \
      --profile /tmp/prof/$name --profile-seconds 3 --json $OUT/$name.json > $OUT/$name.txt 2>&1
  echo "= $name exit $? $((SECONDS - s)) s"
  sed -n '/^M5e/,$p' $OUT/$name.txt | grep -v "^\[pipeline" | head -60
}
step m5e-small-graphs 170 --model small --cudagraphs
step m5e-small-eager 110 --model small
tar -czf $OUT/profiles.tar.gz --exclude '*.torch-trace.json' --exclude '*.pt.trace.json*' -C /tmp prof
echo "total $SECONDS s"
