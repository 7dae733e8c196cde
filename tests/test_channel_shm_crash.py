"""The shared-memory channel survives crashes (SPEC §9): a process killed anywhere in a put or
a get leaves the id's other entries whole and in order, and the budget right; a waiting consumer
learns within seconds that the producer of its request died; a namespace whose owner died is
reclaimed by the next create and by `python -m prefix_cache channel gc`.

Producers and consumers die in processes of their own (spawned, or forked from a spawned
forkserver), by `os._exit` or SIGKILL, as a crashed worker does.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import (OmniPrefixCacheChannelProducerError,
                                  OmniPrefixCacheChannelTimeoutError, StageChannel, StageChunk,
                                  open_channel)
from prefix_cache.channel import _shm
from prefix_cache.channel.shm import NAMESPACE_PREFIX, RECLAIM_GRACE_S, ShmChannel
from prefix_cache.core.pool_rows import PoolRows

pytestmark = [pytest.mark.skipif(not Path("/proc/self").exists(), reason="flock and fork: Linux"),
              pytest.mark.slow]  # processes killed at every step

_SPAWN = multiprocessing.get_context("spawn")
REPO = Path(__file__).resolve().parents[1]


def _marked(i: int) -> dict[str, torch.Tensor]:
    return {HIDDEN_KEY: torch.full((4, 8), float(i))}


def _mark(outputs: dict[str, torch.Tensor]) -> int:
    return int(outputs[HIDDEN_KEY][0, 0])


def _spawn(target: Callable[..., None], *args: object) -> multiprocessing.Process:
    proc = _SPAWN.Process(target=target, args=args)
    proc.start()
    return proc


def _expect_then(spec: str, request_ids: list[str], ready: multiprocessing.Event, end: str,
                 delay_s: float) -> None:
    """In a spawned process: a producer expects `request_ids` (together), says so, and after
    `delay_s` ends as `end` says: "exit" (os._exit), "kill" (SIGKILL), or "publish" (then
    closes)."""
    channel = open_channel(spec)
    channel.expect_all(request_ids)
    ready.set()
    time.sleep(delay_s)
    if end == "exit":
        os._exit(1)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    for request_id in request_ids:
        channel.put(request_id, _marked(7))
    channel.close()


def _producer(channel: ShmChannel, request_ids: str | list[str], end: str, delay_s: float = 0.0
              ) -> tuple[multiprocessing.Process, float]:
    """A spawned producer of `request_ids` on `channel`'s namespace, once it expects them."""
    ready = _SPAWN.Event()
    request_ids = [request_ids] if isinstance(request_ids, str) else request_ids
    proc = _spawn(_expect_then, channel.spec, request_ids, ready, end, delay_s)
    assert ready.wait(60), "the producer did not start"
    return proc, time.monotonic()


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_consumer_learns_within_seconds_that_its_producer_died(end: str) -> None:
    with open_channel("shm") as channel:
        producer, started = _producer(channel, "r1", end, delay_s=0.5)
        with pytest.raises(OmniPrefixCacheChannelProducerError,
                           match=f"request r1: .*producer pid {producer.pid} on host .* died"):
            channel.get("r1", timeout_s=60)
        assert time.monotonic() - started < 0.5 + 2.5
        producer.join(30)


def test_requests_expected_together_each_learn_that_their_producer_died() -> None:
    """A stage announces the requests a step schedules first at once (`expect_all`, one
    namespace lock); each one's consumer is told, and a temp left by a producer that died
    writing an expectation does not stand in the way."""
    with open_channel("shm") as channel:
        stale = Path(channel._expectation_path(channel._name("r2")) + ".new")
        stale.write_bytes(b'{"producer": ".producer-')  # cut off mid-write
        producer, started = _producer(channel, ["r1", "r2", "r3"], "kill", delay_s=0.5)
        assert not stale.exists()
        for request_id in ("r1", "r2", "r3"):
            with pytest.raises(OmniPrefixCacheChannelProducerError,
                               match=f"request {request_id}: .*producer pid {producer.pid} "):
                channel.get(request_id, timeout_s=60)
        assert time.monotonic() - started < 0.5 + 2.5 + 1.0  # the later gets at once
        producer.join(30)


