"""What the next stage receives from the runner: rows by position, across steps and preemption."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from prefix_cache import OmniPrefixCacheError
from prefix_cache.channel import OmniPrefixCacheChannelError, open_channel
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery


def rows(start: int, end: int) -> dict[str, torch.Tensor]:
    positions = torch.arange(start, end, dtype=torch.float32)
    return {"hidden": positions[:, None].repeat(1, 2), "mm.audio": positions[:, None]}


def test_steps_concatenate_by_position() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 5), 5)
    delivery.add("a", 5, rows(5, 6), 1)
    out, positions = delivery.pop("a")
    assert positions == 6
    assert torch.equal(out["hidden"], rows(0, 6)["hidden"])
    assert torch.equal(out["mm.audio"], rows(0, 6)["mm.audio"])
    assert delivery.pop("a") == ({}, 0)


def test_rows_recomputed_after_preemption_replace_the_delivered_ones() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 8), 8)
    delivery.add("a", 8, rows(8, 10), 2)
    delivery.add("a", 4, {k: v + 100 for k, v in rows(4, 12).items()}, 8)  # resumed at its hit
    hidden = delivery.pop("a")[0]["hidden"]
    assert hidden.shape == (12, 2)
    assert torch.equal(hidden[:4], rows(0, 4)["hidden"])
    assert torch.equal(hidden[4:], rows(4, 12)["hidden"] + 100)


def test_a_step_hands_its_requests_views_of_its_rows_by_span() -> None:
    """`add_step`: one tensor per key for the step, each request a span of it; a running
    request's later steps join its earlier rows, and nothing is copied until its finish."""
    delivery = StageDelivery()
    delivery.add_step([("a", 0, 0, 3), ("b", 0, 3, 5)], rows(0, 5))
    step = rows(10, 12)
    delivery.add_step([("b", 2, 0, 1), ("a", 3, 1, 2)], step)
    step["hidden"].zero_()  # views, not copies: what the step tensor holds is what goes out
    a, a_positions = delivery.pop("a")
    b, b_positions = delivery.pop("b")
    assert (a_positions, b_positions) == (4, 3)
    assert torch.equal(a["hidden"], torch.cat([rows(0, 3)["hidden"], torch.zeros(1, 2)]))
    assert torch.equal(a["mm.audio"], torch.tensor([[0.0], [1.0], [2.0], [11.0]]))
    assert torch.equal(b["mm.audio"], torch.tensor([[3.0], [4.0], [10.0]]))


def test_a_gap_in_a_step_fails_that_request_and_not_the_others_of_the_step() -> None:
    sink = Recording()
    delivery = StageDelivery(sink)
    delivery.add_step([("a", 0, 0, 2), ("b", 0, 2, 4)], rows(0, 4))
    delivery.add_step([("a", 5, 0, 1), ("b", 2, 1, 2)], rows(0, 2))  # a: positions 2..4 missing
    delivery.finish(FinishedRequest("a", "a", 2))
    delivery.finish(FinishedRequest("b", "b", 2))
    assert sink.put_ids == ["b"] and "positions 2..4 would be missing" in sink.failures["a"]


class Recording:
    """A stage sink that keeps what it was given."""

    def __init__(self) -> None:
        self.put_ids: list[str] = []
        self.failures: dict[str, str] = {}
        self.expected: list[str] = []

    def put(self, request_id: str, outputs: dict, **kwargs: object) -> None:
        self.put_ids.append(request_id)

    def put_all(self, chunks: Sequence[tuple[str, Any]]) -> list[Exception | None]:
        self.put_ids.extend(request_id for request_id, _ in chunks)
        return [None] * len(chunks)

    def fail(self, request_id: str, cause: str, *, stream: str = "") -> None:
        self.failures[request_id] = cause

    def expect_all(self, request_ids: Sequence[str]) -> None:
        self.expected.extend(request_ids)


def test_rows_past_the_delivered_ones_fail_that_request_naming_the_gap() -> None:
    sink = Recording()
    delivery = StageDelivery(sink)
    delivery.add("a", 0, rows(0, 4), 4)
    delivery.add("a", 8, rows(8, 9), 1)  # positions 4..7 never came: no silent hole
    delivery.add("b", 0, rows(0, 2), 2)
    assert delivery.stats()["delivery_requests_held"] == 1  # a's rows are gone, b's held
    delivery.finish(FinishedRequest("a", "a", prompt_len=4))
    delivery.finish(FinishedRequest("b", "b", prompt_len=2))
    assert sink.put_ids == ["b"]
    assert re.search(r"request a: .*positions 4\.\.7 would be missing", sink.failures["a"])
    assert delivery.stats()["delivery_failed"] == 1


