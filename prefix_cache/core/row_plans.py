"""Where each live request stands, and the plans of its rows read back from the pool from there.

A request's progress is the positions its steps reach: set where a step (re)starts it (new, or
resumed after preemption) at the tokens vLLM found computed, advanced by every step's scheduled
tokens, dropped at its finish (a step of running requests only, the common decode step, is one
C call on the C step path, `running_step`, its new blocks tracked or not). A (re)start
computed past its progress is the step's prefix hit. From the progress, on the engine thread
while the view holds the request's blocks, the rows are planned: a request's at its finish
(`request_rows`), a streaming stage's chunks (`chunk_rows`), and the step's hits that earlier
steps wrote (`hit_rows`, which needs the blocks vLLM gives new tenants tracked from the first
step: `track_allocations`); a step's chunks take all their requests' slots from the view in
one call where it offers that. The reads themselves are built by `request_reads` and
`chunk_reads`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from prefix_cache.config import HIDDEN_KEY, PrefixCacheConfig
from prefix_cache.core import _core
from prefix_cache.core.adapter import RUNNING_ONLY, StepEvents, allocated_blocks
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.chunk_reads import ChunkRows, ChunkSpans, plan_chunk_rows
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import NO_HITS, StepHits
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.layout import GroupView
from prefix_cache.core.reads import ReadPlanner
from prefix_cache.core.request_reads import RequestRows, plan_request_rows
from prefix_cache.core.runs import runs_slots
from prefix_cache.core.step_table import PendingStep
from prefix_cache.errors import OmniPrefixCacheUnmatchError


class RowPlans:
    """The engine thread's row plans by request, from each live request's progress.

    Invariant: a live request's progress is the positions its steps reach, the step under way's
    included once it started; a finished request has none."""

    def __init__(self, config: PrefixCacheConfig, group_id: int, view: GroupView,
                 pool: PrefixBlockPool, planner: ReadPlanner, deferred: DeferredWriter,
                 lock: threading.Lock) -> None:
        self._block_size = config.block_size
        self._num_blocks = config.num_blocks
        self._group_id = group_id
        self._view = view
        self._pool = pool
        self._planner = planner
        self._deferred = deferred
        self._lock = lock
        self._progress: dict[str, int] = {}  # live request -> positions its steps reach
        self._tracks_allocations = False  # see track_allocations
        self._c_path = config.step_path == "c"

    def __len__(self) -> int:
        """The live requests."""
        return len(self._progress)

    def track_allocations(self, started: bool) -> None:
        """Note the blocks vLLM gives new tenants from the first step on (`started`: too late)."""
        if started:
            raise OmniPrefixCacheUnmatchError(
                "track_allocations called after the first step: the blocks allocated before it "
                "are unknown")
        self._tracks_allocations = True

    def note_allocations(self, scheduler_output: Any, events: StepEvents) -> None:
        """Where tracked, mark the blocks vLLM gave new tenants in the step starting; before
        its block copies claim (a claim made after counts as the new tenant's)."""
        if self._tracks_allocations and (allocated := allocated_blocks(
                scheduler_output, events, self._block_size, self._group_id)):
            with self._lock:
                self._pool.mark_allocated(np.asarray(allocated, dtype=np.int64))

    def running_step(self, scheduler_output: Any) -> dict[str, int] | None:
        """On the C step path, a step that only schedules running requests (the common decode
        step) in one call (`_core.running_step`): its scheduled tokens, its requests' progress
        advanced by them, and, where tracked, the new blocks vLLM gave them marked; None,
        nothing changed, for any other step and on the Python path."""
        if not self._c_path:
            return None
        # a running request's new blocks, found before anything changes (a step of others
        # finds them again with the rest)
        allocated = allocated_blocks(scheduler_output, RUNNING_ONLY, self._block_size,
                                     self._group_id) if self._tracks_allocations else None
        scheduled = _core.running_step(scheduler_output, self._progress)
        if scheduled is not None and allocated:
            with self._lock:
                self._pool.mark_allocated(np.asarray(allocated, dtype=np.int64))
        return scheduled

    def finish(self, req_id: str) -> None:
        """`req_id` finished: it stands nowhere."""
        self._progress.pop(req_id, None)

    def step_hits(self, events: StepEvents) -> StepHits:
        """The starting step's prefix hits (their slots checked), its requests' progress then
        advanced by it."""
        restarts = events.started + events.resumed_starts
        hits = [(new.req_id, new.num_computed_tokens, new.block_ids) for new in restarts
                # a miss; or a live request whose rows up to h were handed over
                if new.num_computed_tokens > self._progress.get(new.req_id, 0)]
        step_hits = StepHits.of_blocks(hits, self._block_size, self._num_blocks) if hits \
            else NO_HITS
        for new in restarts:
            self._progress[new.req_id] = new.num_computed_tokens
        _core.add_counts(self._progress, events.num_scheduled_tokens)
        return step_hits

    def request_rows(self, requests: Mapping[str, int | None],
                     starts: Mapping[str, int]) -> dict[str, RequestRows]:
        """`OmniPrefixCacheManager.plan_request_rows`: each request's deferred rows launched
        first."""
        planned = self._positions_slots("plan_request_rows", requests, starts)
        with keeping_tensors():  # a deferred write's launch: the request's, or one it hit
            for req_id in requests:
                self._deferred.retire(req_id)
            return plan_request_rows(self._pool, self._planner, self._deferred, self._lock,
                                     planned)

    def chunk_rows(self, chunks: Mapping[str, tuple[int, int]]) -> dict[str, ChunkRows]:
        """`OmniPrefixCacheManager.plan_chunk_rows`."""
        # no tensor is made here but by the launch of a deferred write the chunks read,
        # which keeps its own (leaving vLLM's inference mode costs tens of µs after a forward)
        return plan_chunk_rows(self._pool, self._planner, self._deferred, self._lock,
                               self._chunk_spans(chunks))

    def _chunk_spans(self, chunks: Mapping[str, tuple[int, int]]) -> ChunkSpans:
        """Each chunk's positions `[start, end)` cut to where its request stands (none where
        it stands behind `start`) and their slots, those of requests the view holds: in one
        call where the view gives every request's at once (`requests_positions_runs`), else a
        request at a time (`_positions_slots`, the reference)."""
        all_runs = getattr(self._view, "requests_positions_runs", None)
        if all_runs is not None:
            req_ids, starts = list(chunks), [start for start, _ in chunks.values()]
            stands = [self._stands(req_id, start, end) for req_id, (start, end) in chunks.items()]
            runs = all_runs(req_ids, starts, stands)
            if runs is not None:
                return ChunkSpans(req_ids, starts, stands, runs_slots(runs))
        planned = self._positions_slots(
            "plan_chunk_rows", {req_id: end for req_id, (_, end) in chunks.items()},
            {req_id: start for req_id, (start, _) in chunks.items()})
        return ChunkSpans.joined([(req_id, start, slots) for req_id, start, slots, _ in planned])

    def _positions_slots(self, call: str, ends: Mapping[str, int | None],
                         starts: Mapping[str, int]) -> list[tuple[str, int, np.ndarray, int]]:
        """Per request the view holds: its first position (`starts`, else 0), the slots of its
        positions from there to its end (None: all its saved steps reached; never past them,
        so none where they stand behind its start), and how many positions its saved steps
        computed past that end."""
        positions_runs = getattr(self._view, "request_positions_runs", None)
        if positions_runs is None:
            raise OmniPrefixCacheUnmatchError(
                f"{call}: view {type(self._view).__name__} cannot give a request's positions "
                f"(it lacks request_positions_runs)")
        planned = []
        for req_id, end in ends.items():
            start = starts.get(req_id, 0)
            stands = self._stands(req_id, start, end)
            runs = positions_runs(req_id, stands, start)
            if runs is not None:
                planned.append((req_id, start, runs_slots(runs),
                                max(self._progress.get(req_id, 0) - stands, 0)))
        return planned

    def _stands(self, req_id: str, start: int, end: int | None) -> int:
        """Where `req_id`'s rows from `start` reach: its progress, cut at `end` (None: not
        cut), and never behind `start` (a request recomputed after preemption may stand behind
        where its chunks reached: it has no rows past them yet)."""
        n = self._progress.get(req_id, 0)
        return max(n if end is None else min(n, end), start)

    def hit_rows(self, step: PendingStep | None) -> dict[str, RequestRows]:
        """`OmniPrefixCacheManager.plan_hit_rows` of the step under way (None: none is); the
        requests planned are handed over (`step.handed_over`): the step reads them no more."""
        if not self._tracks_allocations:
            raise OmniPrefixCacheUnmatchError(
                "plan_hit_rows needs track_allocations() before the first step: without it, a "
                "block vLLM gave a new tenant in this step would read as its former tenant's")
        if step is None:
            raise OmniPrefixCacheUnmatchError(
                "plan_hit_rows called outside a step: call it after new_step_starts")
        hits = step.hits
        if not len(hits):
            return {}
        with self._lock:
            written = self._pool.written_since_allocated(hits.slots)
            if HIDDEN_KEY in self._pool.keys:  # never absent (see plan_request_rows)
                written &= self._pool.present(HIDDEN_KEY, hits.slots)
        whole = np.logical_and.reduceat(written, hits.bounds[:-1])
        planned = [(req_id, 0, hits.slots_of(i), 0) for i, req_id in enumerate(hits.req_ids)
                   if whole[i]]
        if not planned:
            return {}
        with keeping_tensors():  # a live request's deferred write a hit shares is launched
            rows = plan_request_rows(self._pool, self._planner, self._deferred, self._lock,
                                     planned, "the prefix hit")
        step.handed_over = frozenset(rows)
        for req_id in rows:  # gathers the step's start began: the step reads them no more
            for read in step.gathered.pop(req_id, {}).values():
                self._planner.drop(read)
        return rows
