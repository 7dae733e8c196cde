"""A streaming stage's chunks read back from the pool: a step's chunks, all its requests' at once.

Planned on the engine thread once a step made them due, while its requests run (their
blocks stay theirs), from the chunks' slots end to end (`ChunkSpans`, which the view gives
for all of them in one call where it can): one read per key covers every chunk's slots, so
planning costs the same few pool lookups however many requests stream. The thread that
publishes them holds each read once, its rows left in the pool, and hands each request its
rows' span of it (`PoolRows` the channel's writer copies into the chunk's entry); the reads
are let go once every span was copied or the chunks are cancelled.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from collections.abc import Container, Sequence

import numpy as np
import torch

from prefix_cache.config import HIDDEN_KEY
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import StepHits
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.core.reads import ReadPlanner, RowRead, unwritten_hidden_rows
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError


class StepChunks:
    """Chunk `i` is rows `bounds[i]:bounds[i + 1]` of one read per key of all the chunks'
    slots; it gets a key where it has rows of it (absent mm rows read zeros). Its publisher
    takes the rows of every chunk it publishes before it writes any.

    Invariant: until released, each read pins its slots; released once every span handed
    out was let go, or every chunk cancelled, or when the reads fail."""

    def __init__(self, reads: dict[str, RowRead], bounds: list[int],
                 has_key: dict[str, np.ndarray | None], feat_shapes: dict[str, tuple[int, ...]],
                 planner: ReadPlanner) -> None:
        self._reads = reads
        self._bounds = bounds
        self._has_key = has_key  # None: every chunk has rows of the key
        self._feat_shapes = feat_shapes
        self._planner = planner
        self._lock = threading.Lock()
        self._held: dict[str, torch.Tensor | PoolRows] | None = None
        self._spans_out: set[int] = set()  # spans handed out and not let go yet
        self._open = len(bounds) - 1  # chunks not cancelled yet
        self._released = False
        self._error: BaseException | None = None  # why the reads could not be held

    def rows(self, i: int) -> dict[str, torch.Tensor | PoolRows]:
        """Chunk `i`'s rows per key (the reads held at the first call); raises if they
        cannot be had (a write that failed)."""
        with self._lock:
            if self._error is not None:
                raise OmniPrefixCacheError(f"its rows could not be read: {self._error}") \
                    from self._error
            if self._released:
                raise OmniPrefixCacheError(f"chunk {i}'s rows were let go already")
            if self._held is None:
                self._held = self._hold_all()
            self._spans_out.add(i)
        lo, hi = self._bounds[i], self._bounds[i + 1]
        let_go = functools.partial(self._span_let_go, i)
        return {key: rows.span(lo, hi, let_go) if isinstance(rows, PoolRows) else rows[lo:hi]
                for key, rows in self._held.items()
                if (has := self._has_key[key]) is None or has[i]}

    def _hold_all(self) -> dict[str, torch.Tensor | PoolRows]:
        """Each read held, its rows left in the pool (or gathered by the thread that got to it
        first: its tensor); every read let go if one fails (caller holds the lock)."""
        held: dict[str, torch.Tensor | PoolRows] = {}
        try:
            for key, read in self._reads.items():
                shape = (self._bounds[-1], *self._feat_shapes[key])
                rows = self._planner.hold(read, shape)
                if rows is None:  # another thread's: wait for its tensor
                    self._planner.resolve(read)
                    rows = read.out if read.out.shape == shape else read.out.view(shape)
                held[key] = rows
        except BaseException as exc:
            self._held, self._error = held, exc
            self._release()
            raise
        return held

    def _span_let_go(self, i: int) -> None:
        """Span `i` was copied (once: later calls do nothing); the reads go with the last span
        handed out, so a writer of the engine thread never waits on a put waiting for room."""
        with self._lock:
            if i not in self._spans_out:
                return
            self._spans_out.discard(i)
            if not self._spans_out:
                self._release()

    def cancel(self, i: int) -> None:
        """Chunk `i` is done with (published or dropped); once every one is, the reads are let
        go."""
        with self._lock:
            self._spans_out.discard(i)
            self._open -= 1
            if self._open == 0:
                self._release()

    def _release(self) -> None:
        """Let go of every read: those held, and those not resolved yet (caller holds the
        lock; once)."""
        if self._released:
            return
        self._released = True
        for rows in (self._held or {}).values():
            if isinstance(rows, PoolRows):
                rows.let_go()
        for read in self._reads.values():
            self._planner.cancel(read)


class ChunkRows:
    """Request `req_id`'s chunk, its positions `[start, num_rows)` (`StepChunks`' chunk `index`,
    or, where `error` says why its rows cannot be had, none): what `RowsReadBack` gives."""

    rows_cut = 0

    def __init__(self, req_id: str, start: int, num_rows: int, step: StepChunks | None,
                 index: int, error: str | None = None) -> None:
        self.req_id = req_id
        self.start = start
        self.num_rows = num_rows
        self._step = step
        self._index = index
        self._error = error

    def hold(self) -> dict[str, torch.Tensor | PoolRows]:
        """The rows per key, `[num_rows - start, *feat]`, left in the pool for one writer (its
        copy lets them go); raises naming why where they cannot be had."""
        if self._error is not None:
            raise OmniPrefixCacheError(self._error)
        return self._step.rows(self._index) if self._step is not None else {}

    def cancel(self) -> None:
        """Done with the chunk (once: later calls do nothing)."""
        step, self._step = self._step, None
        if step is not None:
            step.cancel(self._index)


class ChunkSpans:
    """Chunks' positions end to end: chunk `i` is request `req_ids[i]`'s positions
    `[starts[i], ends[i])`, at slots `slots[bounds[i]:bounds[i + 1]]`.

    Invariant: `bounds` starts at 0 and ends at `len(slots)`; a chunk's slots are its own
    positions' (`ends[i] - starts[i]` of them)."""

    def __init__(self, req_ids: list[str], starts: list[int], ends: list[int],
                 slots: np.ndarray) -> None:
        self.req_ids = req_ids
        self.starts = starts
        self.ends = ends
        self.bounds = list(itertools.accumulate(map(operator.sub, ends, starts), initial=0))
        if self.bounds[-1] != len(slots):
            raise OmniPrefixCacheUnmatchError(
                f"plan_chunk_rows: the view gave {len(slots)} slots for the "
                f"{self.bounds[-1]} positions of the chunks of {req_ids}")
        self.slots = slots

    @classmethod
    def joined(cls, chunks: Sequence[tuple[str, int, np.ndarray]]) -> ChunkSpans:
        """Per `(request, first position, slots of its chunk's positions)`, end to end."""
        slots = np.concatenate([s for _, _, s in chunks]) if len(chunks) > 1 \
            else chunks[0][2] if chunks else np.zeros(0, dtype=np.int64)
        return cls([req_id for req_id, _, _ in chunks], [start for _, start, _ in chunks],
                   [start + len(s) for _, start, s in chunks], slots)

    def __len__(self) -> int:
        return len(self.req_ids)

    def with_positions(self) -> ChunkSpans:
        """These chunks but those with no positions."""
        return self if all(map(operator.lt, self.starts, self.ends)) else self.without(())

    def without(self, left_out: Container[int]) -> ChunkSpans:
        """These chunks but those at the indices `left_out` and those with no positions."""
        b = self.bounds
        kept = [i for i in range(len(self)) if i not in left_out and b[i] < b[i + 1]]
        return ChunkSpans([self.req_ids[i] for i in kept], [self.starts[i] for i in kept],
                          [self.ends[i] for i in kept],
                          np.concatenate([self.slots[b[i]:b[i + 1]] for i in kept])
                          if kept else self.slots[:0])


