"""OmniPrefixCacheManager: the public facade that turns engine steps into pool writes and hit reads.

Engine thread: `new_step_starts(so)` → forward → `save_outputs(...)` → step id;
then exactly one `materialize(sid, req_ids)` or `discard_step(sid)`, possibly on
the output-builder thread while the engine runs the next step.

Only the engine thread claims slots and launches writes, so launch order is
claim order; the committer lands writes in that order, the prefetch thread
resolves reads ahead of `materialize`. `_lock` covers tables only and is never
held while waiting.

A call rejected for its input changes nothing (the same step may be saved
again). A write that fails after its rows left fails alone: its rows are lost
(a hit on them is refused by name), and its error is raised once, by the next
public call.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from prefix_cache import devices
from prefix_cache.core import _core
from prefix_cache.devices.base import CHECK_SLOTS_ENV, DeviceBackend, Transfer
from prefix_cache.integration.adapter import StartedRequest, translate_step
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.core.committer import Committer
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.errors import (OmniPrefixCacheError, OmniPrefixCacheInputError,
                                 OmniPrefixCacheUnmatchError)
from prefix_cache.core.host_copies import HostCopy
from prefix_cache.core.layout import GroupView, StepLayout
from prefix_cache.core.outputs import StepOutputs, map_tensors, split_outputs
from prefix_cache.core.reads import ReadPlanner, RowRead
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.tasks import TaskState, TaskTable, WriteTask

logger = logging.getLogger(__name__)


class StageCacheOutputs(NamedTuple):
    """What `materialize` hands the next stage; every tensor is a CPU tensor the caller owns."""

    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, torch.Tensor]]
    leftover: dict[str, Any]


@dataclass
class _PendingStep:
    """What `new_step_starts` learned, waiting for this step's `save_outputs`."""

    num_scheduled_tokens: Mapping[str, int]
    hit_spans: dict[str, tuple[int, np.ndarray]]  # req -> (hit tokens, hit slots)


