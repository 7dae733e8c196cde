"""The shared-memory channel: one file per entry in a private directory under /dev/shm.

The namespace is a directory (mode 0700) with a random name, created by the channel opened
without one (its owner). Entries are files (mode 0600) named by a keyed BLAKE2b (a MAC) of the
request id under a random key kept in the directory, so neither a request id nor the namespace's
name alone gives a file's name.

Crash consistency: no file of an entry is ever renamed but once, into place. Each entry is
`NAME.SEQ`, SEQ a sequence number the namespace hands out in publish order (from the ring's
header, below), and the id's oldest entry is the one with the lowest SEQ. A put reserves its
bytes and creates a temp file under the namespace lock (a `flock` on `.lock`, shared by every
process on the machine), writes it without the lock, and renames it to `NAME.SEQ` under the
lock. A take of a file, under the lock, opens the id's lowest entry it awaits (the first chunk
of an entry, or the next of its entry: read from the file's prefix, `peek`; the others stay)
and unlinks it (so exactly one reader takes it), then maps it: the tensors it returns are views
of a mapping no one else can reach. A process killed anywhere thus leaves every other entry
where it was, in order; there is no chain to repair. The empty file `NAME` marks an id that
may have entry files (a put creates it before its entry, a take removes it with the last one),
so a take of an id without files costs one `lstat`. A put's system calls, and a step's
expectations', are made in C (`prefix_cache.channel._shm`) with the GIL released: one call for
the puts the namespace has room for (`_shm.put_all`, under the namespace lock taken first),
three (reserve, write, publish) for a put that waits for room, one for a step's expectations;
each system call made from Python would give the GIL up and wait to take it back (on an
engine's output thread, from the engine thread). A pool's rows are held (`reading`) only while
they are copied, never while a lock another process keeps is awaited: a consumer stopped while
it holds the namespace lock stalls the puts, never the engine thread that moves rows out of
the pool.

The chunk ring (`.ring`, `prefix_cache.channel._shm`'s `_ring.c` has its protocol): a streaming
step's chunks are one per request per step, and a file each cost a put and a take about ten
system calls under the namespace lock. A chunk that is not its entry's last (the last ends the
producer's expectation, a file) and fits a slot (`RING_SLOT_BYTES`) is published into a free
slot of the ring, which every handle maps shared: a copy and two atomic stores, no system call
and no lock, so no reader can stall it. Its slot carries the id's name and a SEQ from the same
sequence as the files, so a take, which looks in the ring first and then, for an older one,
in the id's files, finds an id's entries in publish order wherever they are (a take that finds
the namespace's publish count moved between the two looks looks again: a chunk that reached
the ring just after the first look is older than a file placed behind it). A reader claims a
slot by compare-and-swap (exactly one reader takes it), copies it out and frees it; a full ring
sends chunks to files. Crash consistency holds slot by slot: a slot is published whole or not
at all, a sweep frees a slot whose writer died writing (its word names the producer's number,
`writer` in its lock file) and one a reader has held past the time to live, whose copy then
fails rather than return bytes written since. Every publish, file or slot, bumps the ring's
publish count, a futex that waiting readers block on (the wake is a system call only while one
waits). The ring takes `RING_SHARE` of the capacity, at most `RING_MAX_BYTES`.

`.budget` holds the files' share of the capacity and the bytes their unconsumed entries and
in-flight puts use. The count can only be off by what a killed process left: a temp file of
a dead writer (each writer holds a flock on its temp file until it publishes) or an entry taken
but not yet uncounted. Every sweep, and a put that finds no room (at most every RECOUNT_S: a
put waiting for room polls the budget alone between), recounts it from the files and removes
dead writers' temp files and markers of ids without entries. Any handle frees entries
older than the time to live (by file modification time, this machine's clock) as it puts or
gets; the owner's close removes the whole directory.

Liveness is a held `flock`: a producer's handle creates `.producer-TOKEN` (its pid, host and
start time as JSON) and holds an exclusive flock on it until it closes (which removes the file)
or its process dies (which frees the lock). `expect` writes `.expect-NAME` naming the producer;
the producer's publish of that id removes it. A waiting get tests the lock of the producer that
expected its id, else, when the namespace has producers, whether any of them still holds its
lock. A lock file is written and locked under a temp name, then renamed into place, so no one
finds a live holder's file unlocked. A forked child shares its parent's locks but does not hold
them: registering, it makes a lock file of its own. Every chunk names the lock file of its
producer, so a reader waiting for the rest of an entry tests that producer's. A sweep renames a
dead producer's lock file `.dead-TOKEN` (its change time: when it was found dead) and removes
it a time to live later, so the namespace's later waits name only producers that died since.

The owner's handle likewise holds `.owner`, the namespace's first file. A namespace whose owner
died is reclaimed (`reclaim`) by the next `ShmChannel.create` under the same root and by
`python -m prefix_cache channel gc`: one whose `.owner` no one holds (a forked child of the
owner holds it while it lives), or one its creator died making.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlencode

import torch

from prefix_cache.channel import _shm
from prefix_cache.channel.base import (DEFAULT_FULL_WAIT_S, DEFAULT_TTL_S, Awaited,
                                      StageChannel, spec_number)
from prefix_cache.channel.codec import PREFIX_BYTES, ChunkTag, EncodedEntry, peek
from prefix_cache.channel.errors import OmniPrefixCacheChannelError
from prefix_cache.core.pool_rows import reading

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "omni-prefix-cache-"
_KEY_FILE = ".key"
_LOCK_FILE = ".lock"
_BUDGET_FILE = ".budget"
_RING_FILE = ".ring"
_OWNER_FILE = ".owner"
_TEMP_PREFIX = ".tmp-"
_PRODUCER_PREFIX = ".producer-"
_DEAD_PREFIX = ".dead-"  # a dead producer's lock file, renamed by the sweep that found it
_EXPECT_PREFIX = ".expect-"
_PRODUCER_RE = re.compile(r"\.producer-[0-9a-f]{32}")
_DEAD_RE = re.compile(r"\.dead-[0-9a-f]{32}")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_CREATED_RE = re.compile(re.escape(NAMESPACE_PREFIX) + r"[0-9a-f]{32}")  # as `create` names one
_ENTRY_RE = re.compile(r"([0-9a-f]{64})(?:\.([0-9]+))?")  # NAME, the id's marker; NAME.SEQ
_BUDGET = struct.Struct("<QQ")
_RING_HEADER = struct.Struct("<QII48x")  # magic, slot count, slot bytes (`_shm.h`'s RingHeader)
_RING_MAGIC = int.from_bytes(b"OPCRING\x01", "little")
_SLOT_HEADER_BYTES = 128  # `_ring.c`'s SlotHeader
_WRITING, _READY, _TAKEN = 1, 2, 3  # a ring slot's states (`_ring.c`)
#: A ring slot's bytes, its header included: a chunk of up to this less 128 bytes (a decode
#: step's row of a 7B-class model's hidden states, 7 KiB in bfloat16, with its header and other
#: keys' rows) goes into the ring.
RING_SLOT_BYTES = 32 << 10
#: The ring's share of a namespace's capacity, and its most bytes.
RING_SHARE = 0.25
RING_MAX_BYTES = 8 << 20
#: How many streamed ids' names a handle keeps at most (a streaming stage names each live
#: request's once per chunk; a keyed BLAKE2b costs a few µs on an engine's output thread).
DIGESTS_KEPT = 4096
#: The share of the file system's free space a new namespace may fill unless told otherwise.
DEFAULT_CAPACITY_SHARE = 0.5
#: How old a namespace without an owner lock file must be to be reclaimed (its creator may be
#: making it).
RECLAIM_GRACE_S = 60.0
#: How often a handle's puts that find no room recount the bytes in use from the files (a scan
#: of the namespace under its lock); between, they read the budget alone.
RECOUNT_S = 1.0


def default_root() -> Path:
    """/dev/shm where the system has it, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def default_capacity(root: Path) -> int:
    """`DEFAULT_CAPACITY_SHARE` of the free bytes of the file system under `root`."""
    st = os.statvfs(root)
    return max(1, int(st.f_bavail * st.f_frsize * DEFAULT_CAPACITY_SHARE))


