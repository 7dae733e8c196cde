"""Streamed entries on each channel backend (shared memory; Mooncake Store on loopback): chunks
come in order and each exactly once, across processes and racing readers; `get` joins them; a
failure raises where it was put; capacity holds chunk by chunk; malformed chunks are refused."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import (OmniPrefixCacheChannelError, OmniPrefixCacheChannelFullError,
                                  OmniPrefixCacheChannelTimeoutError, StageChannel, StageChunk,
                                  open_channel)
from tests.test_channel import channel, new_spec  # noqa: F401  (backend-parametrized fixtures)

WIDTH = 8


def positions(start: int, end: int) -> dict[str, torch.Tensor]:
    """Rows whose values are their positions: a misplaced row shows."""
    rows = torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, WIDTH)
    return {HIDDEN_KEY: rows, "codes": rows[:, :2].to(torch.int64)}


def put_stream(channel: StageChannel, request_id: str, bounds: list[int], *,
               pause_s: float = 0.0) -> None:
    """Chunks of positions bounds[0]..bounds[1], bounds[1]..bounds[2], ...; the last final."""
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        channel.put(request_id, positions(start, end), start=start,
                    final=i == len(bounds) - 2, meta={"chunks": len(bounds) - 1})
        time.sleep(pause_s)


def _produce(spec: str, request_id: str, bounds: list[int]) -> None:
    with open_channel(spec) as channel:
        channel.register_producer()
        channel.expect(request_id)
        put_stream(channel, request_id, bounds, pause_s=0.05)


def test_a_stream_from_another_process_arrives_in_order_chunk_by_chunk(
        channel: StageChannel) -> None:
    bounds = [0, 64, 65, 66, 80]
    producer = multiprocessing.get_context("spawn").Process(
        target=_produce, args=(channel.spec, "req-s", bounds))
    producer.start()
    arrived: list[tuple[StageChunk, float]] = []
    for chunk in channel.stream("req-s", timeout_s=60):
        arrived.append((chunk, time.monotonic()))
    producer.join(30)
    assert producer.exitcode == 0
    chunks = [c for c, _ in arrived]
    assert [(c.start, c.final) for c in chunks] == [(0, False), (64, False), (65, False),
                                                    (66, True)]
    for chunk, start, end in zip(chunks, bounds, bounds[1:]):
        assert torch.equal(chunk.rows[HIDDEN_KEY], positions(start, end)[HIDDEN_KEY])
    assert chunks[-1].meta == {"chunks": 4}
    assert arrived[-1][1] - arrived[0][1] > 0.1  # each as it was put, not all at the end
    with pytest.raises(OmniPrefixCacheChannelTimeoutError):  # each exactly once
        channel.get("req-s", timeout_s=0.1)


def test_get_waits_for_the_final_chunk_and_joins_the_rows_from_position_0(
        channel: StageChannel) -> None:
    putter = threading.Thread(target=put_stream, args=(channel, "req-j", [0, 10, 11, 12]),
                              kwargs={"pause_s": 0.1})
    putter.start()
    entry = channel.get_entry("req-j", timeout_s=10)
    putter.join()
    assert entry.final and entry.start == 0 and entry.meta == {"chunks": 3}
    assert all(torch.equal(entry.outputs[k], v) for k, v in positions(0, 12).items())
    channel.put("req-j", positions(0, 3))  # whole entries under the id are as they were
    assert torch.equal(channel.get("req-j", timeout_s=5)["codes"], positions(0, 3)["codes"])


def test_a_key_missing_from_some_chunks_reads_zeros_there_when_joined(
        channel: StageChannel) -> None:
    channel.put("req-k", {HIDDEN_KEY: positions(0, 4)[HIDDEN_KEY]}, start=0, final=False)
    channel.put("req-k", positions(4, 6), start=4, final=True)
    got = channel.get("req-k", timeout_s=5)
    assert torch.equal(got["codes"], torch.cat([torch.zeros(4, 2, dtype=torch.int64),
                                                positions(4, 6)["codes"]]))


def test_readers_racing_on_one_id_each_stream_one_entry_whole(channel: StageChannel) -> None:
    """Two readers stream one id while its producer publishes two streamed entries: the reader
    that takes an entry's first chunk gets all of that entry, the other the next entry; no
    chunk is lost, split off or taken twice."""
    count = 20
    taken: list[list[int]] = [[], []]
    with open_channel(channel.spec) as other:
        def read(handle: StageChannel, into: list[int]) -> None:
            into.extend(chunk.start for chunk in handle.stream("req-r", timeout_s=10))

        readers = [threading.Thread(target=read, args=(h, t))
                   for h, t in ((channel, taken[0]), (other, taken[1]))]
        for reader in readers:
            reader.start()
        for _ in range(2):
            put_stream(channel, "req-r", list(range(count + 1)))
        for reader in readers:
            reader.join(60)
    assert taken == [list(range(count))] * 2


def test_a_failure_mid_stream_raises_where_it_was_put(channel: StageChannel) -> None:
    channel.put("req-f", positions(0, 5), start=0, final=False)
    channel.put("req-f", positions(5, 6), start=5, final=False)
    channel.fail("req-f", "the stage stopped publishing")
    starts = []
    with pytest.raises(OmniPrefixCacheChannelError,
                       match="request req-f: .*the stage stopped publishing"):
        for chunk in channel.stream("req-f", timeout_s=5):
            starts.append(chunk.start)
    assert starts == [0, 5]
    channel.put("req-f", positions(0, 2), start=0, final=True)  # the failure ended the stream


@pytest.mark.parametrize("start, error", [
    (7, "positions 5..6 would be missing"),
    (3, "positions 3..4 were published already"),
])
def test_a_chunk_that_leaves_a_gap_or_overlaps_is_refused_and_the_stream_goes_on(
        channel: StageChannel, start: int, error: str) -> None:
    channel.put("req-m", positions(0, 5), start=0, final=False)
    with pytest.raises(OmniPrefixCacheChannelError,
                       match=f"request req-m: a chunk from position {start} is refused .*{error}"):
        channel.put("req-m", positions(start, start + 2), start=start, final=False)
    channel.put("req-m", positions(5, 6), start=5, final=True)
    assert torch.equal(channel.get("req-m", timeout_s=5)[HIDDEN_KEY], positions(0, 6)[HIDDEN_KEY])


def test_a_chunk_after_the_final_one_is_refused(channel: StageChannel) -> None:
    put_stream(channel, "req-a", [0, 4, 6])
    with pytest.raises(OmniPrefixCacheChannelError,
                       match="request req-a: a chunk from position 6 is refused .*no stream is "
                             "open under the id"):
        channel.put("req-a", positions(6, 7), start=6, final=True)


def test_a_full_channel_holds_chunk_by_chunk(new_spec: str) -> None:
    """Each chunk is an entry: the put that finds no room waits bounded and fails that chunk
    alone, the stream stays where it was, and it goes on once the consumer made room."""
    with open_channel(new_spec + "&capacity=8192&wait=0.3") as channel:
        big = 90  # rows of WIDTH float32 and 2 int64: about 4.3 KiB a chunk
        channel.put("req-c", positions(0, big), start=0, final=False)
        with pytest.raises(OmniPrefixCacheChannelFullError, match="request req-c"):
            channel.put("req-c", positions(big, 2 * big), start=big, final=False)
        chunks = channel.stream("req-c", timeout_s=5)
        assert next(chunks).start == 0  # room again
        channel.put("req-c", positions(big, 2 * big), start=big, final=True)
        assert next(chunks).final



def test_put_all_publishes_each_chunk_and_fails_a_refused_one_alone(
        channel: StageChannel) -> None:
    """A streaming step's chunks, put together: each is published as its own put would be,
    and one refused (a gap, an id twice) fails alone, its stream where it was."""
    channel.put("req-1", positions(0, 4), start=0, final=False)
    failures = channel.put_all([
        ("req-1", StageChunk(positions(4, 6), 4, final=False)),
        ("req-2", StageChunk(positions(0, 3), 0, final=True, meta={"n": 3})),
        ("req-3", StageChunk(positions(2, 5), 2, final=False)),  # positions 0..1 missing
        ("req-2", StageChunk(positions(3, 4), 3, final=True)),  # an id once a call
        ("req-4", StageChunk(positions(0, 2), 0, final=False)),
    ])
    assert failures[:2] == [None, None] and failures[4] is None
    assert isinstance(failures[2], OmniPrefixCacheChannelError)
    assert "request req-3: a chunk from position 2 is refused" in str(failures[2])
    assert isinstance(failures[3], ValueError) and "request req-2" in str(failures[3])
    entry = channel.get_entry("req-2", timeout_s=5)
    assert torch.equal(entry.outputs[HIDDEN_KEY], positions(0, 3)[HIDDEN_KEY])
    assert entry.meta == {"n": 3}
    channel.put_all([("req-1", StageChunk(positions(6, 7), 6, final=True)),
                     ("req-3", StageChunk(positions(0, 1), 0, final=True)),
                     ("req-4", StageChunk(positions(2, 3), 2, final=True))])
    for request_id, end in (("req-1", 7), ("req-3", 1), ("req-4", 3)):
        assert torch.equal(channel.get(request_id, timeout_s=5)[HIDDEN_KEY],
                           positions(0, end)[HIDDEN_KEY]), request_id


def test_put_all_publishes_what_has_room_at_once_and_the_rest_waits_bounded(
        new_spec: str) -> None:
    """Chunks the capacity holds are published together; one it does not hold waits up to
    the channel's full wait and fails alone."""
    with open_channel(new_spec + "&capacity=8192&wait=0.3") as channel:
        big = 40  # about 2.2 KiB a chunk: three fit, the fourth does not
        failures = channel.put_all([(f"req-{i}", StageChunk(positions(0, big), 0, final=False))
                                    for i in range(4)])
        assert failures[:3] == [None, None, None]
        assert isinstance(failures[3], OmniPrefixCacheChannelFullError)
        assert "request req-3" in str(failures[3])
        assert next(channel.stream("req-0", timeout_s=5)).start == 0  # room again
        assert channel.put_all([("req-3", StageChunk(positions(0, big), 0, final=True))]) \
            == [None]
        assert torch.equal(channel.get("req-3", timeout_s=5)[HIDDEN_KEY],
                           positions(0, big)[HIDDEN_KEY])


