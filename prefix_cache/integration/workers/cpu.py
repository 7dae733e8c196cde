"""vLLM's CPU worker with the stage-output cache (imports vLLM's CPU worker: CPU engines only)."""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from prefix_cache.integration.runner_mixin import PrefixCacheRunnerMixin
from prefix_cache.integration.workers.base import PrefixCacheWorkerMixin, cache_runner_class

PrefixCacheCPUModelRunner = cache_runner_class(CPUModelRunner, PrefixCacheRunnerMixin)


class PrefixCacheCPUWorker(PrefixCacheWorkerMixin, cpu_worker.CPUWorker):
    """vLLM's CPU worker whose `CPUModelRunner` carries the stage-output cache."""

    runner_hooks = {CPUModelRunner: PrefixCacheRunnerMixin}
