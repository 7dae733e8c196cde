"""The engine thread's calls of a streaming step's chunk planning, each timed, inside
`benchmarks/stream_step_cost.py` (its streaming and whole-entry stages both run):

    PYTHONPATH=. python3 benchmarks/engine_call_timing.py [stream_step_cost's arguments]

Each function below is wrapped in a `perf_counter_ns` timer, counted on the engine thread
(the main thread) only; printed are the calls and their median µs. A function a tree lacks
(`row_producers` before `row_states`, `row_states` before it) is skipped, so two trees can be
compared side by side. The wrappers add about a microsecond a call, and a wrapped call's time
includes its wrapped callees'.
"""

from __future__ import annotations

import runpy
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prefix_cache.core import block_pool, chunk_reads, reads
from prefix_cache.integration import stage_outputs
from prefix_cache.manager import OmniPrefixCacheManager

#: (owner, attribute) of each function timed, by the name printed
TIMED: dict[str, tuple[Any, str]] = {
    "StageOutputDriver.begin_step": (stage_outputs.StageOutputDriver, "begin_step"),
    "StageOutputDriver.save_step": (stage_outputs.StageOutputDriver, "save_step"),
    "StageOutputDriver.end_step": (stage_outputs.StageOutputDriver, "end_step"),
    "manager.plan_chunk_rows": (OmniPrefixCacheManager, "plan_chunk_rows"),
    "manager._positions_slots": (OmniPrefixCacheManager, "_positions_slots"),
    "chunk_reads._plan_reads": (chunk_reads, "_plan_reads"),
    "ReadPlanner.plan_hits": (reads.ReadPlanner, "plan_hits"),
    "PrefixBlockPool.row_producers": (block_pool.PrefixBlockPool, "row_producers"),
    "PrefixBlockPool.lost": (block_pool.PrefixBlockPool, "lost"),
    "PrefixBlockPool.row_states": (block_pool.PrefixBlockPool, "row_states"),
}


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
    times: dict[str, list[int]] = {}
    for name, (owner, attribute) in TIMED.items():
        if hasattr(owner, attribute):
            setattr(owner, attribute, timed(getattr(owner, attribute), times.setdefault(name, [])))
    sys.argv = ["stream_step_cost.py", *sys.argv[1:]]
    runpy.run_path("benchmarks/stream_step_cost.py", run_name="__main__")
    print(f"\n{'engine thread call':32}  {'calls':>6}  {'median µs':>9}")
    for name, calls in times.items():
        if calls:
            print(f"{name:32}  {len(calls):6d}  {statistics.median(calls) / 1e3:9.1f}")


if __name__ == "__main__":
    main()
