"""PrefixCacheRunnerMixin: stage outputs leave a vLLM model runner V1 (GPU, CPU, NPU) via the cache.

Put it first in the bases (`class R(PrefixCacheRunnerMixin, GPUModelRunner)`); Model Runner
V2 has its own mixin over the same base (`prefix_cache.integration.runner_v2`). It
snapshots the model's policy at `load_model`; at `initialize_kv_cache` it runs
the gate, opens the stage channel and builds the manager (allocating the hidden
pool there, off the request path) when prefix caching is on; per step it calls
`new_step_starts` before the runner updates its batch, `save_outputs` right after
the forward, and leaves reading rows back and publishing to its output thread (see
`prefix_cache.integration.stage_outputs`), so the engine thread never waits for rows.
Each finished request's rows from position 0 go to the channel under its external
request id.

The channel is `vllm_config.additional_config["prefix_cache"]["channel"]`, else
`$PREFIX_CACHE_CHANNEL`; with neither, or one that does not open, the engine is refused (see
`open_stage_channel`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch

from prefix_cache.devices import get_backend
from prefix_cache.channel import OmniPrefixCacheChannelError, StageChannel, open_channel
from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery
from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.integration.forward_output import describe, read_forward_output
from prefix_cache.integration.gate import (check_host_pool, check_stage_outputs,
                                           stage_options, stage_pool_config, stream_every)
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.integration.prometheus import StageMetrics
from prefix_cache.integration.workers.finishes import check_pool_scheduler
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.integration.stage_outputs import StageOutputDriver, StepBatch

logger = logging.getLogger(__name__)
#: The stage's start lines, under vLLM's logger (whose handlers vLLM configures) to show beside
#: vLLM's own: an engine's caller sees no INFO line of a logger outside it.
start_logger = logging.getLogger(f"vllm.{__name__}")

CHANNEL_ENV = "PREFIX_CACHE_CHANNEL"


def open_stage_channel(vllm_config: Any) -> StageChannel:
    """The stage channel this engine publishes to (additional_config, then the environment),
    or a one-line refusal naming the setting and how to fix it.

    There is no default: a namespace of the worker's own would be one no consumer knows, and
    the stage's rows would sit there unread until they expire, so the engine is refused.
    """
    spec = stage_options(vllm_config).get("channel")
    where = "additional_config['prefix_cache']['channel']"
    if not spec:
        spec, where = os.environ.get(CHANNEL_ENV), f"${CHANNEL_ENV}"
    if not spec:
        raise OmniPrefixCacheUnmatchError(
            f"no stage channel is configured, so no consumer could read this stage's outputs: "
            f"open one where they are consumed (prefix_cache.channel.open_channel()) and start "
            f"the engine with additional_config={{'prefix_cache': {{'channel': channel.spec}}}}, "
            f"or set {CHANNEL_ENV} to its spec")
    try:
        channel = open_channel(spec)
    except (OmniPrefixCacheChannelError, ValueError, ImportError) as exc:
        raise OmniPrefixCacheUnmatchError(
            f"{where} {spec!r} cannot be opened: {exc}; open the channel where the rows are "
            f"consumed first (prefix_cache.channel.open_channel()) and hand the engine its "
            f"channel.spec") from None  # the cause is in the line: one traceback, not two
    if channel.owns_namespace:
        channel.close()
        raise OmniPrefixCacheUnmatchError(
            f"{where} {spec!r} names no namespace, so the worker would publish into a new one "
            f"of its own that no consumer could read: open the channel where the rows are "
            f"consumed (prefix_cache.channel.open_channel()) and hand the engine its "
            f"channel.spec")
    return channel


def external_request_id(req_id: str) -> str:
    """The id the engine's caller gave a request: vLLM appends `-<8 random chars>` inside."""
    return external_request_ids()(req_id)


def external_request_ids() -> Callable[[str], str]:
    """`external_request_id` with vLLM's setting read once, now: the delivery maps a request's
    id for every chunk it publishes, and each read of `vllm.envs` reads the environment."""
    from vllm import envs
    if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:
        return _same_id
    return _without_random_suffix


