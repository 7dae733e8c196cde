"""A cache belongs to the process that built it, until it is shut down.

A forked child inherits the manager but not its streams, threads or pinned registrations: it
may use none of them, nor release them. A shutdown whose writes or copies did not finish in
time keeps the pools and staging buffers (registered) for the life of the process: a device
copy may still write into them.
"""

from __future__ import annotations

import os

from prefix_cache.errors import OmniPrefixCacheError

#: This process's id, renewed in a forked child: every public call compares it with the
#: cache's, and `os.getpid()` is a system call.
_PID = os.getpid()


def _renew_pid() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_renew_pid)

#: What shutdowns that timed out kept: neither it nor its registrations are released while this
#: process lives.
_STRANDED: list[tuple[object, ...]] = []


class Lifetime:
    """Whether a cache may be used here and now.

    Invariant: `check` passes only in the process that built the cache, before `end`."""

    def __init__(self) -> None:
        self._pid = _PID  # streams and registrations belong to this process
        self._ended = False

    def check(self, call: str) -> None:
        """Refuse `call` in a forked child or after shutdown."""
        if _PID != self._pid:
            raise OmniPrefixCacheError(
                f"{call}: this prefix cache was built in process {self._pid}; a forked child "
                f"(process {_PID}) cannot use its streams or pinned pools; build a new "
                f"manager in the child")
        if self._ended:
            raise OmniPrefixCacheError(f"{call}: the prefix cache was shut down")

    def end(self) -> bool:
        """Mark the cache shut down; whether the caller releases what it holds (the first
        call, in the process that built it)."""
        if self._ended:
            return False
        self._ended = True
        return _PID == self._pid

    @staticmethod
    def strand(*buffers: object) -> None:
        """Keep `buffers` (and their registrations) for the life of the process."""
        _STRANDED.append(buffers)
