"""The cache's engine-thread µs in a prefill step whose every request is a prefix hit.

    PYTHONPATH=. python benchmarks/hit_prefill_step.py [--device cuda] [--requests 16]

M8's shape: `--requests` requests of `--prompt` tokens, each hitting the same `--shared`-token
prefix (75% by default), scheduled in one step; `new_step_starts` + `save_outputs` timed
together, as the engine thread calls them (the step's rows are on the device and complete
before the calls, as after a forward). Medians over `--rounds` steps after the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.harness import format_table
from prefix_cache.tools.metrics.workload import bench_dtype, synchronize
from tests.sim import StepDriver

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--shared", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    backend = devices.get_backend(args.device)
    dtype = bench_dtype(backend)
    own_blocks = -(-(args.prompt - args.shared) // BLOCK_SIZE)
    shared_blocks = list(range(1, 1 + args.shared // BLOCK_SIZE))
    num_blocks = 1 + len(shared_blocks) + 2 * args.requests * own_blocks  # two rounds' worth
    sim = StepDriver(BLOCK_SIZE)
    cache = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks, BLOCK_SIZE), sim,
                                   backend=backend)
    cache.preallocate(HIDDEN_KEY, (args.hidden,), dtype)
    prefix = list(range(args.shared))
    step_s: list[float] = []
    with cache:
        for round_ in range(args.rounds + 1):
            free = 1 + len(shared_blocks) + (round_ % 2) * args.requests * own_blocks
            new = []
            for i in range(args.requests):
                own = range(free + i * own_blocks, free + (i + 1) * own_blocks)
                hit = args.shared if round_ or i else 0  # the very first request computes it
                tokens = prefix + [10_000 * (round_ + 1) + 100 * i + t
                                   for t in range(args.prompt - args.shared)]
                new.append((f"r{round_}-{i}", tokens, shared_blocks + list(own), hit,
                            args.prompt - hit))
            scheduler_output = sim.step(new=new)
            rows = sim.outputs(args.hidden, dtype).to(backend.device)
            synchronize(backend)
            start = time.perf_counter()
            cache.new_step_starts(scheduler_output)
            step_id = cache.save_outputs(rows, None, num_tokens_unpadded=rows.shape[0],
                                         num_tokens_padded=rows.shape[0])
            if round_:
                step_s.append(time.perf_counter() - start)
            sim.advance()
            cache.materialize(step_id, sim.batch)
            cache.new_step_starts(sim.step(finished=[r for r, *_ in new]))
            cache.discard_step(cache.save_outputs(
                torch.empty((0, args.hidden), dtype=dtype, device=backend.device), None,
                num_tokens_unpadded=0, num_tokens_padded=0))
    print(format_table(
        ["step", "engine-thread µs (median)", "steps"],
        [[f"{args.requests} requests x {args.prompt} tokens, {args.shared} of each a hit",
          f"{statistics.median(step_s) * 1e6:.0f}", str(len(step_s))]]))


if __name__ == "__main__":
    main()
