"""Counters and engine-thread timings the manager reports through `stats()`."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class CacheStats:
    """Monotonic counters plus seconds and calls per public method; safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._calls: defaultdict[str, int] = defaultdict(int)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counters[name] += value

    @contextmanager
    def timed(self, call: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._seconds[call] += elapsed
                self._calls[call] += 1

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self._counters)
            for call, seconds in self._seconds.items():
                out[f"time_s.{call}"] = seconds
                out[f"calls.{call}"] = self._calls[call]
        return out
