#!/usr/bin/env bash
# The CUDA row: a GPU machine with torch (CUDA build) and triton installed; vLLM not needed.
# Runs the conformance suite on the cuda backend, the manager suite, the trace replay and the
# CUDA-only tests, then the quick benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python3 -m pytest -m "not npu and not vllm" "$@"
python3 -m prefix_cache bench --device cuda --quick
