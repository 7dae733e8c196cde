"""The shm channel's chunk ring: a streaming step's chunks are published and taken with no
system call and no lock, in order with the id's entry files, each exactly once, and no fault
(a reader stopped past the time to live, a writer killed mid-write, a ring that is full)
hands a reader another request's rows or loses a slot for good."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import threading
import time

import pytest
import torch

from prefix_cache import HIDDEN_KEY
from prefix_cache.channel import OmniPrefixCacheChannelError, open_channel
from prefix_cache.channel import _shm
from prefix_cache.channel.base import StageChunk
from prefix_cache.channel.codec import PREFIX_BYTES
from prefix_cache.channel import shm
from prefix_cache.channel.shm import RING_SLOT_BYTES, ShmChannel

_WORD = struct.Struct("<Q")
_RING_HEADER_BYTES = 64


def _rows(request: int, start: int, rows: int = 1, width: int = 64) -> dict[str, torch.Tensor]:
    """Rows that name their request and position: row i is (request, start + i, ...)."""
    out = torch.zeros(rows, width)
    out[:, 0] = request
    out[:, 1] = torch.arange(start, start + rows)
    return {HIDDEN_KEY: out}


def _check(rows: torch.Tensor, request: int, start: int) -> None:
    assert rows[:, 0].eq(request).all(), f"rows of request {int(rows[0, 0])}, not {request}"
    assert rows[:, 1].tolist() == list(range(start, start + rows.shape[0]))


def _one_slot_channel(**options: float) -> ShmChannel:
    """A namespace whose ring has exactly one slot (its capacity a quarter of it)."""
    channel = ShmChannel.create(capacity_bytes=4 * RING_SLOT_BYTES, **options)
    assert channel._ring_slots == 1
    return channel


def test_a_streamed_chunk_goes_through_the_ring_with_no_system_call_or_lock() -> None:
    with open_channel("shm") as producer, open_channel(producer.spec) as consumer:
        producer.put("req-0", _rows(0, 0), start=0, final=False)  # registers the producer
        made = _shm.steps()  # every open, flock, rename, unlink... of `_shm`
        producer.put("req-0", _rows(0, 1), start=1, final=False)
        assert _shm.steps() == made
        assert len(_shm.ring_slots(producer._ring)) == 2
        assert not list(producer.directory.glob("[0-9a-f]*"))  # no entry file, no marker
        stream = consumer.stream("req-0", timeout_s=5)
        for start in (0, 1):
            _check(next(stream).rows[HIDDEN_KEY], 0, start)
        assert _shm.ring_slots(producer._ring) == [] and producer.used_bytes() == 0


def test_a_handle_keeps_a_bounded_number_of_ids_names(monkeypatch) -> None:
    """A streaming stage names each live request at every chunk: its handle keeps the names,
    at most `DIGESTS_KEPT` (memory stays flat over any number of requests), and an id whose
    name was dropped is named the same again."""
    monkeypatch.setattr(shm, "DIGESTS_KEPT", 3)
    with open_channel("shm") as producer, open_channel(producer.spec) as consumer:
        for request in range(8):
            producer.put(f"req-{request}", _rows(request, 0), start=0, final=False)
            assert len(producer._digests) <= 3
        producer.put("req-0", _rows(0, 1), start=1, final=False)
        for request in range(8):
            stream = consumer.stream(f"req-{request}", timeout_s=5)
            _check(next(stream).rows[HIDDEN_KEY], request, 0)
            if request == 0:
                _check(next(stream).rows[HIDDEN_KEY], 0, 1)


def test_a_handle_forgets_a_streams_name_when_the_stream_ends() -> None:
    """Names are kept only while a stream runs through the ring: its final entry (a file) put
    and taken, neither handle keeps the id's (memory stays flat over any number of requests)."""
    with open_channel("shm") as producer, open_channel(producer.spec) as consumer:
        producer.put("req-a", _rows(1, 0), start=0, final=False)
        stream = consumer.stream("req-a", timeout_s=5)
        _check(next(stream).rows[HIDDEN_KEY], 1, 0)
        assert "req-a" in producer._digests and "req-a" in consumer._digests
        producer.put("req-a", _rows(1, 1), start=1, final=True)
        assert "req-a" not in producer._digests
        _check(next(stream).rows[HIDDEN_KEY], 1, 1)
        assert "req-a" not in consumer._digests


def test_ring_chunks_and_entry_files_of_one_stream_arrive_in_order() -> None:
    """Big chunks go to files, small ones to the ring, the final one to a file: one order."""
    with open_channel("shm") as producer, open_channel(producer.spec) as consumer:
        start, sizes = 0, [1, 700, 1, 1, 900, 1, 3]  # 700 rows of 64 floats: past a slot
        for i, rows in enumerate(sizes):
            producer.put("req-7", _rows(7, start, rows), start=start, final=i == len(sizes) - 1)
            start += rows
        got = consumer.get("req-7", timeout_s=5)[HIDDEN_KEY]
        _check(got, 7, 0)
        assert got.shape[0] == sum(sizes)
        assert producer.used_bytes() == 0