class _Budget(NamedTuple):
    """The contents of `.budget`: the files' part of the capacity (the ring has the rest)."""

    capacity: int
    used: int  # bytes of unconsumed entry files and in-flight puts


def _create_private_file(path: Path | str) -> int:
    """A new file at `path` open for writing, private to this user."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o600)  # exact, whatever the umask
    return fd


def _holder_record() -> dict[str, Any]:
    """Who this process is, for a lock file: its pid, host and the time it took the lock."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def _describe(record: dict[str, Any]) -> str:
    return f"pid {record.get('pid')} on host {record.get('host')}"


def _read_record(path: Path | str) -> dict[str, Any] | None:
    """The JSON object in the file at `path`; None when it is gone or not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _held(path: str | Path) -> bool:
    """Whether a live process holds an exclusive flock on the file at `path`; a gone file is
    not held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@dataclass
class _HeldFile:
    """A file whose exclusive flock its holder keeps while it lives; `pid` holds it (a forked
    child shares the descriptor but is not the holder). The holder's release removes it."""

    path: Path
    fd: int
    pid: int
    record: dict[str, Any]

    @classmethod
    def create(cls, path: Path, **about: Any) -> _HeldFile:
        """A new lock file at `path` holding `_holder_record()` and `about`: written and locked
        under a temp name, then renamed into place, so no one finds it unlocked while its
        holder lives."""
        record, temp = {**_holder_record(), **about}, path.with_name(path.name + ".new")
        fd = _create_private_file(temp)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _write_all(fd, memoryview(json.dumps(record).encode()), 0)
            os.rename(temp, path)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        return cls(path, fd, os.getpid(), record)

    @functools.cached_property
    def is_producer(self) -> bool:
        """Whether it is a producer's lock file (else the owner's)."""
        return self.path.name.startswith(_PRODUCER_PREFIX)

    @functools.cached_property
    def expectation(self) -> bytes:
        """What an expectation this holder (a producer) records holds: its record and name; its
        publish ends only an expectation that still holds exactly this."""
        return json.dumps({**self.record, "producer": self.path.name}).encode()

    def release(self) -> None:
        """Closes this process's descriptor; the holder also removes the file (a forked child's
        close leaves its parent's lock held)."""
        if self.pid == os.getpid():
            self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _stale(f: os.DirEntry[str], expired_before: float) -> bool:
    """Whether a sweep removes the namespace's file `f`: an entry or expectation older than
    `expired_before`, a dead producer's lock file found dead before then, or a temp file whose
    writer died."""
    if f.name.startswith(_TEMP_PREFIX):
        return not _held(f.path)
    if _DEAD_RE.fullmatch(f.name):
        return f.stat(follow_symlinks=False).st_ctime < expired_before
    return (_ENTRY_RE.fullmatch(f.name) is not None or f.name.startswith(_EXPECT_PREFIX)) \
        and f.stat(follow_symlinks=False).st_mtime < expired_before


