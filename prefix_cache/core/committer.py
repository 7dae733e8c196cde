"""The committer: lands launched writes in launch order, by sweeps rather than a wake-up per write.

Landing a task means: its device copies completed, their checks passed (`Transfer.verify`:
a zero-copy scatter that refused slots outside the pool fails its task), its host half (the
scatter out of staging on staged backends) ran, it is WRITTEN (FAILED on error) and `on_landed`
ran. A write with no host half (a zero-copy scatter) is landed by whichever thread
next sweeps: the engine thread at each save (the copies of the steps before have
long completed by then, so it only queries their events), or a thread waiting on
one of its rows. No thread wakes per write, so no landing competes for the
interpreter with the engine thread's own step. The committer's thread lands what
has a host half (moving bytes on the host is its job) and, every
`_BACKSTOP_S`, whatever nobody swept.

Nothing here waits while holding a lock: one lander at a time holds the landing
token, and takes a task off the queue only once its copies completed. A copy that
never completes fails its task once it is `timeout_s` old, and the writes behind
it land as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from prefix_cache.devices.base import poll_until
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.core.tasks import TaskState, WriteTask

logger = logging.getLogger(__name__)

#: Longest pause between two sweeps of a thread waiting on a write (a landing this late is
#: invisible next to a step), and between two sweeps of the committer's own thread.
_POLL_PAUSE_S = 2e-4
#: How often the committer's thread lands what nobody swept (an engine gone idle).
_BACKSTOP_S = 0.05


class Committer:
    """Lands QUEUED tasks in FIFO order; `on_landed` runs after each, on the landing thread.

    Invariant: `_queue` holds the launched, unlanded tasks in launch order; only
    the holder of the landing token (`_landing`) takes tasks off it, and only from
    its head, so tasks land in launch order.
    """

    def __init__(self, timeout_s: float, on_landed: Callable[[WriteTask], None],
                 bind_thread: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._on_landed = on_landed
        self._bind_thread = bind_thread
        self._queue: deque[WriteTask] = deque()
        #: the queue and the token; `_cond` (over it) the thread's wake-ups. A step's calls
        #: take the lock itself: a Condition's `with` costs two Python-level calls more
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._landing = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="omni-prefix-cache-committer",
                                        daemon=True)
        self._thread.start()

    def submit(self, task: WriteTask) -> None:
        """Queue a task whose copies were issued; a host half wakes the committer's thread."""
        task.lander = self.wait
        task.launched_at = time.monotonic()
        # whether landing it moves bytes on the host (a staged write's scatter)
        for transfer in task.transfers:
            if transfer.finish is not None:
                task.host_half = True
                break
        with self._mutex:
            self._queue.append(task)
            if task.host_half:
                self._cond.notify()

    def sweep(self, *, host_halves: bool = False) -> None:
        """Land every task at the head of the queue whose copies completed; never waits.

        `host_halves=False` (the engine thread) stops at the first task with a host half.
        """
        if not self._queue:
            return
        with self._mutex:
            if self._landing:
                return  # another thread is landing: it lands in order, this one need not
            ready = self._take_ready(host_halves)
            if not ready:
                return
            self._landing = True
        landed = 0
        try:
            for task, error in ready:
                self.land(task, error)
                landed += 1
        finally:
            with self._mutex:
                # a landing that raised (its hooks) leaves the tasks after it queued, in order
                if landed + 1 < len(ready):
                    self._queue.extendleft(reversed([task for task, _ in ready[landed + 1:]]))
                self._landing = False

    def wait(self, task: WriteTask, timeout_s: float) -> None:
        """Sweep until `task` landed; raise naming it if it stayed live for `timeout_s`."""
        def landed() -> bool:
            if not task.landed.is_set():
                self.sweep(host_halves=True)
            return task.landed.is_set()

        poll_until(landed, timeout_s, lambda: OmniPrefixCacheError(
            f"{task.describe()} did not land within {timeout_s:.1f}s"), max_pause_s=_POLL_PAUSE_S)

    def land(self, task: WriteTask, error: BaseException | None = None) -> None:
        """Land a task whose copies completed: run their host half, mark it WRITTEN; FAILED
        with `error` (its copies failed or never completed) or with what fails here."""
        try:
            if error is not None:
                raise error
            if task.launch_error is not None:  # its issued copies are done: now it may fail
                raise task.launch_error
            for transfer in task.transfers:  # what the copies found wrong (slots out of range)
                if transfer.verify is not None:
                    transfer.verify()
            if task.host_half:
                task.transition(TaskState.COPYING)
                task.transition(TaskState.HOST_READY)
                for transfer in task.transfers:
                    if transfer.finish is not None:
                        transfer.finish()
                task.transition(TaskState.WRITTEN)
            else:
                task.settle()
        except BaseException as exc:  # a failed write fails its task only
            task.fail(exc)
        finally:
            task.transfers.clear()  # drop device clones and staging views
            task.chunks.clear()
            self._on_landed(task)

    def close(self, timeout_s: float) -> bool:
        """Land every queued task, and wait for the landings other threads are making, then
        stop; False if that took longer than `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _take_ready(self, host_halves: bool) -> list[tuple[WriteTask, BaseException | None]]:
        """The head tasks that can land now, in order, each with the error it fails with: their
        copies completed, or a query of them failed, or the task is `timeout_s` old (the error
        names its state). Caller holds `_cond`."""
        ready = []
        while self._queue:
            task = self._queue[0]
            if task.host_half and not host_halves:
                break
            error, done = None, True
            try:
                for transfer in task.transfers:
                    if transfer.event is not None and not transfer.event.query():
                        done = False
                        break
            except Exception as exc:  # a driver error: the copy failed
                done, error = True, exc
            if not done:
                if time.monotonic() - task.launched_at < self._timeout_s:
                    break
                error = OmniPrefixCacheError(
                    f"{task.describe()}: device copy not complete after {self._timeout_s:.1f}s")
            ready.append((self._queue.popleft(), error))
        return ready

    def _run(self) -> None:
        self._bind_thread()
        while True:
            with self._cond:
                # a sweep of another thread's may still be landing what it took off the queue
                if self._closing and not (self._queue or self._landing):
                    return
                if not (self._closing or self._staged_head()):
                    self._cond.wait(_BACKSTOP_S)
            try:
                self.sweep(host_halves=True)
            except BaseException:  # on_landed must never kill the thread
                logger.exception("prefix cache committer: landing failed")
            with self._cond:
                if (self._queue or self._landing) and (self._closing or self._staged_head()):
                    self._cond.wait(_POLL_PAUSE_S)  # the head's copies or a landing still run

    def _staged_head(self) -> bool:
        """Whether the head task has a host half (caller holds `_cond`)."""
        return bool(self._queue) and self._queue[0].host_half