def test_a_dead_producers_failure_is_reported_once_and_a_reused_id_waits_for_its_new_one(
        ) -> None:
    """Clients reuse request ids (an engine started again counts from 0): once a consumer
    learned of the death, the id's next request waits for the producer started since."""
    with open_channel("shm") as channel:
        producer, _ = _producer(channel, "r1", "kill")
        with pytest.raises(OmniPrefixCacheChannelProducerError):
            channel.get("r1", timeout_s=30)
        producer.join(30)
        _reused_id_waits_for_its_new_producer(channel)


def _reused_id_waits_for_its_new_producer(channel: ShmChannel) -> None:
    """`r1`'s next request, its producer started again and not publishing it yet: a get waits
    (no death reported again), then takes what that producer publishes."""
    with open_channel(channel.spec) as restarted:
        restarted.register_producer()
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            channel.get("r1", timeout_s=1.2)
        restarted.expect("r1")
        restarted.put("r1", _marked(8))
        assert _mark(channel.get("r1", timeout_s=5)) == 8


def _stream_a_chunk_then_die(spec: str, ready: multiprocessing.Event) -> None:
    """In a spawned process: a producer expects `r1`, streams its first chunk and is killed."""
    channel = open_channel(spec)
    channel.expect("r1")
    channel.put("r1", _marked(5), start=0, final=False)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_death_reported_mid_entry_is_reported_once_and_a_reused_id_waits_for_its_new_one(
        ) -> None:
    """The producer died mid-stream: the reader of its entry learns it, once. The id's next
    request (retried, its new producer alive but not publishing it yet) waits for that
    producer: it is not told of the old one's death again."""
    with open_channel("shm") as channel:
        ready = _SPAWN.Event()
        producer = _spawn(_stream_a_chunk_then_die, channel.spec, ready)
        assert ready.wait(60), "the producer did not start"
        producer.join(30)
        with pytest.raises(OmniPrefixCacheChannelProducerError,
                           match=f"request r1: .*stops at position 4: .*pid {producer.pid} "):
            channel.get("r1", timeout_s=30)
        _reused_id_waits_for_its_new_producer(channel)


def test_a_live_producer_that_publishes_late_still_delivers_and_leaves_nothing() -> None:
    with open_channel("shm") as channel:
        producer, _ = _producer(channel, "r1", "publish", delay_s=1.5)
        assert _mark(channel.get("r1", timeout_s=60)) == 7
        producer.join(30)
        assert producer.exitcode == 0
        assert sorted(p.name for p in channel.directory.iterdir()) \
            == [".budget", ".key", ".lock", ".owner", ".ring"]


def _publish_when_told_then_die(spec: str, ready: Any, told: Any) -> None:
    """In a spawned process: a producer expects `r`, says so, and once told publishes it and
    is killed."""
    channel = open_channel(spec)
    channel.expect("r")
    ready.set()
    told.wait(60)
    channel.put("r", _marked(5))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_producer_that_publishes_and_dies_between_a_take_and_the_liveness_check_delivers(
        ) -> None:
    """The consumer's take finds nothing; the producer publishes and dies; the liveness check
    finds it dead. The consumer takes once more before it reports the death: it gets the
    entry, and nothing stays in the channel for the id's next request."""
    with open_channel("shm") as channel:
        ready, told = _SPAWN.Event(), _SPAWN.Event()
        producer = _spawn(_publish_when_told_then_die, channel.spec, ready, told)
        assert ready.wait(60), "the producer did not start"
        check = channel._dead_producer

        def publish_and_die_first(request_id: str, *args: Any) -> str | None:
            if not told.is_set():
                told.set()
                producer.join(30)
            return check(request_id, *args)

        channel._dead_producer = publish_and_die_first
        assert _mark(channel.get("r", timeout_s=30)) == 5
        assert producer.exitcode == -signal.SIGKILL
        assert not channel.entry_path("r").exists()


def test_a_namespace_whose_producers_all_died_fails_gets_it_never_expected() -> None:
    with open_channel("shm") as channel:
        producer, _ = _producer(channel, "r1", "exit")
        producer.join(30)
        with pytest.raises(OmniPrefixCacheChannelProducerError,
                           match=f"request r2: .*pid {producer.pid} .*every producer"):
            channel.get("r2", timeout_s=30)
        with open_channel(channel.spec) as live:  # a live producer: others may still come
            live.register_producer()
            with pytest.raises(OmniPrefixCacheChannelTimeoutError):
                channel.get("r2", timeout_s=1.2)


