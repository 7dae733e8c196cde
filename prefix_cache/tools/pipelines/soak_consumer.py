"""The soak's consumer: a process of its own that reads a stage's entries and checks their rows.

`serve` is the process: it joins the stage channel, loads every prompt's reference rows
(`References`, written by the soak before it starts), and reads each request the soak hands it
(`Read`), whole (`get_entry`) or chunk by chunk (`stream`), on a thread per read. It checks
what arrived against the prompt's reference rows there, so no rows cross back: one `Outcome`
per read, sent over the pipe it was given. `ConsumerProcess` is the soak's handle on it: start,
hand reads, stop and continue it (SIGSTOP/SIGCONT), kill it, and the reads it took that it
never answered.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from prefix_cache.channel import OmniPrefixCacheChannelError, StageChannel, open_channel
from prefix_cache.config import HIDDEN_KEY

#: Reads one consumer runs at once (the soak keeps fewer requests outstanding).
MAX_READERS = 64
#: How long a consumer that was asked to stop waits for its reads to end.
STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class References:
    """Each prompt's rows from an engine without prefix caching, for its longest generation;
    `tolerance` 0: a delivered row must equal its reference bit for bit, else be within
    `tolerance` of it and nearer to it than to any other prompt's row at that position."""

    rows: list[torch.Tensor]
    tolerance: float

    def save(self, path: Path) -> None:
        torch.save({"rows": self.rows, "tolerance": self.tolerance}, path)

    @classmethod
    def load(cls, path: Path) -> References:
        saved = torch.load(path)
        return cls(saved["rows"], saved["tolerance"])

    def check(self, prompt: int, rows: torch.Tensor, start: int = 0) -> RowCheck:
        """`rows` (positions start..start+n-1 of a request on prompt `prompt`) against its
        reference."""
        reference = self.rows[prompt][start:]
        num_rows = rows.shape[0] if rows.dim() else 0
        if num_rows == 0:
            return RowCheck(start, 0, None, None, 0.0)
        if num_rows > reference.shape[0] or rows.shape[1:] != reference.shape[1:]:
            return RowCheck(start, num_rows, start, None, math.inf)
        diff = (rows - reference[:num_rows]).abs().amax(dim=1)
        wrong = diff > self.tolerance
        if self.tolerance > 0:  # within tolerance but another prompt's row is nearer
            for other, other_rows in enumerate(self.rows):
                common = min(num_rows, other_rows.shape[0] - start)
                if other != prompt and common > 0:
                    other_diff = (rows[:common] - other_rows[start:start + common]).abs()
                    wrong[:common] |= other_diff.amax(dim=1) < diff[:common]
        if not bool(wrong.any()):
            return RowCheck(start, num_rows, None, None, float(diff.max()))
        first = start + int(wrong.nonzero()[0])
        return RowCheck(start, num_rows, first,
                        self.owner(first, rows[first - start], exclude=prompt),
                        float(diff.max()))

    def owner(self, position: int, row: torch.Tensor, *, exclude: int) -> int | None:
        """The prompt other than `exclude` whose reference row at `position` is nearest `row`,
        where it is within the tolerance; else None."""
        nearest, owner = math.inf, None
        for other, other_rows in enumerate(self.rows):
            if other != exclude and position < other_rows.shape[0]:
                diff = float((row - other_rows[position]).abs().max())
                if diff <= self.tolerance and diff < nearest:
                    nearest, owner = diff, other
        return owner


@dataclass(frozen=True)
class RowCheck:
    """Rows that arrived for a request (positions `start`..`start + num_rows - 1`), against its
    prompt's reference: `first_wrong` is the first position whose row is not the reference's
    (None: all are), `owner` the prompt whose row stands there instead, if any."""

    start: int
    num_rows: int
    first_wrong: int | None
    owner: int | None
    max_diff: float


@dataclass(frozen=True)
class Read:
    """Read request `request_id`'s next entry and check it against prompt `prompt`'s rows;
    `timeout_s` bounds the wait for each chunk. `drain`: the read a killed consumer held; what
    is left of the entry is read and answered the same way (its first rows may be gone)."""

    key: int  # the soak's number for this request's instance
    request_id: str
    prompt: int
    streamed: bool  # stream(), chunk by chunk; else get_entry(), whole
    timeout_s: float
    drain: bool = False


