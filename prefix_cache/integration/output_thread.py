"""The runner's output thread: row work (materialize, publish) in step order, off the engine thread.

The engine thread only submits jobs; it never waits for rows. The queue is
bounded: a submit waits at most `timeout_s` for room (the manager's staging
depth already bounds unconsumed steps, so this only binds when the thread
is stuck) and then raises. The first job that fails stops the thread's work;
its error is raised to the engine thread at the next submit or `check()`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefix_cache.devices.base import check_timeout
from prefix_cache.errors import OmniPrefixCacheError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    what: str
    run: Callable[[], None]


class OutputThread:
    """Runs submitted jobs one at a time in submission order; the first failure is sticky."""

    def __init__(self, name: str, *, max_pending: int, timeout_s: float) -> None:
        self.name = name
        self._timeout_s = check_timeout(timeout_s, name)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self._error: OmniPrefixCacheError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, run: Callable[[], None]) -> None:
        """Queue `run` after every job submitted before it; raises an earlier job's failure."""
        self.check()
        if self._closed:
            raise OmniPrefixCacheError(f"{self.name}: {what} submitted after close")
        try:
            self._queue.put(_Job(what, run), timeout=self._timeout_s)
        except queue.Full:
            raise OmniPrefixCacheError(
                f"{self.name}: no room for {what} after {self._timeout_s:.1f}s; "
                f"{self._queue.qsize()} jobs are waiting behind a stuck one") from None

    def check(self) -> None:
        """Raise the failure of an earlier job, if one failed."""
        if self._error is not None:
            raise self._error

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) until every job submitted so far has run; raise a job's failure."""
        timeout_s = self._timeout_s if timeout_s is None else check_timeout(timeout_s, self.name)
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and self._error is None:
            if time.monotonic() > deadline:
                raise OmniPrefixCacheError(
                    f"{self.name}: {self._queue.unfinished_tasks} jobs still pending after "
                    f"{timeout_s:.1f}s")
            time.sleep(1e-3)
        self.check()

    def close(self, timeout_s: float | None = None) -> None:
        """Run what is queued (bounded), then stop the thread; idempotent."""
        if self._closed:
            return
        try:
            self.drain(timeout_s)
        finally:
            self._closed = True
            try:
                self._queue.put_nowait(None)
            except queue.Full:  # a stuck job: the daemon thread is abandoned
                pass

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if self._error is None:
                    job.run()
            except BaseException as exc:  # surfaced on the engine thread
                logger.error("%s: %s failed: %s", self.name, job.what, exc)
                error = exc if isinstance(exc, OmniPrefixCacheError) else \
                    OmniPrefixCacheError(f"{self.name}: {job.what} failed: {exc!r}")
                if error is not exc:
                    error.__cause__ = exc
                self._error = error
            finally:
                self._queue.task_done()
        self._queue.task_done()
