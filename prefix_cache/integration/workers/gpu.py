"""vLLM's GPU worker with the stage-output cache, on model runner V1 or Model Runner V2.

Imports vLLM's GPU worker and model runners only: never `vllm.v1.worker.cpu_worker`,
whose import replaces `torch.cuda.Stream`, `torch.cuda.Event` and `torch.Event`
with placeholders process-wide.
"""

from __future__ import annotations

import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from prefix_cache.integration.runner_mixin import PrefixCacheRunnerMixin
from prefix_cache.integration.runner_v2 import PrefixCacheV2RunnerMixin
from prefix_cache.integration.workers.base import PrefixCacheWorkerMixin, cache_runner_class

PrefixCacheGPUModelRunner = cache_runner_class(GPUModelRunner, PrefixCacheRunnerMixin)


class PrefixCacheGPUWorker(PrefixCacheWorkerMixin, gpu_worker.Worker):
    """vLLM's GPU worker whose model runner (V1 or V2) carries the stage-output cache."""

    runner_hooks = {GPUModelRunner: PrefixCacheRunnerMixin,
                    GPUModelRunnerV2: PrefixCacheV2RunnerMixin}
