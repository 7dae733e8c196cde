"""vLLM model runners and workers with the prefix cache mixed in (imports vLLM; load lazily).

Select them with `LLM(..., worker_cls="prefix_cache.vllm_runners.PrefixCacheCPUWorker")`
on CPU, or `...PrefixCacheGPUWorker` on NVIDIA GPUs. On Ascend, vllm-ascend's
NPUModelRunner subclasses GPUModelRunner (>= v0.12), so
`class R(PrefixCacheRunnerMixin, NPUModelRunner)` is the same one-line change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import vllm.v1.worker.cpu_worker as cpu_worker
import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from prefix_cache.runner_mixin import PrefixCacheRunnerMixin


class PrefixCacheCPUModelRunner(PrefixCacheRunnerMixin, CPUModelRunner):
    """vLLM's CPU runner with the stage-output prefix cache."""


class PrefixCacheGPUModelRunner(PrefixCacheRunnerMixin, GPUModelRunner):
    """vLLM's GPU runner (model runner V1) with the stage-output prefix cache."""


@contextmanager
def _runner_class(module: Any, name: str, cls: type) -> Iterator[None]:
    """The worker modules build their runner by a module-level name: swap it during init_device."""
    original = getattr(module, name)
    setattr(module, name, cls)
    try:
        yield
    finally:
        setattr(module, name, original)


class _StageOutputsRPC:
    """Worker methods reachable through `llm.collective_rpc(...)`."""

    def take_stage_outputs(self) -> dict[str, Any]:
        return self.model_runner.take_stage_outputs()

    def prefix_cache_stats(self) -> dict[str, int | float]:
        cache = self.model_runner.omni_prefix_cache
        return {} if cache is None else cache.stats()

    def shutdown_prefix_cache(self) -> None:
        self.model_runner.shutdown_omni_prefix_cache()


class PrefixCacheCPUWorker(_StageOutputsRPC, cpu_worker.CPUWorker):
    def init_device(self) -> None:
        with _runner_class(cpu_worker, "CPUModelRunner", PrefixCacheCPUModelRunner):
            super().init_device()


class PrefixCacheGPUWorker(_StageOutputsRPC, gpu_worker.Worker):
    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:
            raise NotImplementedError("the prefix cache hooks model runner V1; set "
                                      "VLLM_USE_V2_MODEL_RUNNER=0")
        return PrefixCacheGPUModelRunner(self.vllm_config, self.device)
