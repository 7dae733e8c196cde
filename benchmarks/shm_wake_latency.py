"""How soon a waiting shm reader sees an entry after its put returns (docs/benchmarks-history.md,
M9).

    PYTHONPATH=. python benchmarks/shm_wake_latency.py [--trials 60] [--wait-s 0.03]

A reader thread waits for each request id; `--wait-s` later the main thread puts a one-row
entry under it. Prints the median and spread of (get returned - put returned), in ms: negative
where the reader took the entry before the put returned.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--wait-s", type=float, default=0.03)
    args = parser.parse_args()
    latencies_ms = []
    with open_channel("shm") as channel:
        for i in range(args.trials):
            got_at: list[float] = []
            reader = threading.Thread(target=lambda rid=f"r{i}": (
                channel.get(rid, timeout_s=10), got_at.append(time.perf_counter())))
            reader.start()
            time.sleep(args.wait_s)
            channel.put(f"r{i}", {HIDDEN_KEY: torch.ones(1, 8)})
            put_at = time.perf_counter()
            reader.join(10)
            latencies_ms.append((got_at[0] - put_at) * 1e3)
    print(f"{args.trials} trials, reader waiting {args.wait_s * 1e3:.0f} ms before each put: "
          f"median {statistics.median(latencies_ms):.2f} ms, "
          f"min {min(latencies_ms):.2f}, max {max(latencies_ms):.2f}")


if __name__ == "__main__":
    main()
