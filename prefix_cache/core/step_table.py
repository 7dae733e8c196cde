"""A step's life in the protocol: started, then saved, then consumed exactly once.

`new_step_starts` leaves a pending step (what the step's start learned); its `save_outputs`
makes it a saved step (`save`: the outputs checked, the layout, the hits checked, a staging
slot claimed, the write launched); `materialize` reads the saved step's rows (`read`), or
`discard_step` drops it (`discard`), either taking its record out of the table. A save
refused for its input leaves the pending step as it was (it may be saved again); one
refused for its hits loses it (no retry can serve those positions).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefix_cache.config import ModelCachePolicy, PrefixCacheConfig
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.hits import NO_HITS, StepHits, check_hits
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.layout import GroupView, StepLayout
from prefix_cache.core.outputs import OutputChecker, StepOutputs
from prefix_cache.core.reads import RowRead
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.step_reads import StepReads, StepRecord, StepRows
from prefix_cache.core.tasks import TaskTable
from prefix_cache.core.writes import StepWriter
from prefix_cache.errors import OmniPrefixCacheUnmatchError


@dataclass
class PendingStep:
    """What `new_step_starts` learned, waiting for this step's `save_outputs`; `gathered`: the
    hits' reads planned (and their gathers started) at the start, by request and key;
    `handed_over`: requests whose hit rows `plan_hit_rows` read, which the step does not read
    again."""

    num_scheduled_tokens: Mapping[str, int]
    hits: StepHits
    gathered: dict[str, dict[str, RowRead]]
    handed_over: frozenset[str] = frozenset()


class StepTable:
    """The step started and not saved yet (`pending`), and the saved steps' records by id.

    Invariant: at most one step is pending (`start` is called with none); a saved step's
    record is in the table from its save until it is taken, once."""

    def __init__(self, config: PrefixCacheConfig, view: GroupView, pool: PrefixBlockPool,
                 staging: StagingPool, tasks: TaskTable, lock: threading.Lock,
                 checker: OutputChecker, writer: StepWriter, step_reads: StepReads) -> None:
        self._config = config
        self._view = view
        self._pool = pool
        self._staging = staging
        self._tasks = tasks
        self._lock = lock  # the records; never held while waiting
        self._checker = checker
        self._writer = writer
        self._step_reads = step_reads
        self._c_path = config.step_path == "c"
        self._step_ids = itertools.count(1)
        self._records: dict[int, StepRecord] = {}
        self.pending: PendingStep | None = None
        #: whether the last step saved planned its reads: a stage that reads its rows back at
        #: the finish (`plan_reads=False`) gathers no hit at a step's start after its first
        self._reads_planned = True

    def __len__(self) -> int:
        """The steps saved and not consumed (caller holds the lock)."""
        return len(self._records)

    def start(self, num_scheduled_tokens: Mapping[str, int], hits: StepHits) -> None:
        """A step started: its hits' gathers start (where steps' reads are planned; nothing
        waits), and `save` saves it next."""
        gathered = self._step_reads.gather_hits(hits, num_scheduled_tokens) \
            if hits and self._reads_planned else {}
        self.pending = PendingStep(num_scheduled_tokens, hits, gathered)

    def save(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
             num_tokens_unpadded: int, num_tokens_padded: int,
             slot_mapping: torch.Tensor | None, plan_reads: bool,
             policy: ModelCachePolicy) -> int:
        """`OmniPrefixCacheManager.save_outputs`: the pending step saved, its id returned."""
        if self.pending is None:
            raise OmniPrefixCacheUnmatchError(
                "save_outputs called without new_step_starts for this step")
        n, outputs, new_keys = self._checker.step_outputs(
            hidden_states, mm_outputs, num_tokens_unpadded, num_tokens_padded, policy)
        self._reads_planned = plan_reads
        # a step of immediate rows in stream order, without hits read, keeps none of the
        # tensors it makes (a hit's deferred rows are flushed; a read resolved early guards
        # itself)
        keeps = bool(new_keys or outputs.deferred or outputs.leftover
                     or (plan_reads and self.pending.hits) or not self._writer.in_stream)
        if not keeps:
            return self._save(outputs, new_keys, n, slot_mapping, plan_reads)
        with keeping_tensors():
            return self._save(outputs, new_keys, n, slot_mapping, plan_reads)

    def _save(self, outputs: StepOutputs, new_keys: Mapping[str, tuple[tuple[int, ...],
                                                                         torch.dtype]],
              n: int, slot_mapping: torch.Tensor | None, plan_reads: bool) -> int:
        """`save` once its outputs are split and checked."""
        pending = self.pending
        device_slots = self._writer.device_slots(slot_mapping, n)
        layout = StepLayout.of_step(self._view, pending.num_scheduled_tokens, n,
                                    self._config.block_size, self._pool.num_slots,
                                    c_path=self._c_path)
        try:
            check_hits(self._pool, self._lock, pending.hits, layout, outputs)
        except OmniPrefixCacheUnmatchError:
            self.pending = None  # no retry can serve those positions: the step is lost
            self._step_reads.drop_gathers(pending.gathered)
            raise
        hits = pending.hits
        if hits:  # those of requests in the step; of them, those it reads
            hits = hits.select([i for i, req_id in enumerate(hits.req_ids) if req_id in layout])
        served = hits.select([i for i, req_id in enumerate(hits.req_ids)
                              if req_id not in pending.handed_over]) if plan_reads else NO_HITS
        pending.gathered = self._step_reads.keep_gathers(pending.gathered, layout, served)
        self._writer.install_keys(new_keys)
        step_id = next(self._step_ids)
        slot = self._staging.claim(step_id, self._config.staging_claim_timeout_s,
                                   lambda: len(self._tasks))
        try:
            record = self._writer.save(step_id, slot, outputs, layout, hits, device_slots,
                                       plan_reads, served, pending.gathered)
        except BaseException:
            self._staging.release(slot, ("step", step_id))  # a launched write keeps its own
            raise
        with self._lock:
            self._records[step_id] = record
        self.pending = None
        return step_id

    def read(self, step_id: int, req_ids: list[str], needs_full_hidden_states: bool,
             whole_step: bool) -> StepRows:
        """Saved step `step_id`'s rows of `req_ids` (hit rows, then the step's), the step
        consumed; `whole_step`: the step's rows of its hits too (`StepReads.assemble`)."""
        record = self._take(step_id, req_ids)
        try:
            return self._step_reads.assemble(record, req_ids, needs_full_hidden_states,
                                             whole_step)
        finally:
            self._step_reads.release(record)

    def discard(self, step_id: int) -> None:
        """Consume saved step `step_id` without reading it."""
        self._step_reads.release(self._take(step_id, ()))

    def _take(self, step_id: int, req_ids: Sequence[str]) -> StepRecord:
        """Step `step_id`'s record, taken out of the table, to read `req_ids` of (none: to
        discard it); refused, the table unchanged, where the step cannot give them."""
        with self._lock:
            record = self._records.get(step_id)
            if record is None:
                raise OmniPrefixCacheUnmatchError(
                    f"step {step_id} is unknown or was already consumed")
            if req_ids and not record.readable:
                raise OmniPrefixCacheUnmatchError(
                    f"materialize(step {step_id}): the step was saved with plan_reads=False; "
                    f"it can only be discarded (its rows are read back by plan_request_rows)")
            unknown = record.layout.unknown(req_ids)
            if unknown:
                raise OmniPrefixCacheUnmatchError(
                    f"materialize(step {step_id}): requests {unknown} have no rows in that step "
                    f"(saved: {sorted(record.layout.order)})")
            del self._records[step_id]
        return record

    def clear(self) -> None:
        """Drop every saved step's record (at shutdown)."""
        with self._lock:
            self._records.clear()
