"""vllm-ascend's worker with the stage-output cache (imports vllm-ascend: Ascend machines only).

vllm-ascend's `NPUModelRunner` subclasses vLLM's `GPUModelRunner` (since v0.12)
and keeps the surface the mixin reads: `_model_forward`, `sample_tokens`,
`query_start_loc.np`, the persistent `input_batch` (its own block table, in
kernel blocks of 128 tokens); it has no `_kernel_block_sizes`, so the NPU device
backend validates the table. Like the other workers, `PrefixCacheNPUWorker`
adopts the runner `NPUWorker.init_device` built. This module imports vllm-ascend's
worker and runner only, never vLLM's CPU worker.
"""

from __future__ import annotations

try:
    import vllm_ascend.worker.worker as npu_worker
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
except ImportError as exc:  # pragma: no cover - exercised on machines without vllm-ascend
    raise ImportError(
        f"prefix_cache's NPU worker needs vllm-ascend (and torch_npu with CANN) on an Ascend "
        f"machine: pip install vllm-ascend ({exc})") from exc

from prefix_cache.integration.runner_mixin import PrefixCacheRunnerMixin
from prefix_cache.integration.workers.base import PrefixCacheWorkerMixin, cache_runner_class

PrefixCacheNPUModelRunner = cache_runner_class(NPUModelRunner, PrefixCacheRunnerMixin)


class PrefixCacheNPUWorker(PrefixCacheWorkerMixin, npu_worker.NPUWorker):
    """vllm-ascend's NPU worker whose `NPUModelRunner` (V1) carries the stage-output cache."""

    runner_hooks = {NPUModelRunner: PrefixCacheRunnerMixin}
