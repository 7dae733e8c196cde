"""The stage's figures in vLLM's Prometheus metrics, named `omni_prefix_cache_*`.

`vllm serve` answers `/metrics` from a registry that gathers the files every process writes
under `PROMETHEUS_MULTIPROC_DIR`, where that is set: vLLM sets it itself when it runs more than
one API server; with one, set it before `vllm serve` starts (a directory of its own, emptied
between runs, as vLLM asks). The engine core and its workers inherit it, so the worker that
holds the cache (tensor-parallel rank 0) writes its figures there: a thread of its own reads
the stage's counters every `PERIOD_S` seconds and writes what changed. No server of its own.

Invariant: each counter written equals the stage's counter of that name at the last read.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

#: Seconds between two reads of the stage's counters.
PERIOD_S = 1.0

#: Stage counter -> (metric, help): counters, monotonic since the stage started.
COUNTERS = {
    "hit_tokens": ("omni_prefix_cache_hit_tokens",
                   "Prompt tokens whose rows a prefix hit served from the host pool"),
    "hit_tokens_trimmed": ("omni_prefix_cache_hit_tokens_trimmed",
                           "Prompt tokens vLLM found cached whose rows the capped host pool had "
                           "evicted, recomputed"),
    "evicted_blocks": ("omni_prefix_cache_evicted_blocks",
                       "KV blocks whose rows the capped host pool evicted"),
    "delivery_published": ("omni_prefix_cache_entries_delivered",
                           "Requests whose rows went to the stage channel"),
    "delivery_failed": ("omni_prefix_cache_entries_failed",
                        "Requests whose channel entry failed"),
    "delivery_rows": ("omni_prefix_cache_rows_delivered",
                      "Rows (positions) the stage channel took, in entries and streamed chunks"),
    "delivery_full_wait_s": ("omni_prefix_cache_channel_full_wait_seconds",
                             "Seconds the stage's puts waited for room in a full channel"),
}
#: Stage figure -> (metric, help): gauges, as they stand.
GAUGES = {
    "resident_blocks": ("omni_prefix_cache_resident_blocks",
                        "KV blocks whose rows the host pool holds"),
    "pool_blocks": ("omni_prefix_cache_pool_blocks",
                    "KV blocks whose rows the host pool can hold"),
}
POOL_BYTES = ("omni_prefix_cache_pool_bytes", "Host bytes of the host pool, by key")


class StageMetrics:
    """Writes a stage's counters (`read()`, the stage's `stats()`) as Prometheus metrics of
    vLLM's multiprocess directory, from a thread of its own, until `close`."""

    def __init__(self, read: Callable[[], Mapping[str, int | float]],
                 period_s: float = PERIOD_S) -> None:
        from prometheus_client import Counter, Gauge
        self._read = read
        self._period_s = period_s
        self._counters = {name: Counter(metric, text, registry=None)
                          for name, (metric, text) in COUNTERS.items()}
        self._gauges = {name: Gauge(metric, text, registry=None, multiprocess_mode="livesum")
                        for name, (metric, text) in GAUGES.items()}
        self._pool_bytes = Gauge(*POOL_BYTES, ["key"], registry=None,
                                 multiprocess_mode="livesum")
        self._written: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-prefix-cache-metrics",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def where_vllm_gathers(cls, read: Callable[[], Mapping[str, int | float]]
                           ) -> StageMetrics | None:
        """Metrics of `read` where vLLM gathers processes' metrics (`PROMETHEUS_MULTIPROC_DIR`
        set), else None: a worker's own registry is one nobody serves."""
        return cls(read) if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.write()
            except Exception:  # the figures are no reason to stop the stage
                logger.exception("omni prefix cache: writing its Prometheus metrics failed")

    def write(self) -> None:
        """The stage's counters as they stand, written."""
        stats = self._read()
        for name, counter in self._counters.items():
            delta = stats.get(name, 0) - self._written[name]
            if delta > 0:
                counter.inc(delta)
                self._written[name] += delta
        for name, gauge in self._gauges.items():
            if name in stats:
                gauge.set(stats[name])
        for name, value in stats.items():
            if name.startswith("pool_bytes."):
                self._pool_bytes.labels(key=name.removeprefix("pool_bytes.")).set(value)

    def close(self) -> None:
        """Stop the thread (bounded)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._period_s)
