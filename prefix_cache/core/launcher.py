"""Launching writes: issue a task's copies, hand it to the committer, settle it when it lands.

Only the engine thread launches, so launch order is claim order; the committer
lands tasks in that order. A task that fails after its rows left fails alone: its
rows are lost from then on (a hit on them is refused by name), and its error is
raised once, by the next public call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.committer import Committer
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.tasks import TaskState, TaskTable, WriteTask
from prefix_cache.devices.base import Transfer
from prefix_cache.errors import OmniPrefixCacheError


class WriteLauncher:
    """The committer's front: every launched task lands exactly once, through `_landed`.

    Invariant: a landed task is forgotten by the task table, its landing hooks ran, and,
    if it FAILED, its rows are marked lost before its error is queued for the next call.
    """

    def __init__(self, pool: PrefixBlockPool, staging: StagingPool, tasks: TaskTable,
                 lock: threading.Lock, timeout_s: float,
                 bind_thread: Callable[[], None]) -> None:
        self._pool = pool
        self._staging = staging
        self._tasks = tasks
        self._lock = lock
        self._hooks: list[Callable[[WriteTask], None]] = []
        self._failures: deque[OmniPrefixCacheError] = deque()  # unreported failed writes
        self.committer = Committer(timeout_s, self._landed, bind_thread)

    def on_landed(self, hook: Callable[[WriteTask], None]) -> None:
        """Call `hook(task)` under the table lock as each task lands."""
        self._hooks.append(hook)

    def launch(self, task: WriteTask, transfers: Iterable[Transfer],
               report_failure: bool) -> None:
        """Issue the task's copies (a lazy iterable), then hand it to the committer as QUEUED.

        If issuing fails midway, the task still goes to the committer: the copies
        already issued land (their staging pages stay held) before it fails with
        the error, which is raised here too; `report_failure` says whether the next
        public call should raise it again (False: this caller passes it on).
        """
        issued: list[Transfer] = []
        try:
            issued.extend(transfers)
        except Exception as exc:
            task.launch_error = exc
            task.report_failure = report_failure
        task.transfers = issued
        task.transition(TaskState.QUEUED)
        for transfer in issued:
            if not transfer.complete_at_launch:
                self.committer.submit(task)
                break
        else:  # every copy complete at launch: nothing in flight, land it on this thread
            self.committer.land(task)
        if task.launch_error is not None:
            raise task.launch_error

    def pop_failure(self) -> OmniPrefixCacheError | None:
        """The oldest failed write not yet reported, if any."""
        if not self._failures:  # each public call asks: no lock while there is none
            return None
        with self._lock:
            return self._failures.popleft() if self._failures else None

    def _landed(self, task: WriteTask) -> None:
        """Committer callback: forget the task, run the hooks (budgets), free its staging hold;
        a failed task's rows are lost from now on, and its error waits for the next call."""
        with self._lock:
            self._tasks.forget(task)
            for hook in self._hooks:
                hook(task)
            if task.state is TaskState.FAILED:
                self._pool.mark_lost(task.task_id)
                if task.report_failure:
                    self._failures.append(
                        OmniPrefixCacheError(f"{task.describe()}: {task.error}"))
        if task.staging_slot is not None:
            self._staging.release(task.staging_slot, ("write", task.task_id))