def test_a_full_ring_spills_to_files_in_order() -> None:
    with _one_slot_channel() as producer, open_channel(producer.spec) as consumer:
        for start in range(20):  # one slot: the first chunk takes it, the rest are files
            assert producer.put_all([("req-1", StageChunk(
                _rows(1, start), start, start == 19))]) == [None]
        assert len(_shm.ring_slots(producer._ring)) == 1
        _check(consumer.get("req-1", timeout_s=5)[HIDDEN_KEY], 1, 0)


def test_a_reader_stopped_past_the_ttl_gets_an_error_never_the_next_requests_rows() -> None:
    with _one_slot_channel(ttl_s=0.3) as producer, open_channel(producer.spec) as consumer:
        producer.put("req-a", _rows(1, 0), start=0, final=False)
        (_, slot, word, _), = _shm.ring_find(consumer._ring, consumer._digest("req-a"), 0.0,
                                             PREFIX_BYTES)
        held = _shm.ring_claim(consumer._ring, slot, word)  # then the reader stops
        assert held >= 0
        time.sleep(0.4)
        producer._sweep()  # frees a slot a reader held past the ttl
        producer.put("req-b", _rows(2, 0), start=0, final=False)  # into that same slot
        assert _shm.ring_copy_out(consumer._ring, slot, held) is None  # not req-a's bytes
        _check(next(consumer.stream("req-b", timeout_s=5)).rows[HIDDEN_KEY], 2, 0)


def test_a_reader_woken_after_a_sweep_freed_its_slot_still_has_whole_bytes() -> None:
    """Freed but not yet written again: the copy is the entry's."""
    with _one_slot_channel(ttl_s=0.2) as producer:
        producer.put("req-a", _rows(3, 0), start=0, final=False)
        (_, slot, word, _), = _shm.ring_find(producer._ring, producer._digest("req-a"), 0.0, 0)
        held = _shm.ring_claim(producer._ring, slot, word)
        time.sleep(0.3)
        producer._sweep()
        assert _shm.ring_copy_out(producer._ring, slot, held) is not None


def test_the_take_names_the_request_when_its_slot_was_taken_from_it(monkeypatch) -> None:
    with _one_slot_channel(ttl_s=0.3) as producer, open_channel(producer.spec) as consumer:
        producer.put("req-a", _rows(1, 0), start=0, final=False)
        copy_out = _shm.ring_copy_out

        def stopped_past_the_ttl(ring, slot, held):  # the reader stops between its two calls
            time.sleep(0.4)
            producer._sweep()
            producer.put("req-b", _rows(2, 0), start=0, final=False)
            return copy_out(ring, slot, held)

        monkeypatch.setattr(_shm, "ring_copy_out", stopped_past_the_ttl)
        with pytest.raises(OmniPrefixCacheChannelError, match=r"request req-a: .*lost"):
            next(consumer.stream("req-a", timeout_s=5))


def _set_word(channel: ShmChannel, slot: int, word: int) -> None:
    _WORD.pack_into(channel._ring, _RING_HEADER_BYTES + slot * RING_SLOT_BYTES, word)


def test_a_sweep_frees_a_dead_writers_slot_and_never_a_live_ones() -> None:
    with ShmChannel.create(capacity_bytes=8 * RING_SLOT_BYTES) as channel:
        assert channel._ring_slots == 2
        channel.register_producer()
        live = channel._producer.record["writer"]
        _set_word(channel, 0, live << 32 | 5 << 2 | 1)  # writing, generation 5
        _set_word(channel, 1, (live + 100) << 32 | 9 << 2 | 1)  # a writer that never lived
        channel._sweep()
        assert [(slot, state, writer) for slot, _, state, writer, *_ in
                _shm.ring_slots(channel._ring)] == [(0, 1, live)]


def _put_forever(spec: str, request: int) -> None:
    with open_channel(spec) as channel:
        for start in range(10**9):
            channel.put(f"req-{request}", _rows(request, start), start=start, final=False)


@pytest.mark.slow
def test_writers_killed_anywhere_leave_only_whole_chunks_and_no_lost_slot() -> None:
    context = multiprocessing.get_context("fork")
    with ShmChannel.create(capacity_bytes=64 * RING_SLOT_BYTES) as reader:
        for round_ in range(8):
            child = context.Process(target=_put_forever, args=(reader.spec, round_))
            child.start()
            time.sleep(0.05 + 0.02 * round_)
            os.kill(child.pid, signal.SIGKILL)
            child.join()
            reader._sweep()  # the dead writer's slot, if it died writing
            states = {state for _, _, state, *_ in _shm.ring_slots(reader._ring)}
            assert states <= {2}, f"round {round_}: slots left {states}"
            stream, start = reader.stream(f"req-{round_}", timeout_s=0.5), 0
            try:
                while True:  # every chunk published is whole and in order
                    chunk = next(stream)
                    _check(chunk.rows[HIDDEN_KEY], round_, start)
                    start += chunk.rows[HIDDEN_KEY].shape[0]
            except OmniPrefixCacheChannelError:
                pass  # its producer died: the stream ends there
            assert start > 0
        assert _shm.ring_slots(reader._ring) == []