def test_chunks_of_a_stream_that_never_ended_never_join_the_ids_next_entry(
        channel: StageChannel) -> None:
    """A producer stops mid-stream (its chunks of positions 0..7 stay, no final one); the
    restarted stage publishes the retried request whole under the same id. The read of the
    unfinished stream raises, and the next get returns the retried entry whole."""
    with open_channel(channel.spec) as dead:
        dead.put("req-d", positions(0, 4), start=0, final=False)
        dead.put("req-d", positions(4, 8), start=4, final=False)
    with open_channel(channel.spec) as restarted:
        restarted.put("req-d", positions(0, 6))
    with pytest.raises(OmniPrefixCacheChannelError, match="request req-d"):
        channel.get("req-d", timeout_s=1)
    assert torch.equal(channel.get("req-d", timeout_s=5)[HIDDEN_KEY],
                       positions(0, 6)[HIDDEN_KEY])


def test_a_stream_of_an_unfinished_entry_raises_and_the_next_stream_is_the_next_entry_whole(
        channel: StageChannel) -> None:
    with open_channel(channel.spec) as dead:
        dead.put("req-e", positions(0, 8), start=0, final=False)
    channel.put("req-e", positions(0, 6))
    starts = []
    with pytest.raises(OmniPrefixCacheChannelError, match="request req-e"):
        for chunk in channel.stream("req-e", timeout_s=1):
            starts.append(chunk.start)
    assert starts == [0]
    chunks = list(channel.stream("req-e", timeout_s=5))
    assert [(c.start, c.final) for c in chunks] == [(0, True)]
    assert torch.equal(chunks[0].rows[HIDDEN_KEY], positions(0, 6)[HIDDEN_KEY])


