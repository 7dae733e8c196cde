"""The engine thread's calls, each timed: a streaming step's chunk planning inside
`benchmarks/stream_step_cost.py` (its streaming and whole-entry stages both run), or, with
`--m2` first, the save path of M2's step loop (`engine_thread_us`, a stand-in forward running):

    PYTHONPATH=. python3 benchmarks/engine_call_timing.py [stream_step_cost's arguments]
    PYTHONPATH=. python3 benchmarks/engine_call_timing.py --m2 [--device cuda] [--requests 64]

Each function below is wrapped in a `perf_counter_ns` timer, counted on the engine thread
(the main thread) only; printed are the calls and their median µs. A function a tree lacks
(`row_producers` before `row_states`, `row_states` before it) is skipped, so two trees can be
compared side by side. The wrappers add about a microsecond a call, and a wrapped call's time
includes its wrapped callees'. `OMNI_PREFIX_CACHE_STEP_PATH=python` times the Python reference
of the step's bookkeeping (`PrefixCacheConfig.step_path`) in a tree that has the C path.
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prefix_cache.core import block_pool, chunk_reads, committer, hits, launcher, layout, reads
from prefix_cache.core import outputs, row_plans, staging, step_reads, step_table, tasks, writes
from prefix_cache.integration import group_view, stage_outputs
from prefix_cache.manager import OmniPrefixCacheManager

#: (owner, attribute) of each function timed, by the name printed: the streaming step's
STREAM_TIMED: dict[str, tuple[Any, str]] = {
    "StageOutputDriver.begin_step": (stage_outputs.StageOutputDriver, "begin_step"),
    "StageOutputDriver.save_step": (stage_outputs.StageOutputDriver, "save_step"),
    "StageOutputDriver.end_step": (stage_outputs.StageOutputDriver, "end_step"),
    "manager.plan_chunk_rows": (OmniPrefixCacheManager, "plan_chunk_rows"),
    "RowPlans._positions_slots": (row_plans.RowPlans, "_positions_slots"),
    "chunk_reads._plan_reads": (chunk_reads, "_plan_reads"),
    "ReadPlanner.plan_hits": (reads.ReadPlanner, "plan_hits"),
    "PrefixBlockPool.row_producers": (block_pool.PrefixBlockPool, "row_producers"),
    "PrefixBlockPool.lost": (block_pool.PrefixBlockPool, "lost"),
    "PrefixBlockPool.row_states": (block_pool.PrefixBlockPool, "row_states"),
}
#: ... and M2's save path (the backend's functions are added by `_m2_timed`)
M2_TIMED: dict[str, tuple[Any, str]] = {
    "manager.new_step_starts": (OmniPrefixCacheManager, "new_step_starts"),
    "RowPlans.running_step": (row_plans.RowPlans, "running_step"),
    "manager.save_outputs": (OmniPrefixCacheManager, "save_outputs"),
    "Committer.sweep": (committer.Committer, "sweep"),
    "Committer.land": (committer.Committer, "land"),
    "WriteLauncher._landed": (launcher.WriteLauncher, "_landed"),
    "OutputChecker.step_outputs": (outputs.OutputChecker, "step_outputs"),
    "StepWriter.device_slots": (writes.StepWriter, "device_slots"),
    "StepLayout.of_step": (layout.StepLayout, "of_step"),
    "FullAttentionGroupView.step_layout": (group_view.FullAttentionGroupView, "step_layout"),
    "hits.check_hits": (step_table, "check_hits"),  # as the step table calls it
    "StagingPool.claim": (staging.StagingPool, "claim"),
    "StepWriter.save": (writes.StepWriter, "save"),
    "ReadPlanner.resolve_conflicts": (reads.ReadPlanner, "resolve_conflicts"),
    "PrefixBlockPool.claim_write": (block_pool.PrefixBlockPool, "claim_write"),
    "PrefixBlockPool.claim": (block_pool.PrefixBlockPool, "claim"),
    "PrefixBlockPool.record_write": (block_pool.PrefixBlockPool, "record_write"),
    "TaskTable.new": (tasks.TaskTable, "new"),
    "WriteLauncher.launch": (launcher.WriteLauncher, "launch"),
    "hits.StepHits.select": (hits.StepHits, "select"),
    "manager.discard_step": (OmniPrefixCacheManager, "discard_step"),
    "StepReads.release": (step_reads.StepReads, "release"),
}


def _m2_timed(device: str) -> dict[str, tuple[Any, str]]:
    """M2_TIMED and the save's functions of `device`'s backend."""
    timed = dict(M2_TIMED)
    if device.startswith("cuda"):
        from prefix_cache.devices import cuda
        from prefix_cache.devices.cuda import scatter, slot_pages
        timed.update({
            "CudaBackend.scatter_rows": (cuda.CudaBackend, "scatter_rows"),
            "CudaBackend._scatter_mapped": (cuda.CudaBackend, "_scatter_mapped"),
            "CudaBackend._record_done": (cuda.CudaBackend, "_record_done"),
            "SlotPages.take": (slot_pages.SlotPages, "take"),
            "SlotPages.refused": (slot_pages.SlotPages, "refused"),
            "scatter.scatter_rows": (scatter, "scatter_rows"),
            "scatter._Launcher.__call__": (scatter._Launcher, "__call__"),
            "scatter.as_words": (scatter, "as_words"),
        })
    else:
        from prefix_cache.devices import cpu
        timed["CpuBackend.scatter_rows"] = (cpu.CpuBackend, "scatter_rows")
    return timed


def timed(function: Callable[..., Any], times: list[int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return function(*args, **kwargs)
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            times.append(time.perf_counter_ns() - start)
    return wrapper


def main() -> None:
    m2 = sys.argv[1:2] == ["--m2"]
    times: dict[str, list[int]] = {}
    if m2:
        parser = argparse.ArgumentParser(description="M2's save path, each call timed")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--requests", type=int, default=64)
        parser.add_argument("--tokens", type=int, default=1, help="tokens per request a step")
        parser.add_argument("--steps", type=int, default=2000)
        args = parser.parse_args(sys.argv[2:])
        targets = _m2_timed(args.device)
    else:
        targets = STREAM_TIMED
    for name, (owner, attribute) in targets.items():
        if hasattr(owner, attribute):
            setattr(owner, attribute, timed(getattr(owner, attribute), times.setdefault(name, [])))
    if m2:
        from prefix_cache import devices
        from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, engine_thread_us
        from prefix_cache.tools.metrics.workload import bench_dtype
        backend = devices.get_backend(args.device)
        median = engine_thread_us(backend, args.requests, args.tokens, bench_dtype(backend),
                                  args.steps, forward_us=STEP_FORWARD_US).median_us
        print(f"{args.device}: {args.requests} requests x {args.tokens} tokens: median step "
              f"{median:.1f} µs with the timers")
    else:
        sys.argv = ["stream_step_cost.py", *sys.argv[1:]]
        runpy.run_path("benchmarks/stream_step_cost.py", run_name="__main__")
    print(f"\n{'engine thread call':32}  {'calls':>6}  {'median µs':>9}")
    for name, calls in times.items():
        if calls:
            print(f"{name:32}  {len(calls):6d}  {statistics.median(calls) / 1e3:9.1f}")


if __name__ == "__main__":
    main()
