#!/usr/bin/env bash
# Issue 55 §2 on CPU: c869988 (before the C step path; devrun/base57, built in place) beside
# this tree, in turn: `prefix_cache bench --quick --runs 3` (M2, M2p, M5) and
# `pipeline_bench --only M5e --runs 3`, two rounds each (base, head, head, base).
# Run from the repository root: `bash benchmarks/current/cpu/c_path_ab/ab.sh OUTDIR`.
set -uo pipefail
out=${1:?output folder}; mkdir -p $out
source ci/env.sh
py=$PWD/.venv/bin/python
for tree in base head head base; do
  root=$([ $tree = base ] && echo $PWD/devrun/base57 || echo $PWD)
  n=$(ls $out | grep -c "^bench-$tree")
  echo "== $tree $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH=$root $py -m prefix_cache bench --device cpu --quick --runs 3 \
    --json $out/bench-$tree-$n.json > $out/bench-$tree-$n.txt 2>&1
  grep -E "^M(2|2p|5) " $out/bench-$tree-$n.txt | cut -c1-100
  PYTHONPATH=$root $py -m prefix_cache.tools.pipeline_bench --only M5e --runs 3 \
    --json $out/m5e-$tree-$n.json > $out/m5e-$tree-$n.txt 2>&1
  grep -E "^M5e" -A1 $out/m5e-$tree-$n.txt | cut -c1-140
done
