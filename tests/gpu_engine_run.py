"""One run of a real vLLM GPU engine with the cache's worker, for `tests/test_gpu_engine.py`.

Each run is a process of its own (`python -m tests.gpu_engine_run CASE on|off MP MODEL OUT`): it
starts one stage-1 engine on the GPU with prefix caching on or off, drives a case's workload
through `tools.pipelines.pipeline.run_pipeline` (which takes each request's entry off the stage
channel as soon as vLLM returns its final output), and saves the entries, cached-token counts
and the cache's stats to OUT for the test to compare.

Cases (a tiny random Qwen2, hidden 256, head size 64, bf16, 16-token blocks):

- `main`: two waves of six prompts sharing 64-token prefixes (the second wave hits the first's
  blocks, and its requests stop at any of a third of the vocabulary: an asynchronous scheduler,
  vLLM's default on the GPU, has already fed the stop token when it reads it), two
  decode-heavy requests (48 tokens each), and a 512-token prompt aborted mid-prefill;
- `preempt`: four requests whose decodes outgrow a 13-block KV cache, so vLLM preempts and
  recomputes;
- `preempt-abort`: four requests of unrelated prompts outgrow that cache; the first request
  vLLM preempts is aborted before any step resumes it (in-process only);
- `mm`: `main` on a runner whose forward also emits a per-token multimodal key, which the
  model's attributes declare deferred (`deferred_prefix_cache_mm_keys`);
- `graphs`: `main` with CUDA graphs captured for decode (no torch.compile);
- `capped`: `main` without its 512-token prompt, on a host pool capped at 12 blocks of the KV
  cache's 96 (`CAPPED_BUDGET`): blocks are evicted, hits cut to their resident prefix;
- `tp2`: `main` over two GPUs (`tensor_parallel_size=2`), the engine core and each rank's worker
  in processes of their own (run it multiprocess); OUT holds every rank's stats;
- `v2-main`, `v2-preempt`, `v2-preempt-abort`: those cases on Model Runner V2
  (`VLLM_USE_V2_MODEL_RUNNER=1`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch

from prefix_cache.tools.pipelines.engines import (CUDA_GRAPH_ARGS, EngineShape,
                                                  multiprocessing_mode, start_thinker)
from prefix_cache.tools.pipeline_bench import RESIDENT_SCHEDULER
from prefix_cache.tools.pipelines.pipeline import StageRequest, run_pipeline
from prefix_cache.integration.runner_mixin import PrefixCacheRunnerMixin
from tests.vllm_fixtures import FirstPreemptedAborter, unrelated_decoding_requests

MAIN_SHAPE = EngineShape(block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                         long_prefill_token_threshold=32, num_blocks=97, dtype="bfloat16")
PREEMPT_SHAPE = EngineShape(block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                            long_prefill_token_threshold=32, num_blocks=14, max_model_len=192,
                            dtype="bfloat16")
#: A pool must hold one request of max_model_len (its blocks stay while it runs): 8 blocks here.
CAPPED_SHAPE = dataclasses.replace(MAIN_SHAPE, max_model_len=128)
#: 13 blocks of bf16 rows of hidden 256 (12 usable beside block 0) of the KV cache's 97.
CAPPED_BUDGET = 13 * 16 * 256 * 2
MM_KEY = "codes.audio"
STOP_TOKEN_IDS = tuple(range(0, 1024, 3))
#: Two ranks, each a worker process (`mp`): the cache refuses such workers under asynchronous
#: scheduling. The all-reduce goes through NCCL alone: no custom all-reduce (compiled kernels,
#: which the offline build lacks) and no torch symmetric memory (`TP2_ENV`: vLLM 0.26 sets it up
#: for two H200 ranks and uses it only with NVLink multicast, which the H200 machines keep off).
TP2_ARGS: dict[str, Any] = dict(tensor_parallel_size=2, distributed_executor_backend="mp",
                                disable_custom_all_reduce=True, async_scheduling=False)
TP2_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def main_workload(seed: int = 0) -> list[StageRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(3)]
    requests = [StageRequest("long-aborted", [rng.randrange(1, 1000) for _ in range(512)], 4,
                             arrive_at_step=0, abort_at_step=3)]
    for wave in range(2):
        for i in range(6):
            prompt = prefixes[i % 3] + [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 30))]
            requests.append(StageRequest(f"w{wave}-{i}", prompt, rng.randrange(2, 6),
                                         arrive_at_step=40 * wave + i,
                                         stop_token_ids=STOP_TOKEN_IDS if wave else ()))
    requests += [StageRequest(f"decode-{i}", prefixes[i] + [rng.randrange(1, 1000)
                                                             for _ in range(9)],
                              48, arrive_at_step=80 + i) for i in range(2)]
    return requests


def preempt_workload(seed: int = 1) -> list[StageRequest]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(32)]
    return [StageRequest(f"p{i}", prefix + [rng.randrange(1, 1000) for _ in range(16)], 100,
                         arrive_at_step=0) for i in range(4)]


class _EmitsMM:
    """Below the mixin: the model declares its policy by attributes, and its forward returns
    (hidden, {"codes": {"audio": ...}}) as an omni model's does."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.model.deferred_prefix_cache_mm_keys = [MM_KEY]

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = super()._model_forward(*args, **kwargs)
        return hidden, {"codes": {"audio": hidden[:, :4] * 2}}


