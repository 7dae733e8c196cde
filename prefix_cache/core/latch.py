"""Latch: a gate that opens once, for the per-step records threads wait on.

`threading.Event` builds a Condition (about 3 µs on the engine thread, twice a
step: a write task and a step read); a latch is one lock, held until it opens.
"""

from __future__ import annotations

import threading


class Latch:
    """`threading.Event`'s `set`, `is_set` and `wait` for a flag that is set once.

    Invariant: `_gate` is held while closed and free once open; `set` is called by
    the one thread that moved its owner to a final state (a second call is a no-op).
    """

    __slots__ = ("_gate", "_open")

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()
        self._open = False

    def set(self) -> None:
        if not self._open:
            self._open = True
            self._gate.release()

    def is_set(self) -> bool:
        return self._open

    def wait(self, timeout: float | None = None) -> bool:
        """Block until open or `timeout` seconds passed; whether it is open."""
        if self._open:
            return True
        if self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._gate.release()  # the next waiter passes too
        return self._open
