"""vLLM's GPU worker with the stage-output cache.

Imports vLLM's GPU worker and model runner only: never `vllm.v1.worker.cpu_worker`,
whose import replaces `torch.cuda.Stream`, `torch.cuda.Event` and `torch.Event`
with placeholders process-wide.
"""

from __future__ import annotations

import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from prefix_cache.workers.base import PrefixCacheWorkerMixin, cache_runner_class

PrefixCacheGPUModelRunner = cache_runner_class(GPUModelRunner)


class PrefixCacheGPUWorker(PrefixCacheWorkerMixin, gpu_worker.Worker):
    """vLLM's GPU worker whose model runner (V1) carries the stage-output cache."""

    runner_base = GPUModelRunner
