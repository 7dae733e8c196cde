#!/usr/bin/env bash
# The CPU row of the device matrix (and the README's test command): set up $VENV (default .venv),
# then run every test that needs no accelerator, vLLM's real scheduler and engine included.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
bash ci/setup-cpu.sh
source ci/env.sh
exec "$VENV/bin/python" -m pytest -m "not cuda and not npu" "$@"
