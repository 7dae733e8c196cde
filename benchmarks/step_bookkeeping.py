"""The cache's bookkeeping of M2's 64-request decode step on the host backend, without timers
around its functions: per step, `new_step_starts` + `save_outputs` less the time of the rows'
memcpy (`_core.copy_rows`, the only call timed inside them), then the median over the steps
of M2's step loop (`prefix_cache.tools.metrics.engine_thread.engine_thread_us`).

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

from prefix_cache import devices
from prefix_cache.core import _core
from prefix_cache.devices import cpu
from prefix_cache.tools.metrics.engine_thread import engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype


def run(requests: int, steps: int) -> dict[str, float]:
    """Median µs of `new_step_starts`, `save_outputs`, the memcpy and the bookkeeping, over
    M2's step loop (`engine_thread_us`) of `requests` one-token requests."""
    copies: list[float] = []

    def copy_rows(*args: object) -> None:
        start = time.perf_counter()
        _core.copy_rows(*args)
        copies.append(time.perf_counter() - start)

    cpu._core = types.SimpleNamespace(copy_rows=copy_rows)  # the CPU write's one _core call
    try:
        backend = devices.get_backend("cpu")
        timing = engine_thread_us(backend, requests, 1, bench_dtype(backend), steps)
    finally:
        cpu._core = _core
    if len(copies) != steps:
        raise RuntimeError(f"{len(copies)} row copies for {steps} steps")
    copies = copies[1:]  # the first step allocates: engine_thread_us leaves it out
    starts, saves = zip(*timing.steps_s)

    def median_us(values: list[float] | tuple[float, ...]) -> float:
        return statistics.median(values) * 1e6

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
