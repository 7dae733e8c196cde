"""The save path: a step's rows copied where they must outlive the call, its slots claimed,
its write launched, its reads planned; all on the engine thread, none of it waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

from prefix_cache.config import PrefixCacheConfig
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.deferred import DeferredWriter
from prefix_cache.core.hits import StepHits
from prefix_cache.core.host_copies import HostCopy
from prefix_cache.core.launcher import WriteLauncher
from prefix_cache.core.layout import StepLayout
from prefix_cache.core.outputs import OutputChecker, StepOutputs, map_tensors
from prefix_cache.core.reads import ReadPlanner, RowRead
from prefix_cache.core.staging import StagingPool
from prefix_cache.core.stats import CacheStats
from prefix_cache.core.step_reads import StepReads, StepRecord
from prefix_cache.core.tasks import TaskTable
from prefix_cache.devices.base import DeviceBackend, slot_checks_on
from prefix_cache.errors import OmniPrefixCacheInputError


class StepWriter:
    """Saves steps: only the engine thread calls it, so slots are claimed in launch order."""

    def __init__(self, config: PrefixCacheConfig, backend: DeviceBackend,
                 pool: PrefixBlockPool, staging: StagingPool, tasks: TaskTable,
                 lock: threading.Lock, stats: CacheStats, checker: OutputChecker,
                 launcher: WriteLauncher, deferred: DeferredWriter, reads: ReadPlanner,
                 step_reads: StepReads) -> None:
        self._config = config
        self._backend = backend
        self._pool = pool
        self._staging = staging
        self._tasks = tasks
        self._lock = lock
        self._stats = stats
        self._checker = checker
        self._launcher = launcher
        self._deferred = deferred
        self._reads = reads
        self._step_reads = step_reads
        #: OMNI_PREFIX_CACHE_CHECK_SLOTS=1: compare the runner's slot mapping with the view's
        #: slots every step (a copy to the host: a synchronization, for debugging only)
        self._check_slots = slot_checks_on()

    @property
    def in_stream(self) -> bool:
        """Whether writes go out on the caller's stream, reading its tensors in place."""
        return self._config.write_stream == "compute" or self._backend.synchronous

    def device_slots(self, slot_mapping: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The runner's slot mapping, checked, where it is a device tensor; else None (the
        view's host slots serve). `save` decides whether its write can read it."""
        if slot_mapping is None:
            return None
        if not isinstance(slot_mapping, torch.Tensor):
            raise OmniPrefixCacheInputError(
                f"save_outputs: slot_mapping must be a tensor, got {type(slot_mapping).__name__}")
        shape, dtype = slot_mapping.shape, slot_mapping.dtype
        if len(shape) != 1 or dtype not in (torch.int32, torch.int64) or shape[0] < n:
            raise OmniPrefixCacheInputError(
                f"save_outputs: slot_mapping must be a 1-D int32/int64 tensor of at least the "
                f"step's {n} tokens, got {tuple(shape)} {dtype}")
        device = self._checker.check_device("save_outputs: slot_mapping", slot_mapping,
                                            host_ok=True)
        return None if device.type == "cpu" else slot_mapping

    def install_keys(self, new_keys: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Allocate pools for keys seen for the first time (unlocked), then install them all."""
        if not new_keys:  # every step after a key's first
            return
        allocated = []
        try:
            for key, (feat, dtype) in new_keys.items():
                with self._stats.timed("pool_allocation"):
                    allocated.append(self._pool.allocate(
                        key, feat, dtype, sum(k.storage.nbytes for k in allocated)))
        except BaseException:
            for pool_key in allocated:
                pool_key.storage.close()
            raise
        with self._lock:
            for pool_key in allocated:
                self._pool.install(pool_key)

    def save(self, step_id: int, slot: int, outputs: StepOutputs, layout: StepLayout,
             hits: StepHits, device_slots: torch.Tensor | None, plan_reads: bool,
             served: StepHits, gathered: dict[str, dict[str, RowRead]]) -> StepRecord:
        """Copy what outlives the call, then claim the step's slots and launch its write;
        plan its reads unless it will only be discarded, and those of its hits in `served`
        (`hits`: all of the step's; a hit `plan_hit_rows` read already is not served), taking
        over the reads planned for them at the step's start (`gathered`).

        Everything that can fail for want of memory runs before the claim, so a
        failure there leaves the pool as it was.
        """
        n = layout.num_rows
        in_stream = self.in_stream
        # read in stream order, by a backend that takes them (one that could not map a pool
        # has given them up); the write reads the first n entries
        if not (in_stream and self._backend.device_slots):
            device_slots = None
        if device_slots is not None and self._check_slots:
            self._check_slot_mapping(step_id, device_slots[:n], layout.slots)
        immediate = self._privates(outputs.immediate, in_stream)
        deferred = self._privates(outputs.deferred, in_stream)
        chunks = self._deferred.snapshot(outputs.deferred, layout)
        leftover = map_tensors(outputs.leftover, self._private) if outputs.leftover else {}
        # copy-stream moves start after every private copy: they read them; so does the
        # deferred chunks' write, from whichever stream retires their request
        ready = None if in_stream else self._backend.record_event()
        copied = ready if ready is not None or not chunks else self._backend.record_event()
        arena = self._staging.arenas[slot]
        arena.reset()
        host_rows: dict[str, HostCopy] = {}
        if deferred or leftover:
            host_rows = {key: HostCopy.start(self._backend, arena, rows, ready,
                                             in_stream=in_stream)
                         for key, rows in deferred.items()}
            leftover = map_tensors(leftover, lambda t: HostCopy.start(
                self._backend, arena, t, ready, in_stream=in_stream))
        self._reads.resolve_conflicts(layout.runs)
        task = None
        with self._lock:
            if immediate and n:
                staged = self._backend.needs_staging  # the write passes through the slot's pages
                task = self._tasks.new(f"step {step_id}", staging_slot=slot if staged else None)
            try:
                claim = self._pool.claim_write(layout.runs, immediate if task else (),
                                               task.task_id if task else 0)
            except BaseException:
                if task is not None:
                    self._tasks.forget(task)
                raise
        if task is not None:
            if task.staging_slot is not None:
                self._staging.hold(slot, ("write", task.task_id))
            write_slots = device_slots if device_slots is not None else (
                None if self._backend.host_slots_only else torch.from_numpy(layout.slots))
            self._launcher.launch(task, (
                self._backend.scatter_rows(
                    rows if len(outputs.shapes[key]) == 2 else rows.reshape(n, -1), write_slots,
                    self._pool.keys[key].storage, ready=ready,
                    staging=(self._staging.buffer(slot, key, self._pool.keys[key].row_width,
                                                  self._pool.keys[key].dtype)
                             if task.staging_slot is not None else None),
                    in_stream=in_stream, host_slots=layout.slots)
                for key, rows in immediate.items()), False)
        if chunks:
            self._deferred.append(chunks, layout.slots, claim, copied)
        record = StepRecord(step_id, slot, layout, outputs.feature_shapes(),
                            {}, host_rows, {}, leftover, readable=plan_reads)
        if plan_reads:
            self._step_reads.plan(record, immediate.keys(), claim, task, served, gathered)
        self._stats.add(rows_saved=n, miss_tokens=n, hit_tokens=sum(hits.tokens),
                        hit_requests=len(hits), bytes_saved=n * sum(
                            self._pool.keys[key].row_bytes for key in outputs.shapes))
        return record

    def _privates(self, rows: dict[str, torch.Tensor], in_stream: bool
                  ) -> dict[str, torch.Tensor]:
        """`rows` with each tensor's private copy (`_private`): `rows` itself where the copies
        that read them are issued in stream order (`in_stream`)."""
        if in_stream or not rows:
            return rows
        return {k: self._private(v) for k, v in rows.items()}

    def _private(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor's private copy, ordered on the caller's stream; none is needed
        where the copies that read it are issued in stream order, nor for host tensors."""
        if self.in_stream or tensor.device.type == "cpu":
            return tensor
        return self._backend.snapshot(tensor)

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