def test_a_full_channel_fails_that_request_alone_and_its_consumer_is_told() -> None:
    from prefix_cache.channel import OmniPrefixCacheChannelError, open_channel

    with open_channel("shm://?capacity=4096&wait=0.1") as channel:
        delivery = StageDelivery(channel)
        delivery.add("a", 0, rows(0, 4), 4)
        delivery.add("big", 0, rows(0, 1000), 1000)  # 12 KiB of rows: more than the channel holds
        delivery.add("c", 0, rows(0, 3), 3)
        for rid in ("a", "big", "c"):
            delivery.finish(FinishedRequest(rid, f"ext-{rid}", prompt_len=3))
        with pytest.raises(OmniPrefixCacheChannelError,
                           match=r"request ext-big: .*exceeds the most an entry can hold"):
            channel.get("ext-big", timeout_s=5)
        assert torch.equal(channel.get("ext-a", timeout_s=5)["hidden"], rows(0, 4)["hidden"])
        assert torch.equal(channel.get("ext-c", timeout_s=5)["hidden"], rows(0, 3)["hidden"])
        assert delivery.stats()["delivery_failed"] == 1
        assert delivery.stats()["delivery_published"] == 2


def test_rows_that_cannot_be_joined_fail_that_request_alone() -> None:
    sink = Recording()
    delivery = StageDelivery(sink)
    delivery.add("a", 0, rows(0, 4), 4)
    delivery.add("a", 4, {"hidden": torch.zeros(2, 3), "mm.audio": torch.zeros(2, 1)}, 2)  # width
    delivery.add("b", 0, rows(0, 2), 2)
    delivery.finish(FinishedRequest("a", "ext-a", prompt_len=4))
    delivery.finish(FinishedRequest("b", "ext-b", prompt_len=2))
    assert sink.put_ids == ["ext-b"]
    assert re.search(r"its rows could not be joined: RuntimeError", sink.failures["ext-a"])
    assert delivery.stats()["delivery_failed"] == 1


def test_a_requests_first_rows_tell_the_sink_to_expect_it_once() -> None:
    """So that its consumer learns of the producer's death (SPEC §9); by its external id."""
    sink = Recording()
    delivery = StageDelivery(sink, external_id=lambda req_id: f"ext-{req_id}")
    delivery.add("a", 0, rows(0, 4), 4)
    delivery.add("a", 4, rows(4, 5), 1)
    delivery.add("b", 0, {}, 3)  # positions without rows: a request all the same
    assert sink.expected == ["ext-a", "ext-b"]


class ReadBack:
    """Rows read back as `RequestRows` hands them, without a pool: positions `start...` of
    `req_id`, `hold` gives `held` (or raises `error`, as a lost row does); `cancel` is
    counted."""

    def __init__(self, held: dict[str, torch.Tensor], error: Exception | None = None, *,
                 req_id: str = "", start: int = 0, num_rows: int | None = None) -> None:
        self.held, self.error = held, error
        self.req_id, self.start = req_id, start
        self.num_rows = start + next(iter(held.values())).shape[0] if num_rows is None \
            else num_rows
        self.rows_cut = 0
        self.cancels = 0

    def hold(self) -> dict[str, torch.Tensor]:
        if self.error is not None:
            raise self.error
        return self.held

    def cancel(self) -> None:
        self.cancels += 1


def test_chunks_read_back_stream_a_request_and_its_finish_publishes_the_rest(
        ) -> None:
    """A request read back streams the chunks the engine thread planned (a prefix hit's
    cached rows first), each from where the last ended, and its finish publishes the rest; a
    chunk whose rows cannot be read fails that request alone, by name, and a later chunk or
    finish of it publishes nothing. Every chunk's rows are let go."""
    with open_channel() as channel:
        delivery = StageDelivery(channel, stream_every=1)
        assert delivery.hold(["a", "b"]) == ["a", "b"]
        hit = ReadBack(rows(0, 4), req_id="a")
        lost = ReadBack(rows(0, 4), OmniPrefixCacheError("a row was lost to a failed write"),
                        req_id="b")
        delivery.publish_chunks([hit, lost])
        step = ReadBack(rows(4, 6), req_id="a", start=4)
        after = ReadBack(rows(4, 5), req_id="b", start=4)
        delivery.publish_chunks([step, after])
        final = ReadBack({}, req_id="a", start=6, num_rows=6)
        delivery.publish_reads([(FinishedRequest("a", "a", prompt_len=6), final),
                                (FinishedRequest("b", "b", prompt_len=6),
                                 ReadBack(rows(5, 6), req_id="b", start=5))])
        chunks = list(channel.stream("a", timeout_s=5))
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request b: .*its positions 0..3 could not be read back: .*lost"):
            channel.get("b", timeout_s=5)
        assert channel.used_bytes() == 0  # nothing of b's after its failure
    assert [(c.start, c.rows["hidden"].shape[0] if c.rows else 0, c.final) for c in chunks] == \
        [(0, 4, False), (4, 2, False), (6, 0, True)]
    assert torch.equal(torch.cat([c.rows["hidden"] for c in chunks[:2]]), rows(0, 6)["hidden"])
    assert chunks[-1].meta == {"prompt_len": 6, "num_rows": 6} and not chunks[-1].aborted
    assert hit.cancels and lost.cancels and step.cancels and after.cancels and final.cancels
    assert delivery.stats()["delivery_chunks"] == 2


