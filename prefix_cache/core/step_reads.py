"""A saved step's reads: planned when it is saved, assembled by `materialize`, released once.

A step's record lives from `save_outputs` until exactly one `materialize` or
`discard_step` consumes it. Its reads hold their rows until resolved (see
`ReadPlanner`); assembling puts each request's hit rows before its step rows, per key.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from prefix_cache.config import HIDDEN_KEY
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import HitSpans
from prefix_cache.core.host_copies import HostCopy
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.outputs import map_tensors
from prefix_cache.core.reads import ReadPlanner, RowRead
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.tasks import WriteTask


class StageCacheOutputs(NamedTuple):
    """What `materialize` hands the next stage; every tensor is a CPU tensor the caller owns."""

    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, torch.Tensor]]
    leftover: dict[str, Any]


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

    def plan(self, record: StepRecord, immediate: Iterable[str], claim: int,
             task: WriteTask | None, spans: HitSpans) -> None:
        """Bind this step's and its hits' reads to the writes producing them; they hold their
        rows until resolved (see ReadPlanner)."""
        layout = record.layout
        with self._lock:
            record.step_reads = self._reads.plan_step(
                record.step_id, immediate, lambda: layout.slots, layout.num_rows, claim, task)
            for req_id, (h, hit_slots) in spans.items():
                if req_id not in record.layout:
                    continue
                start, end = record.layout.rows(req_id)
                record.hit_reads[req_id] = self._plan_hit_keys(
                    f"request {req_id} step {record.step_id}", record, hit_slots, end - start)
                self._stats.add(hit_tokens=h, hit_requests=1)
        hit_reads = [read for per_key in record.hit_reads.values() for read in per_key.values()]
        if hit_reads:
            # a hit on rows still held on the device: their deferred writes go out now (a
            # step read's producer is this step's write, launched already)
            self._deferred.flush_tasks([t for read in hit_reads for t in read.producers])
            # hit gathers (random blocks, the large ones) start ahead of materialize; the
            # step's own rows are gathered by their consumer, off the engine thread either way
            self._reads.prefetch(hit_reads)

    def _plan_hit_keys(self, what: str, record: StepRecord, hit_slots: np.ndarray,
                       step_rows: int) -> dict[str, RowRead]:
        """A hit's reads: every key this step emits, and every other per-token key the pool
        has rows of at `hit_slots` (a cached image's rows when the new tokens are text); the
        step's rows of a key it does not emit read zeros (caller holds the lock)."""
        others = [k for k in self._pool.keys  # no rows of it here: the request never had any
                  if k not in record.per_token and self._pool.present(k, hit_slots).any()]
        return {key: self._reads.plan_hit(what, key, hit_slots, step_rows)
                for key in (*record.per_token, *others)}

    def assemble(self, record: StepRecord, req_ids: Sequence[str],
                 needs_full_hidden_states: bool) -> StageCacheOutputs:
        """Each of `req_ids`' rows from position 0, per key: hit rows, then the step's."""
        wanted = set(req_ids)
        for req_id, per_key in record.hit_reads.items():
            if req_id not in wanted:
                for read in per_key.values():
                    self._reads.cancel(read)
        step_rows = self._step_rows(record)
        leftover = map_tensors(record.leftover, lambda copy: copy.result(
            self._timeout_s, f"step {record.step_id} leftover"))
        hidden: dict[str, torch.Tensor] = {}
        mm: dict[str, dict[str, torch.Tensor]] = {k: {} for k in record.per_token
                                                   if k != HIDDEN_KEY}
        hit_bytes = 0
        for req_id in req_ids:
            start, end = record.layout.rows(req_id)
            hits = record.hit_reads.get(req_id, {})
            for key in (*record.per_token, *(k for k in hits if k not in record.per_token)):
                read = hits.get(key)
                mine = step_rows[key][start:end] if key in step_rows else None
                if read is not None:
                    self._reads.resolve(read)
                    h = len(read.slots)
                    if mine is None:  # a key this step does not emit: no rows of its own
                        read.out[h:].zero_()
                    else:
                        read.out[h:].copy_(mine)
                    mine = read.out
                    hit_bytes += h * mine.shape[1] * mine.element_size()
                feat = record.per_token.get(key) or self._pool.keys[key].feat_shape
                value = mine.view(mine.shape[0], *feat)
                if key == HIDDEN_KEY:
                    hidden[req_id] = value
                else:
                    mm.setdefault(key, {})[req_id] = value
        self._stats.add(hit_bytes_gathered=hit_bytes)
        return StageCacheOutputs(hidden if needs_full_hidden_states else None, mm, leftover)

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
        """Cancel its unread reads, grow its slot's arena if it was short (off the engine
        thread), then free the slot."""
        for read in record.reads():
            self._reads.cancel(read)
        self._staging.arenas[record.staging_slot].grow()
        self._staging.release(record.staging_slot, ("step", record.step_id))
