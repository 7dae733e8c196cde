"""The cache's bookkeeping of M2's 64-request decode step on the host backend, without timers
around its functions: per step, `new_step_starts` + `save_outputs` less the time of the rows'
memcpy (`_core.copy_rows`, the only call timed inside them), then the median over the steps.

    PYTHONPATH=. python3 benchmarks/step_bookkeeping.py [--steps 3000] [--rounds 1]

`OMNI_PREFIX_CACHE_STEP_PATH=python` times the Python reference of the step path. It uses
the public calls alone, so two trees can be run side by side (`benchmarks/engine_call_timing.py
--m2` says where inside the calls the time goes, its timers adding about a µs a call).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.core import _core
from prefix_cache.devices import cpu
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, bench_dtype,
                                                 scheduler_step)


def run(requests: int, steps: int) -> dict[str, float]:
    """Median µs of `new_step_starts`, `save_outputs`, the memcpy and the bookkeeping."""
    copies: list[int] = []

    def copy_rows(*args: object) -> None:
        start = time.perf_counter_ns()
        _core.copy_rows(*args)
        copies.append(time.perf_counter_ns() - start)

    cpu._core = types.SimpleNamespace(copy_rows=copy_rows)  # the CPU write's one _core call
    backend = devices.get_backend("cpu")
    batch = RunnerBatch(requests, 1)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    config = PrefixCacheConfig(requests + 2, BLOCK, staging_capacity_tokens=requests)
    dtype = bench_dtype(backend)
    hidden = torch.randn(requests, WIDTH).to(dtype)
    so = scheduler_step(dict.fromkeys(batch.req_ids, 1))
    starts, saves = [], []
    try:
        with OmniPrefixCacheManager(config, view, backend=backend) as cache:
            cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
            for step in range(steps):
                batch.move_to(step % BLOCK)
                t0 = time.perf_counter_ns()
                cache.new_step_starts(so)
                t1 = time.perf_counter_ns()
                step_id = cache.save_outputs(hidden, None, num_tokens_unpadded=requests,
                                             num_tokens_padded=requests, plan_reads=False)
                t2 = time.perf_counter_ns()
                cache.discard_step(step_id)
                starts.append(t1 - t0)
                saves.append(t2 - t1)
    finally:
        cpu._core = _core
    if len(copies) != steps:
        raise RuntimeError(f"{len(copies)} row copies for {steps} steps")

    def median_us(values: list[int]) -> float:
        return statistics.median(values[1:]) / 1e3  # the first step allocates

    return {"new_step_starts": median_us(starts), "save_outputs": median_us(saves),
            "memcpy": median_us(copies),
            "bookkeeping": median_us([a + b - c for a, b, c in zip(starts, saves, copies)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.rounds):
        print("  ".join(f"{name} {us:6.1f}" for name, us in run(args.requests, args.steps).items())
              + "  µs (medians)")


if __name__ == "__main__":
    main()