@dataclass(frozen=True)
class Outcome:
    """What a read got: `rows` that arrived (a failure's before it failed), the entry's
    aborted marker, the channel error that ended it (its class name and message), and
    `disorder`: a chunk that did not start where the rows before it ended, which `stream`
    yielded without raising; `published_at`: when the first piece read was published (its
    publisher's `time.time()`; None: none was read)."""

    key: int
    rows: RowCheck
    aborted: bool = False
    error: str | None = None
    message: str = ""
    disorder: str | None = None
    published_at: float | None = None


def read(channel: StageChannel, references: References, job: Read) -> Outcome:
    """One `Read`, answered whatever happens (an error outside the channel's is answered as
    its class name too: the soak counts it as a problem)."""
    parts: list[torch.Tensor] = []
    first: int | None = None if job.drain else 0  # a drain reads on from where the last stopped
    aborted, disorder, error, message = False, None, None, ""
    published_at: float | None = None
    try:
        for start, rows, final, marked, put_at in _chunks(channel, job):
            first = start if first is None else first
            published_at = put_at if published_at is None else published_at
            standing = first + sum(p.shape[0] for p in parts)
            if start != standing and disorder is None:
                disorder = f"a chunk from position {start} after positions up to {standing}"
            if rows is not None:
                parts.append(rows)
            if final:
                aborted = marked
    except Exception as exc:  # noqa: BLE001 - every read is answered; the soak judges it
        error, message = type(exc).__name__, str(exc)
        if not isinstance(exc, OmniPrefixCacheChannelError):
            message = f"not a channel error: {message}"
    rows = torch.cat(parts) if parts else torch.empty(0)
    return Outcome(job.key, references.check(job.prompt, rows, first or 0), aborted, error,
                   message, disorder, published_at)


def _chunks(channel: StageChannel, job: Read
            ) -> Iterator[tuple[int, torch.Tensor | None, bool, bool, float]]:
    """(start, rows or None, final, aborted, published at) of each piece of the entry as the
    read takes it."""
    if job.streamed:
        for chunk in channel.stream(job.request_id, job.timeout_s):
            yield (chunk.start, chunk.rows.get(HIDDEN_KEY), chunk.final, chunk.aborted,
                   chunk.published_at)
    else:
        entry = channel.get_entry(job.request_id, job.timeout_s)
        yield entry.start, entry.outputs.get(HIDDEN_KEY), True, entry.aborted, \
            entry.published_at


def serve(spec: str, references_path: str, conn: Connection) -> None:
    """The consumer process: answer each `Read` received on `conn` with its `Outcome`, until
    None or the pipe closes. Says ("ready", pid) once it has joined the channel."""
    references = References.load(Path(references_path))
    send_lock = threading.Lock()

    def answer(channel: StageChannel, job: Read) -> None:
        outcome = read(channel, references, job)
        with send_lock:
            conn.send(outcome)

    with open_channel(spec) as channel, ThreadPoolExecutor(MAX_READERS) as pool:
        with send_lock:
            conn.send(("ready", os.getpid()))
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):
                break
            if job is None:
                break
            pool.submit(answer, channel, job)


class ConsumerProcess:
    """The soak's handle on one consumer process. Invariant: `unanswered` holds every read
    handed to the process whose outcome has not come back (a killed process's are held)."""

    def __init__(self, spec: str, references_path: Path, outcomes: queue.Queue[Outcome]
                 ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(spec, str(references_path), child),
                                       name="soak-consumer", daemon=True)
        self.process.start()
        child.close()  # the pipe ends (EOF) when the process does
        self.ready = threading.Event()
        self.unanswered: dict[int, Read] = {}
        self._lock = threading.Lock()
        self._outcomes = outcomes
        self._receiver = threading.Thread(target=self._receive, name="soak-consumer-outcomes",
                                          daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def read(self, job: Read) -> None:
        with self._lock:
            self.unanswered[job.key] = job
        self._conn.send(job)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> dict[int, Read]:
        """SIGKILL the process; once its last outcomes are in, the reads it held."""
        os.kill(self.pid, signal.SIGKILL)
        self._end()
        with self._lock:
            held, self.unanswered = self.unanswered, {}
        return held

    def close(self) -> None:
        """Ask the process to end once its reads have; kill it if it does not."""
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
        self._end()

    def _end(self) -> None:
        self.process.join(STOP_WAIT_S)
        self._receiver.join(STOP_WAIT_S)
        self._conn.close()

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, Outcome):
                with self._lock:
                    self.unanswered.pop(message.key, None)
                self._outcomes.put(message)
            else:
                self.ready.set()
