"""The runner's output thread, timed alone: its work per decode step and per finished request.

    PYTHONPATH=. python benchmarks/output_thread_step.py [--requests 16] [--hidden 2048]

A `StageOutputDriver` over the cache (CPU backend, a shm channel) takes rounds of `--requests`
requests: a prefill of `--prompt` tokens each, `--decode` decode steps, then their finish. The
output thread's two jobs are timed where they run: a step's delivery (`materialize_step` and
`add_step`) and a request's publish (its rows joined, encoded and written). Medians over the
rounds after the first.

What that work costs the engine thread: with `--forward-ops N` (default 300), each decode step
also runs a stand-in forward of N small torch ops on the main thread (each releases and retakes
the GIL, as an eager vLLM step's do), and the main thread's whole step is timed in rounds that
alternate between the output thread delivering and the output thread only consuming each step
(`discard_step`): the difference is the time the engine thread waited for the output thread's
GIL (on the H200 a traced decode step showed the same: BENCHMARKS.md, 2026-12-03 evening).
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
    parser.add_argument("--forward-ops", type=int, default=300)
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
    engine_steps: dict[bool, list[float]] = {True: [], False: []}  # delivering -> step times
    x = torch.zeros(64)

    def forward() -> None:
        for _ in range(args.forward_ops):
            x.add_(1.0)

    with open_channel() as channel:
        driver = StageOutputDriver(StageDelivery(channel), cache.backend, cache=cache,
                                   policy=ModelCachePolicy(),
                                   empty_hidden=lambda: torch.empty(0, width, dtype=dtype))
        deliver = timed(driver._deliver, steps)
        delivering = True

        def deliver_or_consume(step: Any) -> None:
            if delivering:
                deliver(step)
            elif step.step_id is not None:
                cache.discard_step(step.step_id)

        driver._deliver = deliver_or_consume
        driver.delivery.finish = timed(driver.delivery.finish, finishes)

        step_rows: dict[int, torch.Tensor] = {}

        def step(scheduler_output: Any) -> None:
            driver.begin_step(scheduler_output, [])
            # the step's rows: any will do, and the test driver's per-token rows would cost
            # more than the rest of the step together
            n = sum(sim.scheduled[r] for r in sim.batch)
            rows = step_rows.get(n)
            if rows is None:
                rows = step_rows[n] = torch.randn(n, width).to(dtype)
            batch = StepBatch(list(sim.batch), [sim.reqs[r].computed for r in sim.batch],
                              list(itertools.accumulate(sim.scheduled[r] for r in sim.batch)))
            driver.save_step(rows, None, batch, rows.shape[0])
            driver.end_step()
            sim.advance()

        for round_ in range(2 * args.rounds):
            if round_ == 2:  # the first rounds' allocations and first calls are not timed
                steps.clear()
                finishes.clear()
                engine_steps[True].clear()
                engine_steps[False].clear()
            delivering = round_ % 2 == 0
            ids = [f"r{round_}-{i}" for i in range(args.requests)]
            step(sim.step(new=[(
                r, list(range(1000 * i, 1000 * i + args.prompt + args.decode)),
                list(range(1 + i * blocks_per_request, 1 + (i + 1) * blocks_per_request)),
                0, args.prompt) for i, r in enumerate(ids)]))
            for _ in range(args.decode - 1):
                start = time.perf_counter()
                forward()
                step(sim.step(cached={r: 1 for r in ids}))
                engine_steps[delivering].append(time.perf_counter() - start)
            driver.begin_step(sim.step(finished=ids),
                              [FinishedRequest(r, r, args.prompt) for r in ids]
                              if delivering else [])
            driver.end_step()
            driver._thread.drain()
        driver.close()
    print(format_table(
        ["output-thread job", "median µs", "count"],
        [[f"a {args.requests}-request decode step's delivery",
          f"{statistics.median(steps) * 1e6:.0f}", str(len(steps))],
         [f"a finished request's publish ({args.prompt + args.decode - 1} rows)",
          f"{statistics.median(finishes) * 1e6:.0f}", str(len(finishes))]]))
    on, off = (statistics.median(engine_steps[d]) for d in (True, False))
    print()
    print(format_table(
        [f"engine thread: a decode step ({args.forward_ops} torch ops + the cache's calls)",
         "median µs", "count"],
        [["the output thread delivering each step", f"{on * 1e6:.0f}",
          str(len(engine_steps[True]))],
         ["the output thread only consuming each step", f"{off * 1e6:.0f}",
          str(len(engine_steps[False]))],
         ["what delivery costs the engine thread", f"{(on - off) * 1e6:.0f}", ""]]))


if __name__ == "__main__":
    main()
