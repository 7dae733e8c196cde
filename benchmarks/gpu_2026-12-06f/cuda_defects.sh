#!/usr/bin/env bash
# Issue 54, items 8-12 (the CUDA layer), one device call. First the code before the fixes
# (6e62745, carried as devrun/old54 and built in place) against the new GPU tests of items
# 10-12 and the registration script of item 8: each should show its defect. Then the working
# tree: the new tests in full, and the CUDA cases of the reliability, CUDA, DMA, scatter and
# conformance suites. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
out=${OUT:-gpu-out}
root=$PWD
here=benchmarks/gpu_2026-12-06f
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"

echo "+ before the fixes (6e62745)"
(cd devrun/old54 && python3 setup.py -q build_ext --inplace > "$out/old-build.log" 2>&1) \
    || tail "$out/old-build.log"
cp tests/test_cuda_faults.py devrun/old54/tests/test_cuda_faults_new.py
(cd devrun/old54 && PYTHONPATH=$PWD timeout -s INT -k 10 120 python3 -m pytest -q \
    -p no:cacheprovider -rfE --tb=line tests/test_cuda_faults_new.py \
    -k "zero_width or do_not_fit or forked" 2>&1 | tail -12)
(cd devrun/old54 && PYTHONPATH=$PWD timeout 60 python3 "$root/$here/register_twice.py")

echo "+ the working tree"
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/install.log" 2>&1 \
    || tail "$out/install.log"
timeout 60 python3 "$here/register_twice.py"
timeout -s INT -k 20 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    tests/test_cuda_faults.py tests/test_dma_issuer.py tests/test_cuda_events.py \
    > "$out/new.log" 2>&1 &
timeout -s INT -k 20 280 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    --durations=5 -m cuda tests/test_reliability.py tests/test_cuda_*.py \
    tests/test_dma_issuer.py tests/test_scatter_bounds.py tests/test_backend_conformance.py \
    > "$out/suite.log" 2>&1 &
wait
echo "+ new and changed tests, all marks"; tail -15 "$out/new.log"
echo "+ -m cuda suite"; tail -25 "$out/suite.log"
echo "total $SECONDS s"
