"""M5's loop two ways, in turn: as the bench runs it (each step's rows built on the engine
thread, one step behind: two copies of every row there, into the pool and out of it) and as a
stage of whole entries saves (one copy into the pool a step; the prompt's rows read back once
each pass through its four chunks, on the engine thread too).

    PYTHONPATH=. python benchmarks/m5_paths.py [--device cuda] [--rounds 2]

Each figure is M5's: the median over the pairs of loops of cache ÷ off steps per second
(`step_loop`, quick sizes: 10 steps of 256 tokens, 7 pairs), [lowest-highest pair].
"""

from __future__ import annotations

import argparse
import statistics

from prefix_cache import devices
from prefix_cache.tools.reporting.harness import format_table
from prefix_cache.tools.metrics.overhead import step_loop
from prefix_cache.tools.metrics.workload import bench_dtype

PATHS = (("rows built each step (the bench's M5)", False),
         ("whole entries: saved, read back at the end", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    backend = devices.get_backend(args.device)
    dtype = bench_dtype(backend)
    rows = []
    for round_ in range(1, args.rounds + 1):
        for name, whole in PATHS:
            ratios, off = step_loop(backend, 256, dtype, 10, 7, whole_entries=whole)
            rows.append([round_, name, f"{statistics.median(ratios):.3f} "
                         f"[{min(ratios):.3f}-{max(ratios):.3f}]", f"{off:.0f}"])
    backend.close()
    print(format_table(["round", "path", "M5", "off steps/s"], rows))


if __name__ == "__main__":
    main()
