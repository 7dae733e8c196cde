#!/usr/bin/env bash
# The NPU row: an Ascend host with CANN, and a Python ($PYTHON, default python3) with torch and
# torch_npu (the versions vllm-ascend pins). Loads the CANN environment, installs the pinned test
# tools and this project (editable), runs the conformance and manager suites on the npu backend and
# the npu-only tests, then the quick benchmark. A missing piece fails the row; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CANN_SET_ENV=/usr/local/Ascend/ascend-toolkit/set_env.sh

fail() {
    echo "ci/npu.sh: $*" >&2
    exit 1
}

# CANN's set_env.sh puts its runtime (libascendcl, libhccl, ...) on the library path and sets
# ASCEND_HOME_PATH; an environment that already has ASCEND_HOME_PATH is taken as loaded.
if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f "$CANN_SET_ENV" ]; then
    set +u  # CANN's script reads unset variables
    # shellcheck source=/dev/null
    source "$CANN_SET_ENV"
    set -u
fi
[ -n "${ASCEND_HOME_PATH:-}" ] ||
    fail "CANN not found: no \$ASCEND_HOME_PATH and no $CANN_SET_ENV (install the CANN toolkit)"

command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; set PYTHON to the NPU stack's Python"
"$PYTHON" -c "import torch" 2>/dev/null ||
    fail "torch does not import in $PYTHON: install the torch that torch_npu pins first"
# autoload off: a broken torch_npu then fails here with its own ImportError, not inside torch
TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" -c "import torch_npu" ||
    fail "torch_npu does not import with CANN at $ASCEND_HOME_PATH (see the error above)"
"$PYTHON" -c "import sys, torch, torch_npu; sys.exit(not torch.npu.is_available())" ||
    fail "torch_npu sees no Ascend NPU (driver, ASCEND_RT_VISIBLE_DEVICES?)"

source ci/install-test-deps.sh
"$PYTHON" -m pytest -m "not cuda and not vllm" "$@"
"$PYTHON" -m prefix_cache bench --device npu --quick