class _Unwrap:
    """Above the mixin: vLLM's sampler gets the hidden states alone."""

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        return super()._model_forward(*args, **kwargs)[0]


@functools.cache
def _mm_worker() -> type:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from prefix_cache.tools.pipelines.engines import default_worker
    worker = resolve_obj_by_qualname(default_worker())  # this platform's cache worker
    v1_runner = next(iter(worker.runner_hooks))  # the V1 runner class it builds
    runner = type("MMRunner", (_Unwrap, PrefixCacheRunnerMixin, _EmitsMM, v1_runner), {})
    return type("MMWorker", (worker,), {"runner_cls": runner})


def __getattr__(name: str) -> Any:  # the engine process imports the mm worker by name
    if name == "MMWorker":
        return _mm_worker()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run(case: str, caching: bool, multiprocessing: bool, model_dir: Path, out: Path) -> None:
    from prefix_cache.channel import open_channel
    shape, requests, args, options = MAIN_SHAPE, main_workload(), {}, {}
    v2, case = case.startswith("v2-"), case.removeprefix("v2-")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    if case == "preempt":
        shape, requests = PREEMPT_SHAPE, preempt_workload()
    elif case == "preempt-abort":
        shape, requests = PREEMPT_SHAPE, unrelated_decoding_requests()
    elif case == "capped":
        shape, options = CAPPED_SHAPE, {"host_budget_bytes": CAPPED_BUDGET}
        requests = [r for r in requests if r.req_id != "long-aborted"]
        if multiprocessing:
            args["scheduler_cls"] = RESIDENT_SCHEDULER
    elif case == "mm":
        args["worker_cls"] = f"{__name__}.MMWorker"
    elif case == "graphs":
        args.update(CUDA_GRAPH_ARGS)
    elif case == "tp2":
        os.environ.update(TP2_ENV)
        args.update(TP2_ARGS)
    with multiprocessing_mode(multiprocessing), open_channel() as channel:
        engine = start_thinker(model_dir, channel, prefix_caching=caching, shape=shape,
                               stage_options=options if caching else None, **args)
        try:
            core = getattr(engine.engine.engine_core, "engine_core", None)  # in-process only
            runner = None if core is None else \
                type(core.model_executor.driver_worker.worker.model_runner).__mro__[1]
            aborter = FirstPreemptedAborter(engine, [r.req_id for r in requests]) \
                if case == "preempt-abort" else None
            result = run_pipeline(engine, channel, requests, aborts_now=aborter or tuple)
            rank_stats = engine.rank_stats()
        finally:
            engine.close()
    torch.save({"stats": rank_stats[0], "rank_stats": rank_stats,
                "runner": None if runner is None else runner.__module__,
                "aborted_while_preempted": aborter and aborter.aborted,
                "cached": {k: r.cached_tokens for k, r in result.results.items()},
                "generated": {k: r.generated for k, r in result.results.items()},
                "entries": {k: {"aborted": r.entry.aborted, "meta": dict(r.entry.meta),
                                "outputs": dict(r.entry.outputs)}
                            for k, r in result.results.items()}}, out)


if __name__ == "__main__":
    case, caching, mp, model_dir, out = sys.argv[1:]
    run(case, caching == "on", mp == "1", Path(model_dir), Path(out))
