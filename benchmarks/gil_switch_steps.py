"""Engine step time with the cache's worker ÷ vLLM's plain worker (pipeline_bench's M5e step
comparison) under two GIL switch intervals, in one process:

    PYTHONPATH=. python3 benchmarks/gil_switch_steps.py [--runs N]

In-process engines run their steps on this thread while the cache's output thread assembles
and publishes rows. A thread that wants the GIL while another holds it waits up to the switch
interval (5 ms by default) before it asks for it; if the gap between the two workers closes
with a shorter interval, the engine thread's cost is waiting for the GIL, not the cache's own
calls on it.
"""

from __future__ import annotations

import argparse
import sys

from prefix_cache.tools.demo import format_table
from prefix_cache.tools.pipeline_bench import measure_step_time

INTERVALS_S = (sys.getswitchinterval(), 0.0005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for interval in INTERVALS_S:
        sys.setswitchinterval(interval)
        result = measure_step_time(runs=args.runs)
        rows.append([f"{interval * 1e3:g}", f"{result['step_s_plain']['median'] * 1e3:.2f}",
                     f"{result['step_s_cache']['median'] * 1e3:.2f}",
                     f"{1 / result['step_ratio']:.3f}", f"{1 / result['total_ratio']:.3f}",
                     f"{result['engine_thread_library_s_per_step'] * 1e6:.0f}"])
    print(format_table(["switch ms", "plain step ms", "cache step ms", "M5e (median step)",
                        "total plain/cache", "cache calls µs/step"], rows))


if __name__ == "__main__":
    main()
