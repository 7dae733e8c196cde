"""What every cache worker shares: its runner adopted into the cache, finishes reported, stats.

A worker class is `PrefixCacheWorkerMixin` first, then a vLLM (or vllm-ascend)
worker. vLLM releases (0.23 to 0.33) build the model runner in `init_device` in
different ways: a module-level class name (the CPU worker, vllm-ascend's), a local
import (the GPU worker up to 0.31), a `_make_model_runner` factory (the GPU worker
of 0.32 and 0.33). Rather than intercept each, the worker adopts the runner once
it is built: its class becomes the hooking mixin over its own class. The mixins
keep their state in class-level defaults until `load_model`, so the runner needs
nothing from a constructor. A runner the cache cannot hook refuses the engine at
start, naming the vLLM release; a worker never serves without the cache silently.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from prefix_cache.errors import OmniPrefixCacheUnmatchError
from prefix_cache.integration.runner_mixin import StageRunnerBase
from prefix_cache.integration.workers.finishes import report_finishes


@functools.cache
def cache_runner_class(base: type, mixin: type) -> type:
    """`base` (a vLLM model runner class) with the stage-output cache: `mixin` first."""
    return type(f"PrefixCache{base.__name__}", (mixin, base),
                {"__module__": __name__,
                 "__doc__": f"{base.__qualname__} with the stage-output cache."})


def vllm_release() -> str:
    import vllm
    return getattr(vllm, "__version__", "(unknown release)")


def adopt_runner(worker: Any, hooks: Mapping[type, type], runner_cls: type | None = None
                 ) -> StageRunnerBase:
    """Make the runner `worker.init_device` built carry the cache, or refuse the engine.

    `hooks` maps each vLLM runner class the worker may build to the mixin that hooks it.
    The runner's class becomes `runner_cls` (a subclass of its class with a mixin, whose
    constructor adds nothing), else the hooking mixin over its own class.
    """
    runner = getattr(worker, "model_runner", None)
    if isinstance(runner, StageRunnerBase):
        return runner
    mixin = next((m for base, m in hooks.items() if isinstance(runner, base)), None)
    if mixin is None:
        v2 = getattr(worker, "use_v2_model_runner", False)
        raise OmniPrefixCacheUnmatchError(
            f"{type(worker).__name__} on vLLM {vllm_release()}: init_device built "
            f"{'no model runner' if runner is None else type(runner).__qualname__}, not a "
            f"runner the omni prefix cache can hook "
            f"({', '.join(f'{b.__module__}.{b.__qualname__}' for b in hooks)})"
            + ("; this engine uses Model Runner V2: start it with VLLM_USE_V2_MODEL_RUNNER=0"
               if v2 else ""))
    target = runner_cls or cache_runner_class(type(runner), mixin)
    if not (issubclass(target, type(runner)) and issubclass(target, StageRunnerBase)):
        raise OmniPrefixCacheUnmatchError(
            f"{type(worker).__name__}.runner_cls {target.__qualname__} must subclass both a "
            f"cache runner mixin and the runner vLLM {vllm_release()} built, "
            f"{type(runner).__qualname__}")
    try:
        runner.__class__ = target
    except TypeError as exc:  # a base class whose instance layout a subclass changes
        raise OmniPrefixCacheUnmatchError(
            f"{type(worker).__name__} on vLLM {vllm_release()}: cannot give the built "
            f"{type(runner).__qualname__} the cache's class {target.__qualname__}: {exc}") from exc
    return runner


class PrefixCacheWorkerMixin:
    """Put first in a vLLM worker's bases, with `runner_hooks` the runner classes it may build
    and their mixins; a subclass may name its own runner class in `runner_cls`."""

    runner_hooks: Mapping[type, type]
    runner_cls: type | None = None

    def init_device(self) -> None:
        super().init_device()
        runner = adopt_runner(self, self.runner_hooks, self.runner_cls)
        if not report_finishes(self.vllm_config, runner.omni_requests_finished):
            self._check_finishes_reach_a_separate_worker()

    def _check_finishes_reach_a_separate_worker(self) -> None:
        """A worker outside the scheduler's process hears of a finish only at the next step:
        refuse the engines where that step may never run, or where the step before it fed
        the stop token (asynchronous scheduling) and this worker cannot tell its row apart."""
        from vllm import envs
        executor = self.vllm_config.parallel_config.distributed_executor_backend
        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise OmniPrefixCacheUnmatchError(
                f"{type(self).__name__}: an in-process engine core "
                f"(VLLM_ENABLE_V1_MULTIPROCESSING=0) with workers in processes of their "
                f"own ({executor!r} executor) tells a worker of a finish only at its next "
                f"step, which may never run; run the engine core in its own process "
                f"(VLLM_ENABLE_V1_MULTIPROCESSING=1)")
        if self.vllm_config.scheduler_config.async_scheduling:
            raise OmniPrefixCacheUnmatchError(
                f"{type(self).__name__}: asynchronous scheduling with workers in processes "
                f"of their own ({executor!r} executor): a request's last step feeds its stop "
                f"token before the scheduler reads the stop, and a worker away from the "
                f"scheduler cannot tell that row from a real one, so the next stage would get "
                f"one row too many; start the engine with async_scheduling=False, or with a "
                f"single worker (the 'uni' executor)")

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's warm-up, which may run real steps with made-up requests (Model Runner V2's
        kernel warm-up): the stage lets them pass, uncached and unpublished."""
        with self.model_runner.omni_paused():
            return super().compile_or_warm_up_model(*args, **kwargs)

    def prefix_cache_stats(self) -> dict[str, int | float]:
        """The cache's and the delivery's counters, and this worker process's resident bytes
        (numbers only: reachable through `llm.collective_rpc("prefix_cache_stats")`)."""
        stats = self.model_runner.prefix_cache_stats()
        with open("/proc/self/statm") as statm:  # resident pages, the second field
            stats["worker_rss_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return stats
