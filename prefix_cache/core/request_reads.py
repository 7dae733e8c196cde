"""A request's rows read back from the pool: its positions at its finish, a streaming stage's
chunk of them, or its prefix hit's.

Planned on the engine thread while the view still holds the request's blocks (a streaming
stage's prefix hit: at the step's start, `plan_hit_rows`; a chunk: once its positions stand);
the reads pin their slots, so a
block the scheduler hands to a new tenant is not overwritten before they are read (the
writer resolves a pinned read first, see `ReadPlanner`). Read by the thread
that delivers the rows, one read per key the request has rows of: in place, by the channel's
writer (`hold`: one copy, pool to entry), or gathered into tensors (`resolve`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from prefix_cache.config import HIDDEN_KEY
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import StepHits
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.core.reads import ReadPlanner, RowRead, unwritten_hidden_rows
from prefix_cache.errors import OmniPrefixCacheError


class RequestRows:
    """Positions `[start, num_rows)` of `req_id`, per key it has rows of there: a read of them
    (absent mm rows read zeros); `rows_cut` more positions were computed but do not stand.
    Invariant: until resolved or cancelled, each read pins its slots."""

    def __init__(self, req_id: str, start: int, num_rows: int, rows_cut: int,
                 reads: dict[str, RowRead], feat_shapes: dict[str, tuple[int, ...]],
                 planner: ReadPlanner) -> None:
        self.req_id = req_id
        self.start = start
        self.num_rows = num_rows
        self.rows_cut = rows_cut
        self._reads = reads
        self._feat_shapes = feat_shapes
        self._planner = planner
        self._held: list[PoolRows] = []  # rows `hold` left in the pool, until `cancel`

    @property
    def keys(self) -> list[str]:
        return list(self._reads)

    def hold(self) -> dict[str, torch.Tensor | PoolRows]:
        """The rows per key, `[num_rows - start, *feat]`, for one writer: a read this thread claims
        stays in the pool, pinned, for the writer to read in place (`PoolRows`) until
        `cancel()`; one another thread gathered first is its tensor. Raises naming the request
        if a row was lost (its write failed), every read let go."""
        out: dict[str, torch.Tensor | PoolRows] = {}
        try:
            for key, read in self._reads.items():
                rows = self._planner.hold(read, self._shape(key))
                if rows is None:  # another thread's: wait for its tensor
                    out[key] = self._gathered(key, read)
                else:
                    self._held.append(rows)
                    out[key] = rows
        except BaseException:
            self.cancel()
            raise
        return out

    def resolve(self) -> dict[str, torch.Tensor]:
        """The rows per key, `[num_rows - start, *feat]` tensors the caller owns; raises naming the
        request if a row was lost (its write failed). Either way every read is let go."""
        try:
            return {key: self._gathered(key, read) for key, read in self._reads.items()}
        finally:
            self.cancel()

    def _shape(self, key: str) -> tuple[int, ...]:
        return (self.num_rows - self.start, *self._feat_shapes[key])

    def _gathered(self, key: str, read: RowRead) -> torch.Tensor:
        """`read`'s rows in a tensor of their own (gathered here, or by the thread that got to
        it first)."""
        self._planner.resolve(read)
        shape = self._shape(key)
        # a view only where it reshapes: a torch op may hand the GIL to the engine thread
        return read.out if read.out.shape == shape else read.out.view(shape)

    def cancel(self) -> None:
        """Let go of the rows `hold` left in the pool, and of the reads not resolved yet
        (nobody will gather them)."""
        for rows in self._held:
            rows.let_go()
        self._held.clear()
        for read in self._reads.values():
            self._planner.cancel(read)


def plan_request_rows(pool: PrefixBlockPool, planner: ReadPlanner, deferred: DeferredWriter,
                      lock: threading.Lock,
                      requests: Sequence[tuple[str, int, np.ndarray, int]],
                      what: str = "the finish") -> dict[str, RequestRows]:
    """Per `(request, first position, slots of its positions from there, rows cut)`, its rows
    of every key it has rows of there (present, or lost to a failed write: those fail its
    read), the pool looked up once per key for all of them. Hidden rows are never absent: a
    position without one fails the request's read, where zeros would pass for rows nobody
    computed. Rows still held on the device by a live request's deferred write (a prefix it
    shares) are launched."""
    hits = StepHits.join([(req_id, len(slots), slots) for req_id, _, slots, _ in requests
                          if len(slots)])
    reads: dict[str, dict[str, RowRead]] = {req_id: {} for req_id, _, _, _ in requests}
    if len(hits):
        starts = hits.bounds[:-1]
        with lock:
            for key in pool.keys:
                if key == HIDDEN_KEY:  # never absent: every request reads it (plan_hits looks)
                    chosen = list(range(len(hits)))
                else:  # a request reads an mm key where it has rows of it, present or lost
                    present, lost, _ = pool.row_states(key, hits.slots)
                    has_rows = np.logical_or.reduceat(present | lost, starts)
                    chosen = np.flatnonzero(has_rows).tolist()
                planned = planner.plan_hits(key, hits.select(chosen), [
                    (f"{what} of request {hits.req_ids[i]}", 0) for i in chosen]) \
                    if chosen else []
                for i, read in zip(chosen, planned):
                    reads[hits.req_ids[i]][key] = read
    for req_id, start, _, _ in requests:
        read = reads[req_id].get(HIDDEN_KEY)
        if read is not None and read.present is not None and not read.present.all() \
                and read.error is None:
            planner.cancel(read)  # unpins under the lock: not while holding it
            read.fail(OmniPrefixCacheError(unwritten_hidden_rows(start, read.present)))
    deferred.flush_tasks([task for per_key in reads.values() for read in per_key.values()
                          for task in read.producers])
    feat_shapes = {key: pool_key.feat_shape for key, pool_key in pool.keys.items()}
    return {req_id: RequestRows(req_id, start, start + len(slots), cut, reads[req_id],
                                feat_shapes, planner)
            for req_id, start, slots, cut in requests}
