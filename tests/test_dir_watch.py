"""`DirectoryWatch`: a waiter's pause ends when a file is renamed into the directory (how every
shm entry is published), and runs its length otherwise; one watch serves many waiting threads,
and closing it wakes them."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from prefix_cache.channel.dir_watch import DirectoryWatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


def test_a_pause_ends_at_a_rename_into_the_directory_and_runs_out_without_one(
        tmp_path: Path) -> None:
    watch = DirectoryWatch.open(tmp_path)
    assert watch is not None
    try:
        seen = watch.generation
        (tmp_path / "entry.tmp").write_bytes(b"rows")  # a file created, not renamed in
        start = time.monotonic()
        watch.pause(0.2, seen)
        assert time.monotonic() - start >= 0.19 and watch.generation == seen
        timer = threading.Timer(0.1, os.rename, (tmp_path / "entry.tmp", tmp_path / "entry"))
        start = time.monotonic()
        timer.start()
        watch.pause(10, seen)
        assert time.monotonic() - start < 5 and watch.generation == seen + 1
        timer.join()
        start = time.monotonic()
        watch.pause(10, seen)  # a waiter that has not polled since returns at once
        assert time.monotonic() - start < 1
    finally:
        watch.close()


def test_every_waiting_thread_wakes_at_a_rename_and_at_close(tmp_path: Path) -> None:
    watch = DirectoryWatch.open(tmp_path)
    assert watch is not None
    (tmp_path / "a.tmp").write_bytes(b"")
    woke: list[float] = []

    def wait() -> None:
        start = time.monotonic()
        watch.pause(10, watch.generation)
        woke.append(time.monotonic() - start)

    waiters = [threading.Thread(target=wait) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.2)
    os.rename(tmp_path / "a.tmp", tmp_path / "a")
    for waiter in waiters:
        waiter.join(5)
    assert len(woke) == 4 and max(woke) < 5
    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    closer = threading.Thread(target=watch.close)
    closer.start()
    for waiter in waiters:
        waiter.join(15)
    closer.join(15)
    assert len(woke) == 6 and max(woke[4:]) < 5 and not closer.is_alive()


def test_a_directory_that_cannot_be_watched_gives_none(tmp_path: Path) -> None:
    assert DirectoryWatch.open(tmp_path / "absent") is None