@dataclass
class _StepRecord:
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
        self.backend = backend if backend is not None else devices.get_backend(config.device)
        self._pid = os.getpid()  # streams and registrations belong to this process
        self.policy = ModelCachePolicy()
        self.pool = PrefixBlockPool(config.num_blocks, config.block_size, self.backend)
        self.staging = StagingPool(config.staging_depth, config.staging_capacity_tokens,
                                   self.backend)
        self._stats = CacheStats()
        self._lock = threading.Lock()  # the tables below; never held while waiting
        self._step_ids = itertools.count(1)
        self._started = False  # a first step was seen: the policy is fixed
        self._progress: dict[str, int] = {}  # live request -> positions its saved steps reach
        self._pending: _PendingStep | None = None
        self._steps: dict[int, _StepRecord] = {}
        self._failures: deque[OmniPrefixCacheError] = deque()  # unreported failed writes
        self._closed = False
        timeout = config.staging_claim_timeout_s
        self._tasks = TaskTable()
        self._deferred = DeferredWriter(self.pool, self.backend, self._tasks, self._lock,
                                        self._launch, config.gpu_budget_bytes, timeout)
        self._reads = ReadPlanner(self.pool, self._tasks, self._lock, timeout,
                                  config.output_cache_bytes)
        self._committer = Committer(timeout, self._on_landed, self.backend.bind_thread)
        #: OMNI_PREFIX_CACHE_CHECK_SLOTS=1: compare the runner's slot mapping with the view's
        #: slots every step (a copy to the host: a synchronization, for debugging only)
        self._check_slots = os.environ.get(CHECK_SLOTS_ENV, "0") not in ("", "0")

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
            with torch.inference_mode(False):
                pool_key = self.pool.allocate(key, tuple(feat_shape), dtype)
            with self._lock:  # stats() reads the keys from another thread
                self.pool.install(pool_key)

    def new_step_starts(self, scheduler_output: Any) -> None:
        """Apply a scheduler step: retire finished requests first, mirror block copies, note hits."""
        with self._stats.timed("new_step_starts"), torch.inference_mode(False):
            self._check_usable("new_step_starts")
            if self._pending is not None:
                raise OmniPrefixCacheUnmatchError(
                    "new_step_starts called twice without save_outputs: every step, one with "
                    "no tokens included, is saved (then materialized or discarded)")
            events = translate_step(scheduler_output, self.group_id)
            self._started = True
            for req_id in events.finished:  # first, whatever the rest of the step raises
                self._progress.pop(req_id, None)
                self._deferred.retire(req_id)
            for src, dst in events.block_copies:
                self._mirror_block_copy(src, dst)
            restarts = events.started + events.resumed_starts
            spans = {new.req_id: (new.num_computed_tokens, self._hit_slots(new))
                     for new in restarts
                     # a miss; or a live request whose rows up to h were handed over
                     if new.num_computed_tokens > self._progress.get(new.req_id, 0)}
            for new in restarts:
                self._progress[new.req_id] = new.num_computed_tokens
            _core.add_counts(self._progress, events.num_scheduled_tokens)
            self._pending = _PendingStep(events.num_scheduled_tokens, spans)

    def _hit_slots(self, req: StartedRequest) -> np.ndarray:
        """The slots of `req`'s hit positions `[0, num_computed_tokens)`, checked."""
        h, bs = req.num_computed_tokens, self.config.block_size
        if h % bs:
            raise OmniPrefixCacheUnmatchError(
                f"request {req.req_id}: prefix hit of {h} tokens is not aligned to "
                f"block_size {bs}; vLLM never caches partial blocks")
        blocks = np.asarray(req.block_ids[: h // bs], dtype=np.int64)
        if len(blocks) < h // bs:
            raise OmniPrefixCacheUnmatchError(
                f"request {req.req_id}: prefix hit of {h} tokens but only "
                f"{len(req.block_ids)} block ids")
        if (blocks <= 0).any() or (blocks >= self.config.num_blocks).any():
            raise OmniPrefixCacheUnmatchError(
                f"request {req.req_id}: hit block ids {blocks.tolist()} outside "
                f"1..{self.config.num_blocks - 1}")
        return (blocks[:, None] * bs + np.arange(bs)).ravel()

    def save_outputs(self, hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                     *, num_tokens_unpadded: int, num_tokens_padded: int,
                     slot_mapping: torch.Tensor | None = None) -> int:
        """Save this step's rows; returns the step id to materialize or discard.

        Everything it is handed is read, or copied, in order on the caller's
        stream: the caller may overwrite every tensor right away (in its stream
        order). `slot_mapping`, the runner's device slot mapping of the step
        (the KV-cache write's), lets a zero-copy CUDA write read each row's slot
        on the device instead of uploading the host's.
        """
        # tensors the cache keeps are written later by its own threads: never inference tensors
        with self._stats.timed("save_outputs"), torch.inference_mode(False):
            self._check_usable("save_outputs")
            self._committer.sweep()  # the earlier steps' writes (complete by now) land here
            if self._pending is None:
                raise OmniPrefixCacheUnmatchError(
                    "save_outputs called without new_step_starts for this step")
            pending = self._pending
            n, padded = self._token_counts(num_tokens_unpadded, num_tokens_padded)
            outputs = split_outputs(hidden_states, mm_outputs, n, padded, self.policy)
            new_keys = self._check_outputs(outputs)
            device_slots = self._device_slots(slot_mapping, n)
            layout = StepLayout.of_step(self.view, pending.num_scheduled_tokens, n,
                                        self.config.block_size, self.pool.num_slots)
            try:
                self._check_hits(pending.hit_spans, layout, outputs)
            except OmniPrefixCacheUnmatchError:
                self._pending = None  # no retry can serve those positions: the step is lost
                raise
            self._install_keys(new_keys)
            step_id = next(self._step_ids)
            if device_slots is not None and self._check_slots:
                self._check_slot_mapping(step_id, device_slots[:n], layout.slots)
            slot = self.staging.claim(step_id, self.config.staging_claim_timeout_s,
                                      lambda: len(self._tasks))
            try:
                record = self._save(step_id, slot, outputs, layout, pending.hit_spans,
                                    device_slots)
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
            if isinstance(req_ids, str) or not isinstance(req_ids, Iterable):
                raise OmniPrefixCacheInputError(
                    f"materialize(step {step_id}): req_ids must be an iterable of request ids, "
                    f"got {req_ids!r}")
            req_ids = list(req_ids)
            record = self._consume(step_id, req_ids)
            try:
                return self._assemble(record, req_ids)
            finally:
                self._release_step(record)

    def discard_step(self, step_id: int) -> None:
        """Consume a saved step without reading it."""
        with self._stats.timed("discard_step"):
            self._release_step(self._consume(step_id, ()))

    def stats(self) -> dict[str, int | float]:
        """Counters since start: tokens, rows, bytes, staging waits, time per public call, pool
        and free output bytes."""
        self._committer.sweep()  # count writes that completed as landed
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
        return out

    def shutdown(self) -> None:
        """Stop the threads, drain the copy stream, then release pinned memory and device clones.

        Idempotent. In a forked child it only marks the manager closed: the
        parent's streams and registrations are not the child's to release.
        """
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        timeout = self.config.staging_claim_timeout_s
        self._committer.close(timeout)
        self._reads.close()
        self._deferred.close()
        with self._lock:
            self._steps.clear()
        if not self.backend.drain(timeout):  # a copy may still write into a pool: keep them
            raise OmniPrefixCacheError(
                f"shutdown: {self.backend.name} copies still running after {timeout:.1f}s; "
                f"pinned pools left registered")
        self.pool.close()
        self.staging.close()
        if self._owns_backend:
            self.backend.close()

    def __enter__(self) -> OmniPrefixCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ step bookkeeping

    def _check_usable(self, call: str) -> None:
        """Refuse calls after shutdown or in a forked child; raise the oldest unreported failure."""
        if os.getpid() != self._pid:
            raise OmniPrefixCacheError(
                f"{call}: this prefix cache was built in process {self._pid}; a forked child "
                f"(process {os.getpid()}) cannot use its streams or pinned pools; build a new "
                f"manager in the child")
        if self._closed:
            raise OmniPrefixCacheError(f"{call}: the prefix cache was shut down")
        with self._lock:
            failure = self._failures.popleft() if self._failures else None
        if failure is not None:
            raise OmniPrefixCacheError(f"{call}: an earlier write failed: {failure}") from failure

    @staticmethod
    def _token_counts(unpadded: Any, padded: Any) -> tuple[int, int]:
        counts = []
        for name, value in (("num_tokens_unpadded", unpadded), ("num_tokens_padded", padded)):
            try:
                if isinstance(value, bool):
                    raise TypeError
                counts.append(operator.index(value))
            except TypeError:
                raise OmniPrefixCacheInputError(
                    f"save_outputs: {name} must be an int, got {value!r}") from None
        n, padded_n = counts
        if not 0 <= n <= padded_n:
            raise OmniPrefixCacheInputError(
                f"save_outputs: num_tokens_unpadded={n} must be within "
                f"0..num_tokens_padded={padded_n}")
        return n, padded_n

    def _check_outputs(self, outputs: StepOutputs) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Check every tensor against the device, the capacity and its pool; the keys seen first."""
        n = next((len(v) for v in outputs.per_token().values()), 0)
        if n > self.config.staging_capacity_tokens:
            raise OmniPrefixCacheInputError(
                f"save_outputs: step of {n} tokens exceeds staging_capacity_tokens="
                f"{self.config.staging_capacity_tokens}")
        new_keys = {}
        for key, rows in outputs.per_token().items():
            self._check_device(f"save_outputs: {key!r} rows", rows)
            feat, dtype = tuple(rows.shape[1:]), rows.dtype
            pool_key = self.pool.keys.get(key)
            if pool_key is None:
                new_keys[key] = (feat, dtype)
            elif (pool_key.feat_shape, pool_key.dtype) != (feat, dtype):
                raise OmniPrefixCacheInputError(
                    f"save_outputs: {key!r} rows are {feat} {dtype}, its pool holds "
                    f"{pool_key.feat_shape} {pool_key.dtype}")
        for key, value in outputs.leftover.items():
            map_tensors(value, lambda t, key=key: self._check_device(
                f"save_outputs: leftover {key!r}", t, host_ok=True))
        return new_keys

    def _check_device(self, what: str, tensor: torch.Tensor, *, host_ok: bool = False) -> None:
        """The backend's device check, refusing as bad input; `host_ok`: a host tensor passes
        (a leftover is copied in the call)."""
        if host_ok and tensor.device.type == "cpu":
            return
        try:
            self.backend.check_rows(what, tensor)
        except ValueError as exc:
            raise OmniPrefixCacheInputError(str(exc)) from None

    def _install_keys(self, new_keys: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Allocate pools for keys seen for the first time (unlocked), then install them all."""
        allocated = []
        try:
            for key, (feat, dtype) in new_keys.items():
                with self._stats.timed("pool_allocation"):
                    allocated.append(self.pool.allocate(key, feat, dtype))
        except BaseException:
            for pool_key in allocated:
                pool_key.storage.close()
            raise
        with self._lock:
            for pool_key in allocated:
                self.pool.install(pool_key)

    def _check_hits(self, spans: Mapping[str, tuple[int, np.ndarray]], layout: StepLayout,
                    outputs: StepOutputs) -> None:
        """A hit on hidden rows nobody wrote, or on rows of any key a failed write lost (and
        this step does not write again; a key the step omits included), is fatal; checked
        before any claim."""
        for req_id, (h, hit_slots) in spans.items():
            rewritten = np.isin(hit_slots, layout.slots)
            with self._lock:
                for key in self.pool.keys:
                    lost = self.pool.lost(key, hit_slots) & ~rewritten
                    if lost.any():
                        raise OmniPrefixCacheUnmatchError(
                            f"request {req_id}: prefix hit of {h} tokens, but the {key!r} rows "
                            f"of {int(lost.sum())} hit slots (first {int(hit_slots[lost][0])}) "
                            f"were lost to a failed write; those positions cannot be served")
                present = self.pool.present(HIDDEN_KEY, hit_slots)
            missing = ~present & ~rewritten
            if outputs.hidden is not None and missing.any():
                raise OmniPrefixCacheUnmatchError(
                    f"request {req_id}: prefix hit of {h} tokens but hidden rows of "
                    f"{int(missing.sum())} hit slots were never written (first slot "
                    f"{int(hit_slots[missing][0])}); the cache does not match vLLM's KV cache")

    # ------------------------------------------------------------------ writes

    def _device_slots(self, slot_mapping: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The runner's slot mapping, checked, where the write can read it in stream order
        (a device tensor); else None."""
        if slot_mapping is None:
            return None
        if not isinstance(slot_mapping, torch.Tensor):
            raise OmniPrefixCacheInputError(
                f"save_outputs: slot_mapping must be a tensor, got {type(slot_mapping).__name__}")
        if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64) \
                or slot_mapping.shape[0] < n:
            raise OmniPrefixCacheInputError(
                f"save_outputs: slot_mapping must be a 1-D int32/int64 tensor of at least the "
                f"step's {n} tokens, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
        self._check_device("save_outputs: slot_mapping", slot_mapping, host_ok=True)
        if self._in_stream and self.backend.device_slots and slot_mapping.device.type != "cpu":
            return slot_mapping  # the write reads its first n entries
        return None

    @staticmethod
    def _check_slot_mapping(step_id: int, mapping: torch.Tensor, slots: np.ndarray) -> None:
        """Refuse a runner slot mapping that differs from the view's slots (syncs: debug only)."""
        mapped = mapping.cpu().numpy().astype(np.int64)
        differ = np.flatnonzero(mapped != slots)
        if differ.size:
            i = int(differ[0])
            raise OmniPrefixCacheInputError(
                f"save_outputs (step {step_id}): slot_mapping differs from the view's slots in "
                f"{differ.size} of {len(slots)} rows (first: row {i}, slot_mapping "
                f"{int(mapped[i])}, view {int(slots[i])})")

    @property
    def _in_stream(self) -> bool:
        """Whether writes go out on the caller's stream, reading its tensors in place."""
        return self.config.write_stream == "compute" or self.backend.synchronous

    def _private(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor's private copy, ordered on the caller's stream; none is needed
        where the copies that read it are issued in stream order, nor for host tensors."""
        if self._in_stream or tensor.device.type == "cpu":
            return tensor
        return self.backend.snapshot(tensor)

    def _save(self, step_id: int, slot: int, outputs: StepOutputs, layout: StepLayout,
              spans: dict[str, tuple[int, np.ndarray]],
              device_slots: torch.Tensor | None) -> _StepRecord:
        """Copy what outlives the call, then claim the step's slots and launch its write.

        Everything that can fail for want of memory runs before the claim, so a
        failure there leaves the pool as it was.
        """
        n = layout.num_rows
        in_stream = self._in_stream
        immediate = {k: self._private(v) for k, v in outputs.immediate.items()}
        deferred = {k: self._private(v) for k, v in outputs.deferred.items()}
        chunks = self._deferred.snapshot(outputs.deferred, layout)
        leftover = map_tensors(outputs.leftover, self._private)
        # copy-stream moves start after every private copy: they read them
        ready = None if in_stream else self.backend.record_event()
        arena = self.staging.arenas[slot]
        arena.reset()
        host_rows = {key: HostCopy.start(self.backend, arena, rows, ready, in_stream=in_stream)
                     for key, rows in deferred.items()}
        leftover = map_tensors(leftover, lambda t: HostCopy.start(
            self.backend, arena, t, ready, in_stream=in_stream))
        self._reads.resolve_conflicts(layout.runs)
        task = None
        with self._lock:
            claim = self.pool.claim(layout.runs)
            if immediate and n:
                staged = self.backend.needs_staging  # the write passes through the slot's pages
                task = self._tasks.new(f"step {step_id}", staging_slot=slot if staged else None)
                self.pool.record_write(immediate, layout.runs, claim, task.task_id)
        if task is not None:
            if task.staging_slot is not None:
                self.staging.hold(slot, ("write", task.task_id))
            write_slots = torch.from_numpy(layout.slots) if device_slots is None \
                else device_slots
            self._launch(task, (
                self.backend.scatter_rows(
                    rows if rows.dim() == 2 else rows.reshape(n, -1), write_slots,
                    self.pool.keys[key].storage, ready=ready,
                    staging=(self.staging.buffer(slot, key, self.pool.keys[key].row_width,
                                                 rows.dtype)
                             if task.staging_slot is not None else None),
                    in_stream=in_stream)
                for key, rows in immediate.items()), False)
        if chunks:
            self._deferred.append(chunks, layout.slots, claim)
        record = _StepRecord(step_id, slot, layout, outputs.feature_shapes(),
                             {}, host_rows, {}, leftover)
        self._plan_reads(record, immediate.keys(), claim, task, spans)
        self._stats.add(rows_saved=n, miss_tokens=n, bytes_saved=sum(
            v.numel() * v.element_size() for v in outputs.per_token().values()))
        return record

    def _launch(self, task: WriteTask, transfers: Iterable[Transfer],
                report_failure: bool) -> None:
        """Issue the task's copies (a lazy iterable), then hand it to the committer as QUEUED.

        If issuing fails midway, the task still goes to the committer: the copies
        already issued land (their staging pages stay held) before it fails with
        the error, which is raised here too; `report_failure` says whether the next
        public call should raise it again (False: this caller passes it on).
        """
        issued: list[Transfer] = []
        try:
            issued.extend(transfers)
        except Exception as exc:
            task.launch_error = exc
            task.report_failure = report_failure
        task.transfers = issued
        task.transition(TaskState.QUEUED)
        if all(t.complete_at_launch for t in issued):
            self._committer.land(task)  # nothing in flight: land it on this thread
        else:
            self._committer.submit(task)
        if task.launch_error is not None:
            raise task.launch_error

    def _on_landed(self, task: WriteTask) -> None:
        """Committer callback: forget the task, return its budget and staging hold; a failed
        task's rows are lost from now on, and its error waits for the next call."""
        with self._lock:
            self._tasks.forget(task)
            self._deferred.landed(task)
            if task.state is TaskState.FAILED:
                self.pool.mark_lost(task.task_id)
                if task.report_failure:
                    self._failures.append(
                        OmniPrefixCacheError(f"{task.describe()}: {task.error}"))
        if task.staging_slot is not None:
            self.staging.release(task.staging_slot, ("write", task.task_id))

    def _mirror_block_copy(self, src: int, dst: int) -> None:
        """vLLM copied KV block `src` into `dst`: `dst` serves the same rows from now on.

        Before the host copy, `src`'s open deferred writes are flushed and every
        launched write lands: one still in flight to `dst` (a discarded step, a
        retiring tenant's flush) must not land over the copy. Block copies are
        rare, so a barrier is simpler than tracking each write's slots.
        """
        bs = self.config.block_size
        if not (0 < src < self.config.num_blocks and 0 < dst < self.config.num_blocks):
            raise OmniPrefixCacheUnmatchError(
                f"kv_cache_block_copies: block copy {src} -> {dst} outside "
                f"1..{self.config.num_blocks - 1}")
        src_slots = np.arange(src * bs, (src + 1) * bs)
        self._reads.resolve_conflicts(np.array([[dst * bs, (dst + 1) * bs]], dtype=np.int64))
        with self._lock:
            sources = self._tasks.live(self.pool.producer_ids(src_slots, self.pool.keys))
        self._deferred.flush_tasks(sources)
        with self._lock:  # open deferred writes to dst drop those rows: dst gets a new claim
            launched = self._tasks.launched()
        for task in launched:
            try:
                task.wait(self.config.staging_claim_timeout_s)
            except OmniPrefixCacheError:
                if task.state is not TaskState.FAILED:
                    raise  # still running after the timeout: copying now would race it
                with self._lock:
                    self.pool.mark_lost(task.task_id)  # its rows must not be copied as present
        with self._lock:
            self.pool.copy_block(src, dst)

    # ------------------------------------------------------------------ reads

    def _plan_reads(self, record: _StepRecord, immediate: Iterable[str], claim: int,
                    task: WriteTask | None, spans: Mapping[str, tuple[int, np.ndarray]]) -> None:
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

    def _plan_hit_keys(self, what: str, record: _StepRecord, hit_slots: np.ndarray,
                       step_rows: int) -> dict[str, RowRead]:
        """A hit's reads: every key this step emits, and every other per-token key the pool
        has rows of at `hit_slots` (a cached image's rows when the new tokens are text); the
        step's rows of a key it does not emit read zeros (caller holds the lock)."""
        others = [k for k in self.pool.keys  # no rows of it here: the request never had any
                  if k not in record.per_token and self.pool.present(k, hit_slots).any()]
        return {key: self._reads.plan_hit(what, key, hit_slots, step_rows)
                for key in (*record.per_token, *others)}

    # ------------------------------------------------------------------ materialize

    def _consume(self, step_id: int, req_ids: Sequence[str]) -> _StepRecord:
        self._check_usable("materialize" if req_ids else "discard_step")
        with self._lock:
            record = self._steps.get(step_id)
            if record is None:
                raise OmniPrefixCacheUnmatchError(
                    f"step {step_id} is unknown or was already consumed")
            unknown = [r for r in req_ids if r not in record.layout]
            if unknown:
                raise OmniPrefixCacheUnmatchError(
                    f"materialize(step {step_id}): requests {unknown} have no rows in that step "
                    f"(saved: {sorted(record.layout.order)})")
            del self._steps[step_id]
        return record

    def _assemble(self, record: _StepRecord, req_ids: Sequence[str]) -> StageCacheOutputs:
        timeout = self.config.staging_claim_timeout_s
        wanted = set(req_ids)
        for req_id, per_key in record.hit_reads.items():
            if req_id not in wanted:
                for read in per_key.values():
                    self._reads.cancel(read)
        step_rows: dict[str, torch.Tensor] = {}
        for key, read in record.step_reads.items():
            self._reads.resolve(read)
            step_rows[key] = read.out
        for key, copy in record.host_rows.items():
            host = copy.result(timeout, f"step {record.step_id} {key!r} rows")
            step_rows[key] = host.view(host.shape[0], math.prod(host.shape[1:]))
        leftover = map_tensors(record.leftover, lambda copy: copy.result(
            timeout, f"step {record.step_id} leftover"))
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
                feat = record.per_token.get(key) or self.pool.keys[key].feat_shape
                value = mine.view(mine.shape[0], *feat)
                if key == HIDDEN_KEY:
                    hidden[req_id] = value
                else:
                    mm.setdefault(key, {})[req_id] = value
        self._stats.add(hit_bytes_gathered=hit_bytes)
        return StageCacheOutputs(hidden if self.policy.needs_full_hidden_states else None, mm,
                                 leftover)

    def _release_step(self, record: _StepRecord) -> None:
        """Cancel its unread reads, grow its slot's arena if it was short (off the engine
        thread), then free the slot."""
        for read in record.reads():
            self._reads.cancel(read)
        self.staging.arenas[record.staging_slot].grow()
        self.staging.release(record.staging_slot, ("step", record.step_id))
