"""What planning a streaming step's chunks costs the engine thread, alone: `plan_chunk_rows`.

    PYTHONPATH=. python3 benchmarks/chunk_plan_cost.py [--requests 4 32] [--calls 3000]

Per request count, a cache (CPU backend) over the simulated runner (`tests.sim.StepDriver`)
whose requests ran a prefill and a few decode steps; each call plans a one-row chunk per
request, as a decode step with a chunk every position does, and its chunks are let go
(untimed). Printed: the call's median and 10th percentile. Also the view's part of it on a
real vLLM `InputBatch` (`FullAttentionGroupView`): every request's positions in one call
(`requests_positions_runs`) beside a request at a time (`request_positions_runs`).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.core.runs import runs_slots
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.reporting.harness import format_table
from tests.sim import StepDriver

BLOCK_SIZE = 16
PROMPT = 64
HIDDEN = 256


def plan_us(num_requests: int, calls: int) -> tuple[float, float]:
    """`plan_chunk_rows`' median and 10th percentile µs, a one-row chunk per request."""
    sim = StepDriver(BLOCK_SIZE)
    blocks_each = -(-(PROMPT + 8) // BLOCK_SIZE)
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=1 + num_requests * blocks_each, block_size=BLOCK_SIZE),
        sim, backend=devices.get_backend("cpu"))
    manager.preallocate(HIDDEN_KEY, (HIDDEN,), torch.bfloat16)
    manager.track_allocations()  # as a streaming stage's cache does
    ids = [f"r{i}" for i in range(num_requests)]
    out = sim.step(new=[(r, list(range(1000 * i, 1000 * i + PROMPT + 8)),
                         list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)), 0, PROMPT)
                        for i, r in enumerate(ids)])
    try:
        for _ in range(4):
            manager.new_step_starts(out)
            n = sum(sim.scheduled.values())
            manager.discard_step(manager.save_outputs(
                torch.randn(n, HIDDEN).to(torch.bfloat16), None, num_tokens_unpadded=n,
                num_tokens_padded=n, plan_reads=False))
            sim.advance()
            out = sim.step(cached=dict.fromkeys(ids, 1))
        position = PROMPT + 2  # the chunk due: the row the step before saved
        due = dict.fromkeys(ids, (position, position + 1))
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            chunks = manager.plan_chunk_rows(due)
            times.append(time.perf_counter() - start)
            for chunk in chunks.values():
                chunk.cancel()
        assert [(c.start, c.num_rows) for c in chunks.values()] == [due[r] for r in ids]
    finally:
        manager.shutdown()
    return statistics.median(times) * 1e6, float(np.percentile(times, 10)) * 1e6


def view_us(num_requests: int) -> tuple[float, float]:
    """A real InputBatch's view: a one-row span per request, a request at a time and in one
    call (µs, best of 5)."""
    import tests.test_group_view_vllm as vllm_batch  # needs vLLM

    vllm_batch.MAX_REQS = max(vllm_batch.MAX_REQS, num_requests)
    batch = vllm_batch.make_input_batch(BLOCK_SIZE)
    ids = [f"r{i}" for i in range(num_requests)]
    for i, req_id in enumerate(ids):
        vllm_batch.add_request(batch, req_id, PROMPT + 2, list(range(1 + 10 * i, 11 + 10 * i)))
    view = FullAttentionGroupView(batch, BLOCK_SIZE, backend=devices.get_backend("cpu"))
    starts, ends = [PROMPT + 1] * num_requests, [PROMPT + 2] * num_requests

    def each() -> np.ndarray:
        return np.concatenate([runs_slots(view.request_positions_runs(r, end, start))
                               for r, start, end in zip(ids, starts, ends)])

    def at_once() -> np.ndarray:
        return runs_slots(view.requests_positions_runs(ids, starts, ends))

    def best_us(f: Callable[[], np.ndarray]) -> float:
        return min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6

    if not hasattr(view, "requests_positions_runs"):  # a tree before it
        return best_us(each), float("nan")
    assert each().tolist() == at_once().tolist()
    return best_us(each), best_us(at_once)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    rows = []
    for n in args.requests:
        median, p10 = plan_us(n, args.calls)
        each, at_once = view_us(n)
        rows.append([str(n), f"{median:.1f}", f"{p10:.1f}", f"{each:.1f}", f"{at_once:.1f}"])
    print(format_table(["requests", "plan_chunk_rows median µs", "p10 µs",
                        "InputBatch view: a request at a time µs", "in one call µs"], rows))


if __name__ == "__main__":
    main()