def _same_id(req_id: str) -> str:
    return req_id


def _without_random_suffix(req_id: str) -> str:
    return req_id.rsplit("-", 1)[0]


def _outputs_leave_this_rank() -> bool:
    """Last pipeline-parallel rank and the tensor-parallel rank whose output vLLM returns."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    return get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0


class StageRunnerBase:
    """What every cache runner mixin shares: the policy, the stage's output path, finishes.

    A model-runner flavour (V1, V2) supplies `_omni_view` (the cache's group view over its
    batch), `_omni_prompt_len` and `_omni_save` (its step's rows read from its forward's
    output), and calls the stage driver at its own hook points.
    """

    omni_prefix_cache: OmniPrefixCacheManager | None = None
    #: requests vLLM preempted and has not scheduled since, with their prompt lengths noted at
    #: the preemption (V1 keeps their states with the block ids vLLM freed; V2 drops them)
    _omni_preempted: Mapping[str, int | None] = MappingProxyType({})
    _omni_policy: ModelCachePolicy = ModelCachePolicy()
    _omni_stage: StageOutputDriver | None = None
    _omni_metrics: StageMetrics | None = None  # where vLLM gathers processes' metrics
    _omni_external_id: Callable[[str], str]  # set with the stage: its caller's id of a request
    _omni_paused = False  # warm-up steps with made-up requests: neither cached nor published

    # ------------------------------------------------------------------ lifecycle

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self._omni_policy = ModelCachePolicy.from_model(self.model)

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if not kwargs.get("is_profiling", False):  # a minimal KV cache for graph profiling
            self._ensure_omni_prefix_cache()

    def _omni_view(self, config: Any, backend: Any) -> Any:
        """The manager's view of the runner's batch (see `prefix_cache.core.layout.GroupView`)."""
        raise NotImplementedError

    def _omni_prompt_len(self, req_id: str) -> int | None:
        """A live request's prompt length (None: the runner holds no such request)."""
        raise NotImplementedError

    def _ensure_omni_prefix_cache(self) -> OmniPrefixCacheManager | None:
        """Build the stage's output path once, on the rank whose outputs leave the stage."""
        if self._omni_stage is not None or not _outputs_leave_this_rank():
            return self.omni_prefix_cache
        vllm_config = self.vllm_config
        check_stage_outputs(speculative_config=vllm_config.speculative_config)
        options = stage_options(vllm_config)
        every = stream_every(options)
        config = stage_pool_config(vllm_config, self.kv_cache_config,
                                   device_type=self.device.type,
                                   is_pooling_model=self.is_pooling_model)
        if config is not None and config.capped:
            check_pool_scheduler(vllm_config)
        backend = get_backend(self.device.type)
        hidden_size = vllm_config.model_config.get_hidden_size()
        dtype = vllm_config.model_config.dtype
        # refused here, in vLLM's initialize_from_config RPC, whose failure carries the line up
        # to the engine core (a failed worker start reaches it as "see stack trace" only)
        channel = open_stage_channel(vllm_config)  # before any pool is allocated
        try:
            channel.register_producer()  # consumers learn within seconds if this process dies
            manager = None if config is None else self._omni_cache(config, backend,
                                                                   hidden_size, dtype)
        except BaseException:
            channel.close()
            raise
        self._omni_external_id = external_request_ids()  # chunks and finishes alike
        self._omni_stage = StageOutputDriver(
            StageDelivery(channel, external_id=self._omni_external_id, stream_every=every),
            backend, cache=manager,
            policy=self._omni_policy,
            empty_hidden=lambda: torch.empty((0, hidden_size), dtype=dtype, device=self.device),
            timeout_s=30.0 if config is None else config.staging_claim_timeout_s)
        self.omni_prefix_cache = manager
        self._omni_metrics = StageMetrics.where_vllm_gathers(self._omni_stage.stats)
        start_logger.info("stage outputs go to channel %s", channel.spec)
        return manager

    def _omni_cache(self, config: PrefixCacheConfig, backend: Any, hidden_size: int,
                    dtype: torch.dtype) -> OmniPrefixCacheManager:
        """The manager over the runner's batch with the hidden-state pool allocated; refused
        first, in one line, when the pool would be over the host budget."""
        keys = [HIDDEN_KEY] if self._omni_policy.needs_full_hidden_states else []
        pool = check_host_pool(config, keys=len(keys), feat_shape=(hidden_size,), dtype=dtype,
                               device_type=self.device.type)
        manager = OmniPrefixCacheManager(config, self._omni_view(config, backend),
                                         backend=backend)
        manager.register_policy(self._omni_policy)
        for key in keys:
            manager.preallocate(key, (hidden_size,), dtype)
        pinned = any(manager.pool.keys[key].storage.pinned for key in keys)
        start_logger.info("omni prefix cache on %s: %d blocks of %d tokens; host pool %s, %s",
                          backend.name, config.num_blocks, config.block_size, pool,
                          "pinned" if pinned else "pageable")
        return manager

    def shutdown(self) -> None:
        """Publish what is queued, stop the output thread and the cache, then vLLM's shutdown."""
        stage, self._omni_stage = self._omni_stage, None
        metrics, self._omni_metrics = self._omni_metrics, None
        if metrics is not None:
            metrics.close()
        try:
            if stage is not None:
                stage.close()
        finally:
            super().shutdown()

    @contextmanager
    def omni_paused(self) -> Iterator[None]:
        """Steps run meanwhile (a worker's kernel warm-up with made-up requests) pass by the
        stage: nothing is cached or published."""
        self._omni_paused = True
        try:
            yield
        finally:
            self._omni_paused = False

    def _omni_stepping(self, dummy: bool = False) -> StageOutputDriver | None:
        """The stage driver when this step is a real one it should see (turned off too: the
        requests a step retires still get their failures), else None."""
        stage = self._omni_stage
        if stage is None or self._omni_paused or dummy:
            return None
        return stage

    # ------------------------------------------------------------------ finishes

    def omni_requests_finished(self, finished: Mapping[str, int | None]) -> None:
        """The scheduler just retired these requests (before vLLM returns their last outputs),
        each with how many of its rows stand (None: all): publish them now, not when the next
        step tells this runner (that step may never run)."""
        stage = self._omni_stage
        if stage is not None:
            stage.finish_now([self._omni_finished(r, rows) for r, rows in finished.items()])

    def _omni_begin_step(self, stage: StageOutputDriver, scheduler_output: Any) -> None:
        """Start the step on the stage (it pins the rows of the requests the step preempts),
        before the runner drops the finished and preempted requests' states (their prompt
        lengths are read here)."""
        stage.begin_step(scheduler_output, [self._omni_finished(r)
                                            for r in scheduler_output.finished_req_ids])
        self._omni_note_preempted(scheduler_output)

    def _omni_note_preempted(self, scheduler_output: Any) -> None:
        """Note the requests this step preempts, with their prompt lengths, until a step
        schedules them again or they finish."""
        noted = self._omni_preempted
        if preempted := getattr(scheduler_output, "preempted_req_ids", None):
            noted = {**noted, **{r: self._omni_prompt_len(r) for r in preempted}}
        if noted:
            gone = noted.keys() & {*scheduler_output.finished_req_ids,
                                   *scheduler_output.num_scheduled_tokens}
            if gone:
                noted = {r: n for r, n in noted.items() if r not in gone}
        self._omni_preempted = noted

    def _omni_finished(self, req_id: str, rows_standing: int | None = None) -> FinishedRequest:
        # prompt length None: aborted before it was ever scheduled
        return FinishedRequest(req_id, self._omni_external_id(req_id),
                               self._omni_prompt_len(req_id), rows_standing)

    # ------------------------------------------------------------------ per step

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        stage = self._omni_stepping()
        if stage is not None:
            stage.end_step()
        return output

    def _omni_save_contained(self, output: Any) -> None:
        """`_omni_save` of the step's forward output (the flavour's own reading of it), a fault
        in it (an `omni_mm_outputs` override that raises, a batch it cannot read) turning the
        stage off: it never reaches the forward."""
        try:
            self._omni_save(output)
        except Exception as exc:
            self._omni_turn_off(f"reading the step's outputs failed: {type(exc).__name__}: {exc}")

    def _omni_save(self, output: Any) -> None:
        """The flavour's: read the step's rows from `output` and hand them to the stage."""
        raise NotImplementedError(f"{type(self).__name__} reads no step output")

    def _omni_turn_off(self, reason: str) -> None:
        logger.warning("omni prefix cache off for this stage, and its outputs are no longer "
                       "published: %s", reason)
        self._omni_stage.turn_off(reason)  # closed (cache shut down) at the runner's shutdown
        self.omni_prefix_cache = None

    def prefix_cache_stats(self) -> dict[str, int | float]:
        """Counters of the cache and the delivery (numbers only: safe over collective_rpc)."""
        return {} if self._omni_stage is None else self._omni_stage.stats()


