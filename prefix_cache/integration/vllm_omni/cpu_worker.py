"""A CPU worker for vllm-omni's autoregressive stages (vllm-omni 0.30 has no CPU platform).

vllm-omni's AR runner (`GPUARModelRunner`: its step, its outputs, its prefix cache) is put over
vLLM's `CPUModelRunner` (host buffers, no CUDA calls): both derive from vLLM's
`GPUModelRunner`, so the method order is vllm-omni's runner, then vLLM's CPU runner, then the
GPU runner they share. Name it as a stage's `worker_cls`:
`prefix_cache.integration.vllm_omni.cpu_worker.OmniCPUARWorker`.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class OmniCPUARModelRunner(GPUARModelRunner, CPUModelRunner):
    """vllm-omni's AR model runner on vLLM's CPU model runner."""


class OmniCPUARWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker running `OmniCPUARModelRunner`; loads vllm-omni's plugins."""

    model_runner_cls = OmniCPUARModelRunner

    def init_device(self) -> None:
        super().init_device()  # vLLM's CPU setup (threads, distributed), then its runner...
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)  # ...replaced

    def determine_available_memory(self) -> int:
        if not self._should_warm_up_model():  # eager, sized KV cache: vLLM runs no forward here
            self.model_runner.profile_run()  # vllm-omni's models finish their setup in one
        return super().determine_available_memory()
