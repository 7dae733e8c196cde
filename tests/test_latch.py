"""Latch: the once-set gate write tasks and reads wait on, in place of threading.Event."""

from __future__ import annotations

import threading
import time

from prefix_cache.core.latch import Latch


def test_wait_times_out_while_closed_and_every_waiter_passes_once_set() -> None:
    latch = Latch()
    start = time.monotonic()
    assert not latch.wait(0.05) and not latch.is_set()
    assert time.monotonic() - start >= 0.04

    passed: list[bool] = []
    waiters = [threading.Thread(target=lambda: passed.append(latch.wait(10)))
               for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    assert passed == []  # all still waiting
    latch.set()
    latch.set()  # a second set changes nothing
    for waiter in waiters:
        waiter.join(10)
    assert passed == [True] * 4
    assert latch.is_set() and latch.wait(0) and latch.wait()
