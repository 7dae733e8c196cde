#!/usr/bin/env bash
# The CPU row of the device matrix (and the README's test command): set up, then run every
# test that runs without an accelerator, the real vLLM scheduler and engine included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-cpu.sh
source ci/env.sh
exec .venv/bin/python -m pytest -m "not cuda and not npu" "$@"
