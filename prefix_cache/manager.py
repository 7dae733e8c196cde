"""OmniPrefixCacheManager: the public facade that turns engine steps into pool writes and hit reads.

Engine thread: `new_step_starts(so)` → forward → `save_outputs(...)` → step id; then exactly
one `materialize(sid, req_ids)` (or `materialize_step`, the same rows in the step's row order)
or `discard_step(sid)`, possibly on the output-builder thread while the engine runs the next step.

The facade builds the parts, checks every call (`Lifetime`: its process, shutdown; then an
earlier write's failure) and times the engine thread's; each concern below it has one owner:
`StepTable` (the step protocol: the pending step, its save, the saved steps, each consumed
once), `OutputChecker` (what a step is handed), `StepWriter` (the save path), `WriteLauncher`
(launching and landing writes, failures), `StepReads` (planning and assembling a step's reads),
`RowPlans` (where each live request stands, and its rows read back from there: at its finish,
in chunks, its prefix hit), `BlockCopyMirror` (vLLM's block copies), `StatsReport` (what
`stats()` gathers). `_lock` covers tables only and is never held while waiting.

A call rejected for its input changes nothing (the same step may be saved again). A write that
fails after its rows left fails alone: its rows are lost (a hit on them is refused by name),
and its error is raised once, by the next public call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from prefix_cache.devices import get_backend
from prefix_cache.config import ModelCachePolicy, PrefixCacheConfig, devices_on_host
from prefix_cache.core.adapter import translate_step
from prefix_cache.core.block_copies import BlockCopyMirror
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.chunk_reads import ChunkRows
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import NO_HITS
from prefix_cache.core.kept_tensors import keeping_tensors
from prefix_cache.core.launcher import WriteLauncher
from prefix_cache.core.lifetime import Lifetime
from prefix_cache.core.layout import GroupView
from prefix_cache.core.outputs import OutputChecker
from prefix_cache.core.reads import ReadPlanner
from prefix_cache.core.report import StatsReport
from prefix_cache.core.request_reads import RequestRows
from prefix_cache.core.residency import POOL_MOVES_ATTR, PoolMap, PoolStep, ResidentView
from prefix_cache.core.row_plans import RowPlans
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.step_reads import StageCacheOutputs, StepReads, StepRows
from prefix_cache.core.step_table import StepTable
from prefix_cache.core.tasks import TaskTable
from prefix_cache.core.writes import StepWriter
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.errors import (OmniPrefixCacheError, OmniPrefixCacheInputError,
                                 OmniPrefixCacheUnmatchError)

__all__ = ["OmniPrefixCacheManager", "StageCacheOutputs", "StepRows"]

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
        self.view = view  # the runner's (a capped pool's parts see it in pool slots)
        self.group_id = group_id
        #: a capped pool's copy of the scheduler's KV block -> pool block map (None: mirror)
        self.pool_map = PoolMap(config.num_blocks, config.pool_blocks, config.block_size) \
            if config.capped else None
        if self.pool_map is not None:
            view = ResidentView(view, self.pool_map)
        config = config.pool_config()
        self._owns_backend = backend is None  # a backend passed in stays open for its owner
        self.backend = backend if backend is not None else get_backend(config.device)
        self._lifetime = Lifetime()
        self.policy = ModelCachePolicy()
        self.pool = PrefixBlockPool(config.num_blocks, config.block_size, self.backend,
                                    budget_bytes=config.host_budget(
                                        devices_on_host(self.backend.name)),
                                    step_path=config.step_path)
        self.staging = StagingPool(config.staging_depth, config.staging_capacity_tokens,
                                   self.backend)
        self._stats = CacheStats()
        self._lock = threading.Lock()  # the tables below; never held while waiting
        self._started = False  # a first step was seen: the policy is fixed
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
        self._checker = OutputChecker(self.backend, self.pool, config.staging_capacity_tokens,
                                      step_path=config.step_path)
        self._writer = StepWriter(config, self.backend, self.pool, self.staging, self._tasks,
                                  self._lock, self._stats, self._checker, self._launcher,
                                  self._deferred, self._reads, self._step_reads)
        self._block_copies = BlockCopyMirror(self.pool, self._reads, self._deferred,
                                             self._tasks, self._lock, timeout)
        self._steps = StepTable(config, view, self.pool, self.staging, self._tasks, self._lock,
                                self._checker, self._writer, self._step_reads)
        self._rows = RowPlans(config, group_id, view, self.pool, self._reads, self._deferred,
                              self._lock)
        self._report = StatsReport(self._stats, self.staging, self._reads, self._tasks,
                                   self._steps, self._deferred, self._rows, self.pool,
                                   self.backend, self._lock)

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
        """Apply a scheduler step: retire finished requests, mirror block copies, note hits and
        start gathering their rows on the cache's threads."""
        with self._stats.timed("new_step_starts"):
            self._check_usable("new_step_starts")
            if self._steps.pending is not None:
                raise OmniPrefixCacheUnmatchError(
                    "new_step_starts called twice without save_outputs: every step, one with "
                    "no tokens included, is saved (then materialized or discarded)")
            if self.pool_map is not None:
                scheduler_output = self._in_pool_blocks(scheduler_output)
            scheduled = self._rows.running_step(scheduler_output)
            if scheduled is not None:  # only running requests: nothing retires, nothing hits
                self._started = True
                self._steps.start(scheduled, NO_HITS)
                return
            events = translate_step(scheduler_output, self.group_id)
            self._started = True
            self._rows.note_allocations(scheduler_output, events)
            if events.finished or events.block_copies:
                with keeping_tensors():  # a retiring write's launch, a block's host copy
                    for req_id in events.finished:  # first, whatever the rest raises
                        self._rows.finish(req_id)
                        self._deferred.retire(req_id)
                    for src, dst in events.block_copies:
                        self._block_copies.mirror(src, dst)
            self._steps.start(events.num_scheduled_tokens, self._rows.step_hits(events))

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                     *, num_tokens_unpadded: int, num_tokens_padded: int,
                     slot_mapping: torch.Tensor | None = None, plan_reads: bool = True) -> int:
        """Save this step's rows; returns the step id to materialize or discard.

        Everything it is handed is read, or copied, in order on the caller's stream: the caller
        may overwrite every tensor right away (in its stream order). `slot_mapping`, the
        runner's device slot mapping of the step (the KV-cache write's), lets a zero-copy CUDA
        write read each row's slot on the device instead of uploading the host's.
        `plan_reads=False`: the step will only be discarded (its rows are read back at the
        finish, by `plan_request_rows`), so no reads of it or of its hits are planned, and
        `materialize` refuses it.
        """
        with self._stats.timed("save_outputs"):
            self._check_usable("save_outputs")
            self._launcher.committer.sweep()  # the earlier steps' writes (complete by now) land
            if self.pool_map is not None:  # the runner's slot mapping is in KV slots
                slot_mapping = None
            return self._steps.save(hidden_states, mm_outputs, num_tokens_unpadded,
                                    num_tokens_padded, slot_mapping, plan_reads, self.policy)

    def materialize(self, step_id: int, req_ids: Iterable[str]) -> StageCacheOutputs:
        """Full-prompt outputs of `req_ids` for a saved step: hit rows, then this step's rows."""
        with self._stats.timed("materialize"):
            req_ids = self._req_id_list("materialize", step_id, req_ids)
            return self._read(step_id, req_ids, whole_step=False).per_request(
                req_ids, self.policy.needs_full_hidden_states)

    def materialize_step(self, step_id: int, req_ids: Iterable[str]) -> StepRows:
        """`materialize` in the step's row order: the step's rows per key, and each of
        `req_ids`' hits' rows from position 0, without a tensor per request."""
        with self._stats.timed("materialize"):
            return self._read(step_id, self._req_id_list("materialize_step", step_id, req_ids),
                              whole_step=True)

    @staticmethod
    def _req_id_list(call: str, step_id: int, req_ids: Iterable[str]) -> list[str]:
        if isinstance(req_ids, str) or not isinstance(req_ids, Iterable):
            raise OmniPrefixCacheInputError(
                f"{call}(step {step_id}): req_ids must be an iterable of request ids, "
                f"got {req_ids!r}")
        return list(req_ids)

    def _read(self, step_id: int, req_ids: list[str], *, whole_step: bool) -> StepRows:
        """The saved step's rows of `req_ids`, the step consumed (exactly once); `whole_step`:
        with its hits' step rows in the step's rows too."""
        self._check_usable("materialize" if req_ids else "discard_step")
        return self._steps.read(step_id, req_ids, self.policy.needs_full_hidden_states,
                                whole_step)

    def plan_request_rows(self, requests: Mapping[str, int | None],
                          starts: Mapping[str, int] | None = None) -> dict[str, RequestRows]:
        """Pin the rows of each request's positions `[start, n)` (`starts`, else 0), `n` the
        positions its saved steps reached, cut to the count it maps to (None: all), of every
        key it has rows of there; another thread reads them back (`RequestRows.resolve`). For
        the engine thread at a request's finish, while the view still holds its blocks; its
        deferred rows are launched first. A request the view no longer holds gets no entry."""
        with self._stats.timed("plan_request_rows"):
            self._check_usable("plan_request_rows")
            return self._rows.request_rows(requests, starts or {})

    def plan_chunk_rows(self, chunks: Mapping[str, tuple[int, int]]) -> dict[str, ChunkRows]:
        """Pin the rows of each running request's positions `[start, end)` (cut to those its
        saved steps reached), a streaming stage's chunk of it, for another thread to read in
        place: one read per key for all of them (`prefix_cache.core.chunk_reads`). A deferred
        write holding rows a chunk reads is launched (the request's next step opens a new one).
        A request the view no longer holds gets no entry."""
        with self._stats.timed("plan_chunk_rows"):
            self._check_usable("plan_chunk_rows")
            return self._rows.chunk_rows(chunks)

    def track_allocations(self) -> None:
        """From the first step on, note which blocks vLLM gives new tenants, so that
        `plan_hit_rows` can tell a step's hits that earlier steps wrote from a prefix vLLM cached
        in the step under way. Call before the first step."""
        self._check_usable("track_allocations")
        self._rows.track_allocations(self._started)

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
            return self._rows.hit_rows(self._steps.pending)

    def discard_step(self, step_id: int) -> None:
        """Consume a saved step without reading it."""
        with self._stats.timed("discard_step"):
            self._check_usable("discard_step")
            self._steps.discard(step_id)

    def stats(self) -> dict[str, int | float]:
        """Counters since start: tokens, rows, bytes, staging waits, time per public call, pool
        and free output bytes, and the backend's own (`backend.*`)."""
        self._launcher.committer.sweep()  # count writes that completed as landed
        out = self._report.collect()
        out["pool_blocks"] = self.pool.num_blocks - 1
        out["resident_blocks"] = (self.pool.num_blocks - 1 if self.pool_map is None
                                  else self.pool_map.resident_blocks)
        for name in ("evicted_blocks", "hit_tokens_trimmed"):
            out.setdefault(name, 0)
        return out

    def shutdown(self) -> None:
        """Stop the threads, drain the copy stream, then release pinned memory and device clones.

        Idempotent. In a forked child it only marks the manager closed: the parent's streams
        and registrations are not the child's to release.
        """
        if not self._lifetime.end():
            return
        timeout = self.config.staging_claim_timeout_s
        landed = self._launcher.committer.close(timeout)
        self._reads.close()
        self._deferred.close()
        self._steps.clear()
        if not (landed and self.backend.drain(timeout)):
            self._lifetime.strand(self.pool, self.staging)  # a copy may still write into them
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

    def _in_pool_blocks(self, scheduler_output: Any) -> PoolStep:
        """A capped pool's step: the scheduler's moves applied (after the reads of the requests
        retired before it, before anything of this step), and the step in pool blocks."""
        moves = getattr(scheduler_output, POOL_MOVES_ATTR, None)
        if moves is None:
            raise OmniPrefixCacheUnmatchError(
                f"new_step_starts: the host pool is capped ({self.config.pool_blocks - 1} of "
                f"{self.config.num_blocks - 1} KV blocks) but the scheduler output carries no "
                f"{POOL_MOVES_ATTR}: the engine's scheduler is not the cache's "
                f"(prefix_cache.integration.workers.finishes), so no hit could be cut to the "
                f"rows the pool holds")
        self.pool_map.apply(moves)
        if moves.evicted or moves.trimmed:
            self._stats.add(evicted_blocks=moves.evicted,
                            hit_tokens_trimmed=sum(moves.trimmed.values()))
        return PoolStep(scheduler_output, self.pool_map, self.group_id)

    # ------------------------------------------------------------------ the call checks

    def _check_usable(self, call: str) -> None:
        """Refuse calls after shutdown or in a forked child; raise the oldest unreported failure."""
        self._lifetime.check(call)
        failure = self._launcher.pop_failure()
        if failure is not None:
            raise OmniPrefixCacheError(f"{call}: an earlier write failed: {failure}") from failure
