"""What a thread polling for a device copy costs a thread that needs the GIL, on this host.

    python benchmarks/poll_wakeups.py [--rounds 6]

A stand-in engine thread runs small torch ops (each releases and retakes the GIL, as an eager
forward's launches and a graph step's Python do) while another thread either sleeps blocked
or polls the way a cache thread waits for a device copy (`poll_until`: pauses from 10 µs,
doubling to `max_pause_s`, restarting each 2 ms "step"). The engine loop's time, median per
mode, with the modes interleaved round by round.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from prefix_cache.tools.harness import format_table

STEP_S = 2e-3  # a small model's graph step on the H200
OPS = 20_000


def engine_loop() -> float:
    a, b, out = torch.ones(16), torch.ones(16), torch.empty(16)
    start = time.perf_counter()
    for _ in range(OPS):
        torch.add(a, b, out=out)
    return time.perf_counter() - start


def poll(stop: threading.Event, max_pause_s: float) -> None:
    while not stop.is_set():
        start, pause = time.monotonic(), 1e-5
        while time.monotonic() - start < STEP_S and not stop.is_set():
            time.sleep(pause)
            pause = min(pause * 2, max_pause_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {"no other thread": None, "a thread blocked on an event": 0.0,
             "a thread polling, pauses up to 200 µs": 2e-4,
             "a thread polling, pauses up to 1 ms": 1e-3}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, max_pause_s in modes.items():
            stop = threading.Event()
            other = None if max_pause_s is None else threading.Thread(
                target=stop.wait if max_pause_s == 0.0 else poll,
                args=() if max_pause_s == 0.0 else (stop, max_pause_s))
            if other is not None:
                other.start()
            time.sleep(0.02)
            times[mode].append(engine_loop())
            stop.set()
            if other is not None:
                other.join()
    alone = statistics.median(times["no other thread"])
    print(format_table(
        ["beside the engine thread", f"{OPS} small ops, ms (median)", "÷ alone"],
        [[mode, f"{statistics.median(t) * 1e3:.1f}", f"{statistics.median(t) / alone:.3f}"]
         for mode, t in times.items()]))


if __name__ == "__main__":
    main()
