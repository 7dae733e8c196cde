"""Planned reads: rows of one key, bound at planning time to the writes that produce them.

A read is planned on the engine thread against the pool's current claims, then
resolved by whichever thread gets to it first (the prefetch thread, the caller
of `materialize`, or a writer about to reuse its slots): it waits for its
producer tasks to land and gathers its rows into a tensor of its own. A
request's read at its finish may instead be held: its rows stay in the pool,
pinned, for the channel's writer to read in place.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.ma  # noqa: F401  # np.unique's first call imports it: 8 ms on the engine thread
import torch

from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.hits import StepHits
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.errors import OmniPrefixCacheError
from prefix_cache.core.latch import Latch
from prefix_cache.core.output_buffers import OutputBuffers
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.core.runs import runs_slots
from prefix_cache.core.tasks import TaskState, TaskTable, WriteTask

logger = logging.getLogger(__name__)

#: Reads smaller than this are gathered by their consumer: waking the prefetch
#: thread (and contending with the engine thread for the GIL) costs more.
PREFETCH_MIN_BYTES = 256 << 10

#: `ReadPlanner`'s oldest held claim while no step read is held: above every claim.
NO_HELD_CLAIM = int(np.iinfo(np.int64).max)


def unwritten_hidden_rows(start: int, present: np.ndarray) -> str:
    """Why the positions from `start` whose hidden row is absent (`present` False) cannot be
    read: one wording for a finish's and a chunk's read."""
    missing = np.flatnonzero(~present)
    return (f"hidden rows of {len(missing)} of its positions {start}.."
            f"{start + len(present) - 1} (first {start + int(missing[0])}) were never written")


class ReadState(enum.Enum):
    PLANNED = "PLANNED"
    RESOLVING = "RESOLVING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class RowRead:
    """`out[:len(slots)]` = rows of `key` at `slots`, absent rows zero; `out` has `num_rows`
    rows of `width` and is allocated (from `OutputBuffers`) by the thread that resolves it.

    Invariant: while PLANNED or RESOLVING it holds its rows (see ReadPlanner), so no
    write claims its slots and the rows it gathers, or a writer reads in place while it is
    held (`hold`), are the ones it was planned on.
    """

    def __init__(self, what: str, key: str, slots: np.ndarray | Callable[[], np.ndarray],
                 present: np.ndarray | None, producers: list[WriteTask], num_rows: int,
                 width: int, dtype: torch.dtype, *, claim: int | None = None) -> None:
        self.what = what
        self.key = key
        self._slots = slots  # or what builds them, called by the first thread that needs them
        self.present = present  # None: every row is present
        self.claim = claim  # a step's read: the claim its step wrote the rows under
        self.producers = producers
        self.out_shape = (num_rows, width)
        self.dtype = dtype
        self.out: torch.Tensor | None = None  # set once DONE
        self.held: PoolRows | None = None  # set when `hold` claims it
        self.state = ReadState.PLANNED
        self.error: BaseException | None = None
        self.done = Latch()
        self._lock = threading.Lock()

    @property
    def slots(self) -> np.ndarray:
        if callable(self._slots):
            self._slots = self._slots()
        return self._slots

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.out_shape[1] * self.dtype.itemsize

    def describe(self) -> str:
        return f"read of {self.key!r} for {self.what} ({self.state.value})"

    def resolve(self, pool: PrefixBlockPool, outputs: OutputBuffers, timeout_s: float,
                release: Callable[[RowRead], None]) -> None:
        """Gather the rows (or wait for the thread doing it), then `release` them; raise if
        they cannot be had."""
        if not self._claim():
            self._wait(timeout_s)
            return
        self._resolve_claimed(pool, outputs, timeout_s, release)
        self._raise_if_failed()

    def _resolve_claimed(self, pool: PrefixBlockPool, outputs: OutputBuffers, timeout_s: float,
                         release: Callable[[RowRead], None]) -> None:
        """Wait for the producers and gather the rows of a read this thread claimed (see
        `_gather_claimed`) into a tensor of its own."""
        self._gather_claimed(timeout_s, release, lambda: self._gather(pool, outputs))

    def _gather_claimed(self, timeout_s: float, release: Callable[[RowRead], None],
                        gather: Callable[[], None]) -> None:
        """Wait for the producers of a read this thread claimed, then `gather` its rows; it
        ends DONE, or FAILED with the error its consumer raises, the rows released either way."""
        try:
            for task in self.producers:
                task.wait(timeout_s)
            gather()
        except BaseException as exc:
            self._end(ReadState.FAILED, release, exc)
        else:
            self._end(ReadState.DONE, release)

    def gather_parts(self, pool: PrefixBlockPool, timeout_s: float,
                     release: Callable[[RowRead], None],
                     parts: Sequence[tuple[int, int, torch.Tensor]]) -> bool:
        """Gather the rows `lo..hi - 1` of a read of rows all present (a step's own) straight
        into each part's tensor, with no tensor of the read's; False, nothing gathered, where
        another thread claimed the read first (its `out` then holds every row). Raises if the
        rows cannot be had; they are released either way."""
        if not self._claim():
            return False
        self._gather_claimed(timeout_s, release, lambda: pool.gather_parts(
            self.key, np.concatenate([self.slots[lo:hi] for lo, hi, _ in parts]),
            [target for _, _, target in parts]))
        self._raise_if_failed()
        return True

    def hold(self, pool: PrefixBlockPool, shape: tuple[int, ...], timeout_s: float,
             release: Callable[[RowRead], None]) -> PoolRows | None:
        """Claim the read and wait for its producers, leaving its rows in the pool for a writer
        to read in place: they are held (RESOLVING) until their `let_go`, which ends the read
        DONE without `out`, or until a writer of their slots moves them out (`free_slots`).
        None where another thread resolves it (`resolve` then waits for its tensor). Raises if
        the rows cannot be had. For reads of hit rows alone (`shape`: theirs,
        `(len(slots), *feat)`)."""
        slots = self.slots if self.present is None else np.where(self.present, self.slots, -1)
        rows = PoolRows(pool.keys[self.key].storage.byte_rows,
                        np.ascontiguousarray(slots, dtype=np.int64), shape, self.dtype,
                        functools.partial(self._end, ReadState.DONE, release))
        if not self._claim(rows):
            return None
        try:
            for task in self.producers:
                task.wait(timeout_s)
        except BaseException as exc:  # raised even where `free_slots` ended the read first
            self._end(ReadState.FAILED, release, exc)
            raise OmniPrefixCacheError(f"{self.describe()}: {exc}") from exc
        return rows

    def free_slots(self, pool: PrefixBlockPool, outputs: OutputBuffers, timeout_s: float,
                   release: Callable[[RowRead], None]) -> None:
        """Before a writer claims this read's slots: its rows gathered (copy-on-write), or,
        held for a writer reading them in place, moved out of the pool for it, so the read
        holds the slots no more. Never waits for the holder's writer, only for a copy under way
        and for the read's producers; raises if the rows still sit there after `timeout_s`
        (the write must not go on over them)."""
        if self._claim():
            self._resolve_claimed(pool, outputs, timeout_s, release)  # a failure is the consumer's
            return
        if (held := self.held) is not None:
            for task in self.producers:
                try:
                    task.wait(timeout_s)
                except OmniPrefixCacheError as exc:
                    if task.state is not TaskState.FAILED:
                        raise  # still landing: its rows are not all there to move
                    self._end(ReadState.FAILED, release, exc)  # `hold` raises it: nobody
                    return  # reads these rows
            if not held.evict(timeout_s):
                raise OmniPrefixCacheError(
                    f"{self.describe()}: its rows were still being copied out of the pool "
                    f"after {timeout_s:.1f}s, so their slots cannot be written yet")
            self._end(ReadState.DONE, release)
            return
        if not self.done.wait(timeout_s):  # another thread gathers them
            raise OmniPrefixCacheError(f"{self.describe()} still held its rows after "
                                       f"{timeout_s:.1f}s, so their slots cannot be written yet")

    def _claim(self, held: PoolRows | None = None) -> bool:
        """Whether this thread resolves the read (PLANNED -> RESOLVING); `held`: the rows it
        leaves in the pool for a writer (`hold`), recorded with the claim."""
        with self._lock:
            mine = self.state is ReadState.PLANNED
            if mine:
                self.state, self.held = ReadState.RESOLVING, held
        return mine

    def _end(self, state: ReadState, release: Callable[[RowRead], None],
             error: BaseException | None = None) -> None:
        """RESOLVING -> `state` (DONE or FAILED with `error`), the rows released and waiters
        woken; once: a later call does nothing."""
        with self._lock:
            if self.state is not ReadState.RESOLVING:
                return
            self.error, self.state = error, state
        self.producers = []
        release(self)
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """A read that cannot be served, failed before it holds anything: resolving it raises
        `error`."""
        self.error = error
        self.state = ReadState.FAILED
        self.done.set()

    def cancel(self, release: Callable[[RowRead], None]) -> None:
        """Drop a read nobody will consume; a read already being resolved finishes on its own."""
        with self._lock:
            if self.state is not ReadState.PLANNED:
                return
            self.state = ReadState.CANCELLED
        self.producers = []
        release(self)
        self.done.set()

    def _wait(self, timeout_s: float) -> None:
        waiting_on = [t.describe() for t in self.producers]
        if not self.done.wait(timeout_s):
            raise OmniPrefixCacheError(f"{self.describe()} not resolved within {timeout_s:.1f}s"
                                       f"; waiting on {waiting_on or 'the pool gather'}")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.state is ReadState.FAILED:
            raise OmniPrefixCacheError(f"{self.describe()}: {self.error}") from self.error
        if self.state is ReadState.CANCELLED:
            raise OmniPrefixCacheError(f"{self.describe()} was cancelled")

    def _gather(self, pool: PrefixBlockPool, outputs: OutputBuffers) -> None:
        n = len(self.slots)
        complete = self.present is None or bool(self.present.all())
        out = outputs.empty(self.out_shape, self.dtype, zeroed=not complete)
        target = out if n == self.out_shape[0] else out[:n]  # a step's own rows: all of out
        if complete:
            pool.gather(self.key, self.slots, target)
        elif self.present.any():
            rows = np.flatnonzero(self.present)
            part = torch.empty((len(rows), target.shape[1]), dtype=target.dtype)
            pool.gather(self.key, self.slots[rows], part)
            target.index_copy_(0, torch.from_numpy(rows), part)
        self.out = out


class Prefetcher:
    """A thread that resolves reads in the order they were planned, ahead of `materialize`."""

    def __init__(self, pool: PrefixBlockPool, outputs: OutputBuffers, timeout_s: float,
                 release: Callable[[RowRead], None]) -> None:
        self._pool = pool
        self._outputs = outputs
        self._timeout_s = timeout_s
        self._release = release
        self._queue: queue.SimpleQueue[RowRead | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-prefix-cache-prefetch",
                                        daemon=True)
        self._thread.start()

    def submit(self, read: RowRead) -> None:
        self._queue.put(read)

    def _run(self) -> None:
        while (read := self._queue.get()) is not None:
            try:
                read.resolve(self._pool, self._outputs, self._timeout_s, self._release)
            except OmniPrefixCacheError:
                pass  # kept on the read; its consumer raises it
            except BaseException:
                logger.exception("prefix cache prefetch: %s", read.describe())

    def close(self, timeout_s: float) -> bool:
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class ReadPlanner:
    """Reads planned on the engine thread against the pool's current claims.

    Invariant: an unresolved read holds its rows. A hit read pins its slots (a
    slot's pin count equals the hit reads covering it); a step's reads are held
    under the claim the step wrote its rows with, which their slots keep until a
    later write claims them. A writer about to claim slots first resolves every
    read holding rows there (copy-on-write), so no read ever returns another
    tenant's rows. Callers hold the cache's table lock where a method says so.
    """

    def __init__(self, pool: PrefixBlockPool, tasks: TaskTable, lock: threading.Lock,
                 timeout_s: float, output_cache_bytes: int) -> None:
        self._pool = pool
        #: what resolved reads write into: the caller's tensors, recycled once dropped
        self.outputs = OutputBuffers(output_cache_bytes)
        self._tasks = tasks
        self._lock = lock
        self._timeout_s = timeout_s
        self._pinned: set[RowRead] = set()  # hit reads
        #: a step's claim -> its unresolved reads, in claim order
        self._by_claim: dict[int, list[RowRead]] = {}
        self._prefetcher = Prefetcher(pool, self.outputs, timeout_s, self.release)
        self.copy_on_write_reads = 0

    def plan_step(self, step_id: int, keys: Iterable[str], slots: Callable[[], np.ndarray],
                  n: int, claim: int, task: WriteTask | None) -> dict[str, RowRead]:
        """Reads of the `n` rows a step writes under `claim` (at the slots `slots()` gives),
        bound to its write (caller holds the lock); O(keys), whatever the step's size."""
        reads = {key: RowRead(f"step {step_id}", key, slots, None, [task] if task else [], n,
                              self._pool.keys[key].row_width, self._pool.keys[key].dtype,
                              claim=claim)
                 for key in keys}
        if reads:
            self._by_claim[claim] = list(reads.values())
        return reads

    def plan_hits(self, key: str, hits: StepHits, planned: Sequence[tuple[str, int]]
                  ) -> list[RowRead]:
        """Per hit, with its `(what, more_rows)` in `planned`, a read of `key`'s rows at its hit
        slots into a tensor with `more_rows` rows after them (the step's own), bound to the
        writes producing them; the pool is looked up once for all of them (caller holds the
        lock)."""
        pool_key = self._pool.keys[key]
        bounds = hits.bounds
        present, lost, producers = self._pool.row_states(key, hits.slots)
        any_lost = bool(lost.any())
        # each hit's producers: the distinct (hit, producer) pairs of its present rows
        producer_ids: list[set[int]] = [set() for _ in planned]
        if len(hits) == 1:  # one hit (a step's chunks read together): its rows' producers
            producer_ids[0].update((np.unique(producers) if len(producers) > 256
                                    else producers).tolist())
        elif len(producers):
            hit_of_row = np.repeat(np.arange(len(hits)), np.diff(bounds))[present]
            span = int(producers.max()) + 1
            for pair in np.unique(hit_of_row * span + producers).tolist():
                producer_ids[pair // span].add(pair % span)
        reads, pinned = [], []
        for (what, more_rows), lo, hi, ids in zip(planned, bounds[:-1].tolist(),
                                                  bounds[1:].tolist(), producer_ids):
            slots = hits.slots[lo:hi]
            read = RowRead(what, key, slots, present[lo:hi], [], len(slots) + more_rows,
                           pool_key.row_width, pool_key.dtype)
            # absent mm rows read zeros; lost rows (a write that failed since the step's hits
            # were checked) are no absence: the read fails, as one of a producer failing later
            # does
            if any_lost and (lost_here := lost[lo:hi]).any():
                read.fail(OmniPrefixCacheError(
                    f"{int(lost_here.sum())} of its hit rows (first slot "
                    f"{int(slots[lost_here][0])}) were lost to a failed write"))
            else:
                read.producers = self._tasks.live(ids)
                pinned.append(read)
            reads.append(read)
        if pinned:  # their slots pinned in one pass (a slot two hits share counts twice)
            self._pool.pin(hits.slots if len(pinned) == len(reads)
                           else np.concatenate([read.slots for read in pinned]))
            self._pinned.update(pinned)
        return reads

    def prefetch(self, reads: Iterable[RowRead]) -> None:
        """Resolve the large ones ahead of their consumer, on the prefetch thread."""
        for read in reads:
            if read.nbytes >= PREFETCH_MIN_BYTES:
                self._prefetcher.submit(read)

    def resolve(self, read: RowRead) -> None:
        read.resolve(self._pool, self.outputs, self._timeout_s, self.release)

    def resolve_parts(self, read: RowRead, parts: Sequence[tuple[int, int, torch.Tensor]]
                      ) -> None:
        """`read`'s rows `lo..hi - 1` into each part's tensor: gathered there from the pool
        where this thread claims the read, else copied out of the tensor of the thread that
        resolved it (a writer's copy-on-write)."""
        if read.gather_parts(self._pool, self._timeout_s, self.release, parts):
            return
        self.resolve(read)
        for lo, hi, target in parts:
            target.copy_(read.out[lo:hi])

    def hold(self, read: RowRead, shape: tuple[int, ...]) -> PoolRows | None:
        return read.hold(self._pool, shape, self._timeout_s, self.release)

    def cancel(self, read: RowRead) -> None:
        read.cancel(self.release)

    def drop(self, read: RowRead) -> None:
        """Let go of a read nobody will consume, at once: a planned one is cancelled; one that
        another thread is gathering goes on into its own tensor, which nobody reads, but holds
        its rows no more, so no writer waits for it (what it copies of rows overwritten
        meanwhile is never handed out). Not for a read held for a writer (`hold`): its rows are
        read in place, so it is only cancelled."""
        read.cancel(self.release)
        if read.held is None:
            self.release(read)

    def release(self, read: RowRead) -> None:
        """A resolved or cancelled read no longer holds its rows."""
        with self._lock:
            if read in self._pinned:
                self._pinned.discard(read)
                self._pool.unpin(read.slots)
            elif (held := self._by_claim.get(read.claim)) is not None and read in held:
                held.remove(read)
                if not held:
                    del self._by_claim[read.claim]

    def resolve_conflicts(self, runs: np.ndarray) -> None:
        """Before a write claims the slots of `runs`, free every read still holding rows there
        (`RowRead.free_slots`; raises where one cannot be, and the write must not go on); one
        pass over the runs when none does."""
        with self._lock:
            if not (self._by_claim or self._pinned) or not self._pool.any_held(
                    runs, self._oldest_held_claim(), pins=bool(self._pinned)):
                return
            slots = runs_slots(runs)
            conflicts = self._step_reads_at(slots)
            if self._pool.any_pinned(slots):
                claimed = np.zeros(self._pool.num_slots, dtype=bool)
                claimed[slots] = True
                conflicts += [r for r in self._pinned if claimed[r.slots].any()]
        if not conflicts:
            return
        self.copy_on_write_reads += len(conflicts)
        with keeping_tensors():  # the outputs go to the read's consumer, then back to reuse
            for read in conflicts:
                read.free_slots(self._pool, self.outputs, self._timeout_s, self.release)

    def close(self) -> None:
        """Stop the prefetch thread, cancel every read still planned, drop the free outputs."""
        self._prefetcher.close(self._timeout_s)
        with self._lock:
            reads = [*self._pinned, *(r for held in self._by_claim.values() for r in held)]
        for read in reads:
            self.cancel(read)
        self.outputs.clear()

    def _oldest_held_claim(self) -> int:
        """The oldest claim holding step reads (none: past every claim); `_by_claim` is
        filled in claim order, so it is the first."""
        return next(iter(self._by_claim), NO_HELD_CLAIM)

    def _step_reads_at(self, slots: np.ndarray) -> list[RowRead]:
        """The unresolved step reads whose rows sit at some of `slots`: those held under a
        claim the slots still carry (caller holds the lock)."""
        if not self._by_claim or not len(slots):
            return []
        claims = self._pool.claims_at(slots)
        held = np.unique(claims[claims >= self._oldest_held_claim()]).tolist()
        return [read for claim in held for read in self._by_claim.get(claim, ())]
