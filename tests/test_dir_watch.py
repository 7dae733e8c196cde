"""`DirectoryWatch`: a waiter's pause ends when a file is renamed into the directory (how every
shm entry is published) with the waiter's stem, and runs its length otherwise; one watch serves
many waiting threads, waking only those of the renamed stem, and closing it wakes them all."""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from prefix_cache.channel.dir_watch import IN_MOVED_TO, DirectoryWatch, renamed_stems

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")


def test_a_pause_ends_at_a_rename_of_its_stem_and_runs_out_otherwise(tmp_path: Path) -> None:
    watch = DirectoryWatch.open(tmp_path)
    assert watch is not None
    for name in ("mine.tmp", "other.tmp"):
        (tmp_path / name).write_bytes(b"rows")
    try:
        with watch.waiting_for("mine") as pause:
            (tmp_path / "mine.new").write_bytes(b"")  # created, not renamed in
            os.rename(tmp_path / "other.tmp", tmp_path / "other.1")  # another id's entry
            start = time.monotonic()
            pause(0.3)
            assert time.monotonic() - start >= 0.29
            timer = threading.Timer(0.1, os.rename, (tmp_path / "mine.tmp", tmp_path / "mine.7"))
            start = time.monotonic()
            timer.start()
            pause(10)
            assert time.monotonic() - start < 5
            timer.join()
            start = time.monotonic()
            pause(0.3)  # that rename was seen: nothing new
            assert time.monotonic() - start >= 0.29
    finally:
        watch.close()


def test_a_rename_before_the_first_pause_ends_it_at_once(tmp_path: Path) -> None:
    """A waiter registers before its first poll: an entry renamed in between is not waited
    out, whichever poll missed it."""
    watch = DirectoryWatch.open(tmp_path)
    assert watch is not None
    (tmp_path / "id.tmp").write_bytes(b"")
    try:
        with watch.waiting_for("id") as pause:
            os.rename(tmp_path / "id.tmp", tmp_path / "id.1")
            start = time.monotonic()
            pause(10)
            assert time.monotonic() - start < 5
    finally:
        watch.close()


def test_only_the_waiters_of_the_renamed_stem_wake_and_close_wakes_the_rest(
        tmp_path: Path) -> None:
    watch = DirectoryWatch.open(tmp_path)
    assert watch is not None
    (tmp_path / "a.tmp").write_bytes(b"")
    woke: dict[str, list[float]] = {"a": [], "b": []}

    def wait(stem: str) -> None:
        with watch.waiting_for(stem) as pause:
            start = time.monotonic()
            pause(10)
            woke[stem].append(time.monotonic() - start)

    waiters = [threading.Thread(target=wait, args=(stem,)) for stem in "aaab"]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.2)
    os.rename(tmp_path / "a.tmp", tmp_path / "a.1")
    for waiter in waiters[:3]:
        waiter.join(5)
    time.sleep(0.3)
    assert len(woke["a"]) == 3 and max(woke["a"]) < 5 and woke["b"] == []
    closer = threading.Thread(target=watch.close)
    closer.start()
    waiters[3].join(5)
    closer.join(5)
    assert len(woke["b"]) == 1 and woke["b"][0] < 5 and not closer.is_alive()


def test_events_read_as_the_stems_renamed_in() -> None:
    def event(mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name) % 16)
        return struct.pack("iIII", 1, mask, 0, len(padded)) + padded
    events = event(IN_MOVED_TO, b"abc.3") + event(0x100, b"new") + event(IN_MOVED_TO, b"xyz")
    assert renamed_stems(events) == ({"abc", "xyz"}, False)
    assert renamed_stems(struct.pack("iIII", -1, 0x4000, 0, 0)) == (set(), True)


def test_a_directory_that_cannot_be_watched_gives_none(tmp_path: Path) -> None:
    assert DirectoryWatch.open(tmp_path / "absent") is None
