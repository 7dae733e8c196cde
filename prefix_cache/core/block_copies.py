"""vLLM's KV block copies, mirrored in the pool: a copied block serves the same rows."""

from __future__ import annotations

import threading

import numpy as np

from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.reads import ReadPlanner
from prefix_cache.core.tasks import TaskState, TaskTable
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError


class BlockCopyMirror:
    """Copies a block's rows, every key, once no write in flight can land over the copy."""

    def __init__(self, pool: PrefixBlockPool, reads: ReadPlanner, deferred: DeferredWriter,
                 tasks: TaskTable, lock: threading.Lock, timeout_s: float) -> None:
        self._pool = pool
        self._reads = reads
        self._deferred = deferred
        self._tasks = tasks
        self._lock = lock
        self._timeout_s = timeout_s

    def mirror(self, src: int, dst: int) -> None:
        """vLLM copied KV block `src` into `dst`: `dst` serves the same rows from now on.

        Before the host copy, `src`'s open deferred writes are flushed and every
        launched write lands: one still in flight to `dst` (a discarded step, a
        retiring tenant's flush) must not land over the copy. Block copies are
        rare, so a barrier is simpler than tracking each write's slots.
        """
        bs, num_blocks = self._pool.block_size, self._pool.num_blocks
        if not (0 < src < num_blocks and 0 < dst < num_blocks):
            raise OmniPrefixCacheUnmatchError(
                f"kv_cache_block_copies: block copy {src} -> {dst} outside "
                f"1..{num_blocks - 1}")
        src_slots = np.arange(src * bs, (src + 1) * bs)
        self._reads.resolve_conflicts(np.array([[dst * bs, (dst + 1) * bs]], dtype=np.int64))
        with self._lock:
            sources = self._tasks.live(self._pool.producer_ids(src_slots, self._pool.keys))
        self._deferred.flush_tasks(sources)
        with self._lock:  # open deferred writes to dst drop those rows: dst gets a new claim
            launched = self._tasks.launched()
        for task in launched:
            try:
                task.wait(self._timeout_s)
            except OmniPrefixCacheError:
                if task.state is not TaskState.FAILED:
                    raise  # still running after the timeout: copying now would race it
                with self._lock:
                    self._pool.mark_lost(task.task_id)  # its rows must not be copied as present
        with self._lock:
            self._pool.copy_block(src, dst)
