#!/usr/bin/env bash
# M9c on CPU: bf27e97 (A, devrun/bf27 built in place) beside the working tree (B), in turn
source ci/env.sh
root=$PWD; out=benchmarks/cpu_2026-12-06e/m9c_ab; mkdir -p $out
for r in 1 2; do
  for t in A B; do
    d=$root; [ $t = A ] && d=$root/devrun/bf27
    (cd $d && PYTHONPATH=.:$PYTHONPATH $root/.venv/bin/python -m prefix_cache.tools.stream_bench --runs 3 > $root/$out/$t-$r.txt 2>&1)
    echo "$t $r: $(grep -E '^M9c' -A1 $out/$t-$r.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
