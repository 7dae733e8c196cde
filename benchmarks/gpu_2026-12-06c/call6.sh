#!/usr/bin/env bash
# Twelfth session, sixth device call: the quick bench (5 runs) at the working tree (B, the
# session's CUDA save: recycled done events, the scatter by cuLaunchKernel), then at bf27e97's
# library (A, devrun/head built in place), one after the other on one machine
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
(cd devrun/head && python3 setup.py -q build_ext --inplace > $OUT/head-build.log 2>&1) || tail $OUT/head-build.log
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local s=$SECONDS; timeout -k 10 "$@"; echo "= exit $? $((SECONDS - s)) s"; }
tree() { [ $1 = A ] && echo $root/devrun/head || echo $root; }
mkdir -p $OUT/c6
for t in B A; do
  left=$((330 - SECONDS))
  [ $left -lt 100 ] && { echo "skipped bench $t: $left s left"; continue; }
  (cd $(tree $t) && t $((left < 170 ? left : 170)) env PYTHONPATH=. python3 -m prefix_cache bench --device cuda --quick --runs 5 --json $OUT/c6/bench-quick5-$t.json > $OUT/c6/bench-quick5-$t.txt 2>&1)
  echo "[bench $t]"; grep -E "^M[0-9]" -A1 $OUT/c6/bench-quick5-$t.txt | cut -c1-120
done
tar -czf $OUT/c6.tar.gz -C $OUT c6 && rm -rf $OUT/c6
echo "total $SECONDS s"
