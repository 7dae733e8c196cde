"""Wake-ups for entries renamed into a directory (Linux inotify, through libc).

A reader waiting on the shm channel polls for its entry and pauses between polls, backing off
to `_MAX_POLL_S`; an entry published just after a poll would wait out the pause. A
`DirectoryWatch` ends the pauses as soon as a file is renamed into the namespace (every entry
is published by a rename), so its readers poll again at once. One watch (one inotify instance)
serves every thread of a handle. Where inotify is missing the pauses are plain sleeps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import threading
import time

#: inotify event: a file was moved (renamed) into the watched directory.
IN_MOVED_TO = 0x00000080

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


class DirectoryWatch:
    """Invariant: `generation` counts the batches of renames into the directory seen so far;
    `pause(s, seen)` returns once it moved past `seen`, or after `s` seconds. One waiter at a
    time reads the inotify descriptor; the others wait on a condition it notifies."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closing_r, self._closing_w = os.pipe()  # written by close: ends the read at once
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poller.register(self._closing_r, select.POLLIN)
        self._changed = threading.Condition()
        self._generation = 0
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

    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    def pause(self, seconds: float, seen: int) -> None:
        if self._closed:  # a closed watch tells nothing: sleep, as without one
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        with self._changed:
            while self._generation == seen and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if self._reading:  # another waiter reads the descriptor and will notify
                    self._changed.wait(left)
                    continue
                self._reading = True
                self._changed.release()
                renamed = False
                try:
                    renamed = self._wait_for_events(left)
                finally:
                    self._changed.acquire()
                    self._reading = False
                    self._generation += renamed
                    self._changed.notify_all()  # news, or the descriptor is free to read

    def _wait_for_events(self, seconds: float) -> bool:
        """Whether renames arrived within `seconds` (read and dropped: any may be awaited)."""
        ready = {fd for fd, _ in self._poller.poll(max(1, round(seconds * 1000)))}
        if self._fd not in ready:
            return False
        try:
            while os.read(self._fd, 4096):
                pass
        except BlockingIOError:
            pass
        return True

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
