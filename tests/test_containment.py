"""A fault in the stage's way out never takes vLLM's engine down (SPEC §7, Containment).

On vLLM's real CPU engine, in-process (so faults can be injected where they would strike):
a fault while delivering a finished request, reading its rows back, encoding an entry or
writing it to the channel fails the entries it touched, each naming the cause, and every other
request gets its rows; the engine keeps generating, and the cache stays exact. So does a fault
while a streaming stage reads a chunk back from the pool or writes a step's chunks. Faults in
every step stop publishing after `MAX_FAULTED_STEPS`; every request then gets a failure naming
why, and the engine still generates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from prefix_cache import HIDDEN_KEY, OmniPrefixCacheManager  # noqa: E402
from prefix_cache.channel import OmniPrefixCacheChannelError, StageChannel, open_channel  # noqa: E402
from prefix_cache.channel import base as channel_base  # noqa: E402
from prefix_cache.channel.shm import ShmChannel  # noqa: E402
from prefix_cache.core.chunk_reads import ChunkRows  # noqa: E402
from prefix_cache.core.request_reads import RequestRows  # noqa: E402
from prefix_cache.integration.delivery import StageDelivery  # noqa: E402
from prefix_cache.integration.stage_outputs import MAX_FAULTED_STEPS, StageOutputDriver  # noqa: E402
from prefix_cache.tools.pipelines.engines import (  # noqa: E402
    Engine, multiprocessing_mode, start_thinker)
from tests.vllm_fixtures import thinker_model_dir  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]

PREFIX = list(range(100, 164))  # four 16-token blocks every prompt shares
MAX_TOKENS = 4


class InjectedFault(RuntimeError):
    pass


#: Where a fault strikes: (owner, attribute) of the function that raises in its place.
SITES: dict[str, tuple[Any, str]] = {
    "deliver": (StageDelivery, "publish_reads"),  # a step's finished requests' entries, whole
    "read back": (RequestRows, "hold"),  # its rows, held in the pool for the channel's writer
    "encode": (channel_base, "encode"),
    "channel write": (ShmChannel, "_put_now_all"),  # puts into a namespace with room
    "save": (OmniPrefixCacheManager, "save_outputs"),  # on the engine thread
    "chunk read back": (ChunkRows, "hold"),  # a streamed chunk's rows, held in the pool
}


@contextmanager
def fault_at(site: str, calls: Callable[[int], bool]) -> Iterator[list[int]]:
    """Make the function at `site` raise `InjectedFault` on the calls (counted from 1) that
    `calls` picks; yields the numbers of the calls that raised."""
    owner, name = SITES[site]
    original = getattr(owner, name)
    raised: list[int] = []
    count = 0

    def faulty(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if calls(count):
            raised.append(count)
            raise InjectedFault(f"injected fault at {site}, call {count}")
        return original(*args, **kwargs)

    setattr(owner, name, faulty)
    try:
        yield raised
    finally:
        setattr(owner, name, original)


def prompts(first: int, count: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": PREFIX + list(range(1, 3 + i))} for i in range(first, first + count)]


def generate(engine: Engine, batch: list[dict[str, list[int]]]) -> list[Any]:
    return engine.llm.generate(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       ignore_eos=True),
                               use_tqdm=False)


def collect_streams(channel: StageChannel, outs: list[Any]) -> dict[str, torch.Tensor | str]:
    """Each request's chunks joined, or the failure its consumer met in their place."""
    got: dict[str, torch.Tensor | str] = {}
    for out in outs:
        try:
            got[out.request_id] = torch.cat([chunk.rows[HIDDEN_KEY] for chunk in
                                             channel.stream(out.request_id, timeout_s=10)])
        except OmniPrefixCacheChannelError as exc:
            got[out.request_id] = str(exc)
    return got


def collect(channel: StageChannel, outs: list[Any]) -> dict[str, torch.Tensor | str]:
    """Each request's hidden rows, or the failure its consumer got in their place."""
    got: dict[str, torch.Tensor | str] = {}
    for out in outs:
        try:
            got[out.request_id] = channel.get(out.request_id, timeout_s=10)[HIDDEN_KEY]
        except OmniPrefixCacheChannelError as exc:
            got[out.request_id] = str(exc)
    return got


def expected_rows(out: Any) -> int:
    return len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1


@pytest.fixture(scope="module")
def engine_and_channel(thinker_model_dir: Path) -> Iterator[tuple[Engine, StageChannel]]:
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True)
        try:
            yield engine, channel
        finally:
            engine.close()


