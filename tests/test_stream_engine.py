"""Streamed stage outputs on vLLM's real engine (`additional_config["prefix_cache"]["stream"]`):
each request's chunks arrive while it runs, a prefix hit's first chunk is the cached rows alone,
and the chunks joined are the rows the same engine publishes whole (bitwise on CPU; on a GPU,
whose engine schedules asynchronously by default, within the demo's tolerance); an abort mid-stream
ends the stream with a final chunk marked aborted. Rows recomputed after preemption are never
streamed twice."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from prefix_cache import HIDDEN_KEY  # noqa: E402
from prefix_cache.channel import StageChannel, StageChunk, open_channel  # noqa: E402
from prefix_cache.integration.chunks import ChunkSchedule  # noqa: E402
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery  # noqa: E402
from prefix_cache.tools.demo import DEFAULT_TOLERANCE, TOLERANCE, vllm_device  # noqa: E402
from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker  # noqa: E402
from tests.vllm_fixtures import (PREEMPTING_SHAPE, cpu_async_scheduling,  # noqa: E402,F401
                                 thinker_model_dir)

pytestmark = [pytest.mark.vllm]

PREFIX = list(range(100, 164))  # two 32-token blocks
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Streams:
    """A consumer thread per request: each stream's chunks and when they arrived."""

    def __init__(self, channel: StageChannel, request_ids: list[str]) -> None:
        self.chunks: dict[str, list[tuple[StageChunk, float]]] = {r: [] for r in request_ids}
        self.threads = [threading.Thread(target=self._read, args=(channel, r))
                        for r in request_ids]
        for thread in self.threads:
            thread.start()

    def _read(self, channel: StageChannel, request_id: str) -> None:
        for chunk in channel.stream(request_id, timeout_s=60):
            self.chunks[request_id].append((chunk, time.monotonic()))

    def joined(self) -> dict[str, torch.Tensor]:
        for thread in self.threads:
            thread.join(90)
        return {r: torch.cat([c.rows[HIDDEN_KEY] for c, _ in chunks])
                for r, chunks in self.chunks.items()}


def run(model_dir: Path, stream: bool) -> tuple[dict[str, torch.Tensor], Streams | None]:
    """Two waves through one engine: a request that fills the prefix's blocks, then three that
    hit them; every request's rows, read as the consumer reads them."""
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(model_dir, channel, prefix_caching=True,
                               stage_options={"stream": stream})
        try:
            waves = [["first"], ["hit-0", "hit-1", "hit-2"]]
            ids = [r for wave in waves for r in wave]
            streams = Streams(channel, ids) if stream else None
            for wave in waves:
                for request_id in wave:
                    engine.engine.add_request(request_id, {"prompt_token_ids": PREFIX + [
                        1 + len(request_id), 2 + ids.index(request_id)]}, GREEDY)
                while engine.has_work():
                    engine.step()
            rows = streams.joined() if streams else {r: channel.get(r, timeout_s=30)[HIDDEN_KEY]
                                                     for r in ids}
            assert engine.stats()["hit_tokens"] == 3 * len(PREFIX)
        finally:
            engine.close()
    return rows, streams


def test_streamed_chunks_join_to_the_whole_entrys_rows_and_a_hit_comes_first(
        thinker_model_dir: Path) -> None:
    whole, _ = run(thinker_model_dir, stream=False)
    streamed, streams = run(thinker_model_dir, stream=True)
    assert streamed.keys() == whole.keys()
    device = vllm_device()
    for request_id, rows in whole.items():
        if device == "cpu":  # bitwise; a GPU's kernels may reduce in another order per batch
            assert torch.equal(streamed[request_id], rows), request_id
        else:
            torch.testing.assert_close(streamed[request_id], rows, rtol=0,
                                       atol=TOLERANCE.get(device, DEFAULT_TOLERANCE))
    for request_id, chunks in streams.chunks.items():
        starts = [c.start for c, _ in chunks]
        assert len(chunks) >= 3 and chunks[-1][0].final, request_id  # while it ran
        assert starts == sorted(set(starts)) and starts[0] == 0
        if request_id.startswith("hit"):  # the cached rows alone, ahead of any step's
            assert chunks[0][0].rows[HIDDEN_KEY].shape[0] == len(PREFIX)
        arrived = [t for _, t in chunks]
        assert arrived[-1] > arrived[0]


