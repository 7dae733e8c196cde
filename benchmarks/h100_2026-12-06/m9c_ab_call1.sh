#!/usr/bin/env bash
# M9c side by side: A = 3b93832 (devrun/old, built in place), B = the working tree
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
root=$PWD
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
(cd devrun/old && python3 setup.py -q build_ext --inplace > $OUT/old-build.log 2>&1) || tail $OUT/old-build.log
(cd devrun/old && python3 -c "import prefix_cache; print('A', prefix_cache.__file__)")
python3 -c "import prefix_cache; print('B', prefix_cache.__file__)"
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  for t in A B; do
    d=$root; [ $t = A ] && d=$root/devrun/old
    s=$SECONDS
    (cd $d && timeout 110 python3 -m prefix_cache.tools.stream_bench --runs 3 --json $OUT/m9c-$t-$r.json > $OUT/m9c-$t-$r.log 2>&1)
    echo "$t run $r ($((SECONDS-s)) s): $(grep -E '^M9c' $OUT/m9c-$t-$r.log)"
  done
done
for t in A B; do
  d=$root; [ $t = A ] && d=$root/devrun/old
  s=$SECONDS
  (cd $d && timeout 100 python3 -m prefix_cache.tools.stream_bench --runs 3 --every 16 > $OUT/m9c-$t-e16.log 2>&1)
  echo "$t every16 ($((SECONDS-s)) s): $(grep -E '^M9c' $OUT/m9c-$t-e16.log)"
done
left=$((560 - SECONDS))
if [ $left -gt 70 ]; then
  python3 -m pip install -q --no-index --no-deps .profilers/py_spy-*.whl >> $OUT/install.log 2>&1
  timeout $left python3 -m prefix_cache.tools.stream_bench --runs 1 --profile $OUT/m9c-profile > $OUT/m9c-B-profile.log 2>&1
  echo "profile run: exit $? ($(grep -E '^M9c' $OUT/m9c-B-profile.log))"
  [ -d $OUT/m9c-profile ] && tar -czf $OUT/m9c-profile.tar.gz -C $OUT m9c-profile && rm -rf $OUT/m9c-profile
fi
echo "total $SECONDS s"
