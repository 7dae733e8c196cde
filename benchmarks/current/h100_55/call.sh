#!/usr/bin/env bash
# Issue 55's device calls (twentieth and twenty-first sessions): `bash call.sh SECTION...` in the
# repository root.
#   m11              M11 beside vllm-omni 0.30.0, devrun/base57 (c869988, carried) then this tree
#                    (M11_TREES: which of base, head)
#   m9c-MODEL[-graphs]  M9c (`stream_bench --only M9c --runs ${M9C_RUNS:-3}`) on MODEL (small, 7b), eager
#                    or with graphs
#   m5e-MODEL[-graphs]  M5e (`pipeline_bench --only M5e --runs ${M5E_RUNS:-3}`) on MODEL (small, 7b),
#                    eager or with graphs, devrun/base57 then this tree
#   cuda-step        the CUDA tests of the step path (the manager's, the random schedules' and
#                    both step paths', the engine thread's, the launch's, conformance)
#   cuda, bench      as h100_57/call4.sh (the save path's CUDA tests; M2/M2p/M5 base then head)
# Every log and JSON goes into $OUT/raw.tar after each section (the tool brings back 8 files,
# also from a call cut short).
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
      for tree in ${M11_TREES:-base head}; do
        root=$([ $tree = base ] && echo devrun/base57 || echo .)
        t ${M11_S:-90} env PYTHONPATH=$root python3 $root/benchmarks/peer_vllm_omni.py \
          --device cuda --peer-wheel .whl --runs 3 --json $OUT/m11-$tree.json \
          > $OUT/m11-$tree.txt 2>&1
        grep -E "^(M2|hit step|rows)" $OUT/m11-$tree.txt | cut -c1-140
      done ;;
    m9c-*)
      model=${section#m9c-}; graphs=
      [ "${model%-graphs}" != "$model" ] && { model=${model%-graphs}; graphs=--cudagraphs; }
      t ${M9C_S:-200} python3 -m prefix_cache.tools.stream_bench --only M9c --runs ${M9C_RUNS:-3} \
        --model $model $graphs \
        --json $OUT/$section.json > $OUT/$section.log 2>&1
      grep -E "^M9" -A2 $OUT/$section.log | tr -s ' ' ;;
    m5e-*)
      model=${section#m5e-}; graphs=
      [ "${model%-graphs}" != "$model" ] && { model=${model%-graphs}; graphs=--cudagraphs; }
      for tree in base head; do
        pre=$([ $tree = base ] && echo env PYTHONPATH=$PWD/devrun/base57:$PYTHONPATH)
        t ${M5E_S:-150} $pre python3 -m prefix_cache.tools.pipeline_bench --only M5e --model $model \
          $graphs --runs ${M5E_RUNS:-3} --json $OUT/$section-$tree.json > $OUT/$section-$tree.txt 2>&1
        grep -E "^M5e" -A2 $OUT/$section-$tree.txt | tr -s ' ' | cut -c1-160
      done ;;
    cuda-step)
      t ${CUDA_S:-150} python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_manager.py \
        tests/test_manager_random.py tests/test_engine_thread.py tests/test_cuda_launch.py \
        tests/test_backend_conformance.py > $OUT/cuda-step.log 2>&1
      tail -4 $OUT/cuda-step.log ;;
    cuda|bench)
      BUDGET=$((BUDGET - SECONDS)) bash benchmarks/current/h100_57/call4.sh $section ;;
  esac
  (cd $OUT && tar rf raw.tar --remove-files $(ls | grep -v '^raw.tar$'))
done
echo "total $SECONDS s"