def record_put_alls(channel: Any) -> list[list[str]]:
    """The ids of each `put_all` call `channel` takes from now on, a list a call."""
    puts: list[list[str]] = []
    put_all = channel.put_all

    def recorded(chunks: Sequence[tuple[str, Any]]) -> list[Exception | None]:
        puts.append([request_id for request_id, _ in chunks])
        return put_all(chunks)

    channel.put_all = recorded
    return puts


def test_a_streaming_steps_chunks_go_in_one_put_and_one_that_fails_fails_its_request_alone(
        ) -> None:
    """A streaming step's requests' chunks are put together (`put_all`), and so are the final
    chunks of requests retired together; a chunk the channel cannot take (larger than its
    capacity) fails its request, by name, and the others stream on."""
    def step(*spans: tuple[int, int]) -> dict[str, torch.Tensor]:  # each request's positions
        parts = [rows(start, end) for start, end in spans]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    with open_channel("shm://?capacity=4096&wait=0.1") as channel:
        puts = record_put_alls(channel)
        delivery = StageDelivery(channel, stream_every=1)
        delivery.note_prompts({"a": 2, "big": 600, "c": 2})
        delivery.add_step([("a", 0, 0, 2), ("big", 0, 2, 602), ("c", 0, 602, 604)],
                          step((0, 2), (0, 600), (0, 2)))
        for position in (2, 3):  # a sampled token's row stands a step later
            delivery.add_step([("a", position, 0, 1), ("c", position, 1, 2)],
                              step((position, position + 1), (position, position + 1)))
        delivery.finish_all([FinishedRequest(rid, rid, prompt_len=2) for rid in ("a", "big", "c")])
        assert puts == [["a", "big", "c"], ["a", "c"], ["a", "c"]]  # the steps', the finishes
        for rid in ("a", "c"):
            chunks = list(channel.stream(rid, timeout_s=5))
            assert [c.start for c in chunks] == [0, 2, 3]
            assert torch.equal(torch.cat([c.rows["hidden"] for c in chunks]),
                               rows(0, 4)["hidden"])
        with pytest.raises(OmniPrefixCacheChannelError, match="request big: .*chunk of its "
                           "positions 0..599 failed: OmniPrefixCacheChannelFullError"):
            channel.get("big", timeout_s=5)
    assert delivery.stats()["delivery_failed"] == 1
    assert delivery.stats()["delivery_rows"] == 8  # a's and c's 4 each


def test_a_steps_finished_requests_read_back_go_in_one_put_and_each_fails_alone() -> None:
    """Requests held whole that finish in one step are published together (`put_all`): one
    whose rows cannot be read, and one larger than the channel holds, fail alone, by name;
    every read's rows are let go."""
    with open_channel("shm://?capacity=4096&wait=0.1") as channel:
        puts = record_put_alls(channel)
        delivery = StageDelivery(channel)
        delivery.hold(["a", "lost", "big", "c"])
        reads = {"a": ReadBack(rows(0, 3), req_id="a"),
                 "big": ReadBack(rows(0, 600), req_id="big"),
                 "lost": ReadBack(rows(0, 3), OmniPrefixCacheError("a row was lost"),
                                  req_id="lost"),
                 "c": ReadBack(rows(0, 2), req_id="c")}
        delivery.publish_reads([(FinishedRequest(r, r, 2), reads[r]) for r in reads])
        assert puts == [["a", "big", "c"]]
        assert torch.equal(channel.get("a", timeout_s=5)["hidden"], rows(0, 3)["hidden"])
        assert torch.equal(channel.get("c", timeout_s=5)["hidden"], rows(0, 2)["hidden"])
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request lost: .*could not be read back: .*a row was lost"):
            channel.get("lost", timeout_s=5)
        with pytest.raises(OmniPrefixCacheChannelError,
                           match="request big: .*publishing its 600 rows failed: .*exceeds"):
            channel.get("big", timeout_s=5)
    assert all(read.cancels == 1 for read in reads.values())
    assert delivery.stats()["delivery_published"] == 2
    assert delivery.stats()["delivery_failed"] == 2


def test_requests_of_one_external_id_finishing_together_are_published_in_order() -> None:
    """A client that reuses an id: two of its requests finishing in one step each get their
    entry, in order, in two puts (a put takes an id once)."""
    with open_channel() as channel:
        puts = record_put_alls(channel)
        delivery = StageDelivery(channel)
        delivery.hold(["r-1", "r-2", "s"])
        delivery.publish_reads([
            (FinishedRequest("r-1", "r", 2), ReadBack(rows(0, 2), req_id="r-1")),
            (FinishedRequest("s", "s", 2), ReadBack(rows(0, 3), req_id="s")),
            (FinishedRequest("r-2", "r", 2), ReadBack(rows(0, 4), req_id="r-2"))])
        assert puts == [["r", "s"], ["r"]]
        assert [len(channel.get("r", timeout_s=5)["hidden"]) for _ in range(2)] == [2, 4]
        assert len(channel.get("s", timeout_s=5)["hidden"]) == 3
