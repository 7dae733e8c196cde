#!/usr/bin/env bash
# M9c on CPU: a301dc2 (A, /tmp/base55) beside the ring at e80308c (B, /tmp/ring55d), in turn
source /work/main/ci/env.sh
out=/tmp/ring/ab2; mkdir -p $out
for r in 1 2; do
  for t in A B; do
    d=/tmp/ring55d; [ $t = A ] && d=/tmp/base55
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python -m prefix_cache.tools.stream_bench --runs 3 > $out/$t-$r.txt 2>&1)
    echo "$t $r: $(grep -E '^M9c' -A1 $out/$t-$r.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
