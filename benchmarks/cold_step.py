"""The cache's engine-thread µs per step (M2's loop: `new_step_starts` + `save_outputs`) warm,
and after a host pass that evicts the caches, as a real forward does between two steps.

    PYTHONPATH=. python benchmarks/cold_step.py [--device cuda] [--sweep-mib 64] [--steps 400]

Each step writes `--sweep-mib` MiB of host memory (untimed) before its calls; on a device a
stand-in forward (`_ForwardStandIn`, M2's) also runs there. Medians of the timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.tools.harness import format_table
from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, _ForwardStandIn
from prefix_cache.tools.metrics.workload import (BLOCK, WIDTH, RunnerBatch, bench_dtype,
                                                 scheduler_step, synchronize)


def step_us(device: str, num_reqs: int, tokens_per_req: int, steps: int, sweep_mib: int
            ) -> float:
    """Median µs of a step's two calls, with `sweep_mib` MiB written on the host before each."""
    backend = devices.get_backend(device)
    dtype = bench_dtype(backend)
    batch = RunnerBatch(num_reqs, tokens_per_req)
    view = FullAttentionGroupView(batch, BLOCK, backend=backend)
    config = PrefixCacheConfig(num_reqs * (tokens_per_req // BLOCK + 1) + 2, BLOCK,
                               staging_capacity_tokens=num_reqs * tokens_per_req)
    hidden = torch.randn(num_reqs * tokens_per_req, WIDTH, device=backend.device).to(dtype)
    so = scheduler_step(dict.fromkeys(batch.req_ids, tokens_per_req))
    positions = [i * tokens_per_req for i in range(max(BLOCK // tokens_per_req, 1))]
    forward = None if device == "cpu" else _ForwardStandIn(backend, STEP_FORWARD_US)
    sweep = torch.zeros(sweep_mib * 2**18) if sweep_mib else None  # float32: 4 bytes
    times = []
    with OmniPrefixCacheManager(config, view, backend=backend) as cache:
        cache.preallocate(HIDDEN_KEY, (WIDTH,), dtype)
        for step in range(steps + 20):  # the first 20 are not timed
            batch.move_to(positions[step % len(positions)])
            if forward is not None:
                forward()
            if sweep is not None:
                sweep.add_(1.0)
            start = time.perf_counter()
            cache.new_step_starts(so)
            sid = cache.save_outputs(hidden, None, num_tokens_unpadded=hidden.shape[0],
                                     num_tokens_padded=hidden.shape[0])
            times.append(time.perf_counter() - start)
            cache.discard_step(sid)
            synchronize(backend)
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sweep-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    rows = [[name, f"{step_us(args.device, reqs, tokens, args.steps, 0):.0f}",
             f"{step_us(args.device, reqs, tokens, args.steps, args.sweep_mib):.0f}"]
            for name, reqs, tokens in (("64-request decode", 64, 1), ("2048-token prefill", 1, 2048))]
    print(format_table(["step", "warm µs", f"after a {args.sweep_mib} MiB host sweep µs"], rows))


if __name__ == "__main__":
    main()
