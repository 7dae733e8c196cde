"""Rows of one key named by their pool slots: what a channel entry's writer reads in place.

A finished request's rows sit in the pool, pinned by the read planned for them. Handed to the
channel as `PoolRows`, they go from the pool into the entry in one copy (on shm, by pwritev into
the entry's file, in C with the GIL released), with no gathered tensor between. Whoever copies
them into memory of its own instead (a put that must wait for room, a store that takes one
buffer) lets the pool's rows go at once: a writer of the engine thread about to reuse those
slots waits for the rows' holder, never for a full channel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from prefix_cache.core import _core
from prefix_cache.core.block_pool import GATHER_THREADS


@dataclass(frozen=True, eq=False)
class PoolRows:
    """`shape[0]` rows of `dtype`: row `i` is `pool[slots[i]]`, or zeros where `slots[i]` is -1.

    Invariant: the pool's rows at `slots` stay as they are until `let_go` is called (the first
    call counts; later ones do nothing), which whoever copies them calls then."""

    pool: np.ndarray  # [num_slots, row bytes] uint8: the pool's host rows of one key
    slots: np.ndarray  # [rows] int64
    shape: tuple[int, ...]  # the rows', (len(slots), *feat)
    dtype: torch.dtype
    let_go: Callable[[], None]

    def __post_init__(self) -> None:
        if math.prod(self.shape[1:]) * self.dtype.itemsize != self.row_bytes \
                or tuple(self.shape[:1]) != (len(self.slots),):
            raise ValueError(f"pool rows of shape {tuple(self.shape)} and {self.dtype} do not "
                             f"fit {len(self.slots)} slots of {self.row_bytes}-byte rows")

    @property
    def row_bytes(self) -> int:
        return self.pool.shape[1]

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.row_bytes

    def copy_into(self, out: np.ndarray) -> None:
        """The rows into `out`, uint8 `[rows, row bytes]` (one copy), zeros at slot -1; then
        lets the pool's rows go."""
        absent = self.slots < 0
        if absent.any():
            out[absent] = 0
            present = ~absent
            out[present] = self.pool[self.slots[present]]
        else:  # runs of slots copied whole, in threads, without the GIL
            _core.gather_rows(self.pool, self.slots, out, GATHER_THREADS)
        self.let_go()

    def byte_copy(self) -> np.ndarray:
        """The rows' bytes in an array of their own, uint8 `[rows, row bytes]`; lets the pool's
        rows go."""
        out = np.empty((len(self.slots), self.row_bytes), dtype=np.uint8)
        self.copy_into(out)
        return out
