"""What streaming costs an engine thread that needs the GIL: M9c's comparison, without vLLM.

    PYTHONPATH=. python3 benchmarks/stream_step_cost.py [--requests 4] [--hidden 256]
        [--forward-python-us 1500] [--forward-ops 300] [--every 1] [--rounds 6]
        [--dtype bfloat16|float32]

Two stages, each a `StageOutputDriver` over the cache (CPU backend) and one shm channel: one
streams (a chunk per request every `--every` positions, read back from the pool and published
by its output thread as it falls due), the other publishes whole entries at the finish (the
cache's default: no output-thread work per step). Each round, one stage then the other runs
`--requests` requests through a prefill of `--prompt` tokens and `--decode` decode steps; before each step's
calls, the engine thread runs a stand-in forward that needs the GIL as an eager GPU step's
does: a fixed amount of pure Python (`--forward-python-us` of it alone) and `--forward-ops`
small torch ops (each gives the GIL up for a moment, as a kernel launch does). After each round
every request's entry is taken from the channel and checked for its rows (untimed).

Printed: the streaming output thread's job per decode step that has chunks (their reads from
the pool and their put; medians), and the engine thread's decode step with each stage and the
part of it in the driver's calls (the cache's hooks): the steps' ratio is M9c's, their
difference what streaming costs the engine thread a step. Rounds alternate which stage goes
first; the first two are not timed. On this 2-core machine the output thread's system calls
compete for a core too, as they do in the engine (BENCHMARKS.md, M9c).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from prefix_cache.channel import StageChannel, open_channel
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.devices import get_backend
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery
from prefix_cache.integration.stage_outputs import StageOutputDriver, StepBatch
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.reporting.harness import format_table
from tests.sim import StepDriver

BLOCK_SIZE = 16


def _python_work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def python_work_for(us: float) -> int:
    """Iterations of `_python_work` that take about `us` alone on this machine."""
    n = 10_000
    while True:
        start = time.perf_counter()
        _python_work(n)
        elapsed = time.perf_counter() - start
        if elapsed > 0.02:
            return int(n * us * 1e-6 / elapsed)
        n *= 2


class Stage:
    """One stage's driver over a cache of its own, and the engine thread's steps through it."""

    def __init__(self, channel: StageChannel, args: argparse.Namespace, *, streaming: bool,
                 forward: Callable[[], None]) -> None:
        self.args, self.forward = args, forward
        self.sim = StepDriver(BLOCK_SIZE)
        self.blocks_per_request = -(-(args.prompt + args.decode) // BLOCK_SIZE)
        self.cache = OmniPrefixCacheManager(
            PrefixCacheConfig(num_blocks=1 + args.requests * self.blocks_per_request,
                              block_size=BLOCK_SIZE), self.sim, backend=get_backend("cpu"))
        self.cache.preallocate(HIDDEN_KEY, (args.hidden,), args.dtype)
        delivery = StageDelivery(channel, stream_every=args.every if streaming else None)
        self.driver = StageOutputDriver(
            delivery, self.cache.backend, cache=self.cache, policy=ModelCachePolicy(),
            empty_hidden=lambda: torch.empty(0, args.hidden, dtype=args.dtype))
        self.jobs: list[float] = []  # the output thread's per-step jobs: a step's chunks
        publish_chunks = delivery.publish_chunks

        def timed_publish_chunks(reads: Any) -> None:
            start = time.perf_counter()
            publish_chunks(reads)
            self.jobs.append(time.perf_counter() - start)

        delivery.publish_chunks = timed_publish_chunks
        self.rows: dict[int, torch.Tensor] = {}  # any rows will do: per-token ones cost more

    def run(self, ids: list[str]) -> list[tuple[float, float]]:
        """The requests' prefill, decode steps and finish; per decode step, its time and that
        of the driver's calls in it."""
        a = self.args
        prompt_of = {r: list(range(1000 * i, 1000 * i + a.prompt + a.decode))
                     for i, r in enumerate(ids)}
        first = self.sim.step(new=[(r, prompt_of[r], list(range(
            1 + i * self.blocks_per_request, 1 + (i + 1) * self.blocks_per_request)), 0, a.prompt)
            for i, r in enumerate(ids)])
        for new in first.scheduled_new_reqs:  # vLLM's NewRequestData carries the prompt
            new.prompt_token_ids = prompt_of[new.req_id][:a.prompt]
        self._step(first)
        times = []
        for _ in range(a.decode - 1):
            start = time.perf_counter()
            self.forward()
            calls = self._step(self.sim.step(cached=dict.fromkeys(ids, 1)))
            times.append((time.perf_counter() - start, calls))
        self.driver.begin_step(self.sim.step(finished=ids),
                               [FinishedRequest(r, r, a.prompt) for r in ids])
        self.driver.end_step()
        return times

    def _step(self, scheduler_output: Any) -> float:
        """One step's calls, as a runner makes them; the seconds the driver's calls took."""
        start = time.perf_counter()
        self.driver.begin_step(scheduler_output, [])
        calls = time.perf_counter() - start
        n = sum(self.sim.scheduled[r] for r in self.sim.batch)
        rows = self.rows.get(n)
        if rows is None:
            rows = self.rows[n] = torch.randn(n, self.args.hidden).to(self.args.dtype)
        batch = StepBatch(list(self.sim.batch), [self.sim.reqs[r].computed
                                                 for r in self.sim.batch],
                          list(itertools.accumulate(self.sim.scheduled[r]
                                                    for r in self.sim.batch)))
        start = time.perf_counter()
        self.driver.save_step(rows, None, batch, rows.shape[0])
        self.driver.end_step()
        calls += time.perf_counter() - start
        self.sim.advance()
        return calls

    def close(self) -> None:
        self.driver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--every", type=int, default=1, help="stream a chunk every N positions")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--forward-python-us", type=float, default=1500.0)
    parser.add_argument("--forward-ops", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the rows' dtype (a model's hidden states: bfloat16)")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    work = python_work_for(args.forward_python_us)
    x = torch.zeros(64)

    def forward() -> None:
        _python_work(work)
        for _ in range(args.forward_ops):
            x.add_(1.0)

    steps: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with open_channel() as channel:
        stages = {streaming: Stage(channel, args, streaming=streaming, forward=forward)
                  for streaming in (True, False)}
        try:
            for round_ in range(args.rounds + 2):
                for streaming in (True, False) if round_ % 2 == 0 else (False, True):
                    stage = stages[streaming]
                    ids = [f"{'on' if streaming else 'off'}-{round_}-{i}"
                           for i in range(args.requests)]
                    times = stage.run(ids)
                    stage.driver._thread.drain()
                    if round_ >= 2:
                        steps[streaming] += times
                    for r in ids:  # every row arrived, whichever way it went
                        got = channel.get(r, timeout_s=30)[HIDDEN_KEY].shape[0]
                        if got != args.prompt + args.decode - 1:
                            raise RuntimeError(f"request {r}: {got} rows, expected "
                                               f"{args.prompt + args.decode - 1}")
                if round_ == 1:
                    stages[True].jobs.clear()
        finally:
            for stage in stages.values():
                stage.close()
    on, off = (statistics.median(t for t, _ in steps[s]) for s in (True, False))
    calls = {s: statistics.median(c for _, c in steps[s]) for s in (True, False)}
    jobs = stages[True].jobs
    print(format_table(
        ["", "median µs", "count"],
        [[f"output thread: a {args.requests}-request decode step's job, streaming "
          f"({str(args.dtype).removeprefix('torch.')} rows, a chunk every {args.every})",
          f"{statistics.median(jobs) * 1e6:.0f}", str(len(jobs))],
         ["engine thread: a decode step, streaming", f"{on * 1e6:.0f}", str(len(steps[True]))],
         ["... of it in the driver's calls", f"{calls[True] * 1e6:.0f}", ""],
         ["engine thread: a decode step, whole entries", f"{off * 1e6:.0f}",
          str(len(steps[False]))],
         ["... of it in the driver's calls", f"{calls[False] * 1e6:.0f}", ""],
         ["what streaming costs the engine thread a step", f"{(on - off) * 1e6:.0f}", ""],
         ["steps/s streaming ÷ whole entries (M9c's ratio)", f"{off / on:.3f}", ""]]))


if __name__ == "__main__":
    main()
