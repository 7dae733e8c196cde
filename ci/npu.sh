#!/usr/bin/env bash
# The NPU row: an Ascend machine with CANN, torch and torch_npu installed (vllm-ascend's pins).
# Runs the conformance and manager suites on the npu backend and the npu-only tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, torch_npu; assert torch.npu.is_available(), 'no Ascend NPU'"
python3 -m pytest -m "not cuda and not vllm" "$@"
python3 -m prefix_cache bench --device npu --quick
