#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
(cd devrun/old && python3 setup.py -q build_ext --inplace > $OUT/old-build.log 2>&1) || tail $OUT/old-build.log
: timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_block_pool.py tests/test_core.py tests/test_manager.py tests/test_trace_replay.py > $OUT/units.txt 2>&1; echo "units exit $?: $(tail -1 $OUT/units.txt)"
for r in 4; do
  for t in B A; do
    d=$root; [ $t = A ] && d=$root/devrun/old
    s=$SECONDS
    (cd $d && timeout 115 python3 -m prefix_cache.tools.stream_bench --runs 3 --json $OUT/m9c-$t-$r.json > $OUT/m9c-$t-$r.txt 2>&1)
    echo "$t run $r ($((SECONDS-s)) s): $(grep -E '^M9c' $OUT/m9c-$t-$r.txt)"
  done
done
echo "total $SECONDS s"
