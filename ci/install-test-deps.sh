# shellcheck shell=bash
# Sourced by ci/cuda.sh and ci/npu.sh after their checks: the pinned test tools, then this project
# (editable, no dependencies) into $PYTHON, the accelerator host's Python with its own torch stack.
"$PYTHON" -m pip install -q pytest==9.2.0 hypothesis==6.155.2
# numpy: the platform stack's own if it has one (vllm-ascend and torch_npu pin theirs), else this.
"$PYTHON" -c "import numpy" 2>/dev/null || "$PYTHON" -m pip install -q numpy==2.2.6
"$PYTHON" -m pip install -q --no-deps -e .
