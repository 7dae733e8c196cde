"""Runs of consecutive slots: the form a write's bookkeeping takes.

A step's slots come in runs (a request's positions fill a block in order), so
claims and write records are range fills, one C loop over the runs
(`prefix_cache.core._core`), rather than a scatter per slot.
"""

from __future__ import annotations

import numpy as np

from prefix_cache.core import _core


def slot_runs(slots: np.ndarray) -> tuple[np.ndarray, int, int]:
    """`slots` (int64) as `[k, 2]` rows of (first, end), and their min and max ((0, -1) for
    no slots)."""
    runs = np.empty((len(slots), 2), dtype=np.int64)
    k, low, high = _core.slot_runs(slots, runs)
    return runs[:k], low, high


def runs_slots(runs: np.ndarray) -> np.ndarray:
    """The slots of `runs`, in order (the inverse of `slot_runs`)."""
    slots = np.empty(_core.run_stats(runs)[0], dtype=np.int64)
    _core.runs_slots(runs, slots)
    return slots