def plan_chunk_rows(pool: PrefixBlockPool, planner: ReadPlanner, deferred: DeferredWriter,
                    lock: threading.Lock, chunks: ChunkSpans) -> dict[str, ChunkRows]:
    """Each chunk (in `chunks`' order), read with the others by one read per key it has rows
    of (present; hidden rows never absent). A chunk with a row lost to a failed write, or a
    position without a hidden row, is left out and fails alone, naming why. Rows still held on
    the device by a deferred write are launched."""
    out: dict[str, ChunkRows] = dict.fromkeys(chunks.req_ids)
    spans = chunks.with_positions()
    if spans is not chunks:
        for req_id, start, end in zip(chunks.req_ids, chunks.starts, chunks.ends):
            if start == end:
                out[req_id] = ChunkRows(req_id, start, end, None, -1)
    if not len(spans):
        return out
    with lock:
        reads, has_key = _plan_reads(pool, planner, spans.slots, spans.bounds, len(spans))
    if _any_unreadable(reads):  # rare: find which chunks, and plan the others alone
        for read in reads.values():
            planner.cancel(read)  # unpins under the lock: not while holding it
        with lock:
            errors = _unreadable_spans(pool, spans)
        for i, cause in errors.items():
            req_id, start = spans.req_ids[i], spans.starts[i]
            out[req_id] = ChunkRows(req_id, start, spans.ends[i], None, -1, cause)
        spans = spans.without(errors)
        if not len(spans):
            return out
        with lock:
            reads, has_key = _plan_reads(pool, planner, spans.slots, spans.bounds, len(spans))
    deferred.flush_tasks([task for read in reads.values() for task in read.producers])
    step = StepChunks(reads, spans.bounds, has_key,
                      {key: pool_key.feat_shape for key, pool_key in pool.keys.items()},
                      planner)
    for index, (req_id, start, end) in enumerate(zip(spans.req_ids, spans.starts, spans.ends)):
        out[req_id] = ChunkRows(req_id, start, end, step, index)
    return out


