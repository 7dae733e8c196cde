#!/usr/bin/env bash
# The CPU row of the device matrix (and the README's test command): set up $VENV (default .venv),
# then run every test that needs no accelerator, vLLM's real scheduler and engine included;
# `--quick` first: the tests that start no vLLM engine and are not marked slow.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
bash ci/setup-cpu.sh
source ci/env.sh
MARKS="not cuda and not npu"
if [[ "${1:-}" == "--quick" ]]; then  # a developer's loop: no vLLM engine, nothing slow
    shift
    MARKS="$MARKS and not vllm and not slow"
fi
exec "$VENV/bin/python" -m pytest -m "$MARKS" "$@"
