"""Which calls give the GIL up: each call's time while another Python thread spins.

    PYTHONPATH=. python3 benchmarks/gil_handovers.py [--calls 200]

A call that releases the GIL (a system call made through `os`, most torch ops) must then wait
for the spinning thread to hand it back, a good part of the switch interval (5 ms by default):
hundreds of µs. A call that keeps it costs what it costs alone. On an engine's output thread
the engine thread plays the spinner, and every hand-over of the output thread makes it wait
too. Run it on a quiet machine: where no core is free for the spinner, nothing waits.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import fcntl
import torch


def calls(rows: torch.Tensor, fd: int) -> dict[str, Callable[[], object]]:
    return {
        "tensor.shape": lambda: rows.shape,
        "tensor.detach()": rows.detach,
        "tensor.contiguous() (contiguous)": rows.contiguous,
        "tensor.resolve_neg()": rows.resolve_neg,
        "tensor.numpy()": rows.numpy,
        "tensor.view(torch.uint8)": lambda: rows.view(torch.uint8),
        "tensor.reshape(-1)": lambda: rows.reshape(-1),
        "torch.empty(4)": lambda: torch.empty(4),
        "os.pwrite (64 bytes)": lambda: os.pwrite(fd, b"x" * 64, 0),
        "fcntl.flock": lambda: fcntl.flock(fd, fcntl.LOCK_EX),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    rows = torch.randn(16, 64)
    spinning = True

    def spin() -> None:
        while spinning:
            pass

    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        alone = {name: _mean_us(call, args.calls) for name, call in calls(rows, f.fileno()).items()}
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        time.sleep(0.05)
        beside = {name: _mean_us(call, args.calls)
                  for name, call in calls(rows, f.fileno()).items()}
        spinning = False
        spinner.join()
    print(f"µs a call, mean of {args.calls}; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print("| call | alone | beside a spinning thread |")
    print("| --- | --- | --- |")
    for name in alone:
        print(f"| {name} | {alone[name]:.1f} | {beside[name]:.1f} |")


def _mean_us(call: Callable[[], object], n: int) -> float:
    """The mean, not the median: most releases are taken back before the spinner wakes, and
    what a hand-over costs shows in the few that are not."""
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


if __name__ == "__main__":
    main()
