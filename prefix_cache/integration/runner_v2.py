"""Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`) with the stage-output cache.

V2 has no `_model_forward` to wrap, no persistent batch and no host block table:

- the step's rows are read after `execute_model` returns None (a forward ran on the last
  pipeline rank), from `execute_model_state`: the hidden states, and the step's `InputBatch`
  (request order, `num_computed_tokens_np`, `query_start_loc_np`, `idx_mapping_np`);
- the block ids live on the device only (a Triton kernel writes staged rows), so
  `BlockIdMirror` keeps a host copy of the cached group's ids by wrapping
  `BlockTables.append_block_ids`, which every request's new and appended blocks go through;
- the device slot mapping is `BlockTables.slot_mappings[group]`, written each step before the
  forward and read by the cache's write in stream order;
- the forward returns hidden states only (V2 asserts a tensor), so no multimodal outputs;
- a preempted request comes back as a new request (`preempted_req_ids`, then
  `scheduled_new_reqs`), which the adapter already reads; V2 drops its state at the
  preemption, so the mixin keeps its prompt length until then (an abort meanwhile publishes
  it with the rows it had, as the V1 runner does);
- the worker's kernel warm-up runs real steps with made-up requests: the worker pauses the
  stage meanwhile (`StageRunnerBase.omni_paused`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.integration.group_view import (positions_slot_runs, request_slot_runs,
                                                  rows_positions_runs)
from prefix_cache.integration.runner_mixin import StageRunnerBase
from prefix_cache.core.runs import runs_slots
from prefix_cache.integration.stage_outputs import StepBatch


class BlockIdMirror:
    """Host copy of one KV-cache group's block ids, per request row of V2's `BlockTables`:
    row `i` holds `counts[i]` allocator block ids, as `append_block_ids` last left them."""

    def __init__(self, block_tables: Any, group_id: int, max_num_reqs: int,
                 max_blocks: int) -> None:
        self.group_id = group_id
        self.ids = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.counts = np.zeros(max_num_reqs, dtype=np.int64)
        append = block_tables.append_block_ids

        def append_block_ids(req_index: int, new_block_ids: Sequence[Sequence[int]],
                             overwrite: bool, *args: Any, **kwargs: Any) -> None:
            append(req_index, new_block_ids, overwrite, *args, **kwargs)
            self.record(req_index, new_block_ids[group_id], overwrite)

        block_tables.append_block_ids = append_block_ids

    def record(self, req_index: int, block_ids: Sequence[int], overwrite: bool) -> None:
        start = 0 if overwrite else int(self.counts[req_index])
        end = start + len(block_ids)
        if end > self.ids.shape[1]:
            raise OmniPrefixCacheUnmatchError(
                f"request row {req_index}: {end} blocks in KV-cache group {self.group_id}, more "
                f"than the {self.ids.shape[1]} a request of max_model_len can hold")
        self.ids[req_index, start:end] = block_ids
        self.counts[req_index] = end


class StepBatchGroupView:
    """Slots of one full-attention group for the V2 step bound last:
    `slot = ids[row, pos // block_size] * block_size + pos % block_size`."""

    def __init__(self, mirror: BlockIdMirror, block_size: int,
                 row_of: Callable[[str], int | None]) -> None:
        self.mirror = mirror
        self.block_size = block_size
        self._row_of = row_of  # a live request's row in the block tables (None: none)
        self._req_ids: list[str] = []
        self._index: dict[str, int] = {}
        self._computed = np.zeros(0, dtype=np.int32)
        self._ids = mirror.ids[:0]
        self._slot_mapping: torch.Tensor | None = None

    def bind(self, req_ids: Sequence[str], num_computed: np.ndarray, rows: np.ndarray,
             slot_mapping: torch.Tensor | None) -> None:
        """The step's requests in batch order, their computed tokens at the step's start, their
        rows in the block tables, and the group's device slot mapping."""
        self._req_ids = list(req_ids)
        self._index = {r: i for i, r in enumerate(self._req_ids)}
        self._computed = np.ascontiguousarray(num_computed)
        self._ids = self.mirror.ids[rows]  # batch order
        self._slot_mapping = slot_mapping

    def batch_req_ids(self) -> list[str]:
        return self._req_ids

    def device_slot_mapping(self) -> torch.Tensor | None:
        return self._slot_mapping

    def step_slots_cpu(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> torch.Tensor:
        return torch.from_numpy(runs_slots(self.step_slot_runs(req_ids, num_scheduled_tokens)))

    def step_slot_runs(self, req_ids: Sequence[str],
                       num_scheduled_tokens: Mapping[str, int]) -> np.ndarray:
        """The slots as runs (`[k, 2]` of (first, end)), a block at a time."""
        return request_slot_runs(req_ids, num_scheduled_tokens, self._index, self._computed,
                                 self._ids, self.block_size, "the V2 step's batch")

    def request_positions_runs(self, req_id: str, num_positions: int,
                               start: int = 0) -> np.ndarray | None:
        """The slots of `req_id`'s positions `[start, num_positions)` as runs, from its row of
        the mirrored block ids; None where the runner no longer holds the request."""
        row = self._row_of(req_id)
        if row is None:
            return None
        return positions_slot_runs(req_id, start, num_positions, self.mirror.ids[row],
                                   self.block_size, "the V2 runner's block tables")

    def requests_positions_runs(self, req_ids: Sequence[str], starts: Sequence[int],
                                ends: Sequence[int]) -> np.ndarray | None:
        """`request_positions_runs` of every request at once, `[starts[i], ends[i])` of
        `req_ids[i]`, end to end; None where the runner does not hold each of them."""
        rows = [self._row_of(req_id) for req_id in req_ids]
        if None in rows:
            return None
        return rows_positions_runs(req_ids, rows, starts, ends, self.mirror.ids,
                                   self.block_size, "the V2 runner's block tables")


class PrefixCacheV2RunnerMixin(StageRunnerBase):
    """vLLM's Model Runner V2 with the stage-output cache: put it first in the bases."""

    _omni_group_id = 0

    def _omni_view(self, config: Any, backend: Any) -> StepBatchGroupView:
        max_blocks = -(-self.max_model_len // config.block_size)
        mirror = BlockIdMirror(self.block_tables, self._omni_group_id, self.max_num_reqs,
                               max_blocks)
        return StepBatchGroupView(mirror, config.block_size,
                                  lambda req_id: self.req_states.req_id_to_index.get(req_id))

    def _omni_prompt_len(self, req_id: str) -> int | None:
        index = self.req_states.req_id_to_index.get(req_id)
        if index is None:  # preempted since (V2 dropped its state): as noted then
            return self._omni_preempted.get(req_id)
        return int(self.req_states.prompt_len.np[index])

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        stage = self._omni_stepping(dummy=bool(kwargs.get("dummy_run")))
        if stage is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        self._omni_begin_step(stage, scheduler_output)  # before `finish_requests` inside
        output = super().execute_model(scheduler_output, *args, **kwargs)
        state = self.execute_model_state
        if output is not None:  # no forward here, or not the last pipeline rank: no sampling
            stage.end_step()
        elif state is not None and state.hidden_states is not None:
            self._omni_save_contained(state)
        return output

    def _omni_save(self, state: Any) -> None:
        batch = state.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        computed = batch.num_computed_tokens_np[:n]
        slot_mapping = None
        view = getattr(self.omni_prefix_cache, "view", None)
        if isinstance(view, StepBatchGroupView):
            slot_mapping = self.block_tables.slot_mappings[self._omni_group_id]
            view.bind(req_ids, computed, batch.idx_mapping_np[:n], slot_mapping)
        self._omni_stage.save_step(
            state.hidden_states, None,
            StepBatch(req_ids, computed.tolist(), batch.query_start_loc_np[1: n + 1].tolist()),
            num_tokens_padded=state.hidden_states.shape[0], slot_mapping=slot_mapping)
