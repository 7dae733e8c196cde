#!/usr/bin/env bash
# Twentieth session's device calls for issue 55: `bash call.sh SECTION...` in the repository root.
#   m11              M11 beside vllm-omni 0.30.0, devrun/base57 (c869988, carried) then this tree
#   m9c-MODEL[-graphs]  M9c (`stream_bench --runs 3`) on MODEL (small, 7b), eager or with graphs
#   cuda, bench      as h100_57/call4.sh (the save path's CUDA tests; M2/M2p/M5 base then head)
# Every log and JSON goes into $OUT/raw.tgz at the end (the tool brings back 8 files).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/base57 && python3 setup.py -q build_ext --inplace > $OUT/base57-build.log 2>&1) \
  || tail $OUT/base57-build.log
eval "$(bash .vllm-gpu/install.sh)"
nvidia-smi --query-gpu=name --format=csv,noheader
BUDGET=${BUDGET:-570}
# runs "$@" under `timeout`, within what is left of the call's BUDGET s (skipped under 40 s)
t() { local s=$SECONDS limit=$1; shift; local left=$((BUDGET - SECONDS))
      [ $left -lt 40 ] && { echo "= skipped (${left} s left): ${*:1:8}"; return; }
      timeout $((limit < left ? limit : left)) "$@"; echo "= exit $? $((SECONDS - s)) s: ${*:1:8}"; }
for section in "$@"; do
  case $section in
    m11)
      for tree in base head; do
        root=$([ $tree = base ] && echo devrun/base57 || echo .)
        t ${M11_S:-90} env PYTHONPATH=$root python3 $root/benchmarks/peer_vllm_omni.py \
          --device cuda --peer-wheel .whl --runs 3 --json $OUT/m11-$tree.json \
          > $OUT/m11-$tree.txt 2>&1
        grep -E "^(M2|hit step|rows)" $OUT/m11-$tree.txt | cut -c1-140
      done ;;
    m9c-*)
      model=${section#m9c-}; graphs=
      [ "${model%-graphs}" != "$model" ] && { model=${model%-graphs}; graphs=--cudagraphs; }
      t ${M9C_S:-280} python3 -m prefix_cache.tools.stream_bench --runs 3 --model $model $graphs \
        --json $OUT/$section.json > $OUT/$section.log 2>&1
      grep -E "^M9" -A2 $OUT/$section.log | tr -s ' ' ;;
    cuda|bench)
      BUDGET=$((BUDGET - SECONDS)) bash benchmarks/current/h100_57/call4.sh $section ;;
  esac
done
(cd $OUT && tar czf raw.tgz --remove-files $(ls | grep -v '^raw.tgz$'))
echo "total $SECONDS s"
