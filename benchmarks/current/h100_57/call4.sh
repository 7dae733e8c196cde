#!/usr/bin/env bash
# Nineteenth session's last device call: issue 55's step path in C and hit gather, before
# (devrun/base57: c869988, carried, built here) beside after (this tree), in one call:
#   cuda    the CUDA tests of the save path (reliability, DMA, events, launch, scatter,
#           conformance, the manager's, the engine thread's, the random schedules' and both
#           step paths')
#   engine  the GPU engine's main case, in-process
#   bench   `prefix_cache bench --device cuda --quick --runs 3` (M1-M7: M2, M2p, M5)
#   m11     M11 beside vllm-omni 0.30.0 (`benchmarks/peer_vllm_omni.py --device cuda`)
#   m5e     `pipeline_bench --only M5e --quick` (the small model, eager)
#   m10     M10's engines in one process under cProfile (`benchmarks/m10_steps.py --profile`)
# Needs .vllm-gpu/, .whl/ and devrun/base57 carried (made here by
# `mkdir -p devrun/base57 && git archive c869988 | tar -x -C devrun/base57`; devrun/ is
# ignored). Each figure runs the base tree, then the head.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/base57 && python3 setup.py -q build_ext --inplace > $OUT/base57-build.log 2>&1) \
  || tail $OUT/base57-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
BUDGET=${BUDGET:-470}
# runs "$@" under `timeout`, within what is left of the call's BUDGET s (skipped under 40 s)
t() { local s=$SECONDS limit=$1; shift; local left=$((BUDGET - SECONDS))
      [ $left -lt 40 ] && { echo "= skipped (${left} s left): ${*:1:8}"; return; }
      timeout $((limit < left ? limit : left)) "$@"; echo "= exit $? $((SECONDS - s)) s: ${*:1:8}"; }
# the command's prefix for a tree: base57's package first on the path, or nothing
pre() { [ $1 = base ] && echo env PYTHONPATH=$PWD/devrun/base57${PYTHONPATH:+:$PYTHONPATH}; }
for section in "$@"; do
  case $section in
    cuda)
      t ${CUDA_S:-150} python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_reliability.py \
        tests/test_cuda_dma.py tests/test_cuda_events.py tests/test_cuda_faults.py \
        tests/test_cuda_launch.py tests/test_dma_issuer.py tests/test_scatter_bounds.py \
        tests/test_backend_conformance.py tests/test_manager.py tests/test_engine_thread.py \
        tests/test_devices.py tests/test_manager_random.py \
        > $OUT/cuda.log 2>&1
      tail -4 $OUT/cuda.log ;;
    engine)
      eval "$(bash .vllm-gpu/install.sh)"
      t 150 python3 -m pytest -v -p no:cacheprovider tests/test_gpu_engine.py \
        -k "entries_match_with and in-process" --basetemp=/tmp/engine > $OUT/engine.log 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/engine.log | tail -5 ;;
    bench)
      for tree in base head; do
        t 90 $(pre $tree) python3 -m prefix_cache bench --device cuda --quick --runs 3 \
          --json $OUT/bench-$tree.json > $OUT/bench-$tree.txt 2>&1
        grep -E "^M(2|2p|5) " $OUT/bench-$tree.txt | cut -c1-120
      done ;;
    m11)
      for tree in base head; do
        root=$([ $tree = base ] && echo devrun/base57 || echo .)
        t ${M11_S:-100} env PYTHONPATH=$root python3 $root/benchmarks/peer_vllm_omni.py \
          --device cuda --peer-wheel .whl --runs ${M11_RUNS:-3} --json $OUT/m11-$tree.json \
          > $OUT/m11-$tree.txt 2>&1
        grep -E "^\| (M2|hit)" $OUT/m11-$tree.txt | cut -c1-140
      done ;;
    m5e)
      eval "$(bash .vllm-gpu/install.sh)"
      for tree in base head; do
        t 120 $(pre $tree) python3 -m prefix_cache.tools.pipeline_bench --only M5e --quick \
          --json $OUT/m5e-$tree.json > $OUT/m5e-$tree.txt 2>&1
        grep -E "^M5e" -A2 $OUT/m5e-$tree.txt | cut -c1-140
      done ;;
    m10)
      eval "$(bash .vllm-gpu/install.sh)"
      t 150 python3 benchmarks/m10_steps.py --model small --runs 3 --profile 30 \
        > $OUT/m10-steps.log 2>&1
      tail -42 $OUT/m10-steps.log | cut -c1-120 ;;
  esac
done
echo "total $SECONDS s"