def test_under_asynchronous_scheduling_whole_and_streamed_rows_are_the_synchronous_ones(
        thinker_model_dir: Path) -> None:
    """An asynchronous scheduler (a GPU engine's default) leaves a request whose last token the
    step before surely samples out of the next step: the runner drops it from its batch a step
    before its finish. The CPU engine made to schedule so publishes the rows it publishes
    synchronously, whole (read back from the runner's state of the request) and streamed."""
    if vllm_device() != "cpu":
        pytest.skip("a GPU engine schedules asynchronously already: the test above")
    synchronous, _ = run(thinker_model_dir, stream=False)
    with cpu_async_scheduling():
        whole, _ = run(thinker_model_dir, stream=False)
        streamed, _ = run(thinker_model_dir, stream=True)
    for request_id, rows in synchronous.items():
        assert torch.equal(whole[request_id], rows), request_id
        assert torch.equal(streamed[request_id], rows), request_id


def test_an_abort_mid_stream_ends_it_with_a_final_chunk_marked_aborted(
        thinker_model_dir: Path) -> None:
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               stage_options={"stream": True})
        try:
            engine.engine.add_request("long", {"prompt_token_ids": PREFIX * 8},
                                      SamplingParams(max_tokens=4))
            for _ in range(4):  # its prompt is prefilled 32 tokens a step
                engine.step()
            engine.engine.abort_request(["long"])
            chunks = list(channel.stream("long", timeout_s=30))
        finally:
            engine.close()
    assert len(chunks) >= 2 and chunks[-1].final and chunks[-1].aborted
    rows = torch.cat([c.rows[HIDDEN_KEY] for c in chunks])
    assert rows.shape[0] == chunks[-1].meta["num_rows"] < len(PREFIX) * 8


def test_requests_preempted_while_streaming_stream_each_position_once(
        thinker_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests whose decodes outgrow a 7-block KV cache: vLLM preempts some and
    recomputes them from position 0 while their chunks are out; each stream's positions still
    come once, in order, prompt + generated - 1 of them."""
    starts: dict[str, list[int]] = {}  # per request, the position of each step's rows
    due = ChunkSchedule.due

    def recording_due(self: ChunkSchedule, batch: Any, skip: Any = ()) -> Any:
        for req_id, start in zip(batch.req_ids, batch.starts):
            starts.setdefault(req_id, []).append(start)
        return due(self, batch, skip)

    monkeypatch.setattr(ChunkSchedule, "due", recording_due)
    prompts = {f"p{i}": PREFIX[:32] + [7 + i] * 16 for i in range(4)}
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               shape=PREEMPTING_SHAPE, stage_options={"stream": True})
        try:
            streams = Streams(channel, list(prompts))
            for request_id, prompt in prompts.items():
                engine.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            while engine.has_work():
                engine.step()
            joined = streams.joined()
        finally:
            engine.close()
    recomputed = [r for r, s in starts.items() if any(b < a for a, b in zip(s, s[1:]))]
    assert recomputed, "no request was preempted: the KV cache did not run out"
    for request_id, chunks in streams.chunks.items():
        ends = [c.start + c.rows[HIDDEN_KEY].shape[0] for c, _ in chunks]
        assert [c.start for c, _ in chunks] == [0, *ends[:-1]], request_id  # each once
        assert joined[request_id].shape[0] == len(prompts[request_id]) + 99


def test_rows_recomputed_after_preemption_are_not_streamed_again() -> None:
    """vLLM resets a preempted request to position 0: the delivery streams on from where its
    chunks ended, and the joined rows are the recomputed run's."""
    with open_channel() as channel:
        delivery = StageDelivery(channel, stream_every=1)

        def add(start: int, end: int, salt: float = 0.0) -> None:
            rows = torch.arange(start, end, dtype=torch.float32)[:, None] + salt
            delivery.add("a", start, {HIDDEN_KEY: rows}, end - start)

        add(0, 8)
        add(8, 9)       # chunks [0, 7) and [7, 8) out
        add(0, 9)       # preempted: the prompt and its one decode row again
        add(9, 10)
        delivery.finish(FinishedRequest("a", "a", prompt_len=8))
        chunks = list(channel.stream("a", timeout_s=5))
    assert [(c.start, c.rows[HIDDEN_KEY].shape[0]) for c in chunks] == \
        [(0, 7), (7, 1), (8, 1), (9, 1)]
    assert torch.equal(torch.cat([c.rows[HIDDEN_KEY] for c in chunks])[:, 0],
                       torch.arange(10, dtype=torch.float32))
    assert not chunks[-1].aborted and chunks[-1].meta == {"prompt_len": 8, "num_rows": 10}