def test_a_wait_names_no_producer_found_dead_longer_than_the_time_to_live_ago() -> None:
    """A dead producer's lock file is swept a time to live after a sweep first found it dead,
    so the namespace's later waits name the producers that died since, not long-dead ones."""
    with open_channel("shm://?ttl=1") as channel:
        first, _ = _producer(channel, "r1", "exit")
        first.join(30)
        channel._sweep()  # finds it dead
        time.sleep(1.2)
        channel._sweep()  # a time to live later: its file goes
        second, _ = _producer(channel, "r2", "exit")
        second.join(30)
        with pytest.raises(OmniPrefixCacheChannelProducerError,
                           match=f"request r3: .*pid {second.pid} .*every producer") as raised:
            channel.get("r3", timeout_s=30)
        assert f"pid {first.pid} " not in str(raised.value)


def _register_in_child(channel: ShmChannel, report: multiprocessing.Queue) -> None:
    """In a forked child of a registered producer: register again, report the lock files."""
    channel.register_producer()
    report.put(sorted(p.name for p in channel.directory.glob(".producer-*")))


def test_a_forked_child_registers_a_producer_of_its_own() -> None:
    fork = multiprocessing.get_context("fork")
    report = fork.Queue()
    with open_channel("shm") as channel:
        channel.register_producer()
        parents = sorted(p.name for p in channel.directory.glob(".producer-*"))
        child = fork.Process(target=_register_in_child, args=(channel, report))
        child.start()
        in_child = report.get(timeout=30)
        child.join(30)
        assert len(parents) == 1 and len(in_child) == 2 and set(parents) < set(in_child)
        channel.put("r", _marked(1))  # the parent still lives: no false alarm
        assert _mark(channel.get("r", timeout_s=5)) == 1
        with pytest.raises(OmniPrefixCacheChannelTimeoutError):
            channel.get("r", timeout_s=1.2)
        channel.close()
        assert not channel.directory.exists()


# ---------------------------------------------------------------- kill anywhere in a put or get

#: The calls through which a put or a take changes files, the budget or locks: a process may
#: die before any of them, and inside each `_shm` call before any of its system calls (its
#: steps, `_shm.steps`).
_STEP_CALLS = [(os, "open"), (os, "close"), (os, "rename"), (os, "unlink"), (os, "pwrite"),
               (os, "write"), (os, "ftruncate"), (os, "fchmod"), (fcntl, "flock"),
               (_shm, "put_all"), (_shm, "reserve"), (_shm, "write"), (_shm, "publish"),
               (_shm, "expect")]
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "prefix_cache.channel.shm"])