def test_a_stream_whose_middle_chunk_expired_raises_naming_the_missing_positions(
        new_spec: str) -> None:
    with open_channel(new_spec + "&ttl=1") as channel:
        channel.put("req-h", positions(0, 4), start=0, final=False)
        chunks = channel.stream("req-h", timeout_s=5)
        assert next(chunks).start == 0
        channel.put("req-h", positions(4, 8), start=4, final=False)
        time.sleep(1.3)  # the chunk of positions 4..7 expires unread
        channel.put("req-h", positions(8, 10), start=8, final=True)
        with pytest.raises(OmniPrefixCacheChannelError,
                           match=r"request req-h: .*positions 4\.\.7"):
            next(chunks)


def test_two_producers_streams_of_one_id_are_two_entries_in_the_order_they_started(
        channel: StageChannel) -> None:
    """Two handles stream one id at once (two live requests under one external id, or a stage
    restarted under a retried id): their chunks interleave in the channel, yet each entry is
    read whole, the one that started first first."""
    with open_channel(channel.spec) as first, open_channel(channel.spec) as second:
        first.put("req-2", positions(0, 4), start=0, final=False)
        second.put("req-2", positions(0, 3), start=0, final=False)
        first.put("req-2", positions(4, 6), start=4, final=False)
        second.put("req-2", positions(3, 5), start=3, final=True)
        first.put("req-2", positions(6, 7), start=6, final=True)
    for end in (7, 5):
        assert torch.equal(channel.get("req-2", timeout_s=5)[HIDDEN_KEY],
                           positions(0, end)[HIDDEN_KEY])


