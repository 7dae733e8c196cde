"""The cache's vLLM workers, by the names users type (each loads only its own device's vLLM).

Select one with `LLM(..., worker_cls="prefix_cache.vllm_runners.PrefixCacheGPUWorker")`,
`...PrefixCacheCPUWorker` on vLLM's CPU build, or `...PrefixCacheNPUWorker` on Ascend
(vllm-ascend). A name is resolved on first use from its device's module in
`prefix_cache.integration.workers`: naming the GPU or NPU worker never imports vLLM's CPU worker,
which replaces torch's CUDA stream and event classes at import.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module of `prefix_cache.integration.workers` that defines it.
_MODULES = {
    "PrefixCacheCPUWorker": "cpu", "PrefixCacheCPUModelRunner": "cpu",
    "PrefixCacheGPUWorker": "gpu", "PrefixCacheGPUModelRunner": "gpu",
    "PrefixCacheNPUWorker": "npu", "PrefixCacheNPUModelRunner": "npu",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"prefix_cache.integration.workers.{module}"), name)
