"""Rows of one key named by their pool slots: what a channel entry's writer reads in place.

A finished request's rows sit in the pool, held by the read planned for them. Handed to the
channel as `PoolRows`, they go from the pool into the entry in one copy (on shm, by pwritev into
the entry's file, in C with the GIL released), with no gathered tensor between. Whoever copies
them into memory of its own instead (a put that must wait for room, a store that takes one
buffer) lets the pool's rows go at once.

A writer of the engine thread about to reuse those slots never waits for the rows' holder, nor
for a full channel behind it: it moves the rows out of the pool (`evict`), into memory of their
own, and the holder's writer reads them there. Only a copy under way (`reading`) makes it wait,
for that copy alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.core.block_pool import GATHER_THREADS


class _Source:
    """Where held rows are read: row `i` is `pool[slots[i]]`, zeros where `slots[i]` is -1;
    the pool's rows until `evict` moves them into an array of their own.

    Invariant: `lock` is held while a writer reads the rows and while they move, so a reader
    sees them wholly in the pool or wholly moved; it is reentrant, so a writer inside
    `reading` may copy them (`copy_into`) too."""

    __slots__ = ("pool", "slots", "lock", "moved")

    def __init__(self, pool: np.ndarray, slots: np.ndarray) -> None:
        self.pool = pool
        self.slots = slots
        self.lock = threading.RLock()
        self.moved = False

    def gather(self, slots: np.ndarray, out: np.ndarray) -> None:
        """The rows at `slots` (some of `self.slots`) into `out`, zeros at -1 (caller holds
        the lock)."""
        absent = slots < 0
        if absent.any():
            out[absent] = 0
            present = ~absent
            out[present] = self.pool[slots[present]]
        else:  # runs of slots copied whole, in threads, without the GIL
            _core.gather_rows(self.pool, slots, out, GATHER_THREADS)

    def evict(self, timeout_s: float) -> bool:
        """Move the rows out of the pool into an array of their own (once); False if a writer
        still read them after `timeout_s`."""
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            if not self.moved:
                own = np.empty((len(self.slots), self.pool.shape[1]), dtype=np.uint8)
                self.gather(self.slots, own)
                self.pool, self.slots = own, np.arange(len(own), dtype=np.int64)
                self.moved = True
        finally:
            self.lock.release()
        return True


class PoolRows:
    """`shape[0]` rows of `dtype`: row `i` is `pool[slots[i]]`, or zeros where `slots[i]` is -1.

    Invariant: the rows stay as they are until `let_go` is called (the first call counts;
    later ones do nothing), which whoever copies them calls then; a writer reads `pool` and
    `slots` only inside `reading`, since `evict` may move the rows meanwhile. Spans of one
    read's rows (`span`) share where they are."""

    def __init__(self, pool: np.ndarray, slots: np.ndarray, shape: tuple[int, ...],
                 dtype: torch.dtype, let_go: Callable[[], None]) -> None:
        self._source = _Source(pool, slots)
        self._lo = 0
        self.shape = tuple(shape)
        self.dtype = dtype
        self.let_go = let_go
        if math.prod(self.shape[1:]) * dtype.itemsize != self.row_bytes \
                or self.shape[:1] != (len(slots),):
            raise ValueError(f"pool rows of shape {self.shape} and {dtype} do not fit "
                             f"{len(slots)} slots of {self.row_bytes}-byte rows")

    def span(self, lo: int, hi: int, let_go: Callable[[], None]) -> PoolRows:
        """Rows `lo..hi - 1` of these, wherever they are (moved with them); `let_go` is the
        span's own."""
        rows = PoolRows.__new__(PoolRows)
        rows._source, rows._lo = self._source, self._lo + lo
        rows.shape, rows.dtype, rows.let_go = (hi - lo, *self.shape[1:]), self.dtype, let_go
        return rows

    @property
    def pool(self) -> np.ndarray:
        """`[num_slots, row bytes]` uint8: the pool's host rows of one key, or the rows' own
        array once moved."""
        return self._source.pool

    @property
    def slots(self) -> np.ndarray:
        """`[rows]` int64: each row's index in `pool`."""
        return self._source.slots[self._lo:self._lo + self.shape[0]]

    @property
    def row_bytes(self) -> int:
        return self._source.pool.shape[1]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def evict(self, timeout_s: float) -> bool:
        """Move these rows (and every span's) out of the pool, so its slots may be overwritten;
        False if a writer still read them after `timeout_s`."""
        return self._source.evict(timeout_s)

    def copy_into(self, out: np.ndarray) -> None:
        """The rows into `out`, uint8 `[rows, row bytes]` (one copy), zeros at slot -1; then
        lets the pool's rows go."""
        with self._source.lock:
            self._source.gather(self.slots, out)
        self.let_go()

    def byte_copy(self) -> np.ndarray:
        """The rows' bytes in an array of their own, uint8 `[rows, row bytes]`; lets the pool's
        rows go."""
        out = np.empty((self.shape[0], self.row_bytes), dtype=np.uint8)
        self.copy_into(out)
        return out


@contextmanager
def reading(pieces: Iterable[object]) -> Iterator[None]:
    """Keep the rows of every `PoolRows` among `pieces` where they are while the caller's writer
    reads `pool` at `slots` (each place locked once, whatever spans share it)."""
    locks = list({id(p._source): p._source.lock for p in pieces
                  if isinstance(p, PoolRows)}.values())
    taken = 0
    try:
        for lock in locks:
            lock.acquire()
            taken += 1
        yield
    finally:
        for lock in reversed(locks[:taken]):
            lock.release()
