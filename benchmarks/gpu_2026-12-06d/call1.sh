#!/usr/bin/env bash
# Thirteenth session, first device call: issue 30's table renewed at 2b99fef, one tree: M5e on
# the 7B-class model eager (profiled) and with CUDA graphs, M8 on it, M5e on the small model
# eager and with graphs (h200_session.sh perf without its graph test, which runs in the units
# call, so that all five fit one call)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
out=$OUT
python3 -m pip install -q --no-build-isolation --no-deps -e . > $out/install.log 2>&1 || tail $out/install.log
eval "$(bash .vllm-gpu/install.sh)"
python3 -m pip install -q --no-index --no-deps .profilers/py_spy-*.whl >> $out/install.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
echo "py-spy: $(command -v py-spy || echo none)"
profiles=/tmp/perf-profiles
rm -rf $profiles /tmp/omni-prefix-cache-pipeline-bench-*.log
bench=(python3 -m prefix_cache.tools.pipeline_bench)
end=$((SECONDS + 560))
step() {
  local limit=$1 left=$((end - SECONDS)) s=$SECONDS; shift
  [ $left -lt 45 ] && { echo "skipped ($left s left): $*"; return; }
  [ $limit -gt $left ] && limit=$left
  echo "+ $*"; timeout -k 10 $limit "$@" > $out/step.log 2>&1; local rc=$?
  tail -14 $out/step.log; cat $out/step.log >> $out/perf.log
  echo "= exit $rc, $((SECONDS - s)) s (limit $limit s)"
}
step 110 "${bench[@]}" --only M5e --model 7b --runs 5 --profile $profiles/m5e-7b-eager --profile-seconds 6 --json $out/m5e-7b-eager.json
step 130 "${bench[@]}" --only M5e --model 7b --cudagraphs --runs 5 --json $out/m5e-7b-graphs.json
step 200 "${bench[@]}" --only M8 --model 7b --runs 5 --json $out/m8-7b.json
step 80 "${bench[@]}" --only M5e --model small --runs 5 --json $out/m5e-small-eager.json
step 110 "${bench[@]}" --only M5e --model small --cudagraphs --runs 5 --json $out/m5e-small-graphs.json
rm -f $out/step.log
mkdir -p $profiles/vllm-logs; cp /tmp/omni-prefix-cache-pipeline-bench-*.log $profiles/vllm-logs/ 2>/dev/null
tar -czf $out/perf-profiles.tar.gz --exclude '*.torch-trace.json' -C /tmp perf-profiles
ls -l $out; echo "total $SECONDS s"