def fault_once_then_run_again(engine: Engine, channel: StageChannel, site: str, call: int,
                              collect_rows: Callable[[StageChannel, list[Any]],
                                                     dict[str, torch.Tensor | str]]
                              ) -> dict[str, str]:
    """Four requests with the `call`-th call at `site` faulting, then the same prompts again:
    the entries the fault touched fail, each naming its request and the fault; every other one
    gets its rows; the engine goes on, and the second round, prefix hits now, gets every
    request's rows, exactly a delivered one's. Returns the first round's failures."""
    engine.engine.reset_prefix_cache()
    with fault_at(site, lambda count: count == call) as raised:
        outs = generate(engine, prompts(0, 4))
        faulted = collect_rows(channel, outs)
    assert raised == [call]
    failures = {r: v for r, v in faulted.items() if isinstance(v, str)}
    assert failures, f"the fault at {site} failed no entry"
    for req_id, message in failures.items():
        assert f"request {req_id}" in message and f"injected fault at {site}" in message
    for out in outs:
        if out.request_id not in failures:
            assert faulted[out.request_id].shape[0] == expected_rows(out)
    again = generate(engine, prompts(0, 4))
    delivered = collect_rows(channel, again)
    for first, out in zip(outs, again, strict=True):
        rows = delivered[out.request_id]
        assert isinstance(rows, torch.Tensor) and rows.shape[0] == expected_rows(out)
        if first.request_id not in failures:
            torch.testing.assert_close(rows, faulted[first.request_id], rtol=1e-4, atol=1e-4)
    assert engine.stats()["hit_tokens"] > 0
    return failures


#: The call of each site that faults: a publishing one. A step's finishes are one call of
#: `publish_reads`, and its second is the runner's own finish of the requests the scheduler
#: published first, which publishes nothing.
@pytest.mark.parametrize("site, call", [("deliver", 1), ("read back", 2), ("encode", 2),
                                        ("channel write", 2)])
def test_a_fault_fails_the_entries_it_touched_and_the_engine_goes_on_exact(
        engine_and_channel: tuple[Engine, StageChannel], site: str, call: int) -> None:
    fault_once_then_run_again(*engine_and_channel, site, call, collect)


@pytest.fixture(scope="module")
def streaming_engine_and_channel(thinker_model_dir: Path
                                 ) -> Iterator[tuple[Engine, StageChannel]]:
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               stage_options={"stream": True})
        try:
            yield engine, channel
        finally:
            engine.close()


#: The second call of each site: the chunks of a step after the first (the four prompts are
#: prefilled over several steps; a prompt's chunk is its first).
@pytest.mark.parametrize("site", ["chunk read back", "channel write"])
def test_a_fault_in_a_streamed_chunk_fails_its_requests_alone_and_the_engine_goes_on_exact(
        streaming_engine_and_channel: tuple[Engine, StageChannel], site: str) -> None:
    failures = fault_once_then_run_again(*streaming_engine_and_channel, site, 2,
                                         collect_streams)
    if site == "chunk read back":  # its one request
        assert len(failures) == 1, failures
    else:  # every chunk of its put: not all four requests'
        assert len(failures) < 4, failures
    for message in failures.values():
        assert "its positions" in message, message


@pytest.mark.parametrize("site, faults", [("deliver", MAX_FAULTED_STEPS), ("save", 1)],
                         ids=["deliver, output thread", "save, engine thread"])
def test_faults_that_persist_stop_publishing_and_every_request_learns_why(
        thinker_model_dir: Path, site: str, faults: int) -> None:
    """On the output thread, `MAX_FAULTED_STEPS` steps in a row; on the engine thread, the
    first fault (the cache's state is then unknown): the stage stops, the engine goes on."""
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True)
        try:
            # the first `faults` calls fault; a later one (a finish queued before the stage
            # stopped) would publish its rows, so a stage that went on would be seen below
            with fault_at(site, lambda call: call <= faults) as raised:
                outs = generate(engine, prompts(0, 4))
                later = generate(engine, prompts(4, 2))
            failures = collect(channel, outs + later)
            stats = engine.stats()
        finally:
            engine.close()
    assert raised == list(range(1, faults + 1))
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs + later)
    for out in outs + later:
        message = failures[out.request_id]
        assert isinstance(message, str) and f"request {out.request_id}" in message
        assert f"injected fault at {site}" in message
    for out in later:
        assert "stopped publishing" in failures[out.request_id]
    assert stats["delivery_failed"] == len(outs + later)
