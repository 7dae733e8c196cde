set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail $OUT/install.log
python3 -m pip install -q --no-deps devrun/pyspy/*.whl >> $OUT/install.log 2>&1 || tail -3 $OUT/install.log
eval "$(bash .vllm-gpu/install.sh)"
(cd devrun/base55 && python3 setup.py -q build_ext --inplace > $OUT/base55-build.log 2>&1)
timeout 170 env PYTHONPATH=devrun/base55:$PYTHONPATH python3 -m prefix_cache.tools.stream_bench --runs 2 --json $OUT/m9c-small-base.json > $OUT/m9c-small-base.log 2>&1; echo "base exit $? $SECONDS s"
grep -E "^M9c" -A1 $OUT/m9c-small-base.log
mkdir -p $OUT/prof
timeout $((380 - SECONDS)) python3 -m prefix_cache.tools.stream_bench --runs 2 --model small --profile $OUT/prof --profile-seconds 4 --json $OUT/m9c-small-ring.json > $OUT/m9c-small-ring.log 2>&1; echo "ring exit $? $SECONDS s"
grep -E "^M9c" -A1 $OUT/m9c-small-ring.log; sed -n '/where stage 1/,$p' $OUT/m9c-small-ring.log | head -40
