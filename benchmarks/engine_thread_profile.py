"""Where M2's engine-thread time goes: its step loop under cProfile, the cache's functions
and the torch and device calls they make, by self time.

    PYTHONPATH=. python benchmarks/engine_thread_profile.py [--device cuda] [--requests 64]

The loop is M2's (`engine_thread_us`): `--requests` decode requests (or one `--tokens`-token
prefill with `--requests 1`), a stand-in forward of `--forward-us` running on the device
when each step's calls are made (and `--sweep-mib` MiB of host memory written before them, as
a forward evicts the host's caches). It runs once unprofiled (the median the bench would report)
and once under cProfile, whose table lists the `--top` functions by self time, µs per step.
cProfile adds about a µs to every Python call it sees, so its shares, not its sum, are what
to read.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from prefix_cache import devices
from prefix_cache.tools.harness import format_table
from prefix_cache.tools.metrics.engine_thread import STEP_FORWARD_US, engine_thread_us
from prefix_cache.tools.metrics.workload import bench_dtype


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":
        return name  # a builtin: torch's C functions, numpy's, the C extensions'
    short = path.split("prefix_cache/", 1)[-1] if "prefix_cache/" in path else \
        path.rsplit("/", 2)[-1]
    return f"{short}:{line} {name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per request a step")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--forward-us", type=float, default=STEP_FORWARD_US)
    parser.add_argument("--sweep-mib", type=int, default=0,
                        help="host MiB written before each step (untimed), as a forward "
                             "evicts the host's caches (benchmarks/cold_step.py)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    backend = devices.get_backend(args.device)
    dtype = bench_dtype(backend)

    def loop() -> float:
        return engine_thread_us(backend, args.requests, args.tokens, dtype, args.steps,
                                forward_us=args.forward_us,
                                host_sweep_bytes=args.sweep_mib << 20).median_us

    plain = loop()
    profile = cProfile.Profile()
    profile.enable()
    profiled = loop()
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, tottime, cumtime, _)}
    steps = args.steps
    top = sorted(stats.items(), key=lambda item: -item[1][2])[: args.top]
    print(f"{args.device}: {args.requests} requests x {args.tokens} tokens, forward "
          f"{args.forward_us:.0f} µs, host sweep {args.sweep_mib} MiB: median step "
          f"{plain:.1f} µs unprofiled, {profiled:.1f} profiled ({steps} steps)")
    print(format_table(["function", "calls a step", "self µs a step", "with callees µs"],
                       [[_where(key), f"{nc / steps:.1f}", f"{tt / steps * 1e6:.1f}",
                         f"{ct / steps * 1e6:.1f}"] for key, (_, nc, tt, ct, _) in top]))


if __name__ == "__main__":
    main()
