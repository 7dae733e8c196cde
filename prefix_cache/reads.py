"""Planned reads: rows of one key, bound at planning time to the writes that produce them.

A read is planned on the engine thread against the pool's current claims, then
resolved by whichever thread gets to it first (the prefetch thread, the caller
of `materialize`, or a writer about to reuse its slots): it waits for its
producer tasks to land and gathers its rows into a tensor of its own.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from prefix_cache.block_pool import PrefixBlockPool
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.tasks import WriteTask

logger = logging.getLogger(__name__)

#: Reads smaller than this are gathered by their consumer: waking the prefetch
#: thread (and contending with the engine thread for the GIL) costs more.
PREFETCH_MIN_BYTES = 256 << 10


class ReadState(enum.Enum):
    PLANNED = "PLANNED"
    RESOLVING = "RESOLVING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class RowRead:
    """`out[offset : offset + len(slots)]` = rows of `key` at `slots`, absent rows left zero.

    Invariant: while PLANNED or RESOLVING its slots are pinned in the pool, so
    no write claims them and the rows it gathers are the ones it was planned on.
    """

    def __init__(self, what: str, key: str, slots: np.ndarray, present: np.ndarray,
                 producers: list[WriteTask], out: torch.Tensor, offset: int) -> None:
        self.what = what
        self.key = key
        self.slots = slots
        self.present = present
        self.producers = producers
        self.out = out
        self.offset = offset
        self.state = ReadState.PLANNED
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.out.shape[1] * self.out.element_size()

    def describe(self) -> str:
        return f"read of {self.key!r} for {self.what} ({self.state.value})"

    def resolve(self, pool: PrefixBlockPool, timeout_s: float,
                unpin: Callable[[RowRead], None]) -> None:
        """Gather the rows (or wait for the thread doing it); raise if they cannot be had."""
        with self._lock:
            mine = self.state is ReadState.PLANNED
            if mine:
                self.state = ReadState.RESOLVING
        if not mine:
            self._wait(timeout_s)
            return
        try:
            for task in self.producers:
                task.wait(timeout_s)
            self._gather(pool)
            self.state = ReadState.DONE
        except BaseException as exc:
            self.error = exc
            self.state = ReadState.FAILED
        finally:
            self.producers = []
            unpin(self)
            self.done.set()
        self._raise_if_failed()

    def cancel(self, unpin: Callable[[RowRead], None]) -> None:
        """Drop a read nobody will consume; a read already being resolved finishes on its own."""
        with self._lock:
            if self.state is not ReadState.PLANNED:
                return
            self.state = ReadState.CANCELLED
        self.producers = []
        unpin(self)
        self.done.set()

    def _wait(self, timeout_s: float) -> None:
        waiting_on = [t.describe() for t in self.producers]
        if not self.done.wait(timeout_s):
            raise OmniPrefixCacheError(f"{self.describe()} not resolved within {timeout_s:.1f}s"
                                       f"; waiting on {waiting_on or 'the pool gather'}")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.state is ReadState.FAILED:
            raise OmniPrefixCacheError(f"{self.describe()}: {self.error}") from self.error
        if self.state is ReadState.CANCELLED:
            raise OmniPrefixCacheError(f"{self.describe()} was cancelled")

    def _gather(self, pool: PrefixBlockPool) -> None:
        n = len(self.slots)
        target = self.out[self.offset: self.offset + n]
        if self.present.all():
            pool.gather(self.key, self.slots, target)
        elif self.present.any():
            rows = np.flatnonzero(self.present)
            part = torch.empty((len(rows), target.shape[1]), dtype=target.dtype)
            pool.gather(self.key, self.slots[rows], part)
            target.index_copy_(0, torch.from_numpy(rows), part)


class Prefetcher:
    """A thread that resolves reads in the order they were planned, ahead of `materialize`."""

    def __init__(self, pool: PrefixBlockPool, timeout_s: float,
                 unpin: Callable[[RowRead], None]) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._unpin = unpin
        self._queue: queue.SimpleQueue[RowRead | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-prefix-cache-prefetch",
                                        daemon=True)
        self._thread.start()

    def submit(self, read: RowRead) -> None:
        self._queue.put(read)

    def _run(self) -> None:
        while (read := self._queue.get()) is not None:
            try:
                read.resolve(self._pool, self._timeout_s, self._unpin)
            except OmniPrefixCacheError:
                pass  # kept on the read; its consumer raises it
            except BaseException:
                logger.exception("prefix cache prefetch: %s", read.describe())

    def close(self, timeout_s: float) -> bool:
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
