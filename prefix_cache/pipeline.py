"""A two-stage omni pipeline on real vLLM engines: thinker (with the cache) -> channel -> talker.

Stage 1, the thinker, is a vLLM engine whose worker carries the stage-output
cache (`worker_cls`); each finished request's rows from position 0 (its last
hidden states) reach the stage channel under the request's id. Stage 2, the
talker, is a second vLLM engine with `enable_prompt_embeds=True` that generates
greedily from each request's rows as soon as they arrive. The driver steps the
thinker by hand so arrivals and aborts land at fixed steps; it takes a request's
rows once the thinker has run one more step (that step tells the worker the
request finished).

Both engines run under whatever `VLLM_ENABLE_V1_MULTIPROCESSING` says (vLLM's
default: an engine-core process each); nothing crosses vLLM's RPC but the
channel spec, in `additional_config`.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefix_cache.channel import StageChannel, StageEntry
from prefix_cache.config import HIDDEN_KEY

#: The environment a vLLM engine with the cache needs here, and why (set where unset):
ENGINE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",     # the runner mixin hooks model runner V1
    "VLLM_CPU_KVCACHE_SPACE": "1",       # GiB of KV cache per CPU engine (default: most RAM)
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",  # a torch_npu without CANN must not break torch
    "VLLM_PLUGINS": "",                  # no out-of-tree platform may take over the CPU build
    "VLLM_HOST_IP": "127.0.0.1",         # the engines talk over loopback only
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # the models are written locally
}

#: Seconds the driver waits for a finished request's rows on the channel.
ROWS_TIMEOUT_S = 60.0


def apply_engine_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@contextmanager
def multiprocessing_mode(enabled: bool | None) -> Iterator[None]:
    """Run the engines built inside with `VLLM_ENABLE_V1_MULTIPROCESSING` set (None: as is).

    An in-process engine freezes vLLM's environment cache in this process;
    it is reset so the setting given here is the one vLLM reads.
    """
    if enabled is None:
        yield
        return
    from vllm import envs
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if enabled else "0"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        envs.disable_envs_cache()


def write_random_qwen2(path: Path, *, hidden_size: int = 256, num_layers: int = 2,
                       intermediate_size: int = 512, num_heads: int = 4, num_kv_heads: int = 2,
                       vocab_size: int = 1024, max_positions: int = 1024,
                       initializer_range: float = 1.0, seed: int = 0) -> Path:
    """A random Qwen2 saved with transformers (nothing is downloaded); head size hidden/heads.

    `initializer_range=1.0` (not the default 0.02, whose greedy output repeats
    one token) makes the model's tokens depend on its input.
    """
    if (path / "config.json").exists():
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         initializer_range=initializer_range)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def default_worker() -> str:
    """The cache's worker class for this machine's vLLM platform."""
    from vllm.platforms import current_platform
    kind = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}.get(current_platform.device_type)
    if kind is None:
        raise RuntimeError(f"no prefix-cache worker for vLLM platform "
                           f"{current_platform.device_type!r} (cpu, cuda and npu have one)")
    return f"prefix_cache.vllm_runners.PrefixCache{kind}Worker"


@dataclass(frozen=True)
class EngineShape:
    """An engine's batch and KV-cache sizes (small: blocks are reused, prompts are chunked)."""

    max_model_len: int = 768
    block_size: int = 32            # the CPU attention backend needs a multiple of 32
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    long_prefill_token_threshold: int = 32  # a long prompt's chunk per step (0: no limit)
    num_blocks: int = 25            # 24 usable (block 0 is vLLM's null block): 768 tokens

    def engine_args(self) -> dict[str, Any]:
        return dict(max_model_len=self.max_model_len, block_size=self.block_size,
                    max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                    num_gpu_blocks_override=self.num_blocks, enable_chunked_prefill=True,
                    dtype="float32", enforce_eager=True, seed=0, skip_tokenizer_init=True)


class Engine:
    """One vLLM engine (an `LLM`), stepped by hand; `close()` stops its processes.

    An in-process engine's shutdown tears down this process's torch.distributed
    state, which every in-process engine shares: close in-process engines only
    when no other one is still in use.
    """

    def __init__(self, model_dir: Path, shape: EngineShape, **kwargs: Any) -> None:
        apply_engine_env()
        from vllm import LLM
        from vllm.v1.engine.core_client import InprocClient
        self.llm = LLM(model=str(model_dir), **shape.engine_args(), **kwargs)
        self.engine = self.llm.llm_engine
        self.in_process = isinstance(self.engine.engine_core, InprocClient)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[Any]:
        """One engine step; only call it with work pending (a multiprocess engine blocks)."""
        return self.engine.step()

    def flush(self) -> None:
        """Let the worker hear of the last finishes: a multiprocess engine core steps once
        more on its own; an in-process one steps when asked."""
        if self.in_process:
            self.engine.step()

    def stats(self) -> dict[str, int | float]:
        return self.llm.collective_rpc("prefix_cache_stats")[0]

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine, self.llm
        gc.collect()


def start_thinker(model_dir: Path, channel: StageChannel, *, prefix_caching: bool,
                  shape: EngineShape = EngineShape(), worker_cls: str | None = None) -> Engine:
    """Stage 1: an engine whose worker publishes every finished request's rows to `channel`."""
    return Engine(model_dir, shape, enable_prefix_caching=prefix_caching,
                  worker_cls=worker_cls or default_worker(),
                  additional_config={"prefix_cache": {"channel": channel.spec}})


