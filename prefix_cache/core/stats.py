"""Counters and engine-thread timings the manager reports through `stats()`."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from prefix_cache.core import _core


class CacheStats:
    """Monotonic counters plus seconds and calls per public method; safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._calls: defaultdict[str, int] = defaultdict(int)

    def add(self, **counts: int) -> None:
        with self._lock:
            _core.add_counts(self._counters, counts)

    def timed(self, call: str) -> _Timed:
        """A context that adds its seconds to `call`'s."""
        return _Timed(self, call)

    def _add_time(self, call: str, seconds: float) -> None:
        with self._lock:
            self._seconds[call] += seconds
            self._calls[call] += 1

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = dict(self._counters)
            for call, seconds in self._seconds.items():
                out[f"time_s.{call}"] = seconds
                out[f"calls.{call}"] = self._calls[call]
        return out


class _Timed:
    """`CacheStats.timed`'s context: a class, not a generator (a third of the cost per call)."""

    __slots__ = ("_stats", "_call", "_start")

    def __init__(self, stats: CacheStats, call: str) -> None:
        self._stats = stats
        self._call = call

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._stats._add_time(self._call, time.perf_counter() - self._start)
