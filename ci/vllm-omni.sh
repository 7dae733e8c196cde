#!/usr/bin/env bash
# vllm-omni's engine with this cache inside it: set up $VENV (default .venv-omni, by
# ci/setup-vllm-omni.sh), then run tests/vllm_omni there (vllm-omni's Omni on the CPU with its own
# prefix cache and with this one; the adapter beside vllm-omni's manager).
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv-omni}
bash ci/setup-vllm-omni.sh
source ci/env.sh
unset VLLM_PLUGINS  # vllm-omni's own plugin registers its models; this project's acts when asked
exec "$VENV/bin/python" -m pytest tests/vllm_omni "$@"
