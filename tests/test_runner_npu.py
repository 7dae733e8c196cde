"""The NPU worker (vllm-ascend's NPUWorker / NPUModelRunner with the cache) on a stand-in.

vllm-ascend cannot be installed here: it needs torch_npu and the CANN runtime of an Ascend
machine. These tests stand fake `vllm_ascend.worker` modules in for it, holding:

- `NPUModelRunner`: vLLM's CPU runner, a `GPUModelRunner` subclass as vllm-ascend's is since
  v0.12, with the surface the mixin reads there: `_model_forward` (called by `execute_model`),
  `sample_tokens`, `query_start_loc.np`, the persistent `input_batch`; and, like vllm-ascend's
  runner, no `_kernel_block_sizes` (dropped once vLLM's own CPU code has used it). The engine
  uses 128-token blocks, the size vllm-ascend forces with prefix caching.
- `NPUWorker`: vLLM's CPU worker whose `init_device` builds an `NPUModelRunner`, as
  vllm-ascend's `NPUWorker.init_device` does (through its module-level name).

Everything else is real: vLLM's CPU engine, the cache, the shared-memory channel.
"""

from __future__ import annotations

import importlib
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm.v1.worker.cpu_worker as cpu_worker  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

import prefix_cache.integration.workers  # noqa: E402
from prefix_cache import OmniPrefixCacheUnmatchError  # noqa: E402
from prefix_cache.channel import open_channel  # noqa: E402
from prefix_cache.tools.pipelines.engines import (  # noqa: E402
    EngineShape, multiprocessing_mode, start_thinker)
from prefix_cache.tools.pipelines.pipeline import StageRequest, run_pipeline  # noqa: E402
from prefix_cache.integration.workers.base import adopt_runner  # noqa: E402
from tests.vllm_fixtures import engine_runner, thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]

NPU_WORKER = "prefix_cache.vllm_runners.PrefixCacheNPUWorker"
ASCEND_SHAPE = EngineShape(block_size=128, num_blocks=7, max_num_batched_tokens=128,
                           long_prefill_token_threshold=0)


class FakeNPUModelRunner(CPUModelRunner):
    """Stands in for vllm_ascend.worker.model_runner_v1.NPUModelRunner (see the module doc)."""

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        del self._kernel_block_sizes  # vllm-ascend's runner has no such attribute


def fake_vllm_ascend() -> dict[str, types.ModuleType]:
    """The stand-in modules by name, ready for sys.modules."""
    runner_module = types.ModuleType("vllm_ascend.worker.model_runner_v1")
    runner_module.NPUModelRunner = FakeNPUModelRunner
    worker_module = types.ModuleType("vllm_ascend.worker.worker")
    worker_module.NPUModelRunner = FakeNPUModelRunner

    class NPUWorker(cpu_worker.CPUWorker):
        """Stands in for vllm_ascend.worker.worker.NPUWorker (see the module doc)."""

        def init_device(self) -> None:
            cpu_runner, cpu_worker.CPUModelRunner = cpu_worker.CPUModelRunner, \
                worker_module.NPUModelRunner
            try:
                super().init_device()
            finally:
                cpu_worker.CPUModelRunner = cpu_runner

    worker_module.NPUWorker = NPUWorker
    package = types.ModuleType("vllm_ascend")
    package.__path__ = []
    worker_package = types.ModuleType("vllm_ascend.worker")
    worker_package.__path__ = []
    return {"vllm_ascend": package, "vllm_ascend.worker": worker_package,
            "vllm_ascend.worker.worker": worker_module,
            "vllm_ascend.worker.model_runner_v1": runner_module}


@pytest.fixture
def ascend_runners(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`prefix_cache.integration.workers.npu`, imported afresh over the stand-in vllm_ascend."""
    for name, module in fake_vllm_ascend().items():
        monkeypatch.setitem(sys.modules, name, module)
    forget_ascend_runners()
    yield importlib.import_module("prefix_cache.integration.workers.npu")
    forget_ascend_runners()  # built over the stand-in: no later test may see it


def forget_ascend_runners() -> None:
    """Make the next use import `prefix_cache.integration.workers.npu` again."""
    sys.modules.pop("prefix_cache.integration.workers.npu", None)
    if hasattr(prefix_cache.integration.workers, "npu"):
        delattr(prefix_cache.integration.workers, "npu")


def block_prefix_requests(seed: int = 0) -> list[StageRequest]:
    """Four requests sharing a 256-token prefix (two 128-token blocks)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(256)]
    return [StageRequest(f"n{i}", prefix + [rng.randrange(1, 1000) for _ in range(9 + 11 * i)],
                         3, arrive_at_step=3 * i) for i in range(4)]


def test_npu_worker_builds_the_cache_runner_on_vllm_ascends_surface(
        ascend_runners: types.ModuleType, thinker_model_dir: Path) -> None:
    requests = block_prefix_requests()
    runs = {}
    with multiprocessing_mode(False), open_channel() as channel:
        for caching in (True, False):
            engine = start_thinker(thinker_model_dir, channel, prefix_caching=caching,
                                   shape=ASCEND_SHAPE, worker_cls=NPU_WORKER)
            try:
                runner = engine_runner(engine)
                assert isinstance(runner, ascend_runners.PrefixCacheNPUModelRunner)
                assert isinstance(runner, FakeNPUModelRunner) and isinstance(runner,
                                                                            GPUModelRunner)
                assert not hasattr(runner, "_kernel_block_sizes")
                runs[caching] = run_pipeline(engine, channel, requests)
                stats = engine.stats()
            finally:
                engine.close()
            if caching:
                assert stats["hit_tokens"] == 256 * (len(requests) - 1)
    for request in requests:
        on, off = runs[True].results[request.req_id], runs[False].results[request.req_id]
        assert on.rows.shape == off.rows.shape == (len(request.prompt) + 2, 256)
        assert float((on.rows - off.rows).abs().max()) <= 1e-4


def test_npu_worker_refuses_model_runner_v2(ascend_runners: types.ModuleType) -> None:
    # vllm-ascend builds its V2 runner (vllm_ascend.worker.v2.model_runner, on vLLM's V2
    # runner) when VLLM_USE_V2_MODEL_RUNNER is set: not an NPUModelRunner, so refused
    worker = SimpleNamespace(model_runner=object(), use_v2_model_runner=True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        adopt_runner(worker, ascend_runners.PrefixCacheNPUWorker.runner_hooks)


def test_without_vllm_ascend_the_npu_worker_names_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm_ascend", None)  # not importable
    forget_ascend_runners()
    import prefix_cache.vllm_runners as runners
    with pytest.raises(ImportError, match="needs vllm-ascend"):
        runners.PrefixCacheNPUWorker  # noqa: B018
