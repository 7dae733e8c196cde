"""What the shm channel's producer calls cost on their own: a put of a one-row chunk, a put of
a whole expected entry (its expectation ended by it), and a step's expectations told together.

    PYTHONPATH=. python3 benchmarks/shm_put.py [--calls 300] [--rows 272] [--width 64]

Each figure is the median µs of `--calls` calls on a namespace of `open_channel()`, every
entry taken off the channel (untimed) after its put, so the namespace stays small.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel

#: Requests told together, as a stage tells those a step schedules first.
EXPECTED_TOGETHER = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rows", type=int, default=272, help="rows of a whole entry")
    parser.add_argument("--width", type=int, default=64, help="floats a row")
    args = parser.parse_args()
    chunk = {HIDDEN_KEY: torch.randn(1, args.width)}
    whole = {HIDDEN_KEY: torch.randn(args.rows, args.width)}
    meta = {"prompt_len": args.rows - 16, "num_rows": args.rows}
    timings: dict[str, list[float]] = {"chunk put (1 row)": [],
                                       f"whole put ({args.rows} rows, expected)": [],
                                       f"expect_all of {EXPECTED_TOGETHER}": []}
    chunk_times, whole_times, expect_times = timings.values()
    with open_channel() as channel:
        channel.register_producer()
        for i in range(args.calls):
            start = time.perf_counter()
            channel.put(f"c{i}", chunk, final=False)
            chunk_times.append(time.perf_counter() - start)
            channel.put(f"c{i}", {HIDDEN_KEY: chunk[HIDDEN_KEY][:0]}, start=1)
            channel.get(f"c{i}")

            ids = [f"w{i}.{j}" for j in range(EXPECTED_TOGETHER)]
            start = time.perf_counter()
            channel.expect_all(ids)
            expect_times.append(time.perf_counter() - start)
            for request_id in ids:
                start = time.perf_counter()
                channel.put(request_id, whole, meta=meta)
                whole_times.append(time.perf_counter() - start)
                channel.get(request_id)
    print(f"shm channel producer calls, medians of {args.calls} (whole puts: "
          f"{args.calls * EXPECTED_TOGETHER}), µs")
    print("| call | µs |")
    print("| --- | --- |")
    for call, times in timings.items():
        print(f"| {call} | {statistics.median(times) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
