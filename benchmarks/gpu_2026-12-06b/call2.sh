#!/usr/bin/env bash
# Eleventh session, second device call: the DMA save's first runs issued by submit (B, the
# working tree) against HEAD bf27e97 (A, devrun/head built in place), side by side:
# M1's timeline (benchmarks/m1_timeline.py), M2 and M2p's engine-thread loops, then the
# quick bench (5 runs) of each tree
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/head && python3 setup.py -q build_ext --inplace > $OUT/head-build.log 2>&1) || tail $OUT/head-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local s=$SECONDS; timeout "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/head || echo $root; }
for t in A B; do (cd $(tree $t) && PYTHONPATH=. python3 -c "import prefix_cache; print('$t', prefix_cache.__file__)"); done
for r in 1 2; do
  for t in A B; do
    (cd $(tree $t) && t 60 env PYTHONPATH=. python3 $root/benchmarks/m1_timeline.py --tokens 2048 > $OUT/m1-timeline-$t-$r.txt 2>&1)
    echo "[$t $r]"; tail -6 $OUT/m1-timeline-$t-$r.txt
    (cd $(tree $t) && t 40 env PYTHONPATH=. python3 $root/benchmarks/engine_thread_profile.py --device cuda --requests 1 --tokens 2048 --top 25 > $OUT/m2p-$t-$r.txt 2>&1)
    head -1 $OUT/m2p-$t-$r.txt
  done
done
for t in A B; do
  left=$((590 - SECONDS))
  [ $left -lt 100 ] && { echo "skipped bench $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 240 ? left : 240)) env PYTHONPATH=. python3 -m prefix_cache bench --device cuda --quick --runs 5 --json $OUT/bench-quick5-$t.json > $OUT/bench-quick5-$t.txt 2>&1)
  echo "[bench $t]"; grep -E "^M[0-9]" -A0 $OUT/bench-quick5-$t.txt | cut -c1-110
done
echo "total $SECONDS s"