def test_a_failure_ends_its_own_handles_stream_of_the_id_alone(channel: StageChannel) -> None:
    with open_channel(channel.spec) as first, open_channel(channel.spec) as second:
        first.put("req-x", positions(0, 4), start=0, final=False)
        second.put("req-x", positions(0, 2), start=0, final=False)
        second.fail("req-x", "the second request failed")
        first.put("req-x", positions(4, 6), start=4, final=True)
    assert torch.equal(channel.get("req-x", timeout_s=5)[HIDDEN_KEY],
                       positions(0, 6)[HIDDEN_KEY])
    with pytest.raises(OmniPrefixCacheChannelError, match="the second request failed"):
        channel.get("req-x", timeout_s=5)


def test_one_handles_two_streams_of_one_id_are_two_entries_and_a_failure_ends_its_own(
        channel: StageChannel) -> None:
    """A stage runs two requests under one external id at once (a client reused it), each
    streamed under its own name (`stream`): their chunks interleave, yet each is an entry of
    its own, and the failure of one ends that one alone."""
    channel.put("req-y", positions(0, 4), start=0, final=False, stream="a")
    channel.put("req-y", positions(0, 2), start=0, final=False, stream="b")
    channel.put("req-y", positions(4, 6), start=4, final=False, stream="a")
    channel.fail("req-y", "request b failed", stream="b")
    channel.put("req-y", positions(6, 7), start=6, final=True, stream="a")
    assert torch.equal(channel.get("req-y", timeout_s=5)[HIDDEN_KEY],
                       positions(0, 7)[HIDDEN_KEY])
    with pytest.raises(OmniPrefixCacheChannelError, match="request b failed"):
        channel.get("req-y", timeout_s=5)
