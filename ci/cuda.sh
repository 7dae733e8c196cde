#!/usr/bin/env bash
# The CUDA row: an NVIDIA GPU host whose Python ($PYTHON, default python3) has a CUDA build of
# torch and triton; vLLM only for the GPU engine tests. Installs the pinned test tools and this project (editable),
# runs the conformance and manager suites on the cuda backend, the trace replay and the CUDA-only
# tests, then the quick benchmark. A missing piece fails the row; nothing is skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

fail() {
    echo "ci/cuda.sh: $*" >&2
    exit 1
}

command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON to the GPU stack's Python"
"$PYTHON" -c "import torch" 2>/dev/null ||
    fail "torch does not import in $PYTHON: install a CUDA build of torch (>=2.4,<2.15) first"
"$PYTHON" -c "import sys, torch; sys.exit(torch.version.cuda is None)" ||
    fail "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') is not a CUDA build"
"$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" ||
    fail "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?)"
"$PYTHON" -c "import triton" 2>/dev/null ||
    fail "triton does not import: the cuda backend's scatter kernel needs torch's triton"

source ci/install-test-deps.sh
"$PYTHON" -m pytest -m "not npu and not vllm" "$@"
# The GPU worker in a real vLLM GPU engine, where a vLLM GPU build imports (on the H200 machine:
# eval "$(bash ../shared/tools/vllm-gpu/install.sh)" first)
if "$PYTHON" -c "import vllm" 2>/dev/null; then
    "$PYTHON" -m pytest -m "cuda and vllm" "$@"
else
    echo "ci/cuda.sh: vLLM does not import in $PYTHON: the GPU engine tests did not run" >&2
fi
"$PYTHON" -m prefix_cache bench --device cuda --quick
