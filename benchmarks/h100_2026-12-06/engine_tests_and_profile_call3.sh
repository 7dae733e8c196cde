#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
python3 -m pip install -q --no-index --no-deps .profilers/py_spy-*.whl >> $OUT/install.log 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 tests/test_stream_engine.py tests/test_gpu_engine.py -k "stream or v2-main or graphs" > $OUT/tests.log 2>&1
echo "tests exit $? ($SECONDS s)"; tail -14 $OUT/tests.log
left=$((570 - SECONDS))
if [ $left -gt 80 ]; then
  timeout $left python3 -m prefix_cache.tools.stream_bench --runs 1 --profile $OUT/m9c-profile > $OUT/m9c-profile.log 2>&1
  echo "profile run: exit $? ($SECONDS s)"; grep -E '^M9c' -A1 $OUT/m9c-profile.log; tail -5 $OUT/m9c-profile.log
  [ -d $OUT/m9c-profile ] && tar -czf $OUT/m9c-profile.tar.gz -C $OUT m9c-profile && rm -rf $OUT/m9c-profile
fi
