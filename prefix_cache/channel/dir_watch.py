"""Wake-ups for entries renamed into a directory (Linux inotify, through libc).

A reader waiting on the shm channel polls for its entry and pauses between polls, backing off
to `_MAX_POLL_S`; an entry published just after a poll would wait out the pause. A
`DirectoryWatch` ends a waiter's pause as soon as a file of its id (`STEM` or `STEM.*`) is
renamed into the namespace (every entry is published by a rename), so it polls again at once,
and only then: readers of other ids sleep on. One watch (one inotify instance) serves every
thread of a handle. Where inotify is missing the pauses are plain sleeps.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: inotify events: a file was moved (renamed) into the watched directory; events were lost.
IN_MOVED_TO = 0x00000080
IN_Q_OVERFLOW = 0x00004000
#: `struct inotify_event` before its name: wd, mask, cookie, len.
_EVENT = struct.Struct("iIII")

_libc: ctypes.CDLL | None = None


def _inotify() -> ctypes.CDLL | None:
    """libc, where it has inotify (Linux); else None."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
        if not hasattr(libc, "inotify_init1") or not hasattr(libc, "inotify_add_watch"):
            return None
        libc.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        _libc = libc
    return _libc


def renamed_stems(events: bytes) -> tuple[set[str], bool]:
    """The stems (names up to their first dot) of the files `events` renamed in, and whether
    the kernel dropped events (then any stem may have been renamed in)."""
    stems, offset, overflowed = set(), 0, False
    while offset + _EVENT.size <= len(events):
        _, mask, _, length = _EVENT.unpack_from(events, offset)
        name = events[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0")
        offset += _EVENT.size + length
        overflowed |= bool(mask & IN_Q_OVERFLOW)
        if mask & IN_MOVED_TO and name:
            stems.add(os.fsdecode(name).split(".", 1)[0])
    return stems, overflowed


class DirectoryWatch:
    """Invariant: `_renamed[stem]` counts the renames of a waited-for stem seen since its first
    waiter registered; a pause of that stem returns once it moves past what its waiter saw,
    or after its seconds. One waiter at a time reads the inotify descriptor; the others wait
    on a condition it notifies."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closing_r, self._closing_w = os.pipe()  # written by close: ends the read at once
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poller.register(self._closing_r, select.POLLIN)
        self._changed = threading.Condition()
        self._waiters: collections.Counter[str] = collections.Counter()
        self._renamed: collections.Counter[str] = collections.Counter()
        self._reading = False
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy is not its own: it never touches it

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> DirectoryWatch | None:
        """A watch on `directory`, or None where inotify is missing or refuses (no instance
        left under the user's limit, say): its caller then sleeps its pauses."""
        libc = _inotify()
        if libc is None:
            return None
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(directory), IN_MOVED_TO) < 0:
            os.close(fd)
            return None
        return cls(fd)

    @contextmanager
    def waiting_for(self, stem: str) -> Iterator[Callable[[float], None]]:
        """Pauses for a waiter of the files `stem` and `stem.*`: each ends once one was renamed
        in since the waiter registered (enter this before its first poll) or since its last
        pause ended, or after its seconds."""
        with self._changed:
            self._waiters[stem] += 1
            seen = self._renamed[stem]

        def pause(seconds: float) -> None:
            nonlocal seen
            self._pause(stem, seen, seconds)
            with self._changed:
                seen = self._renamed[stem]  # before the next poll: a rename after it counts

        try:
            yield pause
        finally:
            with self._changed:
                self._waiters[stem] -= 1
                if not self._waiters[stem]:
                    del self._waiters[stem]
                    self._renamed.pop(stem, None)

    def _pause(self, stem: str, seen: int, seconds: float) -> None:
        if self._closed:  # a closed watch tells nothing: sleep, as without one
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        with self._changed:
            while self._renamed[stem] == seen and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if self._reading:  # another waiter reads the descriptor and will notify
                    self._changed.wait(left)
                    continue
                self._reading = True
                self._changed.release()
                events = b""
                try:
                    events = self._read_events(left)
                finally:
                    self._changed.acquire()
                    self._reading = False
                    self._count(events)
                    self._changed.notify_all()  # news, or the descriptor is free to read

    def _read_events(self, seconds: float) -> bytes:
        """The events that arrive within `seconds` (none: b"")."""
        ready = {fd for fd, _ in self._poller.poll(max(1, round(seconds * 1000)))}
        if self._fd not in ready:
            return b""
        chunks = []
        try:
            while chunk := os.read(self._fd, 65536):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        return b"".join(chunks)

    def _count(self, events: bytes) -> None:
        """Count the renames of waited-for stems in `events` (caller holds the condition)."""
        stems, overflowed = renamed_stems(events)
        for stem in self._waiters.keys() if overflowed else stems & self._waiters.keys():
            self._renamed[stem] += 1

    def close(self) -> None:
        """Wake every waiter (they return to polling; later pauses sleep) and release the
        descriptors once none reads them (idempotent). In a forked child, nothing: its copy's
        lock may be held and its pipe is the parent's."""
        if os.getpid() != self._pid:
            return
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
            os.write(self._closing_w, b"x")
            while self._reading:
                self._changed.wait()
            for fd in (self._fd, self._closing_r, self._closing_w):
                os.close(fd)
