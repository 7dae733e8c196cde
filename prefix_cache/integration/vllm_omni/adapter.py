"""vllm-omni 0.30's prefix-cache manager API over this project's manager.

vllm-omni's runner (`vllm_omni.core.prefix_cache.runner_mixin`) builds
`OmniPrefixCacheManager(config, view)`, registers its `ModelCachePolicy`, then per step calls
`new_step_starts`, `save_outputs`, and one `materialize` or `discard_step` of the step id; at
the end `shutdown`. `VllmOmniPrefixCache` takes those calls with vllm-omni's types and answers
with them, over `prefix_cache.manager.OmniPrefixCacheManager`. Where the two APIs differ:

- vllm-omni calls `new_step_starts` on a step that runs no forward and then saves nothing;
  this manager wants every step saved: such a step is saved empty and discarded when the next
  step starts (or at shutdown).
- vllm-omni's `StageCacheOutputs` has no `leftover`: outputs that are not per-token go into
  `mm_outputs` per request, split by vllm-omni's own `to_payload_element` over the request's
  rows of the step, as vllm-omni's manager splits them.
- vllm-omni's `eager` picks where its pool writes run; this manager's device backend orders
  its writes, so the argument is accepted and changes nothing. `copy_chunk_bytes` likewise.

Needs `vllm_omni` importable (its types are the API); imported only by the plugin that installs
the adapter and by code that asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from vllm_omni.core.prefix_cache import interface as omni
from vllm_omni.utils.mm_outputs import to_payload_element

from prefix_cache.config import ModelCachePolicy, PrefixCacheConfig
from prefix_cache.manager import OmniPrefixCacheManager


def cache_config(config: omni.PrefixCacheConfig) -> PrefixCacheConfig:
    """This cache's config for a stage vllm-omni sized: same pool, staging and timeout, its
    device-clone budget as `gpu_budget_bytes`."""
    return PrefixCacheConfig(
        num_blocks=config.num_blocks, block_size=config.block_size,
        staging_depth=config.staging_depth,
        staging_capacity_tokens=config.staging_capacity_tokens,
        staging_claim_timeout_s=config.staging_claim_timeout_s,
        gpu_budget_bytes=config.gpu_staging_bytes)


def cache_policy(policy: omni.ModelCachePolicy) -> ModelCachePolicy:
    """This cache's policy for vllm-omni's: whether the hidden states are kept, which mm keys
    are written at the finish."""
    return ModelCachePolicy(needs_full_hidden_states=policy.needs_full_hidden_states,
                            deferred_keys=policy.deferred_keys)


class VllmOmniPrefixCache:
    """vllm-omni's `OmniPrefixCacheManager`, served by this project's manager.

    Invariant: at most one step started without a save (`_unsaved`), and it is saved empty
    and discarded before the next step starts or the cache shuts down.
    """

    def __init__(self, config: omni.PrefixCacheConfig, view: Any, *,
                 eager: bool | None = None) -> None:
        del eager  # vllm-omni's write mode; this manager's backend orders its writes
        self.manager = OmniPrefixCacheManager(cache_config(config), view)
        self._unsaved = False

    def register_policy(self, policy: omni.ModelCachePolicy) -> None:
        self.manager.register_policy(cache_policy(policy))

    def new_step_starts(self, scheduler_output: Any) -> None:
        self._close_unsaved_step()
        self.manager.new_step_starts(scheduler_output)
        self._unsaved = True

    def save_outputs(self, hidden_states: torch.Tensor | None,
                     mm_outputs: Mapping[str, Any] | None, *, num_tokens_unpadded: int,
                     num_tokens_padded: int) -> int:
        step_id = self.manager.save_outputs(hidden_states, mm_outputs,
                                            num_tokens_unpadded=num_tokens_unpadded,
                                            num_tokens_padded=num_tokens_padded)
        self._unsaved = False
        return step_id

    def materialize(self, step_id: int, req_ids: Iterable[str]) -> omni.StageCacheOutputs:
        """Each request's outputs from position 0, vllm-omni's way: per-token keys merged
        with the hit rows, the rest split over the request's rows of the step."""
        req_ids = list(req_ids)
        step = self.manager.materialize_step(step_id, req_ids)
        outputs = step.per_request(req_ids, self.manager.policy.needs_full_hidden_states)
        mm_outputs: dict[str, dict[str, Any]] = dict(outputs.mm_outputs)
        spans = step.spans()
        for key, value in outputs.leftover.items():
            mm_outputs[key] = {
                req_id: to_payload_element(value, step.order.index(req_id), *spans[req_id],
                                           pass_lists_through=True, seq_len=step.ends[-1])
                for req_id in req_ids}
        return omni.StageCacheOutputs(hidden_states=outputs.hidden_states,
                                      mm_outputs=mm_outputs)

    def discard_step(self, step_id: int) -> None:
        self.manager.discard_step(step_id)

    def stats(self) -> dict[str, int | float]:
        return self.manager.stats()

    def shutdown(self) -> None:
        try:
            self._close_unsaved_step()
        finally:
            self.manager.shutdown()

    def _close_unsaved_step(self) -> None:
        if self._unsaved:
            self._unsaved = False
            self.manager.discard_step(self.manager.save_outputs(
                None, None, num_tokens_unpadded=0, num_tokens_padded=0))
