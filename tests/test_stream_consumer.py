"""The consumer side of streamed stages: a request's rows read as they arrive (`RowStream`) are
the whole entry's, however the producer cut them; the codec's frames do not depend on the cut;
a talker fed a stream starts on the prompt rows before the producer's final chunk, and its
tokens are bitwise those of a talker fed the whole entry (vLLM's CPU engine)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import StageChannel, open_channel
from prefix_cache.tools.pipelines.codec_stage import Code2WavLike
from prefix_cache.tools.pipelines.streaming import RowStream
from tests.vllm_fixtures import talker_model_dir  # noqa: F401  (the fixture; no vLLM import)

HIDDEN = 256
PROMPT_LEN = 70
CUTS = [0, 64, 69, 71, 72, 80, 90]  # the first chunk stops short of the prompt's end


def thinker_like_rows(num_rows: int = CUTS[-1], seed: int = 0) -> torch.Tensor:
    """Rows of a final norm's scale (about sqrt(hidden)), as a thinker's are."""
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


def put_chunks(channel: StageChannel, request_id: str, rows: torch.Tensor, cuts: list[int],
               pause_s: float = 0.0) -> list[float]:
    """Publish `rows` in chunks cut at `cuts`, the last final; when each put began (a reader
    may take a chunk before its put returns)."""
    put_at = []
    for start, end in zip(cuts, cuts[1:]):
        time.sleep(pause_s)
        put_at.append(time.perf_counter())
        channel.put(request_id, {HIDDEN_KEY: rows[start:end]}, start=start,
                    final=end == cuts[-1], meta={"prompt_len": PROMPT_LEN})
    return put_at


def test_a_row_stream_yields_the_rows_so_far_and_ends_with_the_whole_entry() -> None:
    rows = thinker_like_rows()
    with open_channel() as channel:
        put_chunks(channel, "streamed", rows, CUTS)
        channel.put("whole", {HIDDEN_KEY: rows}, meta={"prompt_len": PROMPT_LEN})
        streamed = RowStream(channel, "streamed", streaming=True, timeout_s=5)
        seen = [len(so_far) for so_far in streamed]
        whole = RowStream(channel, "whole", streaming=False, timeout_s=5)
        assert [len(so_far) for so_far in whole] == [len(rows)]
    assert seen == CUTS[1:]
    assert len(streamed.arrived_at) == len(CUTS) - 1
    assert torch.equal(streamed.rows(), rows) and torch.equal(whole.rows(), rows)
    assert streamed.meta == whole.meta == {"prompt_len": PROMPT_LEN} and not streamed.aborted


def test_the_codecs_frames_do_not_depend_on_how_the_rows_were_cut() -> None:
    codec = Code2WavLike(HIDDEN)
    rows = thinker_like_rows()
    whole = codec(rows)
    cut = torch.cat([codec(rows[a:b]) for a, b in zip(CUTS, CUTS[1:])])
    assert whole.shape == (len(rows), 240) and torch.equal(cut, whole)
    assert torch.equal(Code2WavLike(HIDDEN)(rows), whole)  # seeded
    assert not torch.equal(Code2WavLike(HIDDEN, seed=1)(rows), whole)


@pytest.mark.vllm
def test_a_streamed_talker_starts_before_the_final_chunk_with_the_whole_entrys_tokens(
        talker_model_dir: Path) -> None:
    from prefix_cache.tools.pipelines.engine_loop import EngineLoop
    from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_talker
    from prefix_cache.tools.pipelines.pipeline import talker_params
    from prefix_cache.tools.pipelines.stream_pipeline import feed_talker

    rows = thinker_like_rows()
    params = talker_params(6)
    with multiprocessing_mode(False), open_channel() as channel:
        talker = start_talker(talker_model_dir)
        loop = EngineLoop(talker, "talker")
        try:
            loop.submit("whole", {"prompt_embeds": rows[:PROMPT_LEN]}, params)
            expected = loop.wait("whole", 120)
            producer_put: list[float] = []
            producer = threading.Thread(target=lambda: producer_put.extend(
                put_chunks(channel, "streamed", rows, CUTS, pause_s=0.3)))
            producer.start()
            stream = RowStream(channel, "streamed", streaming=True, timeout_s=30)
            feed_talker(stream, loop, PROMPT_LEN, params)
            producer.join(30)
            streamed = loop.wait("streamed", 120)
        finally:
            loop.close()
            talker.close()
    assert torch.equal(stream.rows(), rows)
    assert streamed.tokens == expected.tokens and len(expected.tokens) == 6
    # submitted once the chunk holding position PROMPT_LEN - 1 came, before the next one
    assert producer_put[2] <= streamed.submitted_at < producer_put[3]
