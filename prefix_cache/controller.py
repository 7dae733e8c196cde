"""The committer: one thread that lands launched writes in launch order.

It waits on each task's device copies, runs their host half (the scatter out
of staging on staged backends) and marks the task WRITTEN. It only ever waits
on device events, never on another thread or a table lock, and every wait is
bounded: a copy engine that never finishes fails its task with the task's id
and state after the timeout, and the writes behind it land as usual.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from prefix_cache.devices.base import wait_event
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.tasks import TaskState, WriteTask

logger = logging.getLogger(__name__)

#: Longest pause between two queries of a copy's event: the committer polls (bounded waits
#: only), and a landing this much late is invisible next to a step.
_POLL_PAUSE_S = 2e-4


class Committer:
    """Lands QUEUED tasks in FIFO order on its own thread; `on_landed` runs after each."""

    def __init__(self, timeout_s: float, on_landed: Callable[[WriteTask], None],
                 bind_thread: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._on_landed = on_landed
        self._bind_thread = bind_thread
        self._queue: queue.SimpleQueue[WriteTask | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-prefix-cache-committer",
                                        daemon=True)
        self._thread.start()

    def submit(self, task: WriteTask) -> None:
        self._queue.put(task)

    def land(self, task: WriteTask) -> None:
        """Wait for the task's copies, run their host half, mark it WRITTEN (FAILED on error)."""
        try:
            task.transition(TaskState.COPYING)
            for transfer in task.transfers:
                wait_event(transfer.event, self._timeout_s, task.describe,
                           error=OmniPrefixCacheError, max_pause_s=_POLL_PAUSE_S)
            if task.launch_error is not None:  # its issued copies are done: now it may fail
                raise task.launch_error
            task.transition(TaskState.HOST_READY)
            for transfer in task.transfers:
                if transfer.finish is not None:
                    transfer.finish()
            task.transition(TaskState.WRITTEN)
        except BaseException as exc:  # a failed write fails its task only
            task.fail(exc)
        finally:
            task.transfers.clear()  # drop device clones and staging views
            task.chunks.clear()
            self._on_landed(task)

    def _run(self) -> None:
        self._bind_thread()
        while (task := self._queue.get()) is not None:
            try:
                self.land(task)
            except BaseException:  # on_landed must never kill the thread
                logger.exception("prefix cache committer: landing %s", task.describe())

    def close(self, timeout_s: float) -> bool:
        """Stop after the queued tasks; False if the thread is still busy after `timeout_s`."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
