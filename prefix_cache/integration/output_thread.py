"""The runner's output thread: row work (materialize, publish) in step order, off the engine thread.

The engine thread only submits jobs; it never waits for rows, nor for room in the queue: a
job that waits (a put into a full channel) waits a bounded time, and the jobs behind it catch
up after. Only a thread that is stuck (its job has run past `timeout_s` while more than
`max_pending` jobs wait behind it) makes a submit raise, at once. The first job that fails
stops the thread's work; its error is raised to the engine thread at the next submit or
`check()`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefix_cache.devices.base import check_timeout, poll_until
from prefix_cache.errors import OmniPrefixCacheError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    what: str
    run: Callable[[], None]


class OutputThread:
    """Runs submitted jobs one at a time in submission order; the first failure is sticky.

    Invariant: `_submitted - _finished` jobs are queued or running. Submitters count
    `_submitted` under `_submit_lock`, this thread alone counts `_finished` and sets
    `_running` (the job it runs and since when), and each reads the other's without a lock: a
    value read stale only makes a wait poll once more, or a stuck job seem stuck a step later.
    """

    def __init__(self, name: str, *, max_pending: int, timeout_s: float) -> None:
        self.name = name
        self._timeout_s = check_timeout(timeout_s, name)
        self._max_pending = max_pending
        # a hand-over in C: the engine thread pays for one call and the wake, not a Condition
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._submitted = 0
        self._finished = 0
        self._running: tuple[str, float] | None = None  # what runs now, since (monotonic)
        self._error: OmniPrefixCacheError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, run: Callable[[], None]) -> None:
        """Queue `run` after every job submitted before it, without waiting; raises an earlier
        job's failure, or that the thread is stuck."""
        self.check()
        if self._closed:
            raise OmniPrefixCacheError(f"{self.name}: {what} submitted after close")
        with self._submit_lock:
            if self._pending() > self._max_pending:  # the running job and max_pending more
                self._check_not_stuck(what)
            self._submitted += 1
            self._jobs.put(_Job(what, run))

    def _check_not_stuck(self, what: str) -> None:
        """Raise, naming it, where the job running now has run past `timeout_s`."""
        running = self._running
        if running is not None and (ran := time.monotonic() - running[1]) > self._timeout_s:
            raise OmniPrefixCacheError(
                f"{self.name}: {what} not queued: {self._pending() - 1} jobs wait behind "
                f"{running[0]}, which has run for {ran:.1f}s (stuck: over {self._timeout_s:.1f}s)")

    def check(self) -> None:
        """Raise the failure of an earlier job, if one failed."""
        if self._error is not None:
            raise self._error

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every job submitted so far has run; raise a job's failure."""
        timeout_s = self._timeout_s if timeout_s is None else check_timeout(timeout_s, self.name)
        poll_until(lambda: self._pending() == 0 or self._error is not None, timeout_s,
                   lambda: OmniPrefixCacheError(
                       f"{self.name}: {self._pending()} jobs still pending after "
                       f"{timeout_s:.1f}s"), max_pause_s=1e-3)
        self.check()

    def close(self, timeout_s: float | None = None) -> None:
        """Run what is queued (bounded), then stop the thread; idempotent (a stuck job's
        thread, a daemon, is abandoned)."""
        if self._closed:
            return
        try:
            self.drain(timeout_s)
        finally:
            self._closed = True
            self._jobs.put(None)

    def _pending(self) -> int:
        return self._submitted - self._finished

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:
                    self._running = (job.what, time.monotonic())
                    job.run()
            except BaseException as exc:  # surfaced on the engine thread
                logger.error("%s: %s failed: %s", self.name, job.what, exc)
                error = exc if isinstance(exc, OmniPrefixCacheError) else \
                    OmniPrefixCacheError(f"{self.name}: {job.what} failed: {exc!r}")
                if error is not exc:
                    error.__cause__ = exc
                self._error = error
            finally:
                self._running = None
                self._finished += 1
