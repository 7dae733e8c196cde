"""What the next stage receives: a request's rows by position, assembled, published on finish.

A step hands over a request's rows from some position on: 0 for a prefix hit
(hit rows, then the step's), the request's computed-token count otherwise. A
step that emitted no key at all (a stage that delivers multimodal keys only, in
a prefill say) hands over its positions without rows; they read zeros. A
request recomputed after preemption hands over rows it already delivered; they
replace the earlier ones from that position. Rows that would leave a gap break
the request, since the next stage would silently miss positions: its entry is
published as a failure naming the gap, as is one whose parts do not join or whose
publish fails (a full `/dev/shm`, a store gone). Either way the stage goes on with
other requests.

A request's first rows also tell the channel that this stage will publish it
(`expect`), so its consumer learns within seconds if the stage's process dies
first. When the request finishes, all its rows from position 0 go to the stage
channel under its external id, and are forgotten here. The worker only learns that a
request left the batch, not why: a request with fewer rows than its prompt
(aborted mid-prefill, or before it was ever scheduled) is published marked
aborted. One aborted after its prompt was computed looks finished; its entry
carries the prompt length and row count so the consumer can judge.

The scheduler may report a finish before the runner hears of it (`finish_early`,
when the worker shares the scheduler's process): the request is published then,
rows a step already in flight computes for it afterwards are dropped, and the
runner's own `finish` later only forgets it. Such an in-flight step (an
asynchronous scheduler's) feeds the request's stop token; the scheduler says how
many rows stand, and its row is cut whether it arrived before the finish or not.

A streaming stage (`stream_every`) publishes a request's rows as chunks while it
runs, once `stream_every` new positions stand, and once its prompt's positions all
stand (`prefix_cache.integration.chunks` says which stand), each chunk the positions
since the last, and the final chunk, at the finish, the rest. A step's chunks go to
the sink together (`put_all`: one call on shm), each failing its request alone. A
request recomputed after preemption never streams positions again.

A request read back (`hold`: the cache's stage) gets no rows by step: they stay in the
pool. Its chunks, when it streams, are read back as they fall due (`publish_chunks`: a
prefix hit's cached rows are its first chunk, read while the step's forward runs), and
at its finish the rest (`publish_reads`), every position from 0 where it does not
stream, published as an entry added up by steps would be, a step's finishes in one put.
The sink's writer reads them from the pool in place (one copy, pool to entry); they stay
pinned until the put returns.

A request whose finish will never be heard (the stage shuts down first) is not
left for its consumer to time out on: `fail_held` publishes a failure naming the
cause in its place. A stage that stops publishing (`stop_publishing`) does so for
the requests it holds and, as they finish, for every later one.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prefix_cache.channel.base import StageChunk
from prefix_cache.integration.chunks import due_chunk_end
from prefix_cache.core.pool_rows import PoolRows
from prefix_cache.errors import OmniPrefixCacheUnmatchError

logger = logging.getLogger(__name__)


class StageSink(Protocol):
    """Where finished requests' rows go (a `prefix_cache.channel.StageChannel`)."""

    def put(self, request_id: str, outputs: Mapping[str, torch.Tensor | PoolRows], *,
            start: int = 0, final: bool = True, aborted: bool = False,
            meta: Mapping[str, Any] | None = None, stream: str = "") -> None: ...

    def put_all(self, chunks: Sequence[tuple[str, StageChunk]]) -> list[Exception | None]: ...

    def fail(self, request_id: str, cause: str, *, stream: str = "") -> None: ...

    def expect_all(self, request_ids: Sequence[str]) -> None: ...


class RowsReadBack(Protocol):
    """A request's rows of positions `[start, num_rows)` read from the pool: at its finish, a
    streaming stage's chunk, or a prefix hit's at its first step
    (`prefix_cache.core.request_reads.RequestRows`): held there for the sink's writer (`hold`)
    until `cancel`; `rows_cut` more positions were computed by a step whose tokens the
    scheduler discarded."""

    req_id: str
    start: int
    num_rows: int
    rows_cut: int

    def hold(self) -> Mapping[str, torch.Tensor | PoolRows]: ...

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class FinishedRequest:
    """A request the scheduler retired: runner id, external id, prompt length (None: unknown),
    and how many of its rows stand (None: all; the rest came from a step whose tokens the
    scheduler discards)."""

    req_id: str
    external_id: str
    prompt_len: int | None
    rows_standing: int | None = None


