"""vllm-ascend's worker and model runner with the stage-output cache (imports vllm-ascend).

vllm-ascend's `NPUModelRunner` subclasses vLLM's `GPUModelRunner` (since
v0.12) and keeps the surface the mixin reads: `_model_forward`, `sample_tokens`,
`query_start_loc.np`, the persistent `input_batch` (its own block table, in
kernel blocks of 128 tokens); it has no `_kernel_block_sizes`, so the NPU
device backend validates the table. `NPUWorker.init_device` builds the runner
by its module-level name, as vLLM's CPU worker does.
"""

from __future__ import annotations

try:
    import vllm_ascend.worker.worker as npu_worker
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
except ImportError as exc:  # pragma: no cover - exercised on machines without vllm-ascend
    raise ImportError(
        f"prefix_cache's NPU worker needs vllm-ascend (and torch_npu with CANN) on an Ascend "
        f"machine: pip install vllm-ascend ({exc})") from exc

from prefix_cache.runner_mixin import PrefixCacheRunnerMixin
from prefix_cache.vllm_runners import StatsRPC, refuse_model_runner_v2, runner_class


class PrefixCacheNPUModelRunner(PrefixCacheRunnerMixin, NPUModelRunner):
    """vllm-ascend's NPU runner (model runner V1) with the stage-output cache."""


class PrefixCacheNPUWorker(StatsRPC, npu_worker.NPUWorker):
    """vllm-ascend's NPU worker building a `runner_cls` (a `PrefixCacheNPUModelRunner`)."""

    runner_cls: type[NPUModelRunner] = PrefixCacheNPUModelRunner

    def init_device(self) -> None:
        refuse_model_runner_v2(self)
        with runner_class(npu_worker, "NPUModelRunner", self.runner_cls):
            super().init_device()