def _dead_name(producer: str) -> str:
    """The name a sweep gives the lock file `producer` (`.producer-TOKEN`) once found dead."""
    return _DEAD_PREFIX + producer.removeprefix(_PRODUCER_PREFIX)


@dataclass
class _Reservation:
    """A put's room: its temp file, and a descriptor holding an exclusive flock on it until
    the entry is published or the room returned, so a recount can tell a dead writer's."""

    path: str
    fd: int


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _PublishedMeanwhile(Exception):
    """A take's look at the files found the namespace published since its look at the ring:
    it looks again."""


def _refused(request_id: str, error: Exception) -> ValueError:
    """Why a put refused an entry's pieces before it wrote any."""
    return ValueError(f"request {request_id}: its entry's pieces were refused: "
                      f"{type(error).__name__}: {error}")


class ShmChannel(StageChannel):
    """Entries of one namespace directory; the directory exists from create until the owner
    closes, and only this user can list or read it. Entries, markers and `.budget` change only
    under the namespace lock."""

    def __init__(self, directory: Path, *, ttl_s: float, full_wait_s: float,
                 owner: _HeldFile | None) -> None:
        """A handle of the namespace at `directory`; `owner`, the owner's lock file, makes it
        the handle that created it (its close removes the namespace)."""
        self.directory = directory
        self._root = str(directory)  # the puts' paths are strings: a Path costs µs to build
        #: temp names: this handle's random token, then the process and a count (os.urandom
        #: per put would hand the GIL over once more)
        self._temp_token = secrets.token_hex(8)
        self._temp_count = itertools.count()
        fds: list[int] = []
        try:
            key_fd = self._open_private(_KEY_FILE, os.O_RDONLY)
            try:
                self._key = os.read(key_fd, 64)
            finally:
                os.close(key_fd)
            self._digests: dict[str, bytes] = {}  # `_streamed_digest`'s, by request id
            fds.append(self._open_private(_BUDGET_FILE, os.O_RDWR))
            fds.append(self._open_private(_LOCK_FILE, os.O_RDWR))
            self._budget_fd, self._lock_fd = fds
            self._ring = self._map_ring()
            self._ring_slots, self._slot_bytes = _RING_HEADER.unpack_from(self._ring)[1:]
            self._ring_bytes = self._ring_slots * self._slot_bytes
            #: the largest entry a slot takes (none where the ring has no slots)
            self._ring_payload = self._slot_bytes - _SLOT_HEADER_BYTES if self._ring_slots else -1
            self._lock_pid = os.getpid()  # the process `_lock_fd` was opened in
            self._thread_lock = threading.Lock()  # flock excludes processes, not its threads
            #: per id, the numbers of its entries a take's scan found after the one it took,
            #: newest first, and the namespace's next number then (see `_take_oldest`; under
            #: the lock)
            self._later: dict[str, tuple[list[int], int]] = {}
            self._next_recount = 0.0  # a put finding no room recounts from then on (monotonic)
            self._lock_files = [owner] if owner else []  # the owner's and the producer's
            self._producer_held: _HeldFile | None = None  # `_producer`'s last answer
            super().__init__(ttl_s=ttl_s,
                             capacity_bytes=self._read_budget().capacity + self._ring_bytes,
                             full_wait_s=full_wait_s, owns_namespace=owner is not None)
        except BaseException:  # a bad option or file: nothing of the handle stays behind
            _release(directory, os.getpid(), owner is not None, fds, [owner] if owner else [])
            raise
        self._finalizer = weakref.finalize(self, _release, directory, os.getpid(),
                                           owner is not None, fds, self._lock_files, self._ring)

    @classmethod
    def create(cls, root: Path | None = None, *, ttl_s: float = DEFAULT_TTL_S,
               capacity_bytes: int | None = None,
               full_wait_s: float = DEFAULT_FULL_WAIT_S) -> ShmChannel:
        """A new namespace under `root` (default `default_root()`), owned by the returned handle,
        holding at most `capacity_bytes` (default `default_capacity(root)`)."""
        root = root or default_root()
        for dead in reclaim(root):
            logger.warning("shm channel: removed namespace %s, whose owner (%s) died, with %d "
                           "entries (%d bytes)", dead.directory, dead.owner, dead.entries,
                           dead.nbytes)
        directory = root / (NAMESPACE_PREFIX + secrets.token_hex(16))  # see _CREATED_RE
        owner = None
        try:
            capacity = default_capacity(root) if capacity_bytes is None else capacity_bytes
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
                raise ValueError(f"shm channel capacity must be a positive number of bytes, "
                                 f"got {capacity!r}")
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # exact, whatever the umask
            owner = _HeldFile.create(directory / _OWNER_FILE)  # first: see `_dead_namespace`
            slots = min(RING_MAX_BYTES, int(capacity * RING_SHARE)) // RING_SLOT_BYTES
            for name, data, size in (
                    (_KEY_FILE, secrets.token_bytes(32), 0), (_LOCK_FILE, b"", 0),
                    (_RING_FILE, _RING_HEADER.pack(_RING_MAGIC, slots, RING_SLOT_BYTES),
                     _RING_HEADER.size + slots * RING_SLOT_BYTES),
                    (_BUDGET_FILE, _BUDGET.pack(capacity - slots * RING_SLOT_BYTES, 0), 0)):
                fd = _create_private_file(directory / name)  # `.budget` last: `_dead_namespace`
                try:
                    if size:  # the ring's pages now: a full /dev/shm fails here, not in a put
                        os.posix_fallocate(fd, 0, size)
                    _write_all(fd, memoryview(data), 0)
                finally:
                    os.close(fd)
        except OSError as e:
            if owner is not None:
                owner.release()
            shutil.rmtree(directory, ignore_errors=True)
            raise OmniPrefixCacheChannelError(
                f"shm channel: cannot create a namespace under {root}: {e}") from e
        return cls(directory, ttl_s=ttl_s, full_wait_s=full_wait_s, owner=owner)

    @classmethod
    def join(cls, name: str, root: Path | None = None, *, ttl_s: float = DEFAULT_TTL_S,
             full_wait_s: float = DEFAULT_FULL_WAIT_S) -> ShmChannel:
        """The existing namespace `name` under `root`; refused unless private to this user."""
        if not _NAMESPACE_RE.fullmatch(name):
            raise ValueError(f"shm channel namespace {name!r} is not a plain directory name")
        directory = (root or default_root()) / name
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {directory} does not exist (never created, or its "
                f"owner closed it)") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {directory} is not a directory private to this user "
                f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing it")
        return cls(directory, ttl_s=ttl_s, full_wait_s=full_wait_s, owner=None)

    @classmethod
    def from_spec(cls, namespace: str, query: str) -> ShmChannel:
        """`shm://[NAMESPACE][?dir=ROOT&ttl=SECONDS&wait=SECONDS&capacity=BYTES]`: no namespace
        creates one (`capacity` is the new namespace's; a joiner uses the namespace's own)."""
        options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        unknown = options.keys() - {"dir", "ttl", "wait", "capacity"}
        if unknown:
            raise ValueError(f"shm channel spec: unknown option(s) {sorted(unknown)}; "
                             f"known: dir, ttl, wait, capacity")
        root = Path(options["dir"]) if "dir" in options else None
        ttl_s = spec_number("shm", options, "ttl", float, DEFAULT_TTL_S)
        wait_s = spec_number("shm", options, "wait", float, DEFAULT_FULL_WAIT_S)
        capacity = spec_number("shm", options, "capacity", int, None)
        if namespace:
            if capacity is not None:
                raise ValueError("shm channel spec: capacity is set when a namespace is created; "
                                 "a handle joining one uses its capacity")
            return cls.join(namespace, root, ttl_s=ttl_s, full_wait_s=wait_s)
        return cls.create(root, ttl_s=ttl_s, capacity_bytes=capacity, full_wait_s=wait_s)

    @property
    def spec(self) -> str:
        query = urlencode({"dir": str(self.directory.parent), "ttl": f"{self.ttl_s:g}",
                           "wait": f"{self.full_wait_s:g}"}, safe="/")
        return f"shm://{self.directory.name}?{query}"

    def entry_path(self, request_id: str) -> Path:
        """The id's marker: it exists whenever the id has unconsumed entries (`NAME.SEQ`)."""
        return self.directory / self._name(request_id)

    @contextmanager
    def _arrivals(self, request_id: str) -> Iterator[Callable[[float], None]]:
        """Pauses that end when the namespace publishes anything (the ring's publish count,
        which every publish bumps, a futex its readers block on): the count is read before the
        first poll, so a publish after it ends the next pause at once."""
        seen = _shm.ring_wait(self._ring, -1, 0)

        def pause(seconds: float) -> None:
            nonlocal seen
            seen = _shm.ring_wait(self._ring, seen, seconds)

        yield pause

    def _map_ring(self) -> mmap.mmap:
        """`.ring` mapped shared, its header checked."""
        fd = self._open_private(_RING_FILE, os.O_RDWR)
        try:
            ring = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
            _shm.ring_wait(ring, -1, 0)  # checks the header
        except ValueError as e:  # an empty file, or no ring of this version
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {self.directory} has no usable {_RING_FILE}: {e}"
            ) from None
        finally:
            os.close(fd)
        return ring

    def _digest(self, request_id: str) -> bytes:
        """The id's name in the namespace as the ring holds it (`_name` is its hex)."""
        return hashlib.blake2b(request_id.encode(), key=self._key, digest_size=32).digest()

    def _streamed_digest(self, request_id: str) -> bytes:
        """`_digest`, kept for the id's next chunks while its stream runs through the ring at
        this handle: until its final entry is put or one of its entries is taken from a file
        (a stream's last always is), and at most `DIGESTS_KEPT` ids' at once."""
        digest = self._digests.get(request_id)
        if digest is None:
            if len(self._digests) >= DIGESTS_KEPT:
                self._digests.clear()
            digest = self._digests[request_id] = self._digest(request_id)
        return digest

    def _name(self, request_id: str) -> str:
        """The id's name in the namespace: a MAC of it under the namespace's key (a keyed
        BLAKE2b: 0.7 µs warm against 2.3-2.9 for an HMAC-SHA256 through OpenSSL, whose code an
        engine's output thread runs cold)."""
        return self._digest(request_id).hex()

    def _expectation_path(self, name: str) -> str:
        """The expectation file of the id named `name` (`_name`)."""
        return f"{self._root}/{_EXPECT_PREFIX}{name}"

    @property
    def _producer(self) -> _HeldFile | None:
        """This process's producer lock file of the handle, if it registered one."""
        pid, held = os.getpid(), self._producer_held
        if held is not None and held.pid == pid:  # a streaming stage's every put asks
            return held
        held = next((h for h in self._lock_files if h.pid == pid and h.is_producer), None)
        self._producer_held = held
        return held

    def _register_producer(self) -> None:
        if self._producer is not None:
            return
        inherited = [h for h in self._lock_files if h.pid != os.getpid()]
        for lock_file in inherited:  # a forked child's copies of its parent's locks
            self._lock_files.remove(lock_file)
            lock_file.release()
        path = self.directory / (_PRODUCER_PREFIX + secrets.token_hex(16))
        try:  # the number the ring's slots it writes name it by
            self._lock_files.append(_HeldFile.create(path,
                                                     writer=_shm.ring_new_producer(self._ring)))
        except OSError as e:
            raise self._gone_or(e, "cannot register a producer") from e

    def _expect(self, request_ids: Sequence[str]) -> None:
        producer = self._producer
        assert producer is not None, "expect registers the producer first"
        paths = [self._expectation_path(self._name(r)) for r in request_ids]
        try:
            with self._process_locked() as lock_fd:  # one call, its system calls without the GIL
                _shm.expect(lock_fd, paths, producer.expectation)
        except OSError as e:
            failed = next((r for r, path in zip(request_ids, paths)
                           if e.filename in (path, path + ".new")), request_ids[0])
            raise self._gone_or(e, f"cannot record that request {failed} is expected") from e

    def _remove_expectation(self, request_id: str, producer: str) -> None:
        """Removes the id's expectation if the producer named `producer` made it (caller holds
        the lock)."""
        path = self._expectation_path(self._name(request_id))
        if (_read_record(path) or {}).get("producer") == producer:
            with suppress(FileNotFoundError):
                os.unlink(path)

    def _producer_name(self) -> str:
        producer = self._producer
        return producer.path.name if producer is not None else ""

    def _dead_producer(self, request_id: str, producer: str) -> str | None:
        if _PRODUCER_RE.fullmatch(producer):
            if _held(self.directory / producer):
                return None
            record = _read_record(self.directory / producer) \
                or _read_record(self.directory / _dead_name(producer))
            with self._locked():  # its promise of the id is broken: reported here, once
                self._remove_expectation(request_id, producer)
            return _describe(record) if record else f"{producer} (it closed)"
        record = _read_record(self._expectation_path(self._name(request_id)))
        if record is not None and _PRODUCER_RE.fullmatch(str(record.get("producer"))):
            if _held(self.directory / record["producer"]):
                return None
            with self._locked():  # reported once: clients reuse ids, a later request's
                self._remove_expectation(request_id, record["producer"])  # wait is its own
            return _describe(record)
        try:
            producers = [Path(f.path) for f in os.scandir(self.directory)
                         if _PRODUCER_RE.fullmatch(f.name) or _DEAD_RE.fullmatch(f.name)]
        except FileNotFoundError:
            return None  # the namespace is gone: the next take says so
        if not producers or any(map(_held, producers)):
            return None
        dead = [_describe(_read_record(p) or {}) for p in producers]
        return f"{', '.join(dead)} (every producer of the namespace)"

    def used_bytes(self) -> int:
        """Bytes of the capacity held by unconsumed entries and puts in flight: files, and the
        ring's slots in use."""
        with self._operation(), self._locked():
            in_files = self._read_budget().used
        return in_files + len(_shm.ring_slots(self._ring)) * self._slot_bytes

    def _open_private(self, name: str, flags: int) -> int:
        """A descriptor of the namespace's file `name`, refused unless private to this user."""
        path = self.directory / name
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW)
        except OSError as e:
            raise OmniPrefixCacheChannelError(
                f"shm channel namespace {self.directory} has no usable {name}: {e}") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise OmniPrefixCacheChannelError(
                f"shm channel file {path} is not private to this user "
                f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing it")
        return fd

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The namespace lock, held."""
        with self._process_locked() as lock_fd:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)

    @contextmanager
    def _process_locked(self) -> Iterator[int]:
        """This process's descriptor of `.lock`, under the handle's thread lock: `_locked`, or
        a `_shm` step that takes the namespace lock itself, with the GIL released."""
        if self._lock_pid != os.getpid():
            self._open_lock_again()
        with self._thread_lock:
            yield self._lock_fd

    def _open_lock_again(self) -> None:
        """In a forked child: a flock belongs to the open file, which the child shares with its
        parent, so the parent's lock would not exclude the child; and the parent's thread lock
        may have been held by one of its threads when it forked. Take a file and a lock of
        this process's own (two threads racing here still exclude each other by flock: their
        files differ)."""
        fd = self._open_private(_LOCK_FILE, os.O_RDWR)
        weakref.finalize(self, os.close, fd)
        self._thread_lock = threading.Lock()
        self._lock_fd, self._lock_pid = fd, os.getpid()

    def _read_budget(self) -> _Budget:
        return _Budget(*_BUDGET.unpack(os.pread(self._budget_fd, _BUDGET.size, 0)))

    def _write_budget(self, budget: _Budget) -> None:
        os.pwrite(self._budget_fd, _BUDGET.pack(*budget), 0)

    def _add_used(self, delta: int) -> None:
        """Adds `delta` to the bytes in use (caller holds the lock)."""
        budget = self._read_budget()
        self._write_budget(budget._replace(used=max(0, budget.used + delta)))

    def _free_stale(self) -> int:
        """Frees expired entries and expectations, dead writers' temp files and the markers of
        ids left without entries, and recounts the bytes in use from the files, which it
        returns (caller holds the lock)."""
        expired_before = time.time() - self.ttl_s
        self._later.clear()  # an id a reader gave up on is not kept longer than a sweep
        used, chains, markers = 0, set(), []
        for f in list(os.scandir(self.directory)):
            entry = _ENTRY_RE.fullmatch(f.name)
            if entry and entry[2] is None:
                markers.append(f)
            elif _PRODUCER_RE.fullmatch(f.name) and not _held(f.path):
                os.rename(f.path, f"{self._root}/{_dead_name(f.name)}")  # now: found dead
            elif _stale(f, expired_before):
                os.unlink(f.path)
            elif entry or f.name.startswith(_TEMP_PREFIX):
                used += f.stat(follow_symlinks=False).st_size
                if entry:
                    chains.add(entry[1])
        for marker in markers:
            if marker.name not in chains:
                os.unlink(marker.path)
        self._write_budget(self._read_budget()._replace(used=used))
        self._free_stale_slots(expired_before)
        return used

    def _free_stale_slots(self, expired_before: float) -> None:
        """Frees the ring's expired entries, slots a reader has held since before
        `expired_before` (its copy then fails, `_ring.c`), and slots whose writer is no live
        producer of the namespace (it died writing)."""
        writing = []
        for slot, word, state, writer, _, _, published_at, claimed_at in \
                _shm.ring_slots(self._ring):
            if (state == _READY and published_at < expired_before) \
                    or (state == _TAKEN and claimed_at < expired_before):
                _shm.ring_release(self._ring, slot, word)
            elif state == _WRITING:
                writing.append((slot, word, writer))
        if writing:
            live = {record.get("writer") for f in os.scandir(self.directory)
                    if _PRODUCER_RE.fullmatch(f.name) and _held(f.path)
                    and (record := _read_record(f.path)) is not None}
            for slot, word, writer in writing:
                if writer not in live:
                    _shm.ring_release(self._ring, slot, word)

    def _reserve(self, nbytes: int, *, force: bool) -> _Reservation | None:
        temp = self._temp_path()
        try:
            with self._process_locked() as lock_fd:
                fd = _shm.reserve(lock_fd, self._budget_fd, temp, nbytes, force, True)
            if fd < 0:  # no room counted: recount from the files, which frees what expired
                if time.monotonic() < self._next_recount:
                    return None
                with self._locked():
                    self._next_recount = time.monotonic() + RECOUNT_S
                    if self._free_stale() + nbytes > self._read_budget().capacity:
                        return None
                    fd = _shm.reserve(self._lock_fd, self._budget_fd, temp, nbytes, True, False)
        except OSError as e:
            raise self._gone_or(e, f"cannot reserve {nbytes} bytes for an entry") from e
        return _Reservation(temp, fd)

    def _largest_entry_bytes(self) -> int:
        return self.capacity_bytes - self._ring_bytes  # the ring's part takes chunks alone

    def _unreserve(self, reservation: _Reservation) -> None:
        try:
            with self._locked():
                try:
                    size = os.stat(reservation.path, follow_symlinks=False).st_size
                except FileNotFoundError:
                    return  # removed with the namespace
                os.unlink(reservation.path)
                self._add_used(-size)
        finally:
            os.close(reservation.fd)

    def _put_now_all(self, puts: Sequence[tuple[str, EncodedEntry, bool]], *, force: bool
                     ) -> list[bool | Exception]:
        results: list[bool | Exception | None] = [None] * len(puts)
        in_ring = [i for i, (_, encoded, final) in enumerate(puts)
                   if not final and encoded.nbytes <= self._ring_payload]
        if in_ring:
            self._put_in_ring([puts[i] for i in in_ring], in_ring, results)
        in_files = [i for i, result in enumerate(results) if result is None]
        if in_files:
            self._put_in_files([puts[i] for i in in_files], in_files, results, force=force)
        return results  # type: ignore[return-value]  # each set by one of the two

    def _put_in_ring(self, puts: Sequence[tuple[str, EncodedEntry, bool]], at: list[int],
                     results: list[bool | Exception | None]) -> None:
        """Publishes chunks into free slots of the ring (memory alone: no system call, no
        lock), each's outcome at `results[at[i]]`; one no slot took is left None. Final chunks
        go to files: they end the producer's expectation, a file of its own."""
        self._register_producer()
        producer = self._producer
        assert producer is not None, "registered above"
        entries = [(self._streamed_digest(request_id), encoded.nbytes, encoded.pieces)
                   for request_id, encoded, _ in puts]
        with reading(piece for _, _, pieces in entries for _, piece in pieces):
            placed = _shm.ring_put_all(self._ring, producer.record["writer"], entries)
        for i, (request_id, _, _), seq in zip(at, puts, placed):
            if isinstance(seq, Exception):
                results[i] = _refused(request_id, seq)
            elif seq >= 0:
                results[i] = True

    def _put_in_files(self, puts: Sequence[tuple[str, EncodedEntry, bool]], at: list[int],
                      results: list[bool | Exception | None], *, force: bool) -> None:
        """Publishes entries as files, those the budget has room for (all, if `force`), each's
        outcome at `results[at[i]]`: True, False where there was no room, or why it failed."""
        entries = [(self._temp_path(), encoded.nbytes, encoded.pieces,
                    *self._entry_names(request_id, final)) for request_id, encoded, final in puts]
        # the namespace lock first (a consumer stopped while it holds the lock stalls this put,
        # never the engine thread: no pool's rows are held meanwhile), then one call for all
        with self._locked(), reading(piece for _, encoded, _ in puts
                                     for _, piece in encoded.pieces):
            placed = _shm.put_all(self._ring, self._budget_fd, force, entries)
        for i, (request_id, encoded, _), seq in zip(at, puts, placed):
            if isinstance(seq, OSError):
                seq = self._gone_or(seq, f"cannot publish the entry for request {request_id} "
                                         f"({encoded.nbytes} bytes)")
            elif isinstance(seq, Exception):  # its pieces, refused before any system call
                seq = _refused(request_id, seq)
            results[i] = seq if isinstance(seq, Exception) else seq >= 0

    def _publish(self, request_id: str, encoded: EncodedEntry, reservation: _Reservation,
                 *, final: bool) -> None:
        try:
            with reading(piece for _, piece in encoded.pieces):  # a pool's rows, held to copy
                _shm.write(reservation.fd, encoded.pieces)  # unlocked: the file is this put's
            with self._process_locked() as lock_fd:  # one call, its system calls without the GIL
                _shm.publish(self._ring, lock_fd, reservation.fd, reservation.path,
                             *self._entry_names(request_id, final))
        except OSError as e:
            raise self._gone_or(e, f"cannot publish the entry for request {request_id} "
                                   f"({encoded.nbytes} bytes)") from e

    def _entry_names(self, request_id: str, final: bool
                     ) -> tuple[str, str, str | None, bytes | None]:
        """A publish's paths: the id's marker, its entries' prefix (`NAME.`), and, for a final
        entry of a producer, the expectation it ends and what this handle wrote there."""
        if final:  # the id's stream ends here: its name is no longer kept
            self._digests.pop(request_id, None)
        name = self._name(request_id)
        marker = f"{self._root}/{name}"
        producer = self._producer if final else None
        if producer is None:
            return marker, f"{marker}.", None, None
        return marker, f"{marker}.", self._expectation_path(name), producer.expectation

    def _temp_path(self) -> str:
        """A new temp file's path (`_TEMP_PREFIX`): a put's room until it is published."""
        return (f"{self._root}/{_TEMP_PREFIX}{self._temp_token}-{os.getpid()}-"
                f"{next(self._temp_count)}")

    def _take(self, request_id: str, awaited: Awaited) -> torch.Tensor | None:
        digest = self._streamed_digest(request_id)
        name, expired_before = digest.hex(), time.time() - self.ttl_s
        while True:
            seen = _shm.ring_wait(self._ring, -1, 0)  # the publish count before the look
            in_ring = next(((seq, slot, word) for seq, slot, word, prefix in _shm.ring_find(
                self._ring, digest, expired_before, PREFIX_BYTES)
                if awaited.accepts(peek(prefix))), None)
            try:  # then the files, for one older than it
                taken = self._take_file(request_id, name, expired_before, awaited,
                                        below=in_ring[0] if in_ring else None, seen=seen)
            except _PublishedMeanwhile:
                continue
            if taken is not None:
                self._digests.pop(request_id, None)  # a stream's last entry is a file
                return taken
            if in_ring is None:
                if not self.directory.is_dir():
                    raise self._gone(f"waiting for request {request_id}")
                return None
            _, slot, word = in_ring
            held = _shm.ring_claim(self._ring, slot, word)
            if held < 0:
                continue  # another reader took it first, or it expired: look again
            data = _shm.ring_copy_out(self._ring, slot, held)
            if data is None:
                raise OmniPrefixCacheChannelError(
                    f"request {request_id}: its chunk in the ring of shm channel {self.spec} "
                    f"was freed while this reader held it (past the {self.ttl_s:g} s time to "
                    f"live: a stopped reader?) and written again; the chunk is lost")
            return torch.frombuffer(data, dtype=torch.uint8)

    def _take_file(self, request_id: str, name: str, expired_before: float, awaited: Awaited,
                   *, below: int | None, seen: int) -> torch.Tensor | None:
        """The id's oldest entry file that `awaited` accepts, numbered below `below` (None:
        any), taken and mapped: None where there is none. Raises `_PublishedMeanwhile` where
        the namespace published anything since its publish count read `seen`, before the
        ring was looked at: a chunk that reached the ring after that look would be older than
        the files after it (the publish count moves after a chunk is in the ring, and before
        a file behind it is placed, which is under the lock held here)."""
        if not os.path.lexists(f"{self._root}/{name}"):  # the id has no files: no lock taken
            return None
        try:
            with self._locked():
                if _shm.ring_wait(self._ring, -1, 0) != seen:
                    raise _PublishedMeanwhile
                taken = self._take_oldest(name, expired_before, awaited.accepts, below)
        except OSError as e:
            raise self._gone_or(e, f"cannot take an entry for request {request_id}") from e
        if taken is None:
            return None
        fd, size = taken
        try:
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)  # not an entry: decode says so
            view = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(view, dtype=torch.uint8)  # the mapping lives as long as it

    def _take_oldest(self, name: str, expired_before: float,
                     accepts: Callable[[ChunkTag | None], bool], below: int | None
                     ) -> tuple[int, int] | None:
        """Claims the id's oldest unexpired entry file numbered below `below` (None: any) that
        `accepts` its tag, freeing expired ones it passes and leaving the others, and removes
        the id's marker if no file is left (caller holds the lock): its descriptor and size,
        or None.

        The id's entries a scan of the namespace finds are kept for the next takes (`_later`),
        with the namespace's next number when it scanned: files are numbered in publish order
        under the lock, so none published since is older and every file numbered below that is
        in the scan. A backlog drains with one scan, not one per entry. One that another handle
        took (or a sweep freed) since is passed over; where the kept ones yield none, it scans
        again, unless all it looks for is below the number the scan covers."""
        marker = f"{self._root}/{name}"
        if not os.path.lexists(marker):
            self._later.pop(name, None)
            return None
        seqs, covered = self._later.pop(name, (None, 0))
        scanned = seqs is None
        while True:
            if seqs is None:
                covered = _shm.ring_next_seq(self._ring)  # first: the lock is held
                seqs, scanned = self._entry_seqs(name), True
            taken, seqs = self._claim_first(marker, seqs, expired_before, accepts, below)
            if taken is not None or scanned or (below is not None and below <= covered):
                break
            seqs = None
        if seqs:
            self._later[name] = seqs, covered
        elif scanned:  # no entry is left: none can be published while the lock is held
            os.unlink(marker)
        return taken

    def _claim_first(self, marker: str, seqs: list[int], expired_before: float,
                     accepts: Callable[[ChunkTag | None], bool], below: int | None
                     ) -> tuple[tuple[int, int] | None, list[int]]:
        """The first entry of `seqs` (numbers newest first) below `below` that `_claim`
        takes, and the numbers of the id's entries still there after it, newest first (caller
        holds the lock)."""
        left: list[int] = []  # passed over, oldest first
        while seqs and (below is None or seqs[-1] < below):
            seq = seqs.pop()
            claim = self._claim(f"{marker}.{seq}", expired_before, accepts)
            if claim is True:
                left.append(seq)
            elif claim is not False:
                return claim, seqs + left[::-1]
        return None, seqs + left[::-1]

    def _entry_seqs(self, name: str) -> list[int]:
        """The numbers of the id's entries, newest first (caller holds the lock)."""
        return sorted((int(entry[2]) for f in os.scandir(self.directory)
                       if (entry := _ENTRY_RE.fullmatch(f.name)) and entry[1] == name
                       and entry[2]), reverse=True)

    def _claim(self, path: str, expired_before: float,
               accepts: Callable[[ChunkTag | None], bool]) -> tuple[int, int] | bool:
        """Unlinks the entry at `path` and uncounts it if it is unexpired and `accepts` its tag
        (caller holds the lock): its descriptor and size; True where it is left in place;
        False if it had expired (then it is freed, as a sweep would) or is gone (another
        handle took it)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        st = os.fstat(fd)
        unexpired = st.st_mtime >= expired_before
        if unexpired and not accepts(peek(os.pread(fd, PREFIX_BYTES, 0))):
            os.close(fd)
            return True
        os.unlink(path)
        self._add_used(-st.st_size)
        if unexpired:
            return fd, st.st_size
        os.close(fd)
        return False

    def _sweep(self) -> None:
        try:
            with self._locked():
                self._free_stale()
        except FileNotFoundError:
            return  # the owner closed the namespace

    def _gone(self, what: str) -> OmniPrefixCacheChannelError:
        return OmniPrefixCacheChannelError(
            f"shm channel namespace {self.directory} is gone (its owner closed it): {what}")

    def _gone_or(self, error: OSError, what: str) -> OmniPrefixCacheChannelError:
        if not self.directory.is_dir():
            return self._gone(what)
        return OmniPrefixCacheChannelError(f"shm channel {self.spec}: {what}: {error}")

    def _close(self) -> None:
        self._finalizer()


def _release(directory: Path, owner_pid: int, owner: bool, fds: list[int],
             held: list[_HeldFile], ring: mmap.mmap | None = None) -> None:
    for fd in fds:
        os.close(fd)
    if ring is not None:
        with suppress(BufferError):  # a reader still waiting on it: the mapping goes with it
            ring.close()
    for lock_file in held:
        lock_file.release()
    if owner and os.getpid() == owner_pid:  # a forked copy of the owner must not remove it
        shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class DeadNamespace:
    """A namespace whose owner died."""

    directory: Path
    owner: str  # "pid P on host H", or why it is not known
    age_s: float  # since its owner created it
    entries: int  # unconsumed
    nbytes: int  # of all its files


def reclaim(root: Path | None = None, *, dry_run: bool = False) -> list[DeadNamespace]:
    """Removes (unless `dry_run`) this user's namespaces under `root` (default
    `default_root()`) whose owner died, and returns them."""
    root = root or default_root()
    try:
        names = sorted(n for n in os.listdir(root) if _CREATED_RE.fullmatch(n))
    except OSError:
        return []
    dead = [found for name in names if (found := _dead_namespace(root / name)) is not None]
    if not dry_run:
        for namespace in dead:
            shutil.rmtree(namespace.directory, ignore_errors=True)
    return dead


def _dead_namespace(directory: Path) -> DeadNamespace | None:
    """`directory` if it is a namespace of this user whose owner died, else None. Dead: its
    `.owner` (created first, already locked) is not held; or it has neither `.owner` nor
    `.budget` (created last), its creator having died, and is older than `RECLAIM_GRACE_S`.
    One with `.budget` but no `.owner` is an older version's, whose owner cannot be tested."""
    try:
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return None
        record = _read_record(directory / _OWNER_FILE)
        if record is None:
            if os.path.lexists(directory / _BUDGET_FILE) \
                    or time.time() - st.st_mtime < RECLAIM_GRACE_S:
                return None
            owner, age_s = "unknown (it died creating the namespace)", time.time() - st.st_mtime
        elif _held(directory / _OWNER_FILE):
            return None
        else:
            owner, age_s = _describe(record), time.time() - float(record.get("started", 0))
        files = [f for f in os.scandir(directory) if f.is_file(follow_symlinks=False)]
        entries = sum(1 for f in files if (entry := _ENTRY_RE.fullmatch(f.name)) and entry[2])
        nbytes = sum(f.stat(follow_symlinks=False).st_size for f in files)
    except OSError:
        return None  # removed meanwhile, or not readable: not ours to remove
    return DeadNamespace(directory, owner, age_s, entries, nbytes)
