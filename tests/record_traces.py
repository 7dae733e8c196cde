"""Rewrite tests/traces/*.json from vLLM's real Scheduler: `python -m tests.record_traces`.

Each trace is one workload of `tests.scheduler_trace.TRACE_WORKLOADS` run on the
installed vLLM with the cache checking every step. `test_scheduler_diff.py`
fails when a re-recording would differ from the committed files.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from tests.scheduler_trace import TRACE_DIR, TRACE_WORKLOADS, run_workload  # noqa: E402


def main() -> int:
    TRACE_DIR.mkdir(exist_ok=True)
    for name, workload in TRACE_WORKLOADS.items():
        run = run_workload(workload())
        path = TRACE_DIR / f"{name}.json"
        path.write_text(run.trace.dumps())
        print(f"{path}: {len(run.trace.steps)} steps, {run.checker.hit_requests} hits, "
              f"{run.preemptions} preemptions, {sum(run.aborts.values())} aborts, "
              f"{path.stat().st_size / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
