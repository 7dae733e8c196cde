"""A two-stage omni pipeline on real vLLM engines: thinker (with the cache) -> channel -> talker.

Stage 1, the thinker, is a vLLM engine whose worker carries the stage-output
cache; each finished request's rows from position 0 (its last hidden states)
reach the stage channel under the request's id. Stage 2, the talker, is a
second vLLM engine with `enable_prompt_embeds=True` that generates greedily
from each request's rows as soon as they arrive. The driver steps the thinker
by hand so arrivals and aborts land at fixed steps; it takes a request's rows as
soon as the thinker returns its final output (or the driver aborted it): the
worker publishes them whether or not the thinker steps again. Nothing crosses
vLLM's RPC but the channel spec, in `additional_config` (see
`prefix_cache.tools.pipelines.engines`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from prefix_cache.channel import StageChannel, StageEntry
from prefix_cache.config import HIDDEN_KEY
from prefix_cache.tools.pipelines.engines import Engine

#: Seconds the driver waits for a finished request's rows on the channel.
ROWS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class StageRequest:
    """A thinker request: its prompt, tokens to generate (at most; fewer if it samples one of
    `stop_token_ids`), and the thinker steps it arrives (and, optionally, is aborted) at."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrive_at_step: int = 0
    abort_at_step: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class RequestResult:
    """What one request went through: stage-1 rows and prefix hit, stage-2 tokens and margin."""

    req_id: str
    prompt_len: int
    cached_tokens: int = 0
    generated: int = 0  # tokens stage 1 generated (its final output)
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


def greedy_params(max_tokens: int, logprobs: int | None = None) -> Any:
    """Greedy, exactly `max_tokens` tokens (no stop), no detokenizing; `logprobs` best
    logprobs of each token where given."""
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False, logprobs=logprobs)


def talker_params(max_tokens: int) -> Any:
    """`greedy_params` with the two best logprobs of each token (`min_margin` reads them)."""
    return greedy_params(max_tokens, logprobs=2)


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
                 on_rows: Callable[[RequestResult], None] = lambda _: None,
                 aborts_now: Callable[[], Sequence[str]] = tuple) -> PipelineRun:
    """Run `requests` through the thinker, the channel and (when given) the talker;
    `aborts_now`, asked before each thinker step: requests to abort then, beside those of
    `abort_at_step` (decided as the run goes)."""
    from vllm import SamplingParams
    results = {r.req_id: RequestResult(r.req_id, len(r.prompt)) for r in requests}
    arrivals = sorted(requests, key=lambda r: r.arrive_at_step)
    aborts: dict[int, list[str]] = {}
    for r in requests:
        if r.abort_at_step is not None:
            aborts.setdefault(r.abort_at_step, []).append(r.req_id)
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
                                                      ignore_eos=True, detokenize=False,
                                                      stop_token_ids=list(req.stop_token_ids)))
        finished_now = [*aborts.get(step, ()), *aborts_now()]
        if finished_now:
            thinker.engine.abort_request(finished_now)
        if thinker.has_work():
            for out in thinker.step():
                results[out.request_id].cached_tokens = max(
                    results[out.request_id].cached_tokens, out.num_cached_tokens or 0)
                if out.finished:
                    results[out.request_id].generated = len(out.outputs[0].token_ids)
                    finished_now.append(out.request_id)
        take_rows(finished_now)
        if talker is not None and talker.has_work():
            collect(talker.step())
        step += 1
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


def warm_up(thinker: Engine, channel: StageChannel, talker: Engine | None = None,
            requests: Sequence[StageRequest] = ()) -> None:
    """`requests` (default: one short request) through the engines, untimed, under ids of
    their own; then the prefix caches are emptied. vLLM's GPU kernels compile on first use for
    each batch shape, on the first engine of a machine (about 1.3 s of an H200 run's first
    timed pipeline): warming up on the workload itself keeps that out of the timed run."""
    rng = random.Random(12345)
    requests = [replace(r, req_id=f"warm-up-{r.req_id}") for r in requests] or \
        [StageRequest("warm-up", [rng.randrange(1, 1000) for _ in range(40)], 2)]
    run_pipeline(thinker, channel, requests, talker=talker, talker_tokens=2)
    for engine in (thinker, talker):
        if engine is not None:
            engine.engine.reset_prefix_cache()