def _read_all(spec: str, requests: list[int], chunks: int, errors: multiprocessing.Queue) -> None:
    try:
        with open_channel(spec) as channel:
            for request in requests:
                got = channel.get(f"req-{request}", timeout_s=30)[HIDDEN_KEY]
                _check(got, request, 0)
                assert got.shape[0] == chunks
    except BaseException as e:  # reported to the parent
        errors.put(f"{type(e).__name__}: {e}")


@pytest.mark.slow
def test_two_producers_and_two_reader_processes_each_chunk_once_and_exact() -> None:
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    chunks = 60
    with ShmChannel.create(capacity_bytes=32 * RING_SLOT_BYTES) as owner:
        readers = [context.Process(target=_read_all, args=(owner.spec, list(range(k, 16, 2)),
                                                            chunks, errors)) for k in (0, 1)]
        for process in readers:
            process.start()

        def produce(requests: range) -> None:
            with open_channel(owner.spec) as channel:
                for start in range(chunks):
                    failures = channel.put_all([(f"req-{r}", StageChunk(
                        _rows(r, start), start, start == chunks - 1)) for r in requests])
                    assert failures == [None] * len(requests)

        producers = [threading.Thread(target=produce, args=(range(k, k + 8),)) for k in (0, 8)]
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join(60)
        for process in readers:
            process.join(60)
        assert errors.empty(), errors.get()
        assert [p.exitcode for p in readers] == [0, 0]
        assert owner.used_bytes() == 0


def test_a_waiting_reader_is_woken_by_a_publish_from_another_process() -> None:
    with open_channel("shm") as owner:
        seen = _shm.ring_wait(owner._ring, -1, 0)
        context = multiprocessing.get_context("fork")
        child = context.Process(target=lambda: (time.sleep(0.2), open_channel(owner.spec).put(
            "req-w", _rows(4, 0), start=0, final=False)))
        child.start()
        start = time.monotonic()
        assert _shm.ring_wait(owner._ring, seen, 30.0) != seen  # woken, not timed out
        assert time.monotonic() - start < 25
        child.join(10)
        _check(next(owner.stream("req-w", timeout_s=5)).rows[HIDDEN_KEY], 4, 0)


def test_a_namespace_without_a_ring_is_refused_by_name(tmp_path) -> None:
    with ShmChannel.create(tmp_path) as owner:
        (owner.directory / ".ring").unlink()  # the owner's mapping keeps its own
        (owner.directory / ".ring").write_bytes(b"not a ring")
        os.chmod(owner.directory / ".ring", 0o600)
        with pytest.raises(OmniPrefixCacheChannelError, match=r"has no usable \.ring"):
            ShmChannel.join(owner.directory.name, tmp_path)


def test_a_handle_closes_while_its_reader_waits_on_the_ring() -> None:
    with open_channel("shm") as owner:
        handle = open_channel(owner.spec)
        failures: list[BaseException] = []

        def read() -> None:
            try:
                handle.get("req-never", timeout_s=10)
            except OmniPrefixCacheChannelError as e:
                failures.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.2)  # blocked in the ring's wait
        handle.close()  # waits for operations in flight, not for the pause
        reader.join(15)
        assert not reader.is_alive()
        assert failures and "closed" in str(failures[0])


def test_a_chunk_that_lands_in_the_ring_during_a_take_comes_before_the_file_after_it(
        monkeypatch) -> None:
    """A take looks at the ring, then at the id's files: a chunk published to the ring just
    after that look, and the final chunk (a file) right behind it, must not swap places."""
    with open_channel("shm") as producer, open_channel(producer.spec) as consumer:
        producer.put("req-r", _rows(5, 0), start=0, final=False)
        stream = consumer.stream("req-r", timeout_s=5)
        _check(next(stream).rows[HIDDEN_KEY], 5, 0)
        find, landed = _shm.ring_find, []

        def publish_after_the_look(ring, name, expired_before, prefix_bytes):
            found = find(ring, name, expired_before, prefix_bytes)
            if not found and not landed:
                landed.append(True)
                producer.put("req-r", _rows(5, 1), start=1, final=False)  # the ring
                producer.put("req-r", _rows(5, 2), start=2, final=True)  # a file
            return found

        monkeypatch.setattr(_shm, "ring_find", publish_after_the_look)
        _check(next(stream).rows[HIDDEN_KEY], 5, 1)
        _check(next(stream).rows[HIDDEN_KEY], 5, 2)
