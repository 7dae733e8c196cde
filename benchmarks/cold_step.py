"""The cache's engine-thread µs per step (M2's loop: `new_step_starts` + `save_outputs`) warm,
and after a host pass that evicts the caches, as a real forward does between two steps.

    PYTHONPATH=. python benchmarks/cold_step.py [--device cuda] [--sweep-mib 64] [--steps 400]

Each step writes `--sweep-mib` MiB of host memory (untimed) before its calls; on a device, M2's
stand-in forward also runs there. Medians of the timed steps (`engine_thread_us`, M2's own).
"""

from __future__ import annotations

import argparse

from prefix_cache import devices
from prefix_cache.tools.harness import format_table
from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype

#: (name, requests, tokens per request) of the two steps M2 and M2p time.
STEPS = (("64-request decode", 64, 1), ("2048-token prefill", 1, 2048))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sweep-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    backend = devices.get_backend(args.device)
    dtype = bench_dtype(backend)

    def step_us(reqs: int, tokens: int, sweep_mib: int) -> str:
        timing = engine_thread_us(backend, reqs, tokens, dtype, args.steps,
                                  forward_us=STEP_FORWARD_US,
                                  host_sweep_bytes=sweep_mib * 2**20)
        return f"{timing.median_us:.0f}"

    rows = [[name, step_us(reqs, tokens, 0), step_us(reqs, tokens, args.sweep_mib)]
            for name, reqs, tokens in STEPS]
    print(format_table(["step", "warm µs", f"after a {args.sweep_mib} MiB host sweep µs"], rows))


if __name__ == "__main__":
    main()
