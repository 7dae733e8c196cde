"""A saved step's reads: planned when it is saved, assembled by `materialize`, released once.

A step's record lives from `save_outputs` until exactly one `materialize` or
`discard_step` consumes it. Its reads hold their rows until resolved (see
`ReadPlanner`); assembling puts each request's hit rows before its step rows, per key.
A hit's reads are planned earlier, at the step's start (`gather_hits`), so the large ones
are gathered while the forward runs and `materialize` normally finds them done; its save
takes them over, or drops those its own write would make stale (`keep_gathers`). A stage
that reads its rows back at the finish (steps saved with `plan_reads=False`) gathers none from
its second step on: a step's start follows the last save's choice.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from prefix_cache.config import HIDDEN_KEY
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import StepHits, blocks_written
from prefix_cache.core.host_copies import HostCopy
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.outputs import map_tensors
from prefix_cache.core.reads import ReadPlanner, RowRead
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.tasks import TaskState, WriteTask


class StageCacheOutputs(NamedTuple):
    """What `materialize` hands the next stage; every tensor is a CPU tensor the caller owns."""

    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, torch.Tensor]]
    leftover: dict[str, Any]


class StepRows(NamedTuple):
    """A saved step's rows on the host, each tensor the caller's: per key, `[rows, *feat]` in
    the step's row order (request `order[i]` has rows `ends[i-1]:ends[i]`: every request of
    the step, or, for `materialize`, those without a prefix hit); per request with a prefix
    hit, its rows from position 0 per key (its hit rows, then its step rows)."""

    order: list[str]
    ends: list[int]
    rows: dict[str, torch.Tensor]
    hits: dict[str, dict[str, torch.Tensor]]
    leftover: dict[str, Any]

    def spans(self) -> dict[str, tuple[int, int]]:
        """Each request's row range in the step."""
        return dict(zip(self.order, zip([0, *self.ends[:-1]], self.ends)))

    def per_request(self, req_ids: Iterable[str], with_hidden: bool) -> StageCacheOutputs:
        """Each of `req_ids`' rows from position 0 per key (a hit's keys are its own); the
        hidden states None unless `with_hidden`."""
        spans = self.spans()
        hidden: dict[str, torch.Tensor] = {}
        mm: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self.rows if k != HIDDEN_KEY}
        for req_id in req_ids:
            rows = self.hits.get(req_id)
            if rows is None:
                start, end = spans[req_id]
                rows = {key: value[start:end] for key, value in self.rows.items()}
            for key, value in rows.items():
                if key == HIDDEN_KEY:
                    hidden[req_id] = value
                else:
                    mm.setdefault(key, {})[req_id] = value
        return StageCacheOutputs(hidden if with_hidden else None, mm, self.leftover)


@dataclass
class StepRecord:
    """A saved step until it is materialized or discarded (consumed exactly once)."""

    step_id: int
    staging_slot: int
    layout: StepLayout                                  # row range and slot of every row
    per_token: dict[str, tuple[int, ...]]               # key -> feature shape, hidden first
    step_reads: dict[str, RowRead]                      # immediate key -> all rows of the step
    host_rows: dict[str, HostCopy]                      # deferred key -> this step's rows
    hit_reads: dict[str, dict[str, RowRead]]            # req -> key -> [hit + step rows]
    leftover: dict[str, Any]                            # unsplit, each tensor a HostCopy
    readable: bool = True                               # False: no reads planned, discard only

    def reads(self) -> Iterable[RowRead]:
        yield from self.step_reads.values()
        for per_key in self.hit_reads.values():
            yield from per_key.values()


