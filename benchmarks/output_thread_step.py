"""The runner's output thread, timed alone: its work per decode step and per finished request.

    PYTHONPATH=. python benchmarks/output_thread_step.py [--requests 16] [--hidden 2048]

A `StageOutputDriver` over the cache (CPU backend, a shm channel) takes rounds of `--requests`
requests: a prefill of `--prompt` tokens each, `--decode` decode steps, then their finish. The
output thread's two jobs are timed where they run: a step's delivery (`materialize_step` and
`add_step`) and a request's publish (its rows joined, encoded and written). Medians over the
rounds after the first.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from prefix_cache.channel import open_channel
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.devices import get_backend
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery
from prefix_cache.integration.stage_outputs import StageOutputDriver, StepBatch
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.harness import format_table
from tests.sim import StepDriver

BLOCK_SIZE = 16


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        into.append(time.perf_counter() - start)
        return out
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    dtype, width = torch.bfloat16, args.hidden
    sim = StepDriver(BLOCK_SIZE)
    blocks_per_request = -(-(args.prompt + args.decode) // BLOCK_SIZE)
    cache = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=1 + args.requests * blocks_per_request,
                          block_size=BLOCK_SIZE), sim, backend=get_backend("cpu"))
    cache.preallocate(HIDDEN_KEY, (width,), dtype)
    steps: list[float] = []
    finishes: list[float] = []
    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), cache.backend, cache=cache,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, width, dtype=dtype))
        driver._deliver = timed(driver._deliver, steps)
        driver.delivery.finish = timed(driver.delivery.finish, finishes)

        def step(scheduler_output: Any) -> None:
            driver.begin_step(scheduler_output, [])
            rows = sim.outputs(width, dtype)
            batch = StepBatch(list(sim.batch), [sim.reqs[r].computed for r in sim.batch],
                              list(itertools.accumulate(sim.scheduled[r] for r in sim.batch)))
            driver.save_step(rows, None, batch, rows.shape[0])
            driver.end_step()
            sim.advance()

        for round_ in range(args.rounds):
            if round_ == 1:  # the first round's allocations and first calls are not timed
                steps.clear()
                finishes.clear()
            ids = [f"r{round_}-{i}" for i in range(args.requests)]
            step(sim.step(new=[(
                r, list(range(1000 * i, 1000 * i + args.prompt + args.decode)),
                list(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request)),
                0, args.prompt) for i, r in enumerate(ids)]))
            for _ in range(args.decode - 1):
                step(sim.step(cached={r: 1 for r in ids}))
            driver.begin_step(sim.step(finished=ids),
                              [FinishedRequest(r, r, args.prompt) for r in ids])
            driver.end_step()
            driver._thread.drain()
        driver.close()
    print(format_table(
        ["output-thread job", "median µs", "count"],
        [[f"a {args.requests}-request decode step's delivery",
          f"{statistics.median(steps) * 1e6:.0f}", str(len(steps))],
         [f"a finished request's publish ({args.prompt + args.decode - 1} rows)",
          f"{statistics.median(finishes) * 1e6:.0f}", str(len(finishes))]]))


if __name__ == "__main__":
    main()
