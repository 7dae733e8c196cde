"""The committer on its own: sweeps from several threads land every write once, in launch order."""

from __future__ import annotations

import random
import threading

from prefix_cache.controller import Committer
from prefix_cache.devices.base import Transfer
from prefix_cache.tasks import TaskState, WriteTask


class _Copy:
    """A device copy's event, completed when the test says so."""

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete


def test_concurrent_sweeps_and_waiters_land_every_write_once_in_launch_order() -> None:
    landed: list[int] = []
    committer = Committer(10.0, lambda task: landed.append(task.task_id), lambda: None)
    copies = [_Copy() for _ in range(200)]
    tasks = []
    for i, copy in enumerate(copies):
        task = WriteTask(i + 1, f"step {i + 1}", transfers=[Transfer(event=copy)])
        task.transition(TaskState.QUEUED)
        committer.submit(task)
        tasks.append(task)

    errors: list[BaseException] = []

    def reader(seed: int) -> None:  # waits on random writes, landing the ones before them
        rng = random.Random(seed)
        try:
            for _ in range(25):
                tasks[rng.randrange(len(tasks))].wait(10.0)
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=reader, args=(seed,)) for seed in range(3)]
    for thread in readers:
        thread.start()
    order = list(range(len(copies)))
    random.Random(7).shuffle(order)
    for i in order:  # copies complete out of order; the engine thread sweeps after each
        copies[i].complete = True
        committer.sweep()
    for thread in readers:
        thread.join(10.0)
    assert committer.close(10.0)
    assert not errors
    assert landed == [task.task_id for task in tasks]
    assert all(task.state is TaskState.WRITTEN for task in tasks)