def _plan_reads(pool: PrefixBlockPool, planner: ReadPlanner, slots: np.ndarray,
                bounds: list[int], count: int
                ) -> tuple[dict[str, RowRead], dict[str, np.ndarray | None]]:
    """One read per key of `slots`, for the `count` chunks `bounds` splits them into, of the
    keys some chunk has rows of, and which chunks have rows of each mm key (None: all; caller
    holds the lock)."""
    hits = StepHits(("",), (len(slots),), slots, np.array((0, len(slots))))
    what = [(f"the chunks of {count} requests", 0)]
    reads: dict[str, RowRead] = {}
    has_key: dict[str, np.ndarray | None] = {}
    for key in pool.keys:
        if key == HIDDEN_KEY:
            has_key[key] = None
        else:  # a chunk gets an mm key where it has rows of it
            has = np.logical_or.reduceat(pool.present(key, slots), bounds[:-1])  # none empty
            if not has.any():
                continue
            has_key[key] = has
        reads[key] = planner.plan_hits(key, hits, what)[0]
    return reads, has_key


def _any_unreadable(reads: dict[str, RowRead]) -> bool:
    """Whether a read failed at planning (a row lost to a failed write), or some position has
    no hidden row."""
    hidden = reads.get(HIDDEN_KEY)
    return any(read.error is not None for read in reads.values()) or (
        hidden is not None and hidden.present is not None and not hidden.present.all())


def _unreadable_spans(pool: PrefixBlockPool, spans: ChunkSpans) -> dict[int, str]:
    """Per chunk that cannot be read, why: the first of a row lost to a failed write and a
    position without a hidden row (caller holds the lock)."""
    slots, bounds = spans.slots, spans.bounds
    errors: dict[int, str] = {}
    for key in pool.keys:
        lost = pool.lost(key, slots)
        if lost.any():
            counts = np.add.reduceat(lost, bounds[:-1])
            for i in np.flatnonzero(counts).tolist():
                start, end = spans.starts[i], spans.ends[i]
                errors.setdefault(i, f"its positions {start}..{end - 1}: "
                                     f"{int(counts[i])} of its rows of {key!r} were lost to a "
                                     f"failed write")
    if HIDDEN_KEY in pool.keys:
        present = pool.present(HIDDEN_KEY, slots)
        for i, start in enumerate(spans.starts):
            if i not in errors and not present[bounds[i]:bounds[i + 1]].all():
                errors[i] = unwritten_hidden_rows(start, present[bounds[i]:bounds[i + 1]])
    return errors