class StepReads:
    """Plans a saved step's reads and assembles them into the next stage's outputs."""

    def __init__(self, pool: PrefixBlockPool, reads: ReadPlanner, deferred: DeferredWriter,
                 staging: StagingPool, lock: threading.Lock, stats: CacheStats,
                 timeout_s: float) -> None:
        self._pool = pool
        self._reads = reads
        self._deferred = deferred
        self._staging = staging
        self._lock = lock
        self._stats = stats
        self._timeout_s = timeout_s

    def gather_hits(self, hits: StepHits, num_scheduled_tokens: Mapping[str, int]
                    ) -> dict[str, dict[str, RowRead]]:
        """At the step's start, each hit's reads of every key the pool has rows of at its hit
        slots, into tensors with room for the request's scheduled rows after the hit's (the
        tensors `materialize` hands out), bound to the writes producing them; the large ones
        are gathered on the prefetch thread while the forward runs. Nothing here waits.

        Their rows stay as they are until the gather: the reads pin their slots (a writer
        resolves a pinned read before it claims them, see `ReadPlanner`). A hit's blocks are
        its request's, full and cached, so no step writes them while it holds them, but for
        one: a block vLLM cached at scheduling, which the step's own forward computes (its
        slots hold another tenant's rows, or none, until then). `keep_gathers` drops such
        reads before the step claims its slots, and `plan` reads those hits after the claim.
        A capped pool's moves are applied before the step is seen (`PoolStep`), so these read
        the pool blocks the step's hits hold, and one is evicted only once no request holds
        its KV block. So a block under a gather is written again only where, before this step
        was materialized, its request finished or was preempted and a later step gave the
        block a new tenant (its write, or a capped pool's eviction for it), or a block copy
        (`BlockCopyMirror`) lands on it; each such write resolves the pinned read first
        (copy-on-write: it waits for a gather under way, bounded), so no gather ever reads rows
        being overwritten."""
        planned = [(f"request {req_id}'s prefix hit", num_scheduled_tokens.get(req_id, 0))
                   for req_id in hits.req_ids]
        with self._lock:
            reads = self._plan_hit_reads(hits, planned, {}, {})
        try:
            self._start(reads)
        except BaseException:
            self.drop_gathers(reads)
            raise
        return reads

    def keep_gathers(self, gathered: dict[str, dict[str, RowRead]], layout: StepLayout,
                     served: StepHits) -> dict[str, dict[str, RowRead]]:
        """Of the reads `gather_hits` planned at the step's start, those that read what the
        step's hits are served (`served`: the hits the step reads): those on no block the step
        writes (see `gather_hits`; such a read may have gathered already, its rows unpinned).
        The others are dropped (`plan` reads their hits after the step's claim). Each has room
        for its request's rows in the step: the step's layout has its scheduled tokens' rows.
        Before the step claims its slots."""
        if not gathered:
            return {}
        index = {req_id: i for i, req_id in enumerate(served.req_ids)}
        rewritten: list[bool] = []  # per served hit: whether the step writes a block of it
        if gathered.keys() & index.keys():
            bs = self._pool.block_size  # a hit's slots are whole blocks
            rewritten = np.logical_or.reduceat(
                blocks_written(layout.runs, served.slots[::bs] // bs, bs),
                served.bounds[:-1] // bs).tolist()
        kept = {}
        for req_id, per_key in gathered.items():
            i = index.get(req_id)
            if i is not None and not rewritten[i]:
                kept[req_id] = per_key
                continue
            for read in per_key.values():
                self._reads.drop(read)
        return kept

    def drop_gathers(self, gathered: dict[str, dict[str, RowRead]]) -> None:
        """Let go of reads `gather_hits` planned for a step that will not read them."""
        for per_key in gathered.values():
            for read in per_key.values():
                self._reads.drop(read)

    def plan(self, record: StepRecord, immediate: Iterable[str], claim: int,
             task: WriteTask | None, hits: StepHits,
             gathered: dict[str, dict[str, RowRead]]) -> None:
        """Bind this step's and its hits' reads (`hits`: those of requests in the step) to the
        writes producing them; they hold their rows until resolved (see ReadPlanner). A hit's
        reads that `gather_hits` planned at the step's start (`gathered`, kept by
        `keep_gathers`) are taken over; the others are planned now, after the step's claim."""
        layout = record.layout
        fresh: dict[str, dict[str, RowRead]] = {}
        with self._lock:
            record.step_reads = self._reads.plan_step(
                record.step_id, immediate, lambda: layout.slots, layout.num_rows, claim, task)
            if hits:
                planned = []
                for req_id in hits.req_ids:
                    start, end = layout.rows(req_id)
                    planned.append((f"request {req_id} step {record.step_id}", end - start))
                for req_id, per_key in gathered.items():  # named for the step, as planned ones
                    for read in per_key.values():
                        read.what = f"request {req_id} step {record.step_id}"
                fresh = self._plan_hit_reads(hits, planned, record.per_token, gathered)
                record.hit_reads = {req_id: {**gathered.get(req_id, {}), **fresh[req_id]}
                                    for req_id in hits.req_ids}
        self._start(fresh)

    def _start(self, reads: Mapping[str, Mapping[str, RowRead]]) -> None:
        """Hit reads just planned: the deferred writes holding their rows on the device go out
        now (a step read's producer is its step's write, launched already), and the large ones
        are gathered on the prefetch thread (random blocks; the step's own rows are gathered by
        their consumer, off the engine thread either way)."""
        hit_reads = [read for per_key in reads.values() for read in per_key.values()]
        if open_writes := [task for read in hit_reads for task in read.producers
                           if task.state is TaskState.PENDING]:
            with keeping_tensors():  # their launch makes tensors the cache keeps
                self._deferred.flush_tasks(open_writes)
        self._reads.prefetch(hit_reads)

    def _plan_hit_reads(self, hits: StepHits, planned: Sequence[tuple[str, int]],
                        emitted: Mapping[str, Any],
                        planned_before: Mapping[str, Mapping[str, RowRead]]
                        ) -> dict[str, dict[str, RowRead]]:
        """Per hit (`planned`: its read's name and the step's rows after its hit rows), its
        reads of every key `emitted` and of every other per-token key the pool has rows of at
        its hit slots (a cached image's rows when the new tokens are text; the step's rows of a
        key it does not emit read zeros), but those in `planned_before`. One pool lookup per
        key for the whole step (caller holds the lock)."""
        reads: dict[str, dict[str, RowRead]] = {req_id: {} for req_id in hits.req_ids}
        for key in [*emitted, *(k for k in self._pool.keys if k not in emitted)]:
            todo = [i for i, req_id in enumerate(hits.req_ids)
                    if key not in planned_before.get(req_id, ())]
            if todo and key not in emitted:  # read only by hits on rows of it
                chosen = hits.select(todo)
                has_rows = np.logical_or.reduceat(self._pool.present(key, chosen.slots),
                                                  chosen.bounds[:-1])
                todo = [i for i, has in zip(todo, has_rows.tolist()) if has]
            if todo:
                for i, read in zip(todo, self._reads.plan_hits(key, hits.select(todo),
                                                               [planned[i] for i in todo])):
                    reads[hits.req_ids[i]][key] = read
        return reads

    def assemble(self, record: StepRecord, req_ids: Sequence[str], needs_full_hidden_states: bool,
                 whole_step: bool = True) -> StepRows:
        """The step's rows of every key it emits, and each of `req_ids`' hits' rows from
        position 0 (hit rows, then the step's); the hidden states only if the next stage
        needs them. Other requests' hit reads are dropped. Unless the `whole_step`'s rows are
        asked for, a hit's step rows are gathered straight into its hit tensor, and the step's
        rows are only the others' (`StepRows.order`)."""
        wanted = set(req_ids)
        served: dict[str, dict[str, RowRead]] = {}
        for req_id, per_key in record.hit_reads.items():
            if req_id in wanted:
                served[req_id] = per_key
            else:
                for read in per_key.values():
                    self._reads.drop(read)
        for per_key in served.values():  # gathered from the step's start: normally done
            for read in per_key.values():
                self._reads.resolve(read)
        layout = record.layout
        if whole_step or not served or record.host_rows:
            order, ends, flat = layout.order, layout.ends.tolist(), self._step_rows(record)
            filled: Iterable[str] = ()
        else:
            order, ends, flat = self._rows_around_hits(record, served)
            filled = flat.keys()  # the hits' own rows of these keys are in place
        leftover = map_tensors(record.leftover, lambda copy: copy.result(
            self._timeout_s, f"step {record.step_id} leftover"))
        hit_rows: dict[str, dict[str, torch.Tensor]] = {}
        hit_bytes = 0
        for req_id, per_key in served.items():  # a read per key it has rows of
            start, end = layout.rows(req_id)
            rows = hit_rows[req_id] = {}
            for key, read in per_key.items():
                h = len(read.slots)
                if key in filled:
                    pass
                elif key in flat:
                    read.out[h:].copy_(flat[key][start:end])
                else:  # a key this step does not emit: no rows of its own
                    read.out[h:].zero_()
                rows[key] = read.out
                hit_bytes += h * read.out.shape[1] * read.out.element_size()
        self._stats.add(hit_bytes_gathered=hit_bytes)
        shaped = {key: self._shaped(record, key, rows) for key, rows in flat.items()}
        hits = {req_id: {key: self._shaped(record, key, rows) for key, rows in per_key.items()}
                for req_id, per_key in hit_rows.items()}
        if not needs_full_hidden_states:
            shaped.pop(HIDDEN_KEY, None)
            for per_key in hits.values():
                per_key.pop(HIDDEN_KEY, None)
        return StepRows(order, ends, shaped, hits, leftover)

    def _rows_around_hits(self, record: StepRecord, served: Mapping[str, Mapping[str, RowRead]]
                          ) -> tuple[list[str], list[int], dict[str, torch.Tensor]]:
        """The step's own rows of each key read from the pool (all the keys it emits: it has
        no deferred ones): the served hits' straight into their hit tensors, after the hit
        rows (one copy, not two); the other requests', in step order, into a tensor of their
        own (`StepRows`' order, row ends and rows)."""
        layout = record.layout
        order: list[str] = []
        ends: list[int] = []
        runs: list[list[int]] = []  # the others' row ranges in the step, merged where adjacent
        for req_id, (start, end) in layout.items():
            if req_id in served:
                continue
            order.append(req_id)
            ends.append((ends[-1] if ends else 0) + end - start)
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        rows: dict[str, torch.Tensor] = {}
        for key, read in record.step_reads.items():
            own = self._reads.outputs.empty((ends[-1] if ends else 0, read.out_shape[1]),
                                            read.dtype)
            parts, at = [], 0
            for lo, hi in runs:
                parts.append((lo, hi, own[at:at + hi - lo]))
                at += hi - lo
            for req_id, per_key in served.items():
                hit = per_key[key]  # a hit reads every key its step emits
                parts.append((*layout.rows(req_id), hit.out[len(hit.slots):]))
            self._reads.resolve_parts(read, parts)
            rows[key] = own
        return order, ends, rows

    def _shaped(self, record: StepRecord, key: str, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, features]` viewed as `[rows, *feat]`, the key's feature shape (as it is where
        that is its shape already: a view is a torch op, which may hand a busy engine thread
        the GIL)."""
        feat = tuple(record.per_token.get(key) or self._pool.keys[key].feat_shape)
        return rows if rows.shape[1:] == feat else rows.view(rows.shape[0], *feat)

    def _step_rows(self, record: StepRecord) -> dict[str, torch.Tensor]:
        """The step's own rows of every key it emits, `[rows, features]` on the host."""
        rows: dict[str, torch.Tensor] = {}
        for key, read in record.step_reads.items():
            self._reads.resolve(read)
            rows[key] = read.out
        for key, copy in record.host_rows.items():
            host = copy.result(self._timeout_s, f"step {record.step_id} {key!r} rows")
            rows[key] = host.view(host.shape[0], math.prod(host.shape[1:]))
        return rows

    def release(self, record: StepRecord) -> None:
        """Drop its unread reads (a hit's gather under way included: nobody reads it), grow
        its slot's arena if it was short (off the engine thread), then free the slot."""
        for read in record.reads():
            self._reads.drop(read)
        self._staging.arenas[record.staging_slot].grow()
        self._staging.release(record.staging_slot, ("step", record.step_id))
