"""Write tasks: one write of rows into the pool, and the one-way chain of states it moves through."""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from prefix_cache.devices.base import DeviceEvent, Transfer
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError
from prefix_cache.core.latch import Latch


class TaskState(enum.Enum):
    PENDING = "PENDING"        # registered; a deferred write still collecting chunks
    QUEUED = "QUEUED"          # its device copies are launched and it waits for the committer
    COPYING = "COPYING"        # the committer waits on its device copies
    HOST_READY = "HOST_READY"  # its rows are on the host (staging or pool)
    WRITTEN = "WRITTEN"        # its rows are readable in the pool
    FAILED = "FAILED"

    #: Members are singletons, equal only to themselves: hashed by identity in C, not by
    #: Enum's hash of the name in Python (every state change looks states up in sets)
    __hash__ = object.__hash__


#: the states a task ends in
_TERMINAL = frozenset((TaskState.WRITTEN, TaskState.FAILED))
#: each live state's one successor; FAILED may follow any of them
_NEXT = {TaskState.PENDING: TaskState.QUEUED, TaskState.QUEUED: TaskState.COPYING,
         TaskState.COPYING: TaskState.HOST_READY, TaskState.HOST_READY: TaskState.WRITTEN}


@dataclass
class DeferredChunk:
    """One step's rows of a request's deferred keys, held on the device until the write."""

    slots: np.ndarray             # int64 slots of the rows
    claims: np.ndarray            # slot claim each row was saved under
    rows: dict[str, torch.Tensor]  # key -> [n, F] private device copy
    nbytes: int
    copied: DeviceEvent | None    # after the copy, on the saving stream (None: synchronous)


@dataclass
class WriteTask:
    """One write into the pool: a step's immediate keys, or one request's deferred keys.

    Invariant: `state` moves one step along PENDING → QUEUED → COPYING →
    HOST_READY → WRITTEN (QUEUED → WRITTEN in one, `settle`, where its landing
    has no host half), or to FAILED from any non-terminal state; `landed` is
    set exactly when the state becomes terminal.
    """

    task_id: int
    owner: str
    staging_slot: int | None = None
    chunks: list[DeferredChunk] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    budget_bytes: int = 0
    #: raised while its copies were being issued; the issued ones still land first
    launch_error: BaseException | None = None
    #: False when the caller that launched it already got its error
    report_failure: bool = True
    state: TaskState = TaskState.PENDING
    error: BaseException | None = None
    landed: Latch = field(default_factory=Latch)
    #: set by the committer that queued it (when, and how to land tasks up to this one)
    launched_at: float = 0.0
    host_half: bool = False  # landing it runs a transfer's `finish` (the committer's thread)
    lander: Callable[[WriteTask, float], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def describe(self) -> str:
        return f"write task {self.task_id} ({self.owner}, state {self.state.value})"

    def transition(self, new: TaskState) -> None:
        """Move to `new`; anything but the next state or FAILED from a live state raises."""
        with self._lock:  # the state's properties cost more than these set lookups
            old = self.state
            if old in _TERMINAL or (new is not TaskState.FAILED and _NEXT.get(old) is not new):
                raise OmniPrefixCacheUnmatchError(
                    f"illegal transition {old.value} -> {new.value} of {self.describe()}")
            self.state = new
        if new in _TERMINAL:
            self.landed.set()

    def settle(self) -> None:
        """Move from QUEUED through COPYING and HOST_READY to WRITTEN at once: a landing whose
        copies completed and passed their checks, with no host half to run in between (no
        other thread tells those states apart); raises as `transition` does otherwise."""
        with self._lock:
            if self.state is not TaskState.QUEUED:
                raise OmniPrefixCacheUnmatchError(
                    f"illegal transition {self.state.value} -> {TaskState.WRITTEN.value} of "
                    f"{self.describe()}")
            self.state = TaskState.WRITTEN
        self.landed.set()

    def fail(self, error: BaseException) -> bool:
        """Mark FAILED with `error`; False if the task had already landed."""
        with self._lock:
            if self.state in _TERMINAL:
                return False
            self.error = error
            self.state = TaskState.FAILED
        self.landed.set()
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until landed; raise naming the task if it failed or stayed live for `timeout_s`."""
        if self.lander is not None:
            self.lander(self, timeout_s)
        elif not self.landed.wait(timeout_s):
            raise OmniPrefixCacheError(f"{self.describe()} did not land within {timeout_s:.1f}s")
        if self.state is TaskState.FAILED:
            raise OmniPrefixCacheError(f"{self.describe()} failed: {self.error}") from self.error


class TaskTable:
    """Write tasks from creation until their landing is accounted, by id (ids only grow).

    Callers hold the cache's table lock around every call.
    """

    def __init__(self) -> None:
        self._tasks: dict[int, WriteTask] = {}
        self._ids = itertools.count(1)

    def new(self, owner: str, *, staging_slot: int | None = None) -> WriteTask:
        task = WriteTask(next(self._ids), owner, staging_slot=staging_slot)
        self._tasks[task.task_id] = task
        return task

    def forget(self, task: WriteTask) -> None:
        self._tasks.pop(task.task_id, None)

    def live(self, ids: Iterable[int]) -> list[WriteTask]:
        """The tasks among `ids` that have not landed, oldest first."""
        return [self._tasks[i] for i in sorted(ids) if i in self._tasks]

    def launched(self) -> list[WriteTask]:
        """Tasks whose copies were issued and have not landed, oldest first."""
        return [t for t in self._tasks.values() if t.state is not TaskState.PENDING]

    def __len__(self) -> int:
        return len(self._tasks)