@dataclass(frozen=True)
class _FinalEntry:
    """A request's final entry to put: its rows of positions `sent..num_rows - 1` (a chunk's
    worth where it streamed), or the `cause` its failure names instead."""

    request: FinishedRequest
    rows: Mapping[str, torch.Tensor | PoolRows]
    num_rows: int
    sent: int
    cause: str | None


@dataclass(slots=True)
class _Part:
    """Positions `start..end - 1`, whose rows per key are rows `first..first + end - start - 1`
    of `source[key]` (no key: a step that emitted none). A step's requests share its source."""

    start: int
    end: int
    source: Mapping[str, torch.Tensor]  # key -> [rows, *feat]
    first: int = 0

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """This part's rows of positions `lo..hi - 1` (within it) of `key`."""
        return self.source[key][self.first + lo - self.start: self.first + hi - self.start]

    def trimmed(self, start: int, end: int) -> _Part:
        """The same rows, of positions `start..end - 1` only (within it)."""
        return _Part(start, end, self.source, self.first + start - self.start)

    def nbytes(self) -> int:
        return sum((self.end - self.start) * math.prod(t.shape[1:]) * t.element_size()
                   for t in self.source.values())


def _rows(parts: list[_Part], start: int, end: int) -> dict[str, torch.Tensor]:
    """The rows of positions `start..end - 1` per key, which `parts` cover; a key missing from
    a part reads zeros there, as absent mm rows do on a prefix hit. Rows of one part are a view
    of it (a chunk of one step's rows: the channel's writer copies them once)."""
    like = {key: rows for p in reversed(parts) for key, rows in p.source.items()}
    out = {}
    for key, ref in like.items():
        pieces = []
        for p in parts:
            lo, hi = max(p.start, start), min(p.end, end)
            if lo < hi:
                pieces.append(p.rows(key, lo, hi) if key in p.source else
                              ref.new_zeros((hi - lo, *ref.shape[1:])))
        out[key] = (pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces
                    else ref.new_zeros((0, *ref.shape[1:])))
    return out


def _no_rows(keys: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
             ) -> dict[str, torch.Tensor]:
    """Zero rows of each of `keys` (a final chunk after one that had them)."""
    return {key: torch.empty((0, *feat), dtype=dtype) for key, (feat, dtype) in keys.items()}


def _positions(rows: RowsReadBack) -> str:
    return f"its positions {rows.start}..{rows.num_rows - 1}"


