"""Engine-thread µs per step with a backend whose writes cost nothing: the host's bookkeeping alone.

    PYTHONPATH=. python3 benchmarks/host_only_scaling.py [LABEL]

Runs on any machine (CPU). Five passes over a 1-token step, a 64-request decode step, a
2048-token and a 16384-token step, each the median of its steps; prints the median pass.
"""

from __future__ import annotations

import statistics
import sys

import torch

from prefix_cache.tools.bench import engine_thread_us
from prefix_cache.devices.base import Transfer
from prefix_cache.devices.cpu import CpuBackend

STEPS = {"1 token": (1, 1), "64-request decode": (64, 1), "2048 tokens": (1, 2048),
         "16384 tokens": (1, 16384)}


class FreeWrites(CpuBackend):
    """The host backend with writes that do nothing: what is left is the cache's own work."""

    def scatter_rows(self, rows, slots, pool, *, ready, staging, in_stream=False) -> Transfer:
        return Transfer()


def main(label: str) -> None:
    backend = FreeWrites()
    runs: dict[str, list[float]] = {name: [] for name in STEPS}
    for _ in range(5):
        for name, (reqs, tokens) in STEPS.items():
            runs[name].append(engine_thread_us(backend, reqs, tokens, torch.float32,
                                               200 if tokens < 16384 else 50,
                                               num_blocks=2048).median_us)
    print(f"{label}: " + ", ".join(f"{name} {statistics.median(v):.0f} µs"
                                   for name, v in runs.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
