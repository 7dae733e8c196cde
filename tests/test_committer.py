"""The committer on its own: sweeps from several threads land every write once, in launch order."""

from __future__ import annotations

import random
import threading

from prefix_cache.core.committer import Committer
from prefix_cache.devices.base import Transfer
from prefix_cache.core.tasks import TaskState, WriteTask
from tests.faults import GatedEvent


def test_concurrent_sweeps_and_waiters_land_every_write_once_in_launch_order() -> None:
    landed: list[int] = []
    committer = Committer(10.0, lambda task: landed.append(task.task_id), lambda: None)
    copies = [threading.Event() for _ in range(200)]  # set: that write's copy completed
    tasks = []
    for i, copy in enumerate(copies):
        task = WriteTask(i + 1, f"step {i + 1}", transfers=[Transfer(event=GatedEvent(None, copy))])
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
        copies[i].set()
        committer.sweep()
    for thread in readers:
        thread.join(10.0)
    assert committer.close(10.0)
    assert not errors
    assert landed == [task.task_id for task in tasks]
    assert all(task.state is TaskState.WRITTEN for task in tasks)


def test_a_landing_that_raises_leaves_the_ready_tasks_behind_it_queued_in_order() -> None:
    """A sweep takes every ready task at once; where one's landing raises (a hook), the tasks
    after it stay queued and the next sweep lands them, in launch order."""
    landed: list[int] = []

    def on_landed(task: WriteTask) -> None:
        landed.append(task.task_id)
        if task.task_id == 1:
            raise RuntimeError("a landing hook failed")

    committer = Committer(10.0, on_landed, lambda: None)
    copy = threading.Event()
    tasks = []
    for i in range(3):
        task = WriteTask(i + 1, f"step {i + 1}", transfers=[Transfer(event=GatedEvent(None, copy))])
        task.transition(TaskState.QUEUED)
        committer.submit(task)
        tasks.append(task)
    copy.set()
    try:
        committer.sweep()
    except RuntimeError:
        pass  # the engine thread's sweep raises it; the committer's own thread logs it
    committer.sweep()
    assert landed == [1, 2, 3]
    assert all(task.state is TaskState.WRITTEN for task in tasks)
    assert committer.close(5.0)


def test_close_waits_for_a_landing_another_thread_is_making() -> None:
    """A thread waiting on a row may be landing writes it took off the queue when the cache
    shuts down: `close` reports the writes landed (after which shutdown closes the pools they
    write into) only once that landing is done."""
    started, in_hook, leave_hook = threading.Event(), threading.Event(), threading.Event()

    def on_landed(task: WriteTask) -> None:
        in_hook.set()
        leave_hook.wait(10.0)

    # the committer's own thread waits at its start, so the reader's sweep takes the task
    committer = Committer(10.0, on_landed, lambda: started.wait(10.0))
    task = WriteTask(1, "step 1", transfers=[Transfer(event=None)])
    task.transition(TaskState.QUEUED)
    committer.submit(task)
    reader = threading.Thread(target=task.wait, args=(10.0,))
    reader.start()
    assert in_hook.wait(5.0)
    started.set()
    assert not committer.close(0.2)  # the reader is still landing the task
    leave_hook.set()
    reader.join(5.0)
    assert committer.close(5.0) and task.state is TaskState.WRITTEN