def start_talker(model_dir: Path, shape: EngineShape = EngineShape()) -> Engine:
    """Stage 2: an engine fed the thinker's rows as `prompt_embeds`."""
    return Engine(model_dir, shape, enable_prompt_embeds=True)


@dataclass(frozen=True)
class StageRequest:
    """A thinker request: its prompt, tokens to generate, and the thinker steps it arrives
    (and, optionally, is aborted) at."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrive_at_step: int = 0
    abort_at_step: int | None = None


@dataclass
class RequestResult:
    """What one request went through: stage-1 rows and prefix hit, stage-2 tokens and margin."""

    req_id: str
    prompt_len: int
    cached_tokens: int = 0
    entry: StageEntry | None = None
    tokens: list[int] = field(default_factory=list)
    min_margin: float = float("inf")  # smallest top-1 minus top-2 logprob over its tokens

    @property
    def rows(self) -> torch.Tensor | None:
        return None if self.entry is None else self.entry.outputs.get(HIDDEN_KEY)

    @property
    def aborted(self) -> bool:
        return self.entry is not None and self.entry.aborted


@dataclass
class PipelineRun:
    """Per-request results; wall seconds of the whole run and of stage 1 alone (engines up)."""

    results: dict[str, RequestResult]
    seconds: float
    thinker_seconds: float


def talker_params(max_tokens: int) -> Any:
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False, logprobs=2)


def min_margin(logprobs: Sequence[dict[int, Any]] | None) -> float:
    """The smallest gap between the best and second-best logprob over generated tokens."""
    gaps = [float("inf")]
    for options in logprobs or ():
        best = sorted((lp.logprob for lp in options.values()), reverse=True)
        if len(best) >= 2:
            gaps.append(best[0] - best[1])
    return min(gaps)


def run_pipeline(thinker: Engine, channel: StageChannel, requests: Sequence[StageRequest], *,
                 talker: Engine | None = None, talker_tokens: int = 8,
                 on_rows: Callable[[RequestResult], None] = lambda _: None) -> PipelineRun:
    """Run `requests` through the thinker, the channel and (when given) the talker."""
    from vllm import SamplingParams
    results = {r.req_id: RequestResult(r.req_id, len(r.prompt)) for r in requests}
    arrivals = sorted(requests, key=lambda r: r.arrive_at_step)
    aborts: dict[int, list[str]] = {}
    for r in requests:
        if r.abort_at_step is not None:
            aborts.setdefault(r.abort_at_step, []).append(r.req_id)
    retired: list[str] = []  # left the thinker; rows published once it steps again
    params = talker_params(talker_tokens)
    start = time.perf_counter()

    def take_rows(req_ids: list[str]) -> None:
        for req_id in req_ids:
            result = results[req_id]
            result.entry = channel.get_entry(req_id, ROWS_TIMEOUT_S)
            on_rows(result)
            if talker is not None and not result.aborted:
                talker.engine.add_request(req_id, {"prompt_embeds": result.rows}, params)

    def collect(outputs: list[Any]) -> None:
        for out in outputs:
            if out.finished:
                completion = out.outputs[0]
                results[out.request_id].tokens = list(completion.token_ids)
                results[out.request_id].min_margin = min_margin(completion.logprobs)

    step = 0
    while arrivals or thinker.has_work():
        while arrivals and arrivals[0].arrive_at_step <= step:
            req = arrivals.pop(0)
            thinker.engine.add_request(req.req_id, {"prompt_token_ids": req.prompt},
                                       SamplingParams(max_tokens=req.max_tokens, temperature=0.0,
                                                      ignore_eos=True, detokenize=False))
        finished_now = aborts.get(step, [])
        if finished_now:
            thinker.engine.abort_request(finished_now)
        if thinker.has_work():
            for out in thinker.step():
                results[out.request_id].cached_tokens = max(
                    results[out.request_id].cached_tokens, out.num_cached_tokens or 0)
                if out.finished:
                    finished_now.append(out.request_id)
            take_rows(retired)
            retired = finished_now
        else:
            retired += finished_now
        if talker is not None and talker.has_work():
            collect(talker.step())
        step += 1
    thinker.flush()
    take_rows(retired)
    thinker_done = time.perf_counter() - start
    while talker is not None and talker.has_work():
        collect(talker.step())
    return PipelineRun(results, time.perf_counter() - start, thinker_done)


def talk(talker: Engine, prompts: dict[str, torch.Tensor], max_tokens: int
         ) -> dict[str, tuple[list[int], float]]:
    """Greedy talker tokens and their smallest logprob margin for rows given directly."""
    params = talker_params(max_tokens)
    for req_id, rows in prompts.items():
        talker.engine.add_request(req_id, {"prompt_embeds": rows}, params)
    out: dict[str, tuple[list[int], float]] = {}
    while talker.has_work():
        for result in talker.step():
            if result.finished:
                completion = result.outputs[0]
                out[result.request_id] = (list(completion.token_ids),
                                          min_margin(completion.logprobs))
    return out


def warm_up(thinker: Engine, channel: StageChannel, talker: Engine | None = None) -> None:
    """One short request through the engines, untimed; then their prefix caches are emptied."""
    rng = random.Random(12345)
    request = StageRequest("warm-up", [rng.randrange(1, 1000) for _ in range(40)], 2)
    run_pipeline(thinker, channel, [request], talker=talker, talker_tokens=2)
    for engine in (thinker, talker):
        if engine is not None:
            engine.engine.reset_prefix_cache()