@contextmanager
def _each_step(before: Callable[[str], None]) -> Iterator[None]:
    """Calls `before(name)` ahead of each `_STEP_CALLS` call made meanwhile, in this process."""
    originals = [(module, name, getattr(module, name)) for module, name in _STEP_CALLS]

    def traced(call: Callable[..., Any], name: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            before(name)
            return call(*args, **kwargs)
        return step

    for module, name, call in originals:
        setattr(module, name, traced(call, f"{module.__name__}.{name}"))
    try:
        yield
    finally:
        for module, name, call in originals:
            setattr(module, name, call)


#: What the dying process does on the namespace, and what the test process did before and
#: does after it: the marks published, and the orders the consumer may get them in.
def _put_2(channel: StageChannel) -> None:
    channel.put("r", _marked(2))


def _put_2_counted_full(channel: StageChannel) -> None:
    """A put that finds the namespace full by its count, recounts from the files and finds
    room: reserve, write and publish, three `_shm` calls."""
    assert isinstance(channel, ShmChannel)
    channel._maybe_sweep()  # the handle's first sweep, which would recount, is past
    with channel._locked():
        channel._write_budget(channel._read_budget()._replace(used=channel.capacity_bytes))
    channel.put("r", _marked(2))


def _put_2_from_a_pool(channel: StageChannel) -> None:
    """A put of rows read in place from a pool (in reverse slot order: an iovec a row)."""
    rows = _marked(2)[HIDDEN_KEY].flip(0).contiguous()
    pool = rows.numpy().view(np.uint8).reshape(len(rows), -1)
    channel.put("r", {HIDDEN_KEY: PoolRows(pool, np.arange(len(rows))[::-1].copy(),
                                           tuple(rows.shape), rows.dtype, lambda: None)})


def _put_2_beside_another_id(channel: StageChannel) -> None:
    """Puts of two ids in one call (a streaming step's chunks): one lock for both."""
    failures = channel.put_all([("r", StageChunk(_marked(2), 0, final=True)),
                                ("s", StageChunk(_marked(7), 0, final=True))])
    assert failures == [None, None]


def _take(channel: StageChannel) -> None:
    channel.get("r", timeout_s=5)


_PUTS = (_put_2, _put_2_counted_full, _put_2_from_a_pool, _put_2_beside_another_id)
_SCENARIOS: dict[str, tuple[Callable[[StageChannel], None], list[int], list[int],
                            list[list[int]]]] = {
    "put": (_put_2, [1], [3], [[1, 2, 3], [1, 3]]),
    "first put": (_put_2, [], [3], [[2, 3], [3]]),
    "put into a namespace counted full": (_put_2_counted_full, [1], [3], [[1, 2, 3], [1, 3]]),
    "put of pool rows": (_put_2_from_a_pool, [1], [3], [[1, 2, 3], [1, 3]]),
    "puts of two ids together": (_put_2_beside_another_id, [1], [3], [[1, 2, 3], [1, 3]]),
    "take": (_take, [1, 2], [3], [[1, 2, 3], [2, 3]]),
    "last take": (_take, [1], [3], [[1, 3], [3]]),
}


def _die_before_step(spec: str, scenario: str, step: int, inner: int) -> None:
    """In a child process: run the scenario's operation and die (os._exit) just before its
    call number `step` (`inner` > 0: that `_shm` call's system call number `inner`), or right
    after the operation if it makes fewer calls."""
    channel = open_channel(spec)
    calls = 0

    def count(_name: str) -> None:
        nonlocal calls
        if calls == step:
            if not inner:
                os._exit(1)
            _shm.die_before_step(inner)
        calls += 1

    with _each_step(count):
        _SCENARIOS[scenario][0](channel)
    os._exit(1)


def _steps_of(scenario: str, root: Path) -> list[tuple[str, int]]:
    """The calls the scenario's operation makes, in order, traced in this process on a
    namespace prepared as the scenario's, each with the system calls it made in `_shm`."""
    operation, before, _, _ = _SCENARIOS[scenario]
    calls: list[tuple[str, int]] = []  # (name, `_shm.steps()` as it was called)
    with ShmChannel.create(root) as channel, open_channel(channel.spec) as other:
        for mark in before:
            channel.put("r", _marked(mark))
        with _each_step(lambda name: calls.append((name, _shm.steps()))):
            operation(other)
        ends = [made for _, made in calls[1:]] + [_shm.steps()]
    return [(name, end - made) for (name, made), end in zip(calls, ends)]


def _drain(channel: StageChannel, request_id: str = "r") -> list[int]:
    marks = []
    while True:
        try:
            marks.append(_mark(channel.get(request_id, timeout_s=0.05)))
        except OmniPrefixCacheChannelTimeoutError:
            return marks


def _entry_bytes(channel: ShmChannel) -> int:
    return sum(p.stat().st_size for p in channel.directory.iterdir()
               if not p.name.startswith("."))


@pytest.mark.parametrize("scenario", sorted(_SCENARIOS))
def test_a_process_killed_at_any_step_leaves_the_ids_other_entries_whole(
        scenario: str, tmp_path: Path) -> None:
    """For each call of the operation (so a new step cannot be missed): a child dies just
    before it; every other entry of the id is then delivered once, in put order, nothing
    stale stays, and the budget counts exactly the unconsumed entries."""
    operation, before, after, orders = _SCENARIOS[scenario]
    steps = _steps_of(scenario, tmp_path)
    if operation in _PUTS:  # a put's system calls are `_shm`'s: each is a step of its own
        assert any(inner for _, inner in steps), f"no `_shm` system call traced: {steps}"
    if operation is _put_2_counted_full:  # the put that waits for room takes three calls
        assert {f"{_shm.__name__}.{name}" for name in ("reserve", "write", "publish")} \
            <= {name for name, _ in steps}, steps
    kills = [(step, inner) for step, (_, made) in enumerate(steps) for inner in range(made + 1)]
    for step, inner in [*kills, (len(steps), 0)]:
        where = (f"{scenario} killed before step {step} of {len(steps)} "
                 f"({steps[step][0] if step < len(steps) else 'after its last'}"
                 f"{f', its system call {inner}' if inner else ''}); calls: {steps}")
        with ShmChannel.create(tmp_path) as channel:
            for mark in before:
                channel.put("r", _marked(mark))
            child = _FORKSERVER.Process(target=_die_before_step,
                                        args=(channel.spec, scenario, step, inner))
            child.start()
            child.join(60)
            assert child.exitcode == 1, where
            for mark in after:
                channel.put("r", _marked(mark))
            channel._sweep()
            used, unconsumed = channel.used_bytes(), _entry_bytes(channel)
            assert _drain(channel) in orders, where
            assert _drain(channel, "s") in ([], [7]), where  # the id put beside, if any
            assert used == unconsumed, where
            channel._sweep()
            assert channel.used_bytes() == 0, where
            assert sorted(p.name for p in channel.directory.iterdir()) \
                == [".budget", ".key", ".lock", ".owner", ".ring"], where


# ---------------------------------------------------------- reclaiming dead owners' namespaces

def _own_then_die(root: str, report: multiprocessing.Queue) -> None:
    """In a child process: create a namespace under `root`, publish one entry, report the
    namespace and this pid, and die."""
    channel = ShmChannel.create(Path(root))
    channel.put("r", _marked(1))
    report.put((channel.directory.name, os.getpid()))
    report.close()
    report.join_thread()  # sent before dying
    os._exit(1)


def _dead_owners_namespace(root: Path) -> tuple[Path, int]:
    """A namespace under `root` whose owner died, and the owner's pid."""
    report = _FORKSERVER.Queue()
    child = _FORKSERVER.Process(target=_own_then_die, args=(str(root), report))
    child.start()
    name, pid = report.get(timeout=60)
    child.join(30)
    assert child.exitcode == 1 and (root / name).is_dir()
    return root / name, pid


def test_the_next_create_reclaims_dead_owners_namespaces_and_no_live_one(
        tmp_path: Path) -> None:
    dead, _ = _dead_owners_namespace(tmp_path)
    unfinished = tmp_path / (NAMESPACE_PREFIX + "0" * 32)  # its creator died making it
    unfinished.mkdir(0o700)
    old = time.time() - RECLAIM_GRACE_S - 1
    os.utime(unfinished, (old, old))
    older_version = tmp_path / (NAMESPACE_PREFIX + "1" * 32)  # no owner lock to test
    older_version.mkdir(0o700)
    (older_version / ".budget").write_bytes(b"")
    os.utime(older_version, (old, old))
    not_a_namespace = tmp_path / (NAMESPACE_PREFIX + "demo-x")  # e.g. a tool's temp dir
    not_a_namespace.mkdir()
    os.utime(not_a_namespace, (old, old))
    with ShmChannel.create(tmp_path) as live:
        assert not dead.exists() and not unfinished.exists()
        assert older_version.exists() and not_a_namespace.exists()
        with ShmChannel.create(tmp_path), open_channel(live.spec) as joined:
            joined.put("r", _marked(2))
            assert _mark(live.get("r", timeout_s=5)) == 2


def _gc(root: Path, *options: str) -> str:
    done = subprocess.run([sys.executable, "-m", "prefix_cache", "channel", "gc", "--dir",
                           str(root), *options], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_channel_gc_lists_and_removes_the_namespaces_of_dead_owners(tmp_path: Path) -> None:
    with ShmChannel.create(tmp_path) as live:
        dead, pid = _dead_owners_namespace(tmp_path)
        listed = _gc(tmp_path, "--dry-run").splitlines()
        assert listed[0].split() == ["namespace", "owner", "age", "entries", "bytes"]
        row = listed[1].split()
        assert row[:4] == [dead.name, "pid", str(pid), "on"] and row[-2] == "1"  # 1 entry
        assert int(row[-1]) >= _marked(1)[HIDDEN_KEY].nbytes
        assert listed[2:] == [f"would remove 1 namespace of dead owners under {tmp_path}"]
        assert dead.exists()
        removed = _gc(tmp_path).splitlines()
        assert removed[1].split()[0] == dead.name
        assert removed[2:] == [f"removed 1 namespace of dead owners under {tmp_path}"]
        assert not dead.exists() and live.directory.exists()
        assert _gc(tmp_path) == f"no namespace of a dead owner under {tmp_path}\n"
