"""vLLM workers whose model runner carries the stage-output cache (imports vLLM; load lazily).

Select one with `LLM(..., worker_cls="prefix_cache.vllm_runners.PrefixCacheCPUWorker")`,
`...PrefixCacheGPUWorker` on NVIDIA GPUs, or `...PrefixCacheNPUWorker` on Ascend
(vllm-ascend's NPUWorker; imported only when asked for). The mixin hooks vLLM's
model runner V1; under Model Runner V2 every worker refuses at start.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import vllm.v1.worker.cpu_worker as cpu_worker
import vllm.v1.worker.gpu_worker as gpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.runner_mixin import PrefixCacheRunnerMixin

_NPU_NAMES = ("PrefixCacheNPUModelRunner", "PrefixCacheNPUWorker")


class PrefixCacheCPUModelRunner(PrefixCacheRunnerMixin, CPUModelRunner):
    """vLLM's CPU runner with the stage-output cache."""


class PrefixCacheGPUModelRunner(PrefixCacheRunnerMixin, GPUModelRunner):
    """vLLM's GPU runner (model runner V1) with the stage-output cache."""


def refuse_model_runner_v2(worker: Any) -> None:
    """The mixin hooks model runner V1's methods; V2 has other ones."""
    if getattr(worker, "use_v2_model_runner", False):
        raise OmniPrefixCacheUnmatchError(
            f"{type(worker).__name__}: the omni prefix cache hooks vLLM's model runner V1, but "
            f"this engine uses Model Runner V2; start it with VLLM_USE_V2_MODEL_RUNNER=0")


@contextmanager
def runner_class(module: Any, name: str, cls: type) -> Iterator[None]:
    """A worker module builds its runner by a module-level name: point it at `cls` meanwhile."""
    original = getattr(module, name)
    setattr(module, name, cls)
    try:
        yield
    finally:
        setattr(module, name, original)


class StatsRPC:
    """Worker methods reachable through `llm.collective_rpc(...)` (numbers only)."""

    def prefix_cache_stats(self) -> dict[str, int | float]:
        """The cache's and the delivery's counters, and this worker process's resident bytes."""
        stats = self.model_runner.prefix_cache_stats()
        with open("/proc/self/statm") as statm:  # resident pages, the second field
            stats["worker_rss_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return stats


class PrefixCacheCPUWorker(StatsRPC, cpu_worker.CPUWorker):
    """vLLM's CPU worker building a `runner_cls` (a `PrefixCacheCPUModelRunner`)."""

    runner_cls: type[CPUModelRunner] = PrefixCacheCPUModelRunner

    def init_device(self) -> None:
        refuse_model_runner_v2(self)
        with runner_class(cpu_worker, "CPUModelRunner", self.runner_cls):
            super().init_device()


class PrefixCacheGPUWorker(StatsRPC, gpu_worker.Worker):
    """vLLM's GPU worker building a `runner_cls` (a `PrefixCacheGPUModelRunner`)."""

    runner_cls: type[GPUModelRunner] = PrefixCacheGPUModelRunner

    def _make_model_runner(self) -> GPUModelRunner:
        refuse_model_runner_v2(self)
        return self.runner_cls(self.vllm_config, self.device)


def __getattr__(name: str) -> Any:
    """The NPU classes, from `prefix_cache.vllm_ascend_runners` (needs vllm-ascend)."""
    if name in _NPU_NAMES:
        return getattr(importlib.import_module("prefix_cache.vllm_ascend_runners"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