class StageDelivery:
    """Per live request, parts whose positions run contiguously from 0, or from where its last
    chunk ended when streaming (a later part may overlap).

    One thread adds and finishes; `stats()` may be read from another.
    """

    def __init__(self, sink: StageSink | None = None, *,
                 external_id: Callable[[str], str] = lambda req_id: req_id,
                 stream_every: int | None = None) -> None:
        if stream_every is not None and (isinstance(stream_every, bool)
                                         or not isinstance(stream_every, int)
                                         or stream_every < 1):
            raise ValueError(f"stream_every must be a whole number of positions >= 1 or None, "
                             f"got {stream_every!r}")
        self._sink = sink
        self._external_id = external_id  # a runner id's id in the engine's caller
        self._stream_every = stream_every  # None: whole entries at the finish
        self._lock = threading.Lock()
        self._parts: dict[str, list[_Part]] = {}
        self._streamed: dict[str, int] = {}  # positions a request published in chunks
        # read back: the keys of a request's last chunk, with their rows' feature shapes and
        # dtypes (a final chunk without rows still has them)
        self._chunk_keys: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._prompt_lens: dict[str, int] = {}  # streaming: prompt lengths of live requests
        self._published_early: set[str] = set()  # published; the runner's finish is to come
        self._read_back: set[str] = set()  # their rows read back from the pool, not added
        self._broken: dict[str, str] = {}  # requests whose rows can no longer come whole: why
        self._published = 0
        self._chunks = 0
        self._failed = 0
        self._rows_delivered = 0  # rows of every chunk and entry the sink took
        self._rows_cut = 0  # rows of steps whose tokens the scheduler discarded
        self._stopped: str | None = None  # why no rows are published any more

    def stats(self) -> dict[str, int]:
        """Requests and bytes held (waiting for their finish), requests published so far and
        the chunks streamed before their final ones, the rows they carried, requests whose
        entry failed (published as failures), rows cut from entries (fed by steps whose tokens
        the scheduler discarded), and the seconds puts waited for room in a full sink."""
        with self._lock:
            held = sum(p.nbytes() for parts in self._parts.values() for p in parts)
            return {"delivery_requests_held": len(self._parts) + len(self._read_back),
                    "delivery_bytes_held": held,
                    "delivery_published": self._published, "delivery_chunks": self._chunks,
                    "delivery_rows": self._rows_delivered, "delivery_failed": self._failed,
                    "delivery_rows_cut": self._rows_cut,
                    "delivery_full_wait_s": getattr(self._sink, "room_wait_s", 0.0)}

    @property
    def streaming(self) -> bool:
        """Whether requests' rows go out in chunks while they run."""
        return self._stream_every is not None

    @property
    def put_wait_s(self) -> float:
        """How long one put may wait for room in the sink (a sink without a capacity: none)."""
        return getattr(self._sink, "full_wait_s", 0.0)

    @property
    def stream_every(self) -> int | None:
        """Positions a chunk waits for (None: whole entries at the finish)."""
        return self._stream_every

    def note_prompts(self, prompt_lens: Mapping[str, int]) -> None:
        """Prompt lengths of requests a step schedules anew (from the engine thread, before
        the step's rows are added): a streaming stage publishes their prompt rows as soon as
        they are all computed. Others keep nothing."""
        if not self.streaming or not prompt_lens:
            return
        with self._lock:
            self._prompt_lens.update(prompt_lens)

    def add(self, req_id: str, start: int, rows: Mapping[str, torch.Tensor],
            num_rows: int) -> None:
        """`num_rows` positions `start, start + 1, ...`, and `rows` of them per key (each
        `num_rows` long; none for a step that emitted no key): `add_step` for one request."""
        self.add_step([(req_id, start, 0, num_rows)], rows)

    def add_step(self, spans: Iterable[tuple[str, int, int, int]],
                 rows: Mapping[str, torch.Tensor]) -> None:
        """A step's rows: per span `(req_id, start, first, end)`, request `req_id`'s positions
        `start, start + 1, ...` are rows `first..end - 1` of `rows` per key (none for a step
        that emitted no key). The requests keep views of `rows`, not copies.

        Rows that would leave a gap break the request: its entry becomes a failure naming
        the gap, and the stage goes on. Positions without any key leave none: nothing can be
        missing before them, so they cover what came before too.
        """
        added, first_seen = [], []
        with self._lock:
            if self._stopped:
                return
            for req_id, start, first, end in spans:
                if end == first or req_id in self._published_early or req_id in self._broken:
                    continue
                part = _Part(start, start + end - first, rows, first)
                parts = self._parts.get(req_id)
                added.append(req_id)
                if parts is None:
                    first_seen.append(req_id)
                elif parts[-1].start < start == parts[-1].end:  # a running request's next rows
                    parts.append(part)
                    continue
                try:
                    self._add(req_id, part)
                except OmniPrefixCacheUnmatchError as exc:
                    logger.error("%s", exc)
                    self._broken[req_id] = str(exc)
                    self._parts.pop(req_id, None)
        if first_seen:
            self._expect(first_seen)
        if self.streaming:
            self._stream(added)

    def _stream(self, req_ids: Sequence[str]) -> None:
        """Publish, for each of `req_ids`, its positions that stand since its last chunk, once
        there are `stream_every` of them or they complete its prompt (see the module docstring
        for which stand): all in one put (`put_all`). A chunk that cannot be published fails
        its request, as its entry would."""
        if self._sink is None:
            return
        chunks, spans = [], []
        with self._lock:
            for req_id in req_ids:
                parts = self._parts.get(req_id)
                sent = self._streamed.get(req_id, 0)
                stands = due_chunk_end(sent, parts[-1].end if parts else 0,
                                       self._prompt_lens.get(req_id, 0), self._stream_every)
                if stands is None:
                    continue
                rows = _rows(parts, sent, stands)
                if not rows:  # no key emitted yet: nothing to read the positions' zeros by
                    continue
                self._streamed[req_id] = stands
                # what is left from `stands` on; at least the last part, emptied: the next rows
                # join it, and a final chunk without rows still has its keys
                self._parts[req_id] = [p.trimmed(stands, p.end) if p.start < stands else p
                                       for p in parts if p.end > stands or p is parts[-1]]
                chunks.append((self._external_id(req_id),
                               StageChunk(rows, sent, final=False, stream=req_id)))
                spans.append((req_id, sent, stands))
        if not chunks:
            return
        failures = self._put_all(chunks)
        for (req_id, sent, stands), exc in zip(spans, failures):
            if exc is not None:  # a full /dev/shm, a store gone: this request fails alone
                self.fail_requests([req_id], f"publishing the chunk of its positions {sent}.."
                                             f"{stands - 1} failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self._chunks += sum(exc is None for exc in failures)

    def publish_chunks(self, reads: Sequence[RowsReadBack]) -> None:
        """Streaming, requests read back: each one's chunk of positions `[start, num_rows)`,
        read from the pool in place, all in one put (`put_all`), unless its entry failed
        already or the stage stopped. A chunk that cannot be read or published fails its
        request, naming its positions. Every read's rows are let go once the put returns."""
        try:
            with self._lock:
                live = [] if self._stopped is not None or self._sink is None else [
                    rows for rows in reads if rows.req_id not in self._published_early
                    and rows.req_id not in self._broken]
            chunks, putting = [], []
            for rows in live:
                try:
                    held = rows.hold()
                except Exception as exc:  # a write that failed: this request fails alone
                    self.fail_requests([rows.req_id], f"{_positions(rows)} could not be read "
                                                      f"back: {type(exc).__name__}: {exc}")
                    continue
                chunks.append((self._external_id(rows.req_id),
                               StageChunk(held, rows.start, final=False, stream=rows.req_id)))
                putting.append(rows)
            if not chunks:
                return
            failures = self._put_all(chunks)
            for rows, exc in zip(putting, failures):
                if exc is not None:  # a full /dev/shm, a store gone: this request fails alone
                    self.fail_requests([rows.req_id], f"publishing the chunk of "
                                                      f"{_positions(rows)} failed: "
                                                      f"{type(exc).__name__}: {exc}")
            with self._lock:
                for rows, (_, chunk), exc in zip(putting, chunks, failures):
                    if exc is None and rows.req_id not in self._published_early:
                        self._streamed[rows.req_id] = rows.num_rows
                        # a key's rows keep their shape and dtype: kept until the keys change
                        keys = self._chunk_keys.get(rows.req_id)
                        if keys is None or keys.keys() != chunk.rows.keys():
                            self._chunk_keys[rows.req_id] = {
                                key: (tuple(r.shape[1:]), r.dtype)
                                for key, r in chunk.rows.items()}
                        self._chunks += 1
        finally:
            for rows in reads:  # the pool's rows, let go once the put returns
                rows.cancel()

    def _expect(self, req_ids: Sequence[str]) -> None:
        """Tell the sink this stage will publish each of `req_ids` (at once): their consumers
        learn within seconds if this process dies first. A sink that cannot record them only
        costs that warning."""
        if self._sink is None:
            return
        try:
            self._sink.expect_all([self._external_id(req_id) for req_id in req_ids])
        except Exception as exc:
            logger.warning("requests %s: their consumers cannot be told of this stage's "
                           "liveness: %s: %s", ", ".join(req_ids), type(exc).__name__, exc)

    def _add(self, req_id: str, part: _Part) -> None:
        parts = self._parts.get(req_id, [])
        delivered = parts[-1].end if parts else 0
        if part.start > delivered:
            if part.source:
                raise OmniPrefixCacheUnmatchError(
                    f"request {req_id}: rows from position {part.start} but only {delivered} "
                    f"rows were delivered; positions {delivered}..{part.start - 1} would be "
                    f"missing")
            part = _Part(delivered, part.end, {})
        self._parts[req_id] = parts
        while parts and parts[-1].start >= part.start:  # recomputed rows replace delivered ones
            parts.pop()
        if parts and parts[-1].end > part.start:
            parts[-1] = parts[-1].trimmed(parts[-1].start, part.start)
        parts.append(part)

    def hold(self, req_ids: Sequence[str]) -> list[str]:
        """Of a step's requests, those seen first, now held until their finish, whose rows are
        read back from the pool (`publish_chunks`, `publish_reads`) instead of added by step;
        `announce` tells the sink of them. Returns them (none in most steps: one set lookup)."""
        with self._lock:
            if self._read_back.issuperset(req_ids):
                return []
            fresh = [r for r in req_ids
                     if r not in self._read_back and r not in self._published_early]
            self._read_back.update(fresh)
        return fresh

    def announce(self, req_ids: Sequence[str]) -> None:
        """Tell the sink this stage will publish each of `req_ids` (see `_expect`)."""
        self._expect(req_ids)

    def publish_reads(self, reads: Sequence[tuple[FinishedRequest, RowsReadBack | None]], *,
                      early: bool = False) -> None:
        """`finish` (`early`: `finish_early`) of requests read back, a step's together: publish
        each one's `rows` read back (the rest after its chunks; None: it has none the view
        still held), unless published already, all in one put (`put_all`); rows that cannot be
        read are published as that request's failure, naming why. Every read's rows are let go
        once the put returns."""
        entries: list[_FinalEntry] = []
        try:
            for request, rows in reads:
                with self._lock:
                    done = not self._first_finish(request.req_id, early)
                    self._read_back.discard(request.req_id)
                    sent = self._streamed.pop(request.req_id, 0)
                    keys = self._chunk_keys.pop(request.req_id, {})
                    stopped = self._stopped
                    if rows is not None and not done and stopped is None:
                        self._rows_cut += rows.rows_cut
                if done or stopped is not None:
                    if not done:
                        self._fail(request.external_id, request.req_id, stopped, logging.DEBUG)
                elif rows is None:
                    entries.append(_FinalEntry(request, _no_rows(keys), sent, sent, None))
                else:
                    try:  # the sink's writer reads the rows from the pool in place: one copy
                        held, cause = dict(rows.hold()) or _no_rows(keys), None
                    except Exception as exc:  # a write that failed: this request fails alone
                        held, cause = {}, (f"its rows could not be read back: "
                                           f"{type(exc).__name__}: {exc}")
                    entries.append(_FinalEntry(request, held, rows.num_rows, rows.start, cause))
            self._put_entries(entries)
        finally:
            for _, rows in reads:  # the pool's rows, let go once the put returns
                if rows is not None:
                    rows.cancel()

    def pop(self, req_id: str, start: int = 0) -> tuple[dict[str, torch.Tensor], int]:
        """`req_id`'s rows per key from position `start` on (where its last chunk ended, when
        streaming), and how many positions it has in all (at least `start`); forgets them.

        A key missing from some steps (a model may emit it for some tokens only)
        reads zeros at those positions, as absent mm rows do on a prefix hit.
        """
        with self._lock:
            parts = self._parts.pop(req_id, None)
        end = max(parts[-1].end if parts else 0, start)
        return (_rows(parts, start, end) if parts else {}), end

    def finish(self, request: FinishedRequest) -> None:
        """The runner retired `request`: publish its rows under its external id (unless
        `finish_early` did), then free them."""
        self.finish_all([request])

    def finish_early(self, request: FinishedRequest) -> None:
        """The scheduler retired `request` before the runner heard of it: publish it now
        (unless its failure was published already: held when the stage stopped)."""
        self.finish_all([request], early=True)

    def finish_all(self, requests: Sequence[FinishedRequest], *, early: bool = False) -> None:
        """`finish` (`early`: `finish_early`) of a step's retired requests, their entries in
        one put (`put_all`)."""
        with self._lock:
            publishing = [r for r in requests if self._first_finish(r.req_id, early)]
        if publishing:
            self._publish(publishing)

    def _first_finish(self, req_id: str, early: bool) -> bool:
        """Whether this finish publishes `req_id`: not where it was published already (by the
        scheduler's finish, or as a failure), whose mark the runner's own finish clears; a
        scheduler's (`early`) finish marks it (caller holds the lock)."""
        if req_id in self._published_early:
            if not early:
                self._published_early.discard(req_id)
            return False
        if early:
            self._published_early.add(req_id)
        return True

    def fail_held(self, cause: str) -> int:
        """Publish, for every request still held (its finish never came and will not be
        heard), that its rows cannot come, and why; free them. Returns how many."""
        with self._lock:
            held = self._parts.keys() | self._broken.keys() | self._read_back
        return self.fail_requests(held, cause)

    def fail_requests(self, req_ids: Iterable[str], cause: str) -> int:
        """Publish now, for each of `req_ids` not published yet, that its rows cannot come,
        and why; free its rows (rows added later are dropped, and its finish only forgets
        it). Returns how many."""
        with self._lock:
            failing = sorted(set(req_ids) - self._published_early)
            for req_id in failing:
                self._parts.pop(req_id, None)
                self._read_back.discard(req_id)
                self._broken.pop(req_id, None)
                self._streamed.pop(req_id, None)
                self._chunk_keys.pop(req_id, None)
                self._prompt_lens.pop(req_id, None)
            self._published_early.update(failing)
        for req_id in failing:
            self._fail(self._external_id(req_id), req_id, cause)
        return len(failing)

    def stop_publishing(self, cause: str) -> int:
        """Publish no rows from now on: every request held gets a failure naming `cause` now
        (`fail_held`), every later one when it finishes. Returns how many were held."""
        self.stop(cause)
        return self.fail_held(cause)

    def stop(self, cause: str) -> None:
        """Publish no rows from now on: every request that finishes later gets a failure
        naming `cause` (those held and never finished get theirs from `fail_held`)."""
        with self._lock:
            self._stopped = cause

    def _publish(self, requests: Sequence[FinishedRequest]) -> None:
        """Put the requests' entries; where one fails, put a failure in its place (its
        consumer's get raises, naming the cause) and go on: one request's failure is its own."""
        with self._lock:
            stopped = self._stopped
        if stopped is not None:  # said once, when the stage stopped: not again per request
            for request in requests:
                self._fail(request.external_id, request.req_id, stopped, logging.DEBUG)
            return
        entries = []
        for request in requests:
            with self._lock:
                sent = self._streamed.pop(request.req_id, 0)  # in chunks already
                self._prompt_lens.pop(request.req_id, None)
            try:
                (rows, num_rows), cause = self.pop(request.req_id, start=sent), None
            except Exception as exc:  # parts that do not join (a key's row shape changed)
                rows, num_rows = {}, sent
                cause = f"its rows could not be joined: {type(exc).__name__}: {exc}"
            if request.rows_standing is not None and num_rows > request.rows_standing:
                with self._lock:
                    self._rows_cut += num_rows - request.rows_standing
                num_rows = max(request.rows_standing, sent)  # chunks carry only rows that stand
                rows = {key: r[:num_rows - sent] for key, r in rows.items()}
            entries.append(_FinalEntry(request, rows, num_rows, sent, cause))
        self._put_entries(entries)

    def _put_entries(self, entries: Sequence[_FinalEntry]) -> None:
        """Put each request's final entry, all in one put (`put_all`), or its failure where it
        has a `cause` (or a break) or its put fails."""
        chunks: list[tuple[str, StageChunk]] = []
        failures: list[tuple[FinishedRequest, str]] = []
        putting: list[_FinalEntry] = []
        for entry in entries:
            request = entry.request
            with self._lock:
                cause = self._broken.pop(request.req_id, None) or entry.cause
            if cause is not None:
                failures.append((request, cause))
                continue
            aborted = request.prompt_len is None or entry.num_rows < request.prompt_len
            chunks.append((request.external_id, StageChunk(
                entry.rows, entry.sent, final=True, aborted=aborted,
                meta={"prompt_len": request.prompt_len, "num_rows": entry.num_rows},
                stream=request.req_id)))
            putting.append(entry)
        if self._sink is None:
            return
        if chunks:
            put_failures = self._put_all(chunks)
            for entry, exc in zip(putting, put_failures):
                if exc is not None:  # a full /dev/shm, a store gone: this entry fails alone
                    failures.append((entry.request, f"publishing its {entry.num_rows} rows "
                                                    f"failed: {type(exc).__name__}: {exc}"))
            with self._lock:
                self._published += sum(exc is None for exc in put_failures)
        for request, cause in failures:
            self._fail(request.external_id, request.req_id, cause)

    def _put_all(self, chunks: Sequence[tuple[str, StageChunk]]) -> list[Exception | None]:
        """The sink's `put_all`, in as few calls as keep each id once a call (a client may
        reuse an id: its entries go in order); per chunk, what failed it (a failure of the
        sink itself fails each chunk of its call)."""
        failures: list[Exception | None] = []
        start = 0
        while start < len(chunks):
            end, ids = start, set()
            while end < len(chunks) and chunks[end][0] not in ids:
                ids.add(chunks[end][0])
                end += 1
            try:
                failures += self._sink.put_all(chunks[start:end])
            except Exception as exc:
                failures += [exc] * (end - start)
            start = end
        rows = sum(next(iter(chunk.rows.values())).shape[0] if chunk.rows else 0
                   for (_, chunk), failure in zip(chunks, failures) if failure is None)
        with self._lock:
            self._rows_delivered += rows
        return failures

    def _fail(self, external_id: str, req_id: str, cause: str,
              log_level: int = logging.ERROR) -> None:
        """Publish a failure in place of the request's rows (counted), logged either way."""
        with self._lock:
            self._failed += 1
        logger.log(log_level, "request %s (%s): %s", external_id, req_id, cause)
        if self._sink is None:
            return
        try:
            self._sink.fail(external_id, cause, stream=req_id)
        except Exception as exc:
            logger.error("request %s: its failure could not be published either: %s: %s",
                         external_id, type(exc).__name__, exc)
