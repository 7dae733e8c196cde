#!/usr/bin/env bash
# M9c on CPU (twenty-second session): 24754c5 (A, before the one-call chunk views and the
# tracking stages' C step path; /tmp/base24) beside this checkout (B), in turn
source /work/main/ci/env.sh
out=${OUT:-/tmp/m9c_s22}; mkdir -p $out
for r in 1 2; do
  for t in A B; do
    d=/work/main; [ $t = A ] && d=/tmp/base24
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python -m prefix_cache.tools.stream_bench \
      --only M9c --runs 3 > $out/$t-$r.txt 2>&1)
    echo "$t $r: $(grep -E '^M9c' -A1 $out/$t-$r.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
