"""OmniPrefixCacheManager: the public facade that turns engine steps into pool writes and hit reads.

Engine thread: `new_step_starts(so)` → forward → `save_outputs(...)` → step id;
then exactly one `materialize(sid, req_ids)` (or `materialize_step`, the same rows in the
step's row order) or `discard_step(sid)`, possibly on the output-builder thread while the
engine runs the next step.

The facade owns the step protocol (the pending step, the saved steps, the call
checks); each concern below it has one owner: `OutputChecker` (what a step is
handed), `StepWriter` (the save path), `WriteLauncher` (launching and landing
writes, failures), `StepReads` (planning and assembling reads), `BlockCopyMirror`
(vLLM's block copies). `_lock` covers tables only and is never held while waiting.

A call rejected for its input changes nothing (the same step may be saved
again). A write that fails after its rows left fails alone: its rows are lost
(a hit on them is refused by name), and its error is raised once, by the next
public call.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefix_cache.devices import get_backend
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig, devices_on_host
from prefix_cache.core import _core
from prefix_cache.core.adapter import allocated_blocks, translate_step
from prefix_cache.core.block_copies import BlockCopyMirror
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.chunk_reads import ChunkRows, plan_chunk_rows
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import NO_HITS, StepHits, check_hits, hit_slots
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.launcher import WriteLauncher
from prefix_cache.core.layout import GroupView, StepLayout
from prefix_cache.core.outputs import OutputChecker, StepOutputs
from prefix_cache.core.reads import ReadPlanner
from prefix_cache.core.request_reads import RequestRows, plan_request_rows
from prefix_cache.core.runs import runs_slots
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.step_reads import StageCacheOutputs, StepReads, StepRecord, StepRows
from prefix_cache.core.tasks import TaskTable
from prefix_cache.core.writes import StepWriter
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.errors import (OmniPrefixCacheError, OmniPrefixCacheInputError,
                                 OmniPrefixCacheUnmatchError)

__all__ = ["OmniPrefixCacheManager", "StageCacheOutputs", "StepRows"]

#: Pools and staging of managers whose shutdown timed out: a device copy may still write into
#: them, so neither they nor their registrations are released while this process lives.
_STRANDED: list[tuple[PrefixBlockPool, StagingPool]] = []

#: This process's id, renewed in a forked child: every public call compares it with the
#: manager's, and `os.getpid()` is a system call.
_PID = os.getpid()


def _renew_pid() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_renew_pid)


@dataclass
class _PendingStep:
    """What `new_step_starts` learned, waiting for this step's `save_outputs`; `handed_over`:
    requests whose hit rows `plan_hit_rows` read, which the step does not read again."""

    num_scheduled_tokens: Mapping[str, int]
    hits: StepHits
    handed_over: frozenset[str] = frozenset()


#: The public calls a stage makes on the engine thread; `stats()` times each
#: (`time_s.<call>`): their sum is the cache's share of an engine step.
ENGINE_THREAD_CALLS = ("new_step_starts", "save_outputs", "discard_step", "plan_request_rows",
                       "plan_chunk_rows", "plan_hit_rows")


class OmniPrefixCacheManager:
    """Stage-output prefix cache for one stage, keyed by the KV cache's blocks and slots."""

    def __init__(self, config: PrefixCacheConfig, view: GroupView, *,
                 backend: DeviceBackend | None = None, group_id: int = 0) -> None:
        if not isinstance(config, PrefixCacheConfig):
            raise OmniPrefixCacheInputError(
                f"OmniPrefixCacheManager: config must be a PrefixCacheConfig, got "
                f"{type(config).__name__}")
        missing = [m for m in ("batch_req_ids", "step_slots_cpu")
                   if not callable(getattr(view, m, None))]
        if missing:
            raise OmniPrefixCacheInputError(
                f"OmniPrefixCacheManager: view {type(view).__name__} lacks {missing} (a "
                f"FullAttentionGroupView or any object with batch_req_ids and step_slots_cpu)")
        self.config = config
        self.view = view
        self.group_id = group_id
        self._owns_backend = backend is None  # a backend passed in stays open for its owner
        self.backend = backend if backend is not None else get_backend(config.device)
        self._pid = _PID  # streams and registrations belong to this process
        self.policy = ModelCachePolicy()
        self.pool = PrefixBlockPool(config.num_blocks, config.block_size, self.backend,
                                    budget_bytes=config.host_budget(
                                        devices_on_host(self.backend.name)))
        self.staging = StagingPool(config.staging_depth, config.staging_capacity_tokens,
                                   self.backend)
        self._stats = CacheStats()
        self._lock = threading.Lock()  # the tables below; never held while waiting
        self._step_ids = itertools.count(1)
        self._started = False  # a first step was seen: the policy is fixed
        self._progress: dict[str, int] = {}  # live request -> positions its saved steps reach
        self._pending: _PendingStep | None = None
        self._tracks_allocations = False  # see track_allocations
        self._steps: dict[int, StepRecord] = {}
        self._closed = False
        timeout = config.staging_claim_timeout_s
        self._tasks = TaskTable()
        self._launcher = WriteLauncher(self.pool, self.staging, self._tasks, self._lock,
                                       timeout, self.backend.bind_thread)
        self._deferred = DeferredWriter(self.pool, self.backend, self._tasks, self._lock,
                                        self._launcher.launch, config.gpu_budget_bytes, timeout)
        self._launcher.on_landed(self._deferred.landed)
        self._reads = ReadPlanner(self.pool, self._tasks, self._lock, timeout,
                                  config.output_cache_bytes)
        self._step_reads = StepReads(self.pool, self._reads, self._deferred, self.staging,
                                     self._lock, self._stats, timeout)
        self._checker = OutputChecker(self.backend, self.pool, config.staging_capacity_tokens)
        self._writer = StepWriter(config, self.backend, self.pool, self.staging, self._tasks,
                                  self._lock, self._stats, self._checker, self._launcher,
                                  self._deferred, self._reads, self._step_reads)
        self._block_copies = BlockCopyMirror(self.pool, self._reads, self._deferred,
                                             self._tasks, self._lock, timeout)

    # ------------------------------------------------------------------ public API

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set what the model emits; call before the first step."""
        self._check_usable("register_policy")
        if not isinstance(policy, ModelCachePolicy):
            raise OmniPrefixCacheInputError(
                f"register_policy: expected a ModelCachePolicy, got {type(policy).__name__}")
        if self._started:
            raise OmniPrefixCacheUnmatchError(
                "register_policy: the policy is fixed once the first step started; register "
                "it before the first new_step_starts")
        self.policy = policy

    def preallocate(self, key: str, feat_shape: Sequence[int], dtype: torch.dtype) -> None:
        """Allocate `key`'s pool now (at KV-cache init), so no request pays for it."""
        self._check_usable("preallocate")
        if key not in self.pool.keys:
            with keeping_tensors():
                pool_key = self.pool.allocate(key, tuple(feat_shape), dtype)
            with self._lock:  # stats() reads the keys from another thread
                self.pool.install(pool_key)

    def new_step_starts(self, scheduler_output: Any) -> None:
        """Apply a scheduler step: retire finished requests, mirror block copies, note hits."""
        with self._stats.timed("new_step_starts"):
            self._check_usable("new_step_starts")
            if self._pending is not None:
                raise OmniPrefixCacheUnmatchError(
                    "new_step_starts called twice without save_outputs: every step, one with "
                    "no tokens included, is saved (then materialized or discarded)")
            events = translate_step(scheduler_output, self.group_id)
            self._started = True
            if self._tracks_allocations and (allocated := allocated_blocks(
                    scheduler_output, events, self.config.block_size, self.group_id)):
                with self._lock:  # before a block copy's claim, which then counts
                    self.pool.mark_allocated(np.asarray(allocated, dtype=np.int64))
            if events.finished or events.block_copies:
                with keeping_tensors():  # a retiring write's launch, a block's host copy
                    for req_id in events.finished:  # first, whatever the rest raises
                        self._progress.pop(req_id, None)
                        self._deferred.retire(req_id)
                    for src, dst in events.block_copies:
                        self._block_copies.mirror(src, dst)
            restarts = events.started + events.resumed_starts
            hits = [(new.req_id, new.num_computed_tokens, hit_slots(
                        new.req_id, new.num_computed_tokens, new.block_ids,
                        self.config.block_size, self.config.num_blocks))
                    for new in restarts
                    # a miss; or a live request whose rows up to h were handed over
                    if new.num_computed_tokens > self._progress.get(new.req_id, 0)]
            for new in restarts:
                self._progress[new.req_id] = new.num_computed_tokens
            _core.add_counts(self._progress, events.num_scheduled_tokens)
            self._pending = _PendingStep(events.num_scheduled_tokens,
                                         StepHits.join(hits) if hits else NO_HITS)

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                     *, num_tokens_unpadded: int, num_tokens_padded: int,
                     slot_mapping: torch.Tensor | None = None, plan_reads: bool = True) -> int:
        """Save this step's rows; returns the step id to materialize or discard.

        Everything it is handed is read, or copied, in order on the caller's
        stream: the caller may overwrite every tensor right away (in its stream
        order). `slot_mapping`, the runner's device slot mapping of the step
        (the KV-cache write's), lets a zero-copy CUDA write read each row's slot
        on the device instead of uploading the host's. `plan_reads=False`: the
        step will only be discarded (its rows are read back at the finish, by
        `plan_request_rows`), so no reads of it or of its hits are planned, and
        `materialize` refuses it.
        """
        with self._stats.timed("save_outputs"):
            self._check_usable("save_outputs")
            self._launcher.committer.sweep()  # the earlier steps' writes (complete by now) land
            if self._pending is None:
                raise OmniPrefixCacheUnmatchError(
                    "save_outputs called without new_step_starts for this step")
            n, outputs, new_keys = self._checker.step_outputs(
                hidden_states, mm_outputs, num_tokens_unpadded, num_tokens_padded, self.policy)
            # a step of immediate rows in stream order, without hits read, keeps none of the
            # tensors it makes (a hit's deferred rows are flushed; a read resolved early guards
            # itself)
            keeps = bool(new_keys or outputs.deferred or outputs.leftover
                         or (plan_reads and self._pending.hits) or not self._writer.in_stream)
            if not keeps:
                return self._save(outputs, new_keys, n, slot_mapping, plan_reads)
            with keeping_tensors():
                return self._save(outputs, new_keys, n, slot_mapping, plan_reads)

    def _save(self, outputs: StepOutputs, new_keys: Mapping[str, tuple[tuple[int, ...],
                                                                         torch.dtype]],
              n: int, slot_mapping: torch.Tensor | None, plan_reads: bool) -> int:
        """`save_outputs` once its outputs are split and checked."""
        pending = self._pending
        device_slots = self._writer.device_slots(slot_mapping, n)
        layout = StepLayout.of_step(self.view, pending.num_scheduled_tokens, n,
                                    self.config.block_size, self.pool.num_slots)
        try:
            check_hits(self.pool, self._lock, pending.hits, layout, outputs)
        except OmniPrefixCacheUnmatchError:
            self._pending = None  # no retry can serve those positions: the step is lost
            raise
        self._writer.install_keys(new_keys)
        step_id = next(self._step_ids)
        slot = self.staging.claim(step_id, self.config.staging_claim_timeout_s,
                                  lambda: len(self._tasks))
        try:
            record = self._writer.save(step_id, slot, outputs, layout, pending.hits,
                                       device_slots, plan_reads, pending.handed_over)
        except BaseException:
            self.staging.release(slot, ("step", step_id))  # a launched write keeps its own
            raise
        with self._lock:
            self._steps[step_id] = record
        self._pending = None
        return step_id

    def materialize(self, step_id: int, req_ids: Iterable[str]) -> StageCacheOutputs:
        """Full-prompt outputs of `req_ids` for a saved step: hit rows, then this step's rows."""
        with self._stats.timed("materialize"):
            req_ids = self._req_id_list("materialize", step_id, req_ids)
            return self._assemble(step_id, req_ids).per_request(
                req_ids, self.policy.needs_full_hidden_states)

    def materialize_step(self, step_id: int, req_ids: Iterable[str]) -> StepRows:
        """`materialize` in the step's row order: the step's rows per key, and each of
        `req_ids`' hits' rows from position 0, without a tensor per request."""
        with self._stats.timed("materialize"):
            return self._assemble(step_id, self._req_id_list("materialize_step", step_id,
                                                             req_ids))

    @staticmethod
    def _req_id_list(call: str, step_id: int, req_ids: Iterable[str]) -> list[str]:
        if isinstance(req_ids, str) or not isinstance(req_ids, Iterable):
            raise OmniPrefixCacheInputError(
                f"{call}(step {step_id}): req_ids must be an iterable of request ids, "
                f"got {req_ids!r}")
        return list(req_ids)

    def _assemble(self, step_id: int, req_ids: list[str]) -> StepRows:
        record = self._consume(step_id, req_ids)
        try:
            return self._step_reads.assemble(record, req_ids,
                                             self.policy.needs_full_hidden_states)
        finally:
            self._step_reads.release(record)

    def plan_request_rows(self, requests: Mapping[str, int | None],
                          starts: Mapping[str, int] | None = None) -> dict[str, RequestRows]:
        """Pin the rows of each request's positions `[start, n)` (`starts`, else 0), `n` the
        positions its saved steps reached, cut to the count it maps to (None: all), of every
        key it has rows of there; another thread reads them back (`RequestRows.resolve`). For
        the engine thread at a request's finish, while the view still holds its blocks; its
        deferred rows are launched first. A request the view no longer holds gets no entry."""
        with self._stats.timed("plan_request_rows"):
            planned = self._positions_slots("plan_request_rows", requests, starts or {})
            with keeping_tensors():  # a deferred write's launch: the request's, or one it hit
                for req_id in requests:
                    self._deferred.retire(req_id)
                return plan_request_rows(self.pool, self._reads, self._deferred, self._lock,
                                         planned)

    def plan_chunk_rows(self, chunks: Mapping[str, tuple[int, int]]) -> dict[str, ChunkRows]:
        """Pin the rows of each running request's positions `[start, end)` (cut to those its
        saved steps reached), a streaming stage's chunk of it, for another thread to read in
        place: one read per key for all of them (`prefix_cache.core.chunk_reads`). A deferred
        write holding rows a chunk reads is launched (the request's next step opens a new one).
        A request the view no longer holds gets no entry."""
        with self._stats.timed("plan_chunk_rows"):
            planned = self._positions_slots(
                "plan_chunk_rows", {req_id: end for req_id, (_, end) in chunks.items()},
                {req_id: start for req_id, (start, _) in chunks.items()})
            # no tensor is made here but by the launch of a deferred write the chunks read,
            # which keeps its own (leaving vLLM's inference mode costs tens of µs after a forward)
            return plan_chunk_rows(self.pool, self._reads, self._deferred, self._lock,
                                   [(req_id, start, slots) for req_id, start, slots, _ in planned])

    def _positions_slots(self, call: str, ends: Mapping[str, int | None],
                         starts: Mapping[str, int]) -> list[tuple[str, int, np.ndarray, int]]:
        """Per request the view holds: its first position (`starts`, else 0), the slots of its
        positions from there to its end (None: all its saved steps reached; never past them,
        so none where they stand behind its start), and how many positions its saved steps
        computed past that end."""
        self._check_usable(call)
        positions_runs = getattr(self.view, "request_positions_runs", None)
        if positions_runs is None:
            raise OmniPrefixCacheUnmatchError(
                f"{call}: view {type(self.view).__name__} cannot give a request's positions "
                f"(it lacks request_positions_runs)")
        planned = []
        for req_id, end in ends.items():
            n, start = self._progress.get(req_id, 0), starts.get(req_id, 0)
            # a request recomputed after preemption may stand behind where its chunks reached
            # (`start`): it has no rows past them yet
            stands = max(n if end is None else min(n, end), start)
            runs = positions_runs(req_id, stands, start)
            if runs is not None:
                planned.append((req_id, start, runs_slots(runs), max(n - stands, 0)))
        return planned

    def track_allocations(self) -> None:
        """From the first step on, note which blocks vLLM gives new tenants, so that
        `plan_hit_rows` can tell a step's hits that earlier steps wrote from a prefix vLLM cached
        in the step under way. Call before the first step."""
        self._check_usable("track_allocations")
        if self._started:
            raise OmniPrefixCacheUnmatchError(
                "track_allocations called after the first step: the blocks allocated before it "
                "are unknown")
        self._tracks_allocations = True

    def plan_hit_rows(self) -> dict[str, RequestRows]:
        """Pin the rows of the current step's prefix hits that earlier steps wrote, each
        request's positions `[0, h)` of every key it has rows of, for another thread to read as
        soon as their writes land: a streaming stage publishes them as the request's first
        chunk while the step's forward runs. A hit on any block that no write has filled since
        vLLM gave it its tenant (one this very step fills, vLLM having cached it at scheduling)
        is left to the step's own reads. The rows pinned here are the caller's to hand over:
        the step does not read them again, so its `materialize` gives these requests' rows from
        position h on (the step's own), not from 0. Needs `track_allocations`; between
        `new_step_starts` and `save_outputs`."""
        with self._stats.timed("plan_hit_rows"):
            self._check_usable("plan_hit_rows")
            if not self._tracks_allocations:
                raise OmniPrefixCacheUnmatchError(
                    "plan_hit_rows needs track_allocations() before the first step: without it, a "
                    "block vLLM gave a new tenant in this step would read as its former tenant's")
            if self._pending is None:
                raise OmniPrefixCacheUnmatchError(
                    "plan_hit_rows called outside a step: call it after new_step_starts")
            hits = self._pending.hits
            if not len(hits):
                return {}
            with self._lock:
                written = self.pool.written_since_allocated(hits.slots)
                if HIDDEN_KEY in self.pool.keys:  # never absent (see plan_request_rows)
                    written &= self.pool.present(HIDDEN_KEY, hits.slots)
            whole = np.logical_and.reduceat(written, hits.bounds[:-1])
            planned = [(req_id, 0, hits.slots_of(i), 0) for i, req_id in enumerate(hits.req_ids)
                       if whole[i]]
            if not planned:
                return {}
            with keeping_tensors():  # a live request's deferred write a hit shares is launched
                rows = plan_request_rows(self.pool, self._reads, self._deferred, self._lock,
                                         planned, "the prefix hit")
            self._pending.handed_over = frozenset(rows)
            return rows

    def discard_step(self, step_id: int) -> None:
        """Consume a saved step without reading it."""
        with self._stats.timed("discard_step"):
            self._step_reads.release(self._consume(step_id, ()))

    def stats(self) -> dict[str, int | float]:
        """Counters since start: tokens, rows, bytes, staging waits, time per public call, pool
        and free output bytes, and the backend's own (`backend.*`)."""
        self._launcher.committer.sweep()  # count writes that completed as landed
        out = self._stats.snapshot()
        out["staging_waits"] = self.staging.waits
        out["staging_wait_s"] = self.staging.wait_time_s
        out["staging_bytes"] = self.staging.nbytes()
        out["copy_on_write_reads"] = self._reads.copy_on_write_reads
        out["output_cache_bytes"] = self._reads.outputs.free_bytes
        out["outputs_reused"] = self._reads.outputs.reused
        out["outputs_swapped_out"] = self._reads.outputs.swapped_out
        with self._lock:
            out["tasks_in_flight"] = len(self._tasks)
            out["steps_unconsumed"] = len(self._steps)
            out["deferred_device_bytes"] = self._deferred.held_bytes
            out["live_requests"] = len(self._progress)
            pool_bytes = self.pool.nbytes()  # the engine thread installs keys under the lock
        for key, nbytes in pool_bytes.items():
            out[f"pool_bytes.{key}"] = nbytes
        for key, count in self.backend.stats().items():
            out[f"backend.{key}"] = count
        return out

    def shutdown(self) -> None:
        """Stop the threads, drain the copy stream, then release pinned memory and device clones.

        Idempotent. In a forked child it only marks the manager closed: the
        parent's streams and registrations are not the child's to release.
        """
        if self._closed:
            return
        self._closed = True
        if _PID != self._pid:
            return
        timeout = self.config.staging_claim_timeout_s
        landed = self._launcher.committer.close(timeout)
        self._reads.close()
        self._deferred.close()
        with self._lock:
            self._steps.clear()
        if not (landed and self.backend.drain(timeout)):
            _STRANDED.append((self.pool, self.staging))  # a copy may still write into them
            raise OmniPrefixCacheError(
                f"shutdown: {'writes still landing' if not landed else 'copies still running'}"
                f" on {self.backend.name} after {timeout:.1f}s; the pools and staging buffers "
                f"are kept, registered, for the life of the process")
        self.pool.close()
        self.staging.close()
        if self._owns_backend:
            self.backend.close()

    def __enter__(self) -> OmniPrefixCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the step protocol

    def _check_usable(self, call: str) -> None:
        """Refuse calls after shutdown or in a forked child; raise the oldest unreported failure."""
        if _PID != self._pid:
            raise OmniPrefixCacheError(
                f"{call}: this prefix cache was built in process {self._pid}; a forked child "
                f"(process {_PID}) cannot use its streams or pinned pools; build a new "
                f"manager in the child")
        if self._closed:
            raise OmniPrefixCacheError(f"{call}: the prefix cache was shut down")
        failure = self._launcher.pop_failure()
        if failure is not None:
            raise OmniPrefixCacheError(f"{call}: an earlier write failed: {failure}") from failure

    def _consume(self, step_id: int, req_ids: Sequence[str]) -> StepRecord:
        """The saved step's record, taken out of the table: a step is consumed exactly once."""
        self._check_usable("materialize" if req_ids else "discard_step")
        with self._lock:
            record = self._steps.get(step_id)
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
            del self._steps[step_id]
        return record
