"""The shared-memory channel survives crashes (SPEC §9): a waiting consumer learns within
seconds that the producer of its request died.

Producers run in spawned processes that die by `os._exit` or SIGKILL, as a crashed worker does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import (OmniPrefixCacheChannelProducerError,
                                  OmniPrefixCacheChannelTimeoutError, open_channel)
from prefix_cache.channel.shm import ShmChannel

pytestmark = pytest.mark.skipif(not Path("/proc/self").exists(), reason="flock and fork: Linux")

_SPAWN = multiprocessing.get_context("spawn")


def _marked(i: int) -> dict[str, torch.Tensor]:
    return {HIDDEN_KEY: torch.full((4, 8), float(i))}


def _mark(outputs: dict[str, torch.Tensor]) -> int:
    return int(outputs[HIDDEN_KEY][0, 0])


def _spawn(target: Callable[..., None], *args: object) -> multiprocessing.Process:
    proc = _SPAWN.Process(target=target, args=args)
    proc.start()
    return proc


def _expect_then(spec: str, request_id: str, ready: multiprocessing.Event, end: str,
                 delay_s: float) -> None:
    """In a spawned process: a producer expects `request_id`, says so, and after `delay_s`
    ends as `end` says: "exit" (os._exit), "kill" (SIGKILL), or "publish" (then closes)."""
    channel = open_channel(spec)
    channel.expect(request_id)
    ready.set()
    time.sleep(delay_s)
    if end == "exit":
        os._exit(1)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    channel.put(request_id, _marked(7))
    channel.close()


def _producer(channel: ShmChannel, request_id: str, end: str, delay_s: float = 0.0
              ) -> tuple[multiprocessing.Process, float]:
    """A spawned producer of `request_id` on `channel`'s namespace, once it expects it."""
    ready = _SPAWN.Event()
    proc = _spawn(_expect_then, channel.spec, request_id, ready, end, delay_s)
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


def test_a_live_producer_that_publishes_late_still_delivers_and_leaves_nothing() -> None:
    with open_channel("shm") as channel:
        producer, _ = _producer(channel, "r1", "publish", delay_s=1.5)
        assert _mark(channel.get("r1", timeout_s=60)) == 7
        producer.join(30)
        assert producer.exitcode == 0
        assert sorted(p.name for p in channel.directory.iterdir() if p.name != ".owner") \
            == [".budget", ".key", ".lock"]


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
