"""cProfile of the engine-thread calls (new_step_starts + save_outputs), sorted by own time.

    PYTHONPATH=. python3 benchmarks/profile_engine_thread.py cuda

Profiles a 64-request decode step and a 2048-token prefill step, 300 steps each after 50
unprofiled ones, through the same loop as the bench's M2 and M2p.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from prefix_cache import devices
from prefix_cache.tools.bench import engine_thread_us


def main(device: str) -> None:
    backend = devices.get_backend(device)
    dtype = torch.float32 if backend.name == "cpu" else torch.bfloat16
    for num_reqs, tokens in ((64, 1), (1, 2048)):
        engine_thread_us(backend, num_reqs, tokens, dtype, 50)
        profile = cProfile.Profile()
        profile.enable()
        timing = engine_thread_us(backend, num_reqs, tokens, dtype, 300)
        profile.disable()
        print(f"=== {num_reqs} requests x {tokens} tokens: median {timing.median_us:.0f} µs")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    backend.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
