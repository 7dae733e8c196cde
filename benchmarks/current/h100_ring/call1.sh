#!/usr/bin/env bash
# Eighteenth session's device calls: `bash call.sh SECTION...` in the repository root.
#   reliability  issue 54's CUDA cases (reliability, CUDA units, DMA, scatter, conformance)
#   m9c-ab       M9c, random stages: a301dc2 (devrun/base55, carried) beside this tree
#   m9c-small    M9c on pipeline_bench's small model, eager then CUDA graphs
#   m9c-7b       M9c on the 7B-class model (dummy weights), eager then CUDA graphs
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
# runs "$@" under `timeout`, within what is left of the call's 570 s (skipped under 60 s)
t() { local s=$SECONDS limit=$1; shift; local left=$((570 - SECONDS))
      [ $left -lt 60 ] && { echo "= skipped (${left} s left): ${*:1:8}"; return; }
      timeout $((limit < left ? limit : left)) "$@"; echo "= exit $? $((SECONDS - s)) s: ${*:1:8}"; }
m9c() { grep -E "^M9" -A1 "$1" | tr -s ' '; }
for section in "$@"; do
  case $section in
    reliability)
      t 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_reliability.py \
        tests/test_cuda_dma.py tests/test_cuda_events.py tests/test_cuda_faults.py \
        tests/test_cuda_launch.py tests/test_dma_issuer.py tests/test_scatter_bounds.py \
        tests/test_backend_conformance.py > $OUT/reliability.log 2>&1
      tail -4 $OUT/reliability.log ;;
    m9c-ab)
      (cd devrun/base55 && python3 setup.py -q build_ext --inplace > $OUT/base55-build.log 2>&1)
      for round in 1; do
        t 200 env PYTHONPATH=devrun/base55 python3 -m prefix_cache.tools.stream_bench --runs 3 \
          --json $OUT/m9c-base-$round.json > $OUT/m9c-base-$round.log 2>&1
        m9c $OUT/m9c-base-$round.log
        t 200 python3 -m prefix_cache.tools.stream_bench --runs 3 --json $OUT/m9c-ring-$round.json \
          > $OUT/m9c-ring-$round.log 2>&1
        m9c $OUT/m9c-ring-$round.log
      done ;;
    m9c-small|m9c-7b)
      model=${section#m9c-}
      for graphs in "" --cudagraphs; do
        name=m9c-$model${graphs:+-graphs}
        t 280 python3 -m prefix_cache.tools.stream_bench --runs 3 --model $model $graphs \
          --json $OUT/$name.json > $OUT/$name.log 2>&1
        m9c $OUT/$name.log
      done ;;
  esac
done
echo "total $SECONDS s"
