"""Three stages on real vLLM engines, streamed: thinker -> talker -> codec (vllm-omni's async_chunk).

Stage 1, the thinker, is a vLLM engine with the stage-output cache; its worker
publishes each request's rows (last hidden states from position 0) to channel 1,
in chunks while the request runs when `streaming`, else whole at its finish.
Stage 2, the talker, is a vLLM engine on `prompt_embeds` with the cache worker
too (publishing to channel 2): its prompt is the thinker's prompt rows,
positions 0..prompt_len-1, so it starts as soon as those have arrived, while the
thinker still generates, and its tokens are those of a talker started after the
thinker finished. Stage 3, the codec (`Code2WavLike`, no cache), turns the
talker's rows from position prompt_len-1 (each the row that chose one talker
token) into frames as they arrive. Each engine is stepped by its own thread
(`EngineLoop`); requests run one at a time, so each latency is that request's own.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import torch

from prefix_cache.channel import StageChannel
from prefix_cache.tools.pipelines.codec_stage import Code2WavLike
from prefix_cache.tools.pipelines.engine_loop import EngineLoop, Finished
from prefix_cache.tools.pipelines.engines import Engine, EngineShape, start_thinker
from prefix_cache.tools.pipelines.pipeline import ROWS_TIMEOUT_S, greedy_params, talker_params
from prefix_cache.tools.pipelines.streaming import RowStream


@dataclass(frozen=True)
class StreamRequest:
    """A thinker request: its prompt and the tokens it generates (all of them: no stop)."""

    req_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class StreamResult:
    """One request through the stages; times in perf_counter seconds."""

    req_id: str
    prompt_len: int
    thinker: Finished
    thinker_rows: torch.Tensor
    first_chunk_at: float  # the first of the thinker's rows reached the talker's side
    talker: Finished
    talker_rows: torch.Tensor | None = None  # None: the talker publishes nothing (two stages)
    frames: torch.Tensor | None = None
    first_frame_at: float | None = None

    def since_submission(self, at: float | None) -> float:
        """Seconds from the thinker's submission of this request to `at`."""
        return float("nan") if at is None else at - self.thinker.submitted_at

    @property
    def first_chunk_s(self) -> float:
        return self.since_submission(self.first_chunk_at)

    @property
    def talker_first_token_s(self) -> float:
        return self.since_submission(self.talker.first_token_at)

    @property
    def first_frame_s(self) -> float:
        return self.since_submission(self.first_frame_at)


def start_stage(model_dir: Path, channel: StageChannel, *, prefix_caching: bool,
                stream: bool | int, prompt_embeds: bool = False,
                shape: EngineShape = EngineShape(), **engine_args: Any) -> Engine:
    """A vLLM engine whose worker publishes its requests' rows to `channel`: in chunks while
    they run when `stream` (True: every position; N: every N positions), else at their finish;
    `prompt_embeds`: it takes rows as prompts (a talker); `engine_args`: more of vLLM's."""
    return start_thinker(model_dir, channel, prefix_caching=prefix_caching, shape=shape,
                         stage_options={"stream": stream}, enable_prompt_embeds=prompt_embeds,
                         **engine_args)


@dataclass
class Stages:
    """The running stages of one pipeline run. `talker_channel` and `codec` None: the talker
    is a plain engine (two stages)."""

    thinker: EngineLoop
    thinker_channel: StageChannel
    talker: EngineLoop
    talker_channel: StageChannel | None
    codec: Code2WavLike | None
    streaming: bool
    talker_tokens: int
    timeout_s: float = ROWS_TIMEOUT_S

    def run(self, request: StreamRequest) -> StreamResult:
        """`request` through every stage; returns once the last one is done with it."""
        prompt_len = len(request.prompt)
        self.thinker.submit(request.req_id, {"prompt_token_ids": request.prompt},
                            greedy_params(request.max_tokens))
        with ThreadPoolExecutor(1, thread_name_prefix="feed-talker") as pool:
            fed = pool.submit(self._feed_talker, request.req_id, prompt_len)
            frames = self._codec(request.req_id, prompt_len)
            thinker_rows = fed.result(self.timeout_s)
        thinker = self.thinker.wait(request.req_id, self.timeout_s)
        talker = self.talker.wait(request.req_id, self.timeout_s)
        result = StreamResult(request.req_id, prompt_len, thinker, thinker_rows.rows(),
                              thinker_rows.arrived_at[0], talker)
        if frames is not None:
            talker_rows, result.frames, result.first_frame_at = frames
            result.talker_rows = talker_rows.rows()
        return result

    def _feed_talker(self, req_id: str, prompt_len: int) -> RowStream:
        rows = RowStream(self.thinker_channel, req_id, self.streaming, self.timeout_s)
        feed_talker(rows, self.talker, prompt_len, talker_params(self.talker_tokens))
        return rows

    def _codec(self, req_id: str, prompt_len: int
               ) -> tuple[RowStream, torch.Tensor, float | None] | None:
        """The talker's rows as they arrive, the codec's frames from them and when the first
        frame was made: one frame per talker token, from the row that chose it (positions
        prompt_len-1 on)."""
        if self.talker_channel is None or self.codec is None:
            return None
        rows = RowStream(self.talker_channel, req_id, self.streaming, self.timeout_s)
        frames: list[torch.Tensor] = []
        done, first_frame_at = prompt_len - 1, None
        for so_far in rows:
            if len(so_far) > done:
                frames.append(self.codec(so_far[done:]))
                first_frame_at = first_frame_at or time.perf_counter()
                done = len(so_far)
        rows.check_whole()
        return rows, torch.cat(frames) if frames else torch.empty(0), first_frame_at


def feed_talker(rows: RowStream, talker: EngineLoop, prompt_len: int, params: Any) -> None:
    """Submit `rows.request_id` to `talker` on its first `prompt_len` rows as soon as they have
    arrived, then take the rest of `rows` (the stage's outputs, to check or pass on)."""
    submitted = False
    for so_far in rows:
        if not submitted and len(so_far) >= prompt_len:
            talker.submit(rows.request_id, {"prompt_embeds": so_far[:prompt_len]}, params)
            submitted = True
    rows.check_whole()
    if not submitted:
        raise RuntimeError(f"request {rows.request_id}: its stage published "
                           f"{len(rows.rows())} rows, fewer than its {prompt_len} prompt "
                           f"positions")


def run_stages(thinker: Engine, thinker_channel: StageChannel, talker: Engine,
               talker_channel: StageChannel | None, requests: Sequence[StreamRequest], *,
               streaming: bool, talker_tokens: int, codec: Code2WavLike | None = None
               ) -> list[StreamResult]:
    """`requests` one at a time through the stages, each engine stepped by a thread of its own
    for the length of the run."""
    with ExitStack() as stack:  # every loop is closed, whichever close raises
        loops = [EngineLoop(thinker, "thinker"), EngineLoop(talker, "talker")]
        for loop in loops:
            stack.callback(loop.close)
        stages = Stages(loops[0], thinker_channel, loops[1], talker_channel, codec, streaming,
                        talker_tokens)
        return [stages.run(request) for request in requests]
