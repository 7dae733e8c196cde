"""Hand stage outputs from one process to another through the stage channel, without vLLM.

The consumer (this process) opens a new shared-memory namespace, which it owns: the namespace
lasts until the consumer closes it or exits, and then goes with every unconsumed entry. It
gives the namespace's spec to a producer process, which joins it and publishes each request's
rows under the request's id (as a vLLM worker with the cache does once a request finishes).
The consumer takes each entry as it arrives; a taken entry is the consumer's alone.

Run it from anywhere once the package is installed: python examples/channel_two_processes.py
"""

from __future__ import annotations

import multiprocessing
import sys

import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import open_channel

REQUESTS = {"req-0": 5, "req-1": 9}  # request id -> rows


def rows_of(request_id: str) -> torch.Tensor:
    count = REQUESTS[request_id]
    return torch.arange(count * 4, dtype=torch.float32).view(count, 4) + len(request_id)


def produce(spec: str) -> None:
    """The producer: joins the consumer's namespace and publishes every request's rows."""
    with open_channel(spec) as channel:
        for request_id in REQUESTS:
            channel.put(request_id, {HIDDEN_KEY: rows_of(request_id)},
                        meta={"num_rows": REQUESTS[request_id]})


def main() -> int:
    with open_channel("shm") as channel:  # this process owns the namespace
        producer = multiprocessing.get_context("spawn").Process(target=produce,
                                                                args=(channel.spec,))
        producer.start()
        for request_id in REQUESTS:
            entry = channel.get_entry(request_id, timeout_s=60)
            rows = entry.outputs[HIDDEN_KEY]
            print(f"{request_id}: {rows.shape[0]} rows of {rows.shape[1]}, as published: "
                  f"{torch.equal(rows, rows_of(request_id))}; meta {entry.meta}")
        producer.join(60)
    return 0 if producer.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
