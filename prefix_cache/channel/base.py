"""The stage channel: per request id a queue of entries, each published whole and taken once.

An entry may be published in chunks as its rows are made (`put(..., start=K, final=False)`,
then a final chunk): each chunk is published as an entry is, so chunks keep every rule below
one by one, and `stream` yields them as they come while `get` joins them. A handle refuses a
chunk that would leave a gap, overlap the rows before it, or follow the final one. Every chunk
carries its entry's id, minted by the publishing handle at the entry's first chunk: a reader
takes the id's oldest chunk that starts an entry, then that entry's chunks alone, each where
the last ended or raising. So the chunks of a stream whose producer died never join the id's
next entry, two producers' streams of one id are two entries (in the order they started), and
a hole (a chunk that expired unread) raises rather than go unseen.

A put never replaces an unconsumed entry: entries under one id are taken in put order, each
exactly once (clients reuse request ids). A namespace holds at most `capacity_bytes` of
unconsumed entries; a put that finds no room waits up to `full_wait_s`, then fails that entry
alone. Puts into a channel that stays full share that wait: once it has passed, each fails at
once until one finds room, so a consumer that lags costs its producer one wait, not one per
entry. An entry that waits for room never holds a pool's rows meanwhile (`PoolRows`: it is
copied out first). Entries expire `ttl_s` after their put, by the clock of the machine that
published them.

A producer may say which requests it will publish (`register_producer`, then `expect`): a
consumer waiting for such a request learns within `LIVENESS_CHECK_S` or so that the producing
process died (`OmniPrefixCacheChannelProducerError`, naming it), rather than at its timeout. It
also learns it when the namespace's producers have all died and none lives.

A backend supplies the primitives: reserve room and publish an encoded entry atomically behind
the id's earlier ones, take (claim, free and return) the id's oldest entry, sweep expired
entries, release its resources. This class builds the bounded waits and lifecycle on them.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from prefix_cache.channel.codec import (ENTRY_ID_BYTES, ChunkTag, EncodedEntry, StageEntry,
                                        decode, encode)
from prefix_cache.channel.errors import (OmniPrefixCacheChannelError,
                                         OmniPrefixCacheChannelFullError,
                                         OmniPrefixCacheChannelProducerError,
                                         OmniPrefixCacheChannelTimeoutError)
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.devices.base import check_timeout, poll_until

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0
#: How long a put waits for room in a full channel before it fails the entry.
DEFAULT_FULL_WAIT_S = 10.0
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.02
#: How often a waiting get asks whether the request's producer still lives.
LIVENESS_CHECK_S = 0.5
#: How long `close()` waits for the operations other threads have in flight on the handle.
CLOSE_WAIT_S = 30.0


@dataclass(frozen=True)
class StageChunk:
    """Rows of positions `start, start + 1, ...` of one request's entry, per key; the last
    chunk is `final` and carries the entry's `aborted` marker and `meta`. One given to
    `put_all` may hold `PoolRows`, as `put`'s outputs may. `stream` is the publisher's name of
    the entry it belongs to, where one id has several in progress at once (two live requests
    under one external id): chunks of different streams are chunks of different entries.
    A chunk `stream` yields says when its publisher put it (`published_at`, its `time.time()`).
    """

    rows: dict[str, torch.Tensor]
    start: int
    final: bool
    aborted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    stream: str = ""
    published_at: float = 0.0


@dataclass(frozen=True)
class Awaited:
    """The chunk of an id a reader waits for: the first chunk of the id's next entry (`entry`
    None), or the next chunk of the entry `entry`, which the producer `producer` publishes
    (`StageChannel._producer_name`; "": none registered)."""

    entry: str | None = None
    producer: str = ""

    def accepts(self, tag: ChunkTag | None) -> bool:
        """Whether a chunk whose prefix says `tag` is the one: for a first chunk, one that
        starts an entry, or one that is unreadable (its take says so); else one of `entry`."""
        if self.entry is None:
            return tag is None or tag.start == 0
        return tag is not None and tag.entry == self.entry


@dataclass(frozen=True)
class _Stream:
    """An entry this handle has put chunks of, not its final one: the entry's id, and the
    position its next chunk starts at."""

    entry: str
    stands: int


class StageChannel(ABC):
    """Entries live from their put until one get consumes them or `ttl_s` passes, never longer;
    unconsumed entries never hold more than `capacity_bytes` (failure markers aside).

    Invariant: the backend's resources (files, a store connection) are released only while no
    operation of any thread is in flight on them (`_operation`), so none uses them after.
    """

    def __init__(self, *, ttl_s: float, capacity_bytes: int, full_wait_s: float,
                 owns_namespace: bool) -> None:
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"channel ttl must be a finite number of seconds > 0, got {ttl_s}")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes <= 0:
            raise ValueError(f"channel capacity must be a positive number of bytes, "
                             f"got {capacity_bytes!r}")
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self.full_wait_s = check_timeout(full_wait_s, "channel full wait")
        #: whether this handle created its namespace (a spec naming none): its close frees it
        self.owns_namespace = owns_namespace
        self._full_since: float | None = None  # a put found no room, and none found room since
        #: seconds this handle's puts have waited for room in a full namespace
        self.room_wait_s = 0.0
        self._sweep_every_s = min(ttl_s, 60.0) / 4
        self._next_sweep = 0.0
        self._closed = False
        self._in_flight = 0  # operations running on the backend, on any thread
        self._idle = threading.Condition()
        self._streams: dict[tuple[str, str], _Stream] = {}  # (id, stream): chunks out, no final
        self._streams_lock = threading.Lock()
        self._entry_ids: tuple[int, bytes, Iterator[int]] = (0, b"", iter(()))  # pid, token, n

    @property
    @abstractmethod
    def spec(self) -> str:
        """The string `open_channel` takes in another process to reach this same namespace."""

    def put(self, request_id: str, outputs: Mapping[str, torch.Tensor | PoolRows], *,
            start: int = 0, final: bool = True, aborted: bool = False,
            meta: Mapping[str, Any] | None = None, stream: str = "") -> None:
        """Publishes `outputs` (CPU tensors or `PoolRows` by key, each as many rows; the caller
        holds pool rows until the put returns, or until it lets them go) for `request_id`, behind
        any unconsumed entries of the same id: a whole entry, or with `final=False` a chunk of
        one, rows of positions `start, start + 1, ...` (then the next chunk starts where this
        one ends, up to one with `final=True`; `stream` names the entry where the id has
        several in progress). `aborted` marks a request that ended early; `meta` is JSON. Waits
        up to `full_wait_s` for room; then raises `OmniPrefixCacheChannelFullError` and
        publishes nothing (the stream stays where it was)."""
        chunk = StageChunk(outputs, start, final, aborted, meta, stream)  # rows as put takes
        failure = self.put_all([(request_id, chunk)])[0]
        if failure is not None:
            raise failure

    def put_all(self, chunks: Sequence[tuple[str, StageChunk]]) -> list[Exception | None]:
        """Publishes each `(request_id, chunk)` as `put(request_id, chunk.rows,
        start=chunk.start, final=chunk.final, aborted=chunk.aborted, meta=chunk.meta,
        stream=chunk.stream)` would, together: on `shm`, those the namespace has room for in one call (its lock taken twice
        for all of them), as a stage puts a step's chunks or finished entries. Returns, per
        chunk in order, None where it was published, else the exception that failed it alone
        (it published nothing, its stream stays where it was); an id's stream may appear once.
        Pool
        rows of a chunk published at once are let go, and those of every other copied out,
        before any waits for room."""
        self._check_open()
        failures: list[Exception | None] = [None] * len(chunks)
        # index, (id, stream), entry, the stream it continues
        entries: list[tuple[int, tuple[str, str], StageEntry, _Stream | None]] = []
        now, seen, producer = time.time(), set(), self._producer_name()
        with self._streams_lock:
            for i, (request_id, chunk) in enumerate(chunks):
                try:
                    key = self._stream_key(request_id, chunk, seen)
                    stream = self._check_chunk(request_id, chunk, self._streams.get(key))
                    entries.append((i, key, StageEntry(
                        request_id, dict(chunk.rows), chunk.aborted, dict(chunk.meta or {}), now,
                        start=chunk.start, final=chunk.final,
                        entry=stream.entry if stream else self._new_entry_id(),
                        producer=producer), stream))
                except (ValueError, TypeError, OmniPrefixCacheChannelError) as exc:
                    failures[i] = exc
        for (i, *_), failure in zip(entries, self._put_entries(
                [entry for _, _, entry, _ in entries], bounded=True)):
            failures[i] = failure
        with self._streams_lock:
            for i, key, entry, stream in entries:
                if failures[i] is not None or self._streams.get(key) != stream:
                    continue  # failed, or a fail() ended its stream meanwhile
                if entry.final:
                    self._streams.pop(key, None)
                else:
                    self._streams[key] = _Stream(entry.entry, entry.start + entry.num_rows)
        return failures

    @staticmethod
    def _stream_key(request_id: str, chunk: StageChunk, seen: set[tuple[str, str]]
                    ) -> tuple[str, str]:
        """`chunk`'s stream of `request_id`, `(request_id, chunk.stream)`, which joins `seen`; a
        ValueError for an id that is not a non-empty str or a stream in `seen` already, a
        TypeError for rows that are no mapping or a stream that is no str."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty str, got {request_id!r}")
        if not isinstance(chunk.rows, Mapping):
            raise TypeError(f"request {request_id}: outputs must be a mapping of str keys to CPU "
                            f"tensors, e.g. {{HIDDEN_KEY: rows}}; got {type(chunk.rows).__name__}")
        if not isinstance(chunk.stream, str):
            raise TypeError(f"request {request_id}: stream must be a str, got "
                            f"{chunk.stream!r}")
        key = (request_id, chunk.stream)
        if key in seen:
            raise ValueError(f"request {request_id}: one put_all takes one chunk of an id's "
                             f"stream; put its next chunk in a later call")
        seen.add(key)
        return key

    def _check_chunk(self, request_id: str, chunk: StageChunk, stream: _Stream | None
                     ) -> _Stream | None:
        """The stream `chunk` of `request_id` continues, `stream` (the open one of its id and
        name, if any), or None where it starts an entry; a channel error for a gap, an overlap
        or a chunk after the final one (caller holds the lock)."""
        start = chunk.start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"request {request_id}: chunk start must be a whole number, "
                             f"got {start!r}")
        stands = stream.stands if stream else 0
        if chunk.final and start == 0 and stream is None:
            return None  # a whole entry: its keys may be of any shape
        if len(chunk.rows) > 1:  # one key's rows are as many as themselves
            counts = {key: rows.shape[0] if isinstance(rows, (torch.Tensor, PoolRows))
                      and len(rows.shape) else None for key, rows in chunk.rows.items()}
            if len(set(counts.values())) > 1:
                raise ValueError(f"request {request_id}: the keys of a chunk must have as many "
                                 f"rows each (its positions), got {counts}")
        if start == stands:
            return stream
        if stream is None:
            what = "no stream is open under the id (its final chunk was put, or its first chunk, " \
                   "from position 0, never was)"
        elif start > stands:
            what = f"positions {stands}..{start - 1} would be missing"
        else:
            what = f"positions {start}..{stands - 1} were published already"
        raise OmniPrefixCacheChannelError(
            f"request {request_id}: a chunk from position {start} is refused on channel "
            f"{self.spec}: {what}")

    def fail(self, request_id: str, cause: str, *, stream: str = "") -> None:
        """Publishes, in place of `request_id`'s rows, that they could not be published and why:
        its consumer's get raises a channel error naming the request and `cause`. It ends this
        handle's stream `stream` of the id, if one is open (its consumer raises there; other
        entries of the id go on). A failure marker is a few hundred bytes and is published even
        into a full channel."""
        self._check_open(request_id)
        with self._streams_lock:
            open_stream = self._streams.pop((request_id, stream), None)
        self._put_entry(StageEntry(
            request_id, {}, True, {}, time.time(), error=str(cause),
            start=open_stream.stands if open_stream else 0,
            entry=open_stream.entry if open_stream else self._new_entry_id(),
            producer=self._producer_name()), bounded=False)

    def _new_entry_id(self) -> str:
        """An id no other entry of any handle or process has: a random token of this process's
        handle, then a count (a forked child draws a token of its own)."""
        pid, token, count = self._entry_ids
        if pid != os.getpid():
            token, count = secrets.token_bytes(ENTRY_ID_BYTES // 2), itertools.count()
            self._entry_ids = (os.getpid(), token, count)
        return (token + next(count).to_bytes(ENTRY_ID_BYTES // 2, "big")).hex()

    def register_producer(self) -> None:
        """Marks this handle a live producer of the namespace until it closes or its process
        dies (idempotent). A stage's worker registers at start, before it takes requests."""
        with self._operation():
            self._register_producer()

    def expect(self, request_id: str) -> None:
        """Says this handle will publish `request_id`'s next entry (registering it a producer):
        if its process dies before it does, a consumer waiting for the entry raises
        `OmniPrefixCacheChannelProducerError` within seconds. Its put or fail ends the promise."""
        self.expect_all([request_id])

    def expect_all(self, request_ids: Sequence[str]) -> None:
        """`expect` for each of `request_ids`, recorded together (on `shm`, under one
        namespace lock: a stage announces the requests a step schedules first at once)."""
        for request_id in request_ids:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request id must be a non-empty str, got {request_id!r}")
        if not request_ids:
            return
        with self._operation(request_ids[0]):  # refused, naming it, once the handle closed
            self._register_producer()
            self._expect(request_ids)

    def _put_entry(self, entry: StageEntry, *, bounded: bool) -> None:
        """`_put_entries` of one entry, raising what failed it."""
        failure = self._put_entries([entry], bounded=bounded)[0]
        if failure is not None:
            raise failure

    def _put_entries(self, entries: Sequence[StageEntry], *, bounded: bool
                     ) -> list[Exception | None]:
        """Publishes each entry (`bounded`: counted against the capacity; else always): those
        with room now at once (`_put_now_all`), the others as room comes. Every entry left to
        wait for room is copied out of any pool first, and they all wait within one window
        (`_room_deadline`): entries into a channel that stays full fail one by one, at once
        after the first full wait, each naming why. Per entry, None or the exception that
        failed it."""
        failures: list[Exception | None] = [None] * len(entries)
        encoded: list[tuple[int, StageEntry, EncodedEntry]] = []
        for i, entry in enumerate(entries):
            try:
                encoded.append((i, entry, encode(entry)))
            except (TypeError, ValueError) as exc:
                failures[i] = exc
        if not encoded:
            return failures
        with self._operation(encoded[0][1].request_id):  # a reservation never outlives it
            self._maybe_sweep()
            try:
                placed = self._put_now_all(
                    [(entry.request_id, data, entry.final) for _, entry, data in encoded],
                    force=not bounded)
            except Exception as exc:  # one failure of the backend's call fails each of them
                placed = [exc] * len(encoded)
            waiting = []
            for (i, entry, data), done in zip(encoded, placed):
                if done is True:  # written: no pool's rows wait for a later entry's room
                    data.let_go()
                    self._had_room(bounded)
                elif isinstance(done, Exception):
                    failures[i] = done
                else:
                    try:
                        reservation = self._reserve(data.nbytes, force=not bounded)
                        if reservation is None:
                            waiting.append((i, entry, data))
                        else:
                            self._had_room(bounded)
                            self._publish_reserved(entry, data, reservation)
                    except Exception as exc:
                        failures[i] = exc
            if waiting and self._room_deadline() <= time.monotonic():  # full past its wait
                for i, entry, data in waiting:
                    failures[i] = self._full_error(entry.request_id, data.nbytes)
                return failures
            waiting = [(i, entry, data.owned()) for i, entry, data in waiting]  # no pool's rows
            for i, entry, data in waiting:  # wait for room
                try:
                    self._publish_reserved(entry, data,
                                           self._wait_for_room(entry.request_id, data.nbytes))
                except Exception as exc:
                    failures[i] = exc
        return failures

    def _publish_reserved(self, entry: StageEntry, encoded: EncodedEntry, reservation: Any
                          ) -> None:
        """Publish one entry in its reserved room (returned if that fails)."""
        try:
            self._publish(entry.request_id, encoded, reservation, final=entry.final)
        except BaseException:
            self._unreserve(reservation)
            raise

    def _had_room(self, bounded: bool) -> None:
        """A put counted against the capacity found room: the channel is not full."""
        if bounded:
            self._full_since = None

    def _room_deadline(self) -> float:
        """Until when a put that finds no room waits for it: `full_wait_s` after a put first
        found the channel full since the last one found room, so puts into a channel that
        stays full wait that long once in all, not once each."""
        if self._full_since is None:
            self._full_since = time.monotonic()
        return self._full_since + self.full_wait_s

    def _wait_for_room(self, request_id: str, nbytes: int) -> Any:
        """A reservation of `nbytes` of the capacity, waiting up to `_room_deadline`; else
        raises."""
        if nbytes > self._largest_entry_bytes():
            raise OmniPrefixCacheChannelFullError(
                f"request {request_id}: its entry of {nbytes} bytes exceeds the most an entry "
                f"can hold ({self._largest_entry_bytes()} of the {self.capacity_bytes} bytes of "
                f"channel {self.spec})")
        def room() -> Any:
            self._check_open(request_id)  # closed meanwhile: its close waits for this put
            reservation = self._reserve(nbytes, force=False)
            if reservation is None:
                self._maybe_sweep()  # expired entries make room too
            else:
                self._had_room(True)
            return reservation

        left = max(0.0, self._room_deadline() - time.monotonic())
        started = time.monotonic()
        try:
            return poll_until(room, left, lambda: self._full_error(request_id, nbytes),
                              first_pause_s=_FIRST_POLL_S, max_pause_s=_MAX_POLL_S)
        finally:
            self.room_wait_s += time.monotonic() - started

    def _largest_entry_bytes(self) -> int:
        """The most bytes an entry that waits for room can ever find: the whole capacity,
        unless the backend keeps a part of it for chunks alone."""
        return self.capacity_bytes

    def _full_error(self, request_id: str, nbytes: int) -> OmniPrefixCacheChannelFullError:
        return OmniPrefixCacheChannelFullError(
            f"request {request_id}: channel {self.spec} stayed full for {self.full_wait_s:g} s "
            f"(capacity {self.capacity_bytes} bytes, entry {nbytes} bytes); is its consumer "
            f"reading?")

    def get(self, request_id: str, timeout_s: float = 30.0) -> dict[str, torch.Tensor]:
        """The outputs published for `request_id`, waiting up to `timeout_s`; consumes the entry.

        The tensors are the caller's own. `get_entry` also tells whether the request was aborted.
        """
        return self.get_entry(request_id, timeout_s).outputs

    def get_entry(self, request_id: str, timeout_s: float = 30.0) -> StageEntry:
        """The entry published for `request_id`, waiting up to `timeout_s` (for each chunk of a
        streamed one, then joined from position 0); consumes it. An entry the publisher failed
        (`fail`) raises a channel error naming its cause."""
        chunks = list(self._chunks(request_id, timeout_s))
        if len(chunks) == 1:
            return chunks[0]
        return replace(chunks[-1], outputs=join_chunks(chunks), start=0)

    def stream(self, request_id: str, timeout_s: float = 30.0) -> Iterator[StageChunk]:
        """`request_id`'s next entry chunk by chunk as they are published, in order, each
        consumed once (a whole entry is one final chunk); `timeout_s` bounds the wait for each.
        A failure the publisher put in their place raises where it was put, and so does a
        chunk that does not start where the last ended. The entry is the reader's alone: other
        entries of the id stay for later reads, whatever their chunks' order."""
        for entry in self._chunks(request_id, timeout_s):
            yield StageChunk(entry.outputs, entry.start, entry.final, entry.aborted, entry.meta,
                             published_at=entry.published_at)

    def _chunks(self, request_id: str, timeout_s: float) -> Iterator[StageEntry]:
        """The chunks of the id's next entry in order, up to its final one: the oldest chunk
        that starts an entry (position 0), then that entry's alone. Whole or raising: a chunk
        that does not start where the last ended is a channel error naming the positions."""
        chunk, stands = None, 0
        while chunk is None or not chunk.final:
            chunk = self._next_chunk(request_id, timeout_s, chunk, stands)
            if chunk.start != stands:
                what = f"positions {stands}..{chunk.start - 1} are missing (expired unread)" \
                    if chunk.start > stands else "it starts over"
                raise OmniPrefixCacheChannelError(
                    f"request {request_id}: a chunk of its entry on channel {self.spec} starts "
                    f"at position {chunk.start}, not {stands}: {what}")
            yield chunk
            stands = chunk.start + chunk.num_rows

    def _next_chunk(self, request_id: str, timeout_s: float, last: StageEntry | None,
                    stands: int) -> StageEntry:
        """The next chunk of the entry whose chunk `last` was (None: the oldest chunk that
        starts an entry), which continues from position `stands`, waiting up to `timeout_s`.
        A reader that finds none and learns that its producer died takes once more (it may
        have published before it died) before it reports the death."""
        check_timeout(timeout_s, f"get for request {request_id}")
        self._check_open(request_id)
        awaited = Awaited() if last is None else Awaited(last.entry, last.producer)
        next_check = time.monotonic() + LIVENESS_CHECK_S
        def arrived() -> StageEntry | None:
            nonlocal next_check
            with self._operation(request_id):
                self._maybe_sweep()
                entry = self._take_entry(request_id, awaited)
                dead = None
                if entry is None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + LIVENESS_CHECK_S
                    dead = self._dead_producer(request_id, awaited.producer)
                    if dead is not None:
                        entry = self._take_entry(request_id, awaited)
            if entry is None and dead is not None:
                raise OmniPrefixCacheChannelProducerError(
                    f"request {request_id}: no entry on channel {self.spec}, and its producer "
                    f"{dead} died before publishing it" if last is None else
                    f"request {request_id}: its entry on channel {self.spec} stops at position "
                    f"{stands}: its producer {dead} is gone without publishing the rest")
            if entry is not None and entry.error is not None:
                raise OmniPrefixCacheChannelError(
                    f"request {request_id}: its stage could not publish its rows on channel "
                    f"{self.spec}: {entry.error}")
            return entry

        with self._arrivals(request_id) as pause:
            return poll_until(arrived, timeout_s, lambda: OmniPrefixCacheChannelTimeoutError(
                f"no entry for request {request_id} on channel {self.spec} within "
                f"{timeout_s:g} s (entries live {self.ttl_s:g} s unless consumed)"
                if last is None else
                f"request {request_id}: no chunk of its entry from position {stands} on channel "
                f"{self.spec} within {timeout_s:g} s"),
                first_pause_s=_FIRST_POLL_S, max_pause_s=_MAX_POLL_S, sleep=pause)

    @contextmanager
    def _arrivals(self, request_id: str) -> Iterator[Callable[[float], None]]:
        """The pause between the polls of a reader waiting for `request_id` (entered before
        its first poll): a sleep, unless the channel can be told that an entry of the id was
        published, and end the pause then."""
        yield time.sleep

    def close(self) -> None:
        """Releases this handle (idempotent); the namespace's owner also frees every entry.
        Operations other threads have in flight end first (at most CLOSE_WAIT_S); later ones
        raise a channel error."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            idle = self._idle.wait_for(lambda: self._in_flight == 0, CLOSE_WAIT_S)
        if not idle:
            logger.error("channel %s: %d operations still running %g s after close(); its "
                         "resources are kept", self.spec, self._in_flight, CLOSE_WAIT_S)
            return
        self._close()

    def __enter__(self) -> StageChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}{', closed' if self._closed else ''})"

    def _take_entry(self, request_id: str, awaited: Awaited) -> StageEntry | None:
        data = self._take(request_id, awaited)
        if data is None:
            return None
        try:
            entry = decode(data)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise OmniPrefixCacheChannelError(
                f"entry for request {request_id} on channel {self.spec} is unreadable: {e}") from e
        if entry.request_id != request_id:
            raise OmniPrefixCacheChannelError(
                f"entry taken for request {request_id} on channel {self.spec} belongs to "
                f"request {entry.request_id}")
        return entry

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_every_s
            self._sweep()

    def _check_open(self, request_id: str | None = None) -> None:
        if self._closed:
            raise OmniPrefixCacheChannelError(
                f"channel {self.spec} is closed"
                + (f" (request {request_id})" if request_id is not None else ""))

    @contextmanager
    def _operation(self, request_id: str | None = None) -> Iterator[None]:
        """One use of the backend's resources: refused once the handle is closed, and waited
        for by `close()`."""
        with self._idle:
            self._check_open(request_id)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the capacity in use: unconsumed entries and puts in flight (on Mooncake,
        this handle's, as far as it has seen them consumed)."""

    @abstractmethod
    def _reserve(self, nbytes: int, *, force: bool) -> Any:
        """Room for an entry of `nbytes`, counted against the capacity (always given if
        `force`); None when it does not fit. `_publish` consumes it; `_unreserve` returns it."""

    @abstractmethod
    def _unreserve(self, reservation: Any) -> None:
        """Returns the room of a reservation whose publish failed."""

    def _put_now_all(self, puts: Sequence[tuple[str, EncodedEntry, bool]], *, force: bool
                     ) -> list[bool | Exception]:
        """Reserve and publish each `(request_id, encoded, final)` in one step where the backend
        can and there is room now (or `force`): per put, True where published, False where it
        is left to `_reserve`/`_wait_for_room` and `_publish`, or the exception that failed it.
        A backend that reads a pool's rows in place holds them (`reading`) for the copy alone,
        never across a wait for a lock or a store (as `_publish`)."""
        return [False] * len(puts)

    @abstractmethod
    def _publish(self, request_id: str, encoded: EncodedEntry, reservation: Any, *,
                 final: bool) -> None:
        """Stores the entry in its reserved room behind the id's unconsumed entries, so that a
        reader sees all of it or none of it; never replaces one. A `final` entry (not a chunk
        that more follow) ends this handle's expectation of the id."""

    @abstractmethod
    def _take(self, request_id: str, awaited: Awaited) -> torch.Tensor | None:
        """Claims and frees the id's oldest unexpired entry that `awaited` accepts by its tag
        (`peek` of its prefix; None: not one of this version's), leaving those before it in
        place; its bytes (flat uint8, the caller's) or None. Exactly one take, of all handles,
        claims each entry."""

    def _producer_name(self) -> str:
        """The name under which `_dead_producer` tests this handle's producer, for the entries
        it publishes to carry; "" where it registered none."""
        return ""

    @abstractmethod
    def _register_producer(self) -> None:
        """Makes this handle a live producer that consumers of any handle can test (idempotent);
        its liveness ends when it closes or its process dies."""

    @abstractmethod
    def _expect(self, request_ids: Sequence[str]) -> None:
        """Records that this handle's producer will publish each of `request_ids`' next entry;
        its publish (entry or failure) removes the record."""

    @abstractmethod
    def _dead_producer(self, request_id: str, producer: str) -> str | None:
        """A description of the dead producer (its pid and host) if `request_id`'s awaited
        chunk will not come because its producer is gone: the one named `producer` (the
        entry's, by `_producer_name`) where it is not ""; else the producer that expected the
        id, or, if none did, the namespace's, when it has producers that died and none that
        lives. None otherwise."""

    @abstractmethod
    def _sweep(self) -> None:
        """Frees the entries this handle can see that are older than `ttl_s`."""

    @abstractmethod
    def _close(self) -> None:
        """Releases the backend; the namespace's owner also frees every entry in it."""


def spec_number(scheme: str, options: Mapping[str, str], name: str, kind: type[int] | type[float],
                default: Any) -> Any:
    """Option `name` of a channel spec read as `kind` (`default` when absent), or a ValueError
    naming the option and what it takes."""
    if name not in options:
        return default
    try:
        return kind(options[name])
    except ValueError:
        what = "a whole number of bytes" if kind is int else "a number of seconds"
        raise ValueError(f"{scheme} channel spec: option {name}={options[name]!r} must be "
                         f"{what}") from None


def join_chunks(chunks: list[StageEntry]) -> dict[str, torch.Tensor]:
    """The chunks' rows from their first position on, per key; a key missing from some chunks
    reads zeros at their positions."""
    like = {key: rows for chunk in reversed(chunks) for key, rows in chunk.outputs.items()}
    return {key: torch.cat([chunk.outputs[key] if key in chunk.outputs else
                            ref.new_zeros((chunk.num_rows, *ref.shape[1:])) for chunk in chunks])
            for key, ref in like.items()}
