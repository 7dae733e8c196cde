"""PrefixCacheRunnerMixin: the cache inside a vLLM model runner (GPUModelRunner, CPUModelRunner, NPUModelRunner).

Put it first in the bases (`class R(PrefixCacheRunnerMixin, GPUModelRunner)`). It
snapshots the model's policy at `load_model`, runs the gate and builds the
manager at `initialize_kv_cache` (allocating the hidden pool there, off the
request path), calls `new_step_starts` before the runner updates its batch,
`save_outputs` right after the forward, and `materialize` once the step's output
is built, delivering each request's rows by position to `take_stage_outputs()`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from prefix_cache import devices
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy
from prefix_cache.delivery import StageDelivery
from prefix_cache.gate import stage_prefix_cache_config
from prefix_cache.group_view import FullAttentionGroupView
from prefix_cache.manager import OmniPrefixCacheManager

logger = logging.getLogger(__name__)


def _outputs_leave_this_rank() -> bool:
    """Last pipeline-parallel rank and the tensor-parallel rank whose output vLLM returns."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    return get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0


class PrefixCacheRunnerMixin:
    """Runs one stage's prefix cache inside the runner; None-safe when the gate turns it off."""

    omni_prefix_cache: OmniPrefixCacheManager | None = None
    _omni_policy: ModelCachePolicy = ModelCachePolicy()
    _omni_in_step = False
    _omni_step_id: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._omni_delivery = StageDelivery()
        self._omni_step_ends: dict[str, int] = {}  # req -> position after this step's tokens

    # ------------------------------------------------------------------ lifecycle

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self._omni_policy = ModelCachePolicy.from_model(self.model)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self._ensure_omni_prefix_cache()

    def _ensure_omni_prefix_cache(self) -> OmniPrefixCacheManager | None:
        """Build the manager once, on the rank whose outputs leave the stage."""
        if self.omni_prefix_cache is not None or getattr(self, "_omni_gate_done", False):
            return self.omni_prefix_cache
        self._omni_gate_done = True
        vllm_config = self.vllm_config
        config = stage_prefix_cache_config(
            kv_cache_config=self.kv_cache_config, cache_config=self.cache_config,
            kv_transfer_config=vllm_config.kv_transfer_config,
            scheduler_config=self.scheduler_config, model_config=self.model_config,
            speculative_config=self.speculative_config, parallel_config=self.parallel_config,
            is_pooling_model=self.is_pooling_model)
        if config is None or not _outputs_leave_this_rank():
            return None
        backend = devices.get_backend(self.device.type)
        kernel_sizes = getattr(self, "_kernel_block_sizes", None)
        view = FullAttentionGroupView(self.input_batch, config.block_size, backend=backend,
                                      kernel_block_size=kernel_sizes[0] if kernel_sizes else None)
        manager = OmniPrefixCacheManager(config, view, backend=backend)
        manager.register_policy(self._omni_policy)
        if self._omni_policy.needs_full_hidden_states:
            manager.preallocate(HIDDEN_KEY, (self.model_config.get_hidden_size(),),
                                self.model_config.dtype)
        self.omni_prefix_cache = manager
        logger.info("omni prefix cache on %s: %d blocks of %d tokens", backend.name,
                    config.num_blocks, config.block_size)
        return manager

    # ------------------------------------------------------------------ per step

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.omni_prefix_cache is not None:
            self.omni_prefix_cache.new_step_starts(scheduler_output)  # before _update_states
        self._omni_step_id = None
        self._omni_step_ends = {}
        self._omni_in_step = True
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self._omni_in_step = False

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._model_forward(*args, **kwargs)
        if self._omni_in_step:  # dummy and profile runs are not steps
            self._omni_in_step = False
            hidden = output[0] if getattr(self, "use_aux_hidden_state_outputs", False) else output
            if isinstance(hidden, torch.Tensor):
                self._omni_after_forward(hidden, self.omni_mm_outputs(output))
        return output

    def _omni_after_forward(self, hidden: torch.Tensor, mm: dict[str, Any] | None) -> None:
        """Save the step (cache on) or deliver each request's own rows (cache off)."""
        num_reqs = self.input_batch.num_reqs
        bounds = self.query_start_loc.np[: num_reqs + 1].tolist()
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs].tolist()
        req_ids = self.input_batch.req_ids[:num_reqs]
        self._omni_step_ends = {r: computed[i] + bounds[i + 1] - bounds[i]
                                for i, r in enumerate(req_ids)}
        if self.omni_prefix_cache is not None:
            self._omni_step_id = self.omni_prefix_cache.save_outputs(
                hidden, mm, num_tokens_unpadded=bounds[-1], num_tokens_padded=hidden.shape[0])
            return
        for i, req_id in enumerate(req_ids):
            self._omni_delivery.add(req_id, computed[i], {
                HIDDEN_KEY: hidden[bounds[i]: bounds[i + 1]].to("cpu", copy=True)})

    def omni_mm_outputs(self, model_output: Any) -> dict[str, Any] | None:
        """Per-token multimodal outputs of an omni model's forward; plain LMs have none."""
        return None

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        step_id, self._omni_step_id = self._omni_step_id, None
        if step_id is not None:
            outs = self.omni_prefix_cache.materialize(step_id, list(self._omni_step_ends))
            for req_id, end in self._omni_step_ends.items():
                rows = {k: v[req_id] for k, v in outs.mm_outputs.items()}
                if outs.hidden_states is not None:
                    rows[HIDDEN_KEY] = outs.hidden_states[req_id]
                if rows:  # a hit's rows start at 0, the others where the step's tokens do
                    self._omni_delivery.add(req_id, end - next(iter(rows.values())).shape[0],
                                            rows)
        return output

    def take_stage_outputs(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each request's rows from position 0 delivered so far, per key: what the next stage gets."""
        return self._omni_delivery.take()

    def shutdown_omni_prefix_cache(self) -> None:
        if self.omni_prefix_cache is not None:
            self.omni_prefix_cache.shutdown()
