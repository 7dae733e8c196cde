"""What the shm channel's consumer calls cost on their own: the take of a one-row chunk that
its producer just put (a consumer keeping up), and a `get` of a streamed entry whose chunks all
queued first (a consumer behind its producer, or one that joins a stream at its end).

    PYTHONPATH=. python3 benchmarks/shm_take.py [--calls 400] [--rounds 5] [--backlog 1000]

Each take figure is the mean µs of `--calls` takes, one line per round, on a namespace of
`open_channel()` that also holds a pending chunk of each of 8 other ids (as a stage's
namespace does); the backlog figure is one `get` of `--backlog` one-row chunks.
"""

from __future__ import annotations

import argparse
import time

import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel

#: Other ids with a chunk waiting in the namespace while the takes run.
OTHER_IDS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backlog", type=int, default=1000)
    args = parser.parse_args()
    row = {HIDDEN_KEY: torch.ones(1, 256)}
    with open_channel() as channel:
        for i in range(OTHER_IDS):
            channel.put(f"other-{i}", row, final=False)
        print("| round | take of a chunk just put, µs |")
        print("| --- | --- |")
        for round_ in range(args.rounds):
            taking, chunks = 0.0, channel.stream(f"kept-up-{round_}", timeout_s=5)
            for start in range(args.calls):
                channel.put(f"kept-up-{round_}", row, start=start, final=False)
                began = time.perf_counter()
                next(chunks)
                taking += time.perf_counter() - began
            print(f"| {round_ + 1} | {taking / args.calls * 1e6:.1f} |")
        for start in range(args.backlog):
            channel.put("behind", row, start=start, final=start == args.backlog - 1)
        began = time.perf_counter()
        channel.get("behind", timeout_s=30)
        print(f"\nget of a streamed entry of {args.backlog} queued chunks: "
              f"{time.perf_counter() - began:.3f} s")


if __name__ == "__main__":
    main()
