"""What `OmniPrefixCacheManager.stats()` reports, gathered from each part that counts."""

from __future__ import annotations

import threading
from collections.abc import Sized

from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.reads import ReadPlanner
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.tasks import TaskTable
from prefix_cache.devices.base import DeviceBackend


class StatsReport:
    """One flat dict of counters: the call counters and times, staging, reads and output
    memory, the tables (read together under the lock), pool bytes per key, the backend's.

    Invariant: it only reads; no count it reports is kept here."""

    def __init__(self, stats: CacheStats, staging: StagingPool, reads: ReadPlanner,
                 tasks: TaskTable, steps: Sized, deferred: DeferredWriter, requests: Sized,
                 pool: PrefixBlockPool, backend: DeviceBackend, lock: threading.Lock) -> None:
        self._stats = stats
        self._staging = staging
        self._reads = reads
        self._tasks = tasks
        self._steps = steps  # the steps saved and not consumed
        self._deferred = deferred
        self._requests = requests  # the live requests
        self._pool = pool
        self._backend = backend
        self._lock = lock

    def collect(self) -> dict[str, int | float]:
        out = self._stats.snapshot()
        out["staging_waits"] = self._staging.waits
        out["staging_wait_s"] = self._staging.wait_time_s
        out["staging_bytes"] = self._staging.nbytes()
        out["copy_on_write_reads"] = self._reads.copy_on_write_reads
        out["output_cache_bytes"] = self._reads.outputs.free_bytes
        out["outputs_reused"] = self._reads.outputs.reused
        out["outputs_swapped_out"] = self._reads.outputs.swapped_out
        with self._lock:
            out["tasks_in_flight"] = len(self._tasks)
            out["steps_unconsumed"] = len(self._steps)
            out["deferred_device_bytes"] = self._deferred.held_bytes
            out["live_requests"] = len(self._requests)
            pool_bytes = self._pool.nbytes()  # the engine thread installs keys under the lock
        for key, nbytes in pool_bytes.items():
            out[f"pool_bytes.{key}"] = nbytes
        for key, count in self._backend.stats().items():
            out[f"backend.{key}"] = count
        return out
