"""Deferred keys: a request's rows held on the device and written to the pool once, at its end.

A model's deferred outputs (`ModelCachePolicy.deferred_keys`) are complete only
when the request finishes, so each step's rows wait on the device in the
request's open write task. The write goes out when the request retires, when a
hit needs those rows, or, oldest first, when the rows held pass the device
budget; a later step then opens a new write, and a hit reads both.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.devices.base import NULL_SLOT, DeviceBackend, DeviceEvent, Transfer
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.runs import slot_runs
from prefix_cache.core.tasks import DeferredChunk, TaskState, TaskTable, WriteTask

logger = logging.getLogger(__name__)

#: One request's rows of one step: (request, first row, end row, key -> private device copy).
StepChunk = tuple[str, int, int, dict[str, torch.Tensor]]
#: Issues a task's copies (lazily), then hands it to the committer (`WriteLauncher.launch`).
Launch = Callable[[WriteTask, Iterable[Transfer], bool], None]


class DeferredWriter:
    """Each live request's open deferred write, and the device bytes all deferred writes hold.

    Invariant: a request has at most one open (PENDING) write; `held_bytes` is
    the sum of `budget_bytes` over deferred writes not yet landed. Callers hold
    the cache's table lock only where a method says so.
    """

    def __init__(self, pool: PrefixBlockPool, backend: DeviceBackend, tasks: TaskTable,
                 lock: threading.Lock, launch: Launch, budget_bytes: int,
                 timeout_s: float) -> None:
        self._pool = pool
        self._backend = backend
        self._tasks = tasks
        self._lock = lock
        self._launch = launch
        self._budget_bytes = budget_bytes
        self._timeout_s = timeout_s
        self._open: dict[str, WriteTask] = {}
        self._writes: defaultdict[str, int] = defaultdict(int)  # live request -> writes opened
        self.held_bytes = 0

    def snapshot(self, deferred: Mapping[str, torch.Tensor], layout: StepLayout
                 ) -> list[StepChunk]:
        """Each request's rows of the deferred keys, as private device copies made on the
        caller's stream (`append` takes the event after them)."""
        if not deferred:
            return []
        return [(req_id, start, end,
                 {k: self._backend.snapshot(v[start:end]) for k, v in deferred.items()})
                for req_id, (start, end) in layout.items()]

    def append(self, chunks: list[StepChunk], slots: np.ndarray, claim: int,
               copied: DeviceEvent | None) -> None:
        """Add each request's chunk to its open write (opening one), then keep to the budget;
        `copied`: the event after their copies on the saving stream (their write, wherever it
        is launched from, waits for it)."""
        for req_id, start, end, rows in chunks:
            nbytes = sum(t.numel() * t.element_size() for t in rows.values())
            chunk = DeferredChunk(slots[start:end], np.full(end - start, claim), rows, nbytes,
                                  copied)
            with self._lock:
                task = self._open.get(req_id)
                if task is None:
                    self._writes[req_id] += 1
                    task = self._open[req_id] = self._tasks.new(
                        f"request {req_id} deferred write {self._writes[req_id]}")
                task.chunks.append(chunk)
                task.budget_bytes += nbytes
                self.held_bytes += nbytes
                self._pool.record_write(rows, slot_runs(chunk.slots)[0], claim, task.task_id)
        self._enforce_budget()

    def retire(self, req_id: str) -> None:
        """`req_id` finished or was aborted: its rows were published to vLLM, so they land."""
        self.flush(req_id)
        self._writes.pop(req_id, None)

    def flush_tasks(self, tasks: Iterable[WriteTask]) -> None:
        """Launch whichever of `tasks` are open deferred writes (a hit needs their rows)."""
        pending = {t.task_id for t in tasks if t.state is TaskState.PENDING}
        with self._lock:
            req_ids = [r for r, t in self._open.items() if t.task_id in pending]
        for req_id in req_ids:
            self.flush(req_id)

    def flush(self, req_id: str) -> None:
        """Close `req_id`'s open write and launch it; its next chunk opens a new one.

        Never raises: a write that cannot be launched fails alone (its rows are
        lost) and its error is raised by the next public call.
        """
        with self._lock:
            task = self._open.pop(req_id, None)
            if task is None:
                return
            # rows whose slots went to a new tenant go to the null block, which nothing reads:
            # dropping them on the device would cost an index upload, a synchronization
            parts = [(chunk, np.where(keep, chunk.slots, NULL_SLOT)) for chunk in task.chunks
                     if (keep := self._pool.still_claimed(chunk.slots, chunk.claims)).any()]

        def issue() -> Iterator[Transfer]:
            # the copies were made on the stream of each save: this one waits for them (on
            # the device), whichever stream retires the request
            for copied in {id(c.copied): c.copied for c, _ in parts
                           if c.copied is not None}.values():
                copied.wait()
            slots = torch.from_numpy(np.concatenate([kept for _, kept in parts]))
            rows = {key: torch.cat([chunk.rows[key] for chunk, _ in parts])
                    for key in parts[0][0].rows}
            # after the cats, on this stream: the copies, elsewhere, wait for it to read them
            ready = self._backend.record_event()
            for key, key_rows in rows.items():
                yield self._backend.scatter_rows(
                    key_rows.reshape(len(slots), -1), slots, self._pool.keys[key].storage,
                    ready=ready, staging=None)

        try:
            with keeping_tensors():  # the launch's slots, joined rows and copies outlive it
                self._launch(task, issue() if parts else (), True)
        except Exception:
            pass  # the task failed alone; the next public call raises its error

    def landed(self, task: WriteTask) -> None:
        """A task landed: return its device bytes (caller holds the lock)."""
        self.held_bytes -= task.budget_bytes
        task.budget_bytes = 0

    def close(self) -> None:
        """Fail every open write: the cache shuts down before those requests finished."""
        with self._lock:
            open_tasks = list(self._open.values())
            self._open.clear()
        for task in open_tasks:
            task.fail(OmniPrefixCacheError("cache shut down before the request finished"))
            task.chunks.clear()

    def _enforce_budget(self) -> None:
        """Flush the oldest open writes, then wait for flushed ones, until under budget."""
        while self.held_bytes > self._budget_bytes:
            with self._lock:
                oldest = next(iter(self._open), None)
                in_flight = [t for t in self._tasks.launched() if t.budget_bytes]
            if oldest is not None:
                logger.debug("deferred device bytes %d over budget %d: flushing request %s",
                             self.held_bytes, self._budget_bytes, oldest)
                self.flush(oldest)
            elif in_flight:
                try:
                    in_flight[0].wait(self._timeout_s)
                except OmniPrefixCacheError:
                    pass  # a failed write returned its budget; its error is reported once
            else:
                return