class PrefixCacheRunnerMixin(StageRunnerBase):
    """Model runner V1 (`GPUModelRunner`, `CPUModelRunner`, vllm-ascend's `NPUModelRunner`)
    with the stage-output cache: put it first in the bases."""

    _omni_in_step = False

    def _omni_view(self, config: Any, backend: Any) -> FullAttentionGroupView:
        kernel_sizes = getattr(self, "_kernel_block_sizes", None)
        return FullAttentionGroupView(self.input_batch, config.block_size, backend=backend,
                                      kernel_block_size=kernel_sizes[0] if kernel_sizes else None,
                                      request_block_ids=self._omni_block_ids)

    def _omni_block_ids(self, req_id: str) -> Sequence[Sequence[int]] | None:
        """Each KV-cache group's block ids of a request the runner holds, in the batch or not;
        None for one preempted since (its rows may be a new tenant's by now)."""
        state = self.requests.get(req_id)
        return None if state is None or req_id in self._omni_preempted else state.block_ids

    def _omni_prompt_len(self, req_id: str) -> int | None:
        state = self.requests.get(req_id)
        return None if state is None else state.num_prompt_tokens

    # ------------------------------------------------------------------ per step

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        stage = self._omni_stepping()
        if stage is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        self._omni_begin_step(stage, scheduler_output)
        self._omni_in_step = stage.active
        try:
            output = super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self._omni_in_step = False
        if output is not None:  # no sample_tokens follows (no forward, pooling, PP)
            stage.end_step()
        return output

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._model_forward(*args, **kwargs)
        if self._omni_in_step:  # dummy and profile runs are not steps
            self._omni_in_step = False
            self._omni_save_contained(output)
        return output

    def _omni_save(self, output: Any) -> None:
        read = read_forward_output(output)
        if read is None:
            self._omni_turn_off(f"the forward returned {describe(output)}, which it cannot read "
                                f"(a tensor, a (hidden, aux) tuple, or an object with hidden "
                                f"states and multimodal_outputs)")
            return
        num_reqs = self.input_batch.num_reqs
        batch = StepBatch(list(self.input_batch.req_ids[:num_reqs]),
                          self.input_batch.num_computed_tokens_cpu[:num_reqs].tolist(),
                          self.query_start_loc.np[1: num_reqs + 1].tolist())
        view = getattr(self.omni_prefix_cache, "view", None)
        # the output is read once: the hook is called only where it is overridden
        hook = self.omni_mm_outputs
        mm = read.mm if getattr(hook, "__func__", None) is _READ_MM else hook(output)
        self._omni_stage.save_step(
            read.hidden, mm, batch,
            num_tokens_padded=read.hidden.shape[0],
            slot_mapping=view.device_slot_mapping()
            if isinstance(view, FullAttentionGroupView) else None)

    def omni_mm_outputs(self, model_output: Any) -> Mapping[str, Any] | None:
        """Per-token multimodal outputs of an omni model's forward (None for plain LMs).

        Override for a model that hands its multimodal outputs over another way.
        """
        read = read_forward_output(model_output)
        return None if read is None else read.mm


#: The mixin's own `omni_mm_outputs`: a runner whose hook is this one takes the mm outputs from
#: the forward's output it read already.
_READ_MM = PrefixCacheRunnerMixin.omni_mm_outputs
