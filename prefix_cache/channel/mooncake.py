"""The Mooncake Store channel: entries are objects in a Mooncake Store, for stages across machines.

Mooncake Store (the store vLLM and vllm-ascend deployments use for KV transfer) keeps values in
the memory segments of its clients. This channel's clients contribute none, so a holder
(`mooncake_client --global_segment_size=...`) must run for entries to outlive their publisher.
Entries move through buffers registered with the store, so their size is bounded by the
holder's segment, not by a client-side buffer.

The store has no compare-and-swap, so every key has one writer, and no key is written twice
but a handle's own record. A handle that publishes is a producer: it holds a slot
`NAMESPACE/.producer/K` naming its token T, and keeps, per request id, a chain of its own:
the record `NAMESPACE/HMAC(id)/T` holds the chain's run R, the lowest index that may be
unconsumed, the next index and the deadline of the chain's newest entry (the publisher's wall
clock plus its time to live); its entries are `NAMESPACE/HMAC(id)/T.R.I`, I = 0, 1, 2... Only T
writes or removes its records, under a lock per id, so no handle's sweep or put can touch
another's chain; an entry key is written once (a new run draws a new R), so a remove only ever
removes what its caller read: exactly one take's remove of an entry succeeds. A put writes the
entry, then the record.

A reader finds an id's chains through the slots (the namespace's producers, read at most every
DISCOVERY_S) and takes the oldest chunk it awaits: chains of several producers under one id are
several entries, taken in the order their chunks were published (read in place from their
prefixes, `peek`, where more than one chain holds some).

Expiry needs no publisher: a take removes the entries of an expired chain rather than return
them, and each handle's keeper thread removes what it published once expired, records too.
Clocks of the machines are assumed synchronised well within the time to live. The handle counts
the bytes of its unconsumed entries against the channel's capacity. Size the holder's segment
above the capacity of the channels using it: the master evicts old keys silently at 90% of its
segments.

A producer's keeper rewrites its slot (its lease) every LEASE_REFRESH_S, and so does a put that
finds it due; `expect(id)` stores `NAMESPACE/.expect/HMAC(id)/T`, removed by its final put. A
waiter judges a producer dead when its lease has not changed, or has been gone, for LEASE_S of
the waiter's own clock. A clean close removes the handle's expectations first, so a producer
that closed is never judged dead for them, then frees its slot and records where it left no
entry, else marks its slot closed: its chains stay readable. Any handle reclaims a slot that
stayed unchanged for LEASE_S plus the time to live (a producer that closed or died), removing
every key of that producer (the store's remove by pattern): by then its entries expired. A
producer starved of its lease that long is taken for dead.

Mooncake has no authentication of its own: it belongs on a private network. The master,
metadata server and holder bind where their flags say; the transfer engine inside every client
(this one included) listens on all interfaces, which Mooncake 0.3.13 cannot be told otherwise.
A client advertises `$MC_TCP_BIND_ADDRESS`, else the local address that routes to the master.

Mooncake's client logs about 17 INFO lines as it connects; its log level is `$MC_LOG_LEVEL`,
which this channel sets to WARNING where it is unset (set `MC_LOG_LEVEL=INFO` to see them).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import re
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, urlencode

import numpy as np
import torch

from prefix_cache.channel.base import (DEFAULT_FULL_WAIT_S, DEFAULT_TTL_S, LIVENESS_CHECK_S,
                                       Awaited, StageChannel, spec_number)
from prefix_cache.channel.codec import PREFIX_BYTES, ChunkTag, EncodedEntry, join, peek
from prefix_cache.channel.errors import OmniPrefixCacheChannelError

logger = logging.getLogger(__name__)

# Mooncake ErrorCodes that mean "no entry to take yet": none stored, or one still being stored.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
_ABSENT = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
#: A put session refused: the key exists or is being stored.
OBJECT_ALREADY_EXISTS = -705
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]+")
_TOKEN_RE = re.compile(r"[0-9a-f]{16}")
# magic, run, first index maybe unconsumed, next index, newest entry's deadline (time())
_CHAIN = struct.Struct("<8s16sQQd")
_CHAIN_MAGIC = b"OPCCHN03"
_RECORD = struct.Struct("<16sQQ32s")  # a producer's token, pid, lease counter, host
#: The lease counter of a producer that closed: its chains stay readable, it is never dead.
CLOSED = (1 << 64) - 1
#: Bytes each small value (a chain's record, a producer's) may hold.
SMALL_BYTES = 64
#: Producer slots of a namespace; a reader reads them all in one call.
MAX_PRODUCERS = 64
#: Tries of a buffer's registration (the metadata server's update times out now and then).
REGISTER_ATTEMPTS = 4
REGISTER_PAUSE_S = 0.05
#: How often a producer rewrites its lease.
LEASE_REFRESH_S = 1.0
#: Reads of a producer's chain record before one that cannot be read fails the get.
RECORD_READS = 3
RECORD_REREAD_S = 0.005
#: How long a lease may stay unchanged (or gone), by a waiter's clock, before its producer is dead.
LEASE_S = 4.0
#: How old a reader's view of the namespace's producers (where it finds an id's chains) may be:
#: a waiting reader's longest pause, so a new producer's first chunk is seen as soon as any.
DISCOVERY_S = 0.02
#: How many keys of each chain a reader peeks at to order chains by their chunks' age.
PEEK_KEYS = 8
#: Bytes of unconsumed entries a namespace's publisher keeps in the store unless told otherwise.
DEFAULT_CAPACITY = 1 << 30
#: How long connecting waits for the master's port to accept before saying it is not there.
MASTER_PROBE_S = 2.0
#: Client set-up attempts, each on a fresh random port, unless the environment says otherwise.
SETUP_ATTEMPTS = 5
_INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU machines; -cuda13 or -npu "
                 "elsewhere), and libibverbs1")


#: Mooncake's log level unless the environment names one: its INFO lines are start-up chatter.
LOG_LEVEL = "WARNING"


#: Buffers whose unregistration failed (the metadata server's update timed out): still
#: registered with their client, so their memory is never handed out again.
_STILL_REGISTERED: list[torch.Tensor] = []


def _register(store: Any, ptr: int, nbytes: int) -> int:
    """Registers `nbytes` at `ptr` with the store's transfer engine, which updates the metadata
    server: a call that times out under load now and then, so one that fails is tried again
    (REGISTER_ATTEMPTS in all, REGISTER_PAUSE_S apart). Mooncake's return code of the last."""
    for attempt in range(REGISTER_ATTEMPTS):
        if attempt:
            time.sleep(REGISTER_PAUSE_S * attempt)
        rc = store.register_buffer(ptr, nbytes)
        if rc == 0:
            return 0
    return rc


def _store_class() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", LOG_LEVEL)  # read when the client starts logging
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise OmniPrefixCacheChannelError(
            f"mooncake channel: Mooncake Store's client does not import ({e}); {_INSTALL_HINT}"
        ) from e
    return MooncakeDistributedStore


def _local_address(master_host: str, master_port: int) -> str:
    """The address this client advertises to the store's other clients."""
    configured = os.environ.get("MC_TCP_BIND_ADDRESS")
    if configured:
        return configured
    try:
        if ipaddress.ip_address(master_host).is_loopback:
            return master_host
    except ValueError:
        pass  # a host name: ask the routing table
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, master_port))  # UDP: no packet is sent
        return probe.getsockname()[0]


def producer_keys(namespace: str, token: str) -> str:
    """The pattern (for the store's remove by pattern) of every key of the producer `token`:
    its records, entries and expectations."""
    return f"^{re.escape(namespace)}/(\\.expect/)?[0-9a-f]{{64}}/{token}(\\.|$)"


@dataclass
class _Held:
    """What this handle holds as a producer, given back when it closes: its slot (and the slot's
    record saying it closed), the expectations it has not fulfilled (removed first: then no
    waiter mistakes the close for a death), and whether it left no entry (then its slot and
    every key of its own go; else the slot says it closed, and its chains stay readable)."""

    token: str
    slot: str | None = None
    closed_record: bytes = b""
    expected: set[str] = field(default_factory=set)
    drained: bool = False


def _release(store: Any, values: SmallValues, leases: _Leases, held: _Held, namespace: str,
             owner: bool, owner_pid: int, stop: threading.Event) -> None:
    stop.set()  # the keeper ends before its next store call
    if os.getpid() == owner_pid:
        if held.expected:
            store.batch_remove(sorted(held.expected), force=True)
        if owner:
            store.remove_by_regex(f"^{re.escape(namespace)}/", force=True)
        elif held.slot is not None and held.drained:
            store.remove_by_regex(producer_keys(namespace, held.token), force=True)
            store.remove(held.slot, force=True)
        elif held.slot is not None:
            values.upsert(held.slot, held.closed_record)
    leases.close()
    values.close()
    store.close()


@dataclass(frozen=True)
class _Chain:
    """A producer's chain of one id's entries as its record holds it: its run (the keys of a new
    run are new), the lowest index that may be unconsumed, the next index, and when its newest
    entry expires (the publisher's `time.time()`)."""

    run: str
    first: int
    next: int
    deadline: float

    def key(self, head: str, token: str, index: int) -> str:
        return f"{head}/{token}.{self.run}.{index}"

    def keys(self, head: str, token: str) -> list[str]:
        """The keys of indices `first` to `next` (exclusive)."""
        return [self.key(head, token, i) for i in range(self.first, self.next)]

    def expired(self) -> bool:
        return self.deadline <= time.time()

    def pack(self) -> bytes:
        return _CHAIN.pack(_CHAIN_MAGIC, self.run.encode(), self.first, self.next,
                           self.deadline)

    @staticmethod
    def unpack(raw: bytes) -> _Chain:
        """The chain in a record; a ValueError if it is not one this channel wrote."""
        if len(raw) != _CHAIN.size:
            raise ValueError(f"is not one this channel wrote ({len(raw)} bytes)")
        magic, run, first, nxt, deadline = _CHAIN.unpack(raw)
        if magic != _CHAIN_MAGIC or first > nxt or not _TOKEN_RE.fullmatch(run.decode("latin-1")):
            raise ValueError("is not one this channel wrote")
        return _Chain(run.decode(), first, nxt, deadline)


@dataclass(frozen=True)
class _Producer:
    """A producing handle as its slot and its expectations name it."""

    token: str
    pid: int
    host: str

    def record(self, counter: int) -> bytes:
        return _RECORD.pack(self.token.encode(), self.pid, counter, self.host.encode()[:32])

    @staticmethod
    def from_record(raw: bytes) -> tuple[_Producer, int]:
        """The producer a record names, and its lease counter."""
        token, pid, counter, host = _RECORD.unpack(raw)
        return _Producer(token.decode("latin-1"), pid,
                         host.rstrip(b"\0").decode(errors="replace")), counter

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}"


class SmallValues:
    """Values of at most SMALL_BYTES each (chains' records, producers' records, entries'
    prefixes), up to MAX_PRODUCERS in one call, moved through buffers registered with the store
    once each (a registration costs about a millisecond on loopback, several gets' worth, and
    every poll of a get reads records). Threads take buffers of their own: none waits for
    another's store call.

    Invariant: a buffer serves one store call at a time; each stays registered until `close`.
    """

    _BUFFER_BYTES = MAX_PRODUCERS * SMALL_BYTES

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()  # guards the lists, never held across a store call
        self._all: list[torch.Tensor] = []
        self._free = [self._register()]  # a store that refuses registrations fails at open

    def _register(self) -> torch.Tensor:
        buffer = torch.zeros(self._BUFFER_BYTES, dtype=torch.uint8)
        rc = _register(self._store, buffer.data_ptr(), self._BUFFER_BYTES)
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: registering a {self._BUFFER_BYTES}-byte buffer failed with "
                f"Mooncake code {rc}")
        with self._lock:
            self._all.append(buffer)
        return buffer

    @contextmanager
    def _buffer(self, value: bytes = b"") -> Iterator[torch.Tensor]:
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None:
            buffer = self._register()
        buffer.numpy()[:len(value)] = np.frombuffer(value, dtype=np.uint8)
        try:
            yield buffer
        finally:
            with self._lock:
                self._free.append(buffer)

    def get(self, key: str) -> bytes | None:
        """The value of `key`, None if there is none; a ValueError if it cannot be read."""
        return self.get_all([key])[0]

    def get_all(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each of `keys` (at most MAX_PRODUCERS), None where there is none, in one
        call; a ValueError if one cannot be read."""
        if not keys:
            return []
        with self._buffer() as buffer:
            ptr = buffer.data_ptr()
            reads = self._store.batch_get_into(
                list(keys), [ptr + k * SMALL_BYTES for k in range(len(keys))],
                [SMALL_BYTES] * len(keys))
            raw = buffer.numpy()[:len(keys) * SMALL_BYTES].tobytes()
        for key, read in zip(keys, reads, strict=True):
            if read < 0 and read not in _ABSENT:
                raise ValueError(f"{key} could not be read (Mooncake code {read})")
        return [None if read < 0 else raw[k * SMALL_BYTES:k * SMALL_BYTES + read]
                for k, read in enumerate(reads)]

    def prefixes(self, keys: Sequence[str]) -> list[bytes | None]:
        """The first PREFIX_BYTES of each of `keys` (at most MAX_PRODUCERS), read in place in one
        call; None where the key is gone or cannot be read."""
        if not keys:
            return []
        with self._buffer() as buffer:
            ptr, n = buffer.data_ptr(), len(keys)
            reads = self._store.get_into_ranges(
                [ptr], [list(keys)], [[[k * PREFIX_BYTES] for k in range(n)]],
                [[[0]] * n], [[[PREFIX_BYTES]] * n])[0]
            raw = buffer.numpy()[:n * PREFIX_BYTES].tobytes()
        return [raw[k * PREFIX_BYTES:(k + 1) * PREFIX_BYTES] if read == [PREFIX_BYTES] else None
                for k, read in enumerate(reads)]

    def upsert(self, key: str, value: bytes) -> int:
        """Stores `value` under `key`, replacing any; Mooncake's return code."""
        with self._buffer(value) as buffer:
            return self._store.upsert_from(key, buffer.data_ptr(), len(value))

    def create(self, key: str, value: bytes) -> bool:
        """Stores `value` under `key` unless the key exists or is being stored: whether it did.
        A ValueError if the store refuses otherwise."""
        started = self._store.batch_put_session_start([key], [len(value)])[0]
        if started == OBJECT_ALREADY_EXISTS:
            return False
        if started != 0:
            raise ValueError(f"could not be created (Mooncake code {started})")
        with self._buffer(value) as buffer:
            written = self._store.batch_put_from_multi_buffer_ranges(
                [key], [[buffer.data_ptr()]], [[len(value)]], [[0]])[0]
        ended = self._store.batch_put_session_end([key])[0] if written == len(value) else -1
        if ended != 0:
            self._store.batch_put_session_revoke([key])
            raise ValueError(f"could not be created (wrote {written}, ended {ended})")
        return True

    def close(self) -> None:
        with self._lock:
            buffers, self._all, self._free = self._all, [], []
        for buffer in buffers:
            self._store.unregister_buffer(buffer.data_ptr())


class _Leases:
    """The producers' slots of a namespace as one handle watches them: a producer is dead once
    its lease's value has stayed the same, or been gone, for LEASE_S of this handle's monotonic
    clock (no clock is compared across machines); one whose slot says CLOSED closed. A slot that
    stayed unchanged for `reclaim_after_s` more (a producer that died or closed) is reclaimed:
    every key of its producer, then the slot, removed. A slot being rewritten reads as not ready
    (on loopback, two reads in three while a lease is rewritten back to back): it holds what
    the last scan found in it, so a live producer is never missed.

    Invariant: `_changed[token]` is when the store answered the scan that last saw that
    producer's lease change (first hearing of a producer counts as a change), and `_scanned`
    when the last completed scan asked. A scan's values held at some moment between its
    question and its answer, so a lease stayed the same at least from the one to the other,
    however long this process was stopped before or after either read.
    """

    def __init__(self, store: Any, namespace: str, reclaim_after_s: float) -> None:
        self._store = store
        self._namespace = namespace
        self.slots = [f"{namespace}/.producer/{k}" for k in range(MAX_PRODUCERS)]
        self._reclaim_after_s = reclaim_after_s
        self._buffer = torch.zeros(MAX_PRODUCERS * _RECORD.size, dtype=torch.uint8)
        self._registered = False
        self._lock = threading.Lock()  # one scan at a time; others use its result
        self._values: dict[str, bytes] = {}
        self._changed: dict[str, float] = {}
        self._in_slots: dict[str, tuple[str, _Producer, bool]] = {}  # slot, producer, closed
        self._scanned = -math.inf

    def scan(self, max_age_s: float, *, wait: bool = False) -> None:
        """Reads every slot in one call unless the last scan is younger than `max_age_s`; a scan
        in progress on another thread serves instead (`wait`: this one waits for it, then scans
        if it is still too old). Reclaims the slots of producers long gone."""
        if time.monotonic() - self._scanned < max_age_s:
            return
        if not self._lock.acquire(blocking=wait):
            return
        if time.monotonic() - self._scanned < max_age_s:  # another thread's scan served
            self._lock.release()
            return
        try:
            asked = time.monotonic()  # what a scan reads is as old as its question
            self._read_slots()
            self._reclaim(asked)
            self._scanned = asked
        finally:
            self._lock.release()

    def _read_slots(self) -> None:
        ptr, size = self._buffer.data_ptr(), _RECORD.size
        if not self._registered:
            if _register(self._store, ptr, self._buffer.numel()) != 0:
                raise OmniPrefixCacheChannelError(
                    f"mooncake channel: registering a {self._buffer.numel()}-byte buffer failed")
            self._registered = True
        reads = self._store.batch_get_into(self.slots, [ptr + k * size for k in range(
            MAX_PRODUCERS)], [size] * MAX_PRODUCERS)
        answered = time.monotonic()
        raw = self._buffer.numpy().tobytes()
        seen = {found[0]: (token, found) for token, found in self._in_slots.items()}
        in_slots = {}
        for k, (slot, read) in enumerate(zip(self.slots, reads, strict=True)):
            if read == REPLICA_IS_NOT_READY and slot in seen:
                token, found = seen[slot]  # its producer rewriting its lease: as last seen
                in_slots[token] = found
                continue
            if read != size:
                continue
            value = raw[k * size:(k + 1) * size]
            producer, counter = _Producer.from_record(value)
            if not _TOKEN_RE.fullmatch(producer.token):
                continue  # not a record this channel wrote
            in_slots[producer.token] = (slot, producer, counter == CLOSED)
            if self._values.get(producer.token) != value:
                self._values[producer.token], self._changed[producer.token] = value, answered
        self._in_slots = in_slots

    def _reclaim(self, asked: float) -> None:
        """Removes every key of the producers whose slot stayed unchanged for LEASE_S more
        than `reclaim_after_s` up to the scan asked at `asked`, then their slots, and forgets
        producers gone from the slots as long."""
        for token, changed in list(self._changed.items()):
            if asked - changed < LEASE_S + self._reclaim_after_s:
                continue
            if token in self._in_slots:
                self._store.remove_by_regex(producer_keys(self._namespace, token), force=True)
                self._store.remove(self._in_slots.pop(token)[0], force=True)
            else:
                del self._changed[token]
                self._values.pop(token, None)

    def producers(self) -> list[_Producer]:
        """The producers in the slots at the last scan: live, dead or closed."""
        return [producer for _, producer, _ in self._in_slots.values()]

    def find(self, token: str) -> tuple[_Producer, bool] | None:
        """The producer whose token is `token` and whether it closed, if the last scan saw it."""
        found = self._in_slots.get(token)
        return (found[1], found[2]) if found is not None else None

    def dead(self, producer: _Producer) -> bool:
        """Whether `producer` died: its lease unchanged for LEASE_S from the answer that showed
        it changed to the question of the last scan that completed (a closed one never). Not
        up to now, nor up to that scan's answer: a handle whose process was stopped, before or
        after the store answered, or whose scan another thread still runs, has not looked
        meanwhile."""
        found = self._in_slots.get(producer.token)
        if found is not None and found[2]:
            return False
        changed = self._changed.setdefault(producer.token, time.monotonic())
        return self._scanned - changed >= LEASE_S

    def all_dead(self) -> list[_Producer]:
        """The producers in the slots that have not closed, if there are some and all are dead;
        else none."""
        producers = [p for _, p, closed in self._in_slots.values() if not closed]
        return producers if all(map(self.dead, producers)) else []

    def close(self) -> None:
        if self._registered:
            self._store.unregister_buffer(self._buffer.data_ptr())


class _IdLocks:
    """A lock per id (head key), kept while some thread holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, list[int]]] = {}  # lock, [users]

    @contextmanager
    def hold(self, head: str, *, wait: bool = True) -> Iterator[bool]:
        """Holds `head`'s lock for the block; yields False, holding nothing, if `wait` is off
        and another thread holds it."""
        with self._guard:
            lock, users = self._locks.setdefault(head, (threading.Lock(), [0]))
            users[0] += 1
        held = lock.acquire(blocking=wait)
        try:
            yield held
        finally:
            if held:
                lock.release()
            with self._guard:
                users[0] -= 1
                if users[0] == 0:
                    del self._locks[head]


@dataclass
class _Live:
    """An entry this handle published and has not seen consumed: its size and deadline."""

    nbytes: int
    deadline: float


class MooncakeChannel(StageChannel):
    """Entries of a namespace are the store's objects under `NAMESPACE/`; any handle removes
    expired entries it finds, each removes what it published once expired, and the owner's
    close removes them all.

    Invariant: `_used` is the sum of `_live` sizes plus reservations not yet published; the
    store holds this handle's record of an id as `_chains` has it once a put of the id
    returned (no other handle writes it).
    """

    def __init__(self, master: str, metadata: str, namespace: str, *, ttl_s: float,
                 owner: bool, protocol: str = "tcp", device: str = "",
                 capacity_bytes: int = DEFAULT_CAPACITY,
                 full_wait_s: float = DEFAULT_FULL_WAIT_S) -> None:
        super().__init__(ttl_s=ttl_s, capacity_bytes=capacity_bytes, full_wait_s=full_wait_s,
                         owns_namespace=owner)
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"mooncake channel namespace {namespace!r} is not [A-Za-z0-9_-]+")
        self.master, self.metadata, self.namespace = master, metadata, namespace
        self._protocol, self._device = protocol, device
        self._store = self._connect()
        try:
            self._values = SmallValues(self._store)
        except BaseException:
            self._store.close()  # nothing else holds the connection to close it
            raise
        self._leases = _Leases(self._store, namespace, reclaim_after_s=ttl_s)
        self._producer = _Producer(secrets.token_hex(8), os.getpid(), socket.gethostname())
        self._held = _Held(self._producer.token)
        self._lease_counter = 0
        self._lease_due = 0.0  # when this producer's lease is to be rewritten (monotonic)
        self._lock = threading.Lock()  # bookkeeping only: never held across a store call
        self._id_locks = _IdLocks()
        self._register_lock = threading.Lock()
        self._live: OrderedDict[str, _Live] = OrderedDict()  # in put order: expiry order
        self._chains: dict[str, _Chain] = {}  # this handle's, by head
        self._used = 0
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(
            self, _release, self._store, self._values, self._leases, self._held, namespace,
            owner, os.getpid(), self._stop)

    @classmethod
    def from_spec(cls, netloc: str, query: str) -> MooncakeChannel:
        """`mooncake://HOST:PORT?metadata=URL[&namespace=NS&ttl=S&wait=S&capacity=BYTES
        &protocol=P&device=D]`."""
        options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        known = {"metadata", "namespace", "ttl", "wait", "capacity", "protocol", "device"}
        unknown = options.keys() - known
        if unknown:
            raise ValueError(f"mooncake channel spec: unknown option(s) {sorted(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        host, colon, port = netloc.rpartition(":")
        if not colon or not host or "metadata" not in options:
            raise ValueError(f"mooncake channel spec needs the master's HOST:PORT and "
                             f"?metadata=URL (the metadata server), got {netloc!r} and {query!r}")
        if not port.isdigit():
            raise ValueError(f"mooncake channel spec: the master's port {port!r} in {netloc!r} "
                             f"is not a port number")
        namespace = options.get("namespace") or secrets.token_hex(16)
        return cls(netloc, options["metadata"], namespace,
                   ttl_s=spec_number("mooncake", options, "ttl", float, DEFAULT_TTL_S),
                   owner="namespace" not in options,
                   protocol=options.get("protocol", "tcp"), device=options.get("device", ""),
                   capacity_bytes=spec_number("mooncake", options, "capacity", int,
                                              DEFAULT_CAPACITY),
                   full_wait_s=spec_number("mooncake", options, "wait", float,
                                           DEFAULT_FULL_WAIT_S))

    @property
    def spec(self) -> str:
        options = {"metadata": self.metadata, "namespace": self.namespace,
                   "ttl": f"{self.ttl_s:g}", "wait": f"{self.full_wait_s:g}",
                   "capacity": str(self.capacity_bytes), "protocol": self._protocol}
        if self._device:
            options["device"] = self._device
        return f"mooncake://{self.master}?{urlencode(options, safe=':/')}"

    def entry_key(self, request_id: str) -> str:
        """The store key under which `request_id`'s chains are, one a producer."""
        digest = hmac.new(self.namespace.encode(), request_id.encode(), hashlib.sha256)
        return f"{self.namespace}/{digest.hexdigest()}"

    def entry_keys(self, request_id: str) -> list[str]:
        """The store keys of `request_id`'s unconsumed entries, each producer's oldest first."""
        with self._operation(request_id):
            head = self.entry_key(request_id)
            self._leases.scan(0.0)
            tokens = [p.token for p in self._leases.producers()]
            keys = [key for _, keys in self._candidates(head, self._chains_of(
                head, tokens, request_id)) for key in keys]
            exists = self._store.batch_is_exist(keys) if keys else []
            return [key for key, e in zip(keys, exists, strict=True) if e == 1]

    def used_bytes(self) -> int:
        """Bytes of this handle's entries not yet seen consumed, and its puts in flight."""
        return self._used

    def _connect(self) -> Any:
        store = _store_class()()
        host, _, port = self.master.rpartition(":")
        host = host.strip("[]")
        try:  # Mooncake's own setup waits about 4.5 s per attempt for an absent master
            socket.create_connection((host, int(port)), timeout=MASTER_PROBE_S).close()
        except OSError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: cannot reach the Mooncake master at {self.master} ({e}); "
                f"is mooncake_master running there?") from e
        os.environ["MC_TCP_BIND_ADDRESS"] = _local_address(host, int(port))
        # Each attempt takes a fresh random port: a killed client's port stays registered
        # with the metadata server, and a client that draws it is refused.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(SETUP_ATTEMPTS))
        rc = store.setup(os.environ["MC_TCP_BIND_ADDRESS"], self.metadata, 0, 0,
                         self._protocol, self._device, self.master)
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: the Mooncake master at {self.master} answers, but setting "
                f"up a client with metadata server {self.metadata} failed (setup returned "
                f"{rc}, Mooncake's log above says why); is the metadata server running, and "
                f"are the client ports (MC_STORE_CLIENT_MIN_PORT..MC_STORE_CLIENT_MAX_PORT) "
                f"free?")
        return store

    @contextmanager
    def _registered(self, buffer: torch.Tensor) -> Iterator[int]:
        """`buffer` registered with the store while the block runs. One whose unregistration
        fails stays registered with the client, which refuses any registration overlapping
        it: its memory is kept for the life of the process (`_STILL_REGISTERED`), so no later
        buffer is allocated there."""
        ptr = buffer.data_ptr()
        rc = _register(self._store, ptr, buffer.numel())
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: registering a {buffer.numel()}-byte buffer "
                f"failed with Mooncake code {rc}")
        try:
            yield ptr
        finally:
            if self._store.unregister_buffer(ptr) != 0:
                logger.warning("mooncake channel %s: unregistering a %d-byte buffer failed; "
                               "its memory is kept", self.spec, buffer.numel())
                _STILL_REGISTERED.append(buffer)

    def _put_bytes(self, key: str, data: torch.Tensor, what: str) -> None:
        with self._registered(data) as ptr:
            self._check_stored(self._store.upsert_from(key, ptr, data.numel()), what,
                               data.numel())

    def _check_stored(self, rc: int, what: str, nbytes: int) -> None:
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: storing {what} ({nbytes} bytes) failed "
                f"with Mooncake code {rc}; is a segment holder (mooncake_client "
                f"--global_segment_size=...) running with room for it?")

    def _record_key(self, head: str, token: str) -> str:
        """The key of the producer `token`'s record of its chain under `head`."""
        return f"{head}/{token}"

    def _reserve(self, nbytes: int, *, force: bool) -> int | None:
        if not self._count_if_room(nbytes, force):
            self._forget_consumed()
            if not self._count_if_room(nbytes, False):
                return None
        return nbytes

    def _count_if_room(self, nbytes: int, force: bool) -> bool:
        with self._lock:
            if force or self._used + nbytes <= self.capacity_bytes:
                self._used += nbytes
                return True
        return False

    def _unreserve(self, reservation: int) -> None:
        with self._lock:
            self._used -= reservation

    def _forget_consumed(self) -> None:
        """Stops counting the entries of this handle that readers consumed."""
        with self._lock:
            keys = list(self._live)
        if not keys:
            return
        exists = self._store.batch_is_exist(keys)
        with self._lock:
            for key, e in zip(keys, exists, strict=True):
                if e == 0 and key in self._live:
                    self._used -= self._live.pop(key).nbytes

    def _publish(self, request_id: str, encoded: EncodedEntry, reservation: int, *,
                 final: bool) -> None:
        self._register_producer()  # readers find this handle's chains through its slot
        self._refresh_lease_if_due()
        head = self.entry_key(request_id)
        data = join(encoded)  # a pool's rows read (and let go) before any store call
        with self._id_locks.hold(head):  # one put of an id at a time writes its record
            self._append(head, request_id, data, reservation)
        if final:
            self._fulfil(head)

    def _append(self, head: str, request_id: str, data: torch.Tensor,
                reservation: int) -> None:
        token = self._producer.token
        chain = self._chain_for(head)
        key = chain.key(head, token, chain.next)
        self._put_bytes(key, data, f"the entry for request {request_id}")
        grown = replace(chain, next=chain.next + 1, deadline=time.time() + self.ttl_s)
        try:
            self._check_stored(self._values.upsert(self._record_key(head, token), grown.pack()),
                               f"the record of request {request_id}", _CHAIN.size)
        except BaseException:
            self._store.remove(key, force=True)
            raise
        with self._lock:
            self._chains[head] = grown
            self._live[key] = _Live(reservation, grown.deadline)
        self._start_keeper()

    def _chain_for(self, head: str) -> _Chain:
        """The chain of this handle a new entry under `head` joins: its own, `first` moved past
        consumed entries, or, where it has none or it expired, a new run (whose keys are new)."""
        with self._lock:
            chain = self._chains.get(head)
        if chain is None or chain.expired():
            return _Chain(secrets.token_hex(8), 0, 0, 0.0)
        if chain.next == chain.first:
            return chain
        exists = self._store.batch_is_exist(chain.keys(head, self._producer.token))
        return replace(chain, first=chain.first + next(
            (i for i, e in enumerate(exists) if e == 1), len(exists)))

    def _take(self, request_id: str, awaited: Awaited) -> torch.Tensor | None:
        head = self.entry_key(request_id)
        if awaited.producer:  # the rest of an entry: its producer's chain holds it
            tokens = [awaited.producer]
        else:
            self._leases.scan(DISCOVERY_S)
            tokens = [p.token for p in self._leases.producers()]
        queue = self._candidates(head, self._chains_of(head, tokens, request_id))
        if len(queue) > 1:
            queue = self._by_age(queue, awaited)
        for _, keys in queue:
            for key in keys:
                data = self._take_key(key, request_id, awaited.accepts)
                if data is not None:
                    return data
        return None

    def _chains_of(self, head: str, tokens: Sequence[str], request_id: str
                   ) -> list[tuple[str, _Chain]]:
        """The chains the producers `tokens` hold under `head`, as their records say now."""
        records = self._read_records(head, tokens, request_id)
        return [(token, chain) for token, chain in zip(tokens, records) if chain is not None]

    def _read_records(self, head: str, tokens: Sequence[str], request_id: str
                      ) -> list[_Chain | None]:
        """The chain records of `tokens` under `head`, read again (RECORD_READS in all) while
        one reads as bytes this channel never wrote (once in a 30-minute soak; reads racing
        rewrites on loopback never tore, the cause is not known); a channel error naming the
        last failure."""
        keys = [self._record_key(head, t) for t in tokens]
        for attempt in range(1, RECORD_READS + 1):
            try:
                return [None if raw is None else _Chain.unpack(raw)
                        for raw in self._values.get_all(keys)]
            except ValueError as e:
                failure = e
            if attempt < RECORD_READS:
                time.sleep(RECORD_REREAD_S * attempt)
        raise OmniPrefixCacheChannelError(
            f"mooncake channel {self.spec}: a record of request {request_id} {failure} "
            f"({RECORD_READS} reads)") from failure

    def _candidates(self, head: str, chains: Sequence[tuple[str, _Chain]]
                    ) -> list[tuple[str, list[str]]]:
        """Per chain with unexpired entries, its token and their keys, oldest first (one call
        asks which exist, unless the chains name one key alone: its take finds out); the
        entries of expired chains are removed, never returned."""
        named = [(token, chain, chain.keys(head, token)) for token, chain in chains]
        keys = [key for _, _, chain_keys in named for key in chain_keys]
        if len(keys) > 1:
            exists = iter(self._store.batch_is_exist(keys))
            named = [(token, chain, [key for key in chain_keys if next(exists) == 1])
                     for token, chain, chain_keys in named]
        queue, expired = [], []
        for token, chain, chain_keys in named:
            if chain.expired():  # whoever published them: never returned, removed
                expired += chain_keys
            elif chain_keys:
                queue.append((token, chain_keys))
        if expired:
            self._store.batch_remove(expired, force=True)
        return queue

    def _by_age(self, queue: list[tuple[str, list[str]]], awaited: Awaited
                ) -> list[tuple[str, list[str]]]:
        """The chains' keys, each chain's from the first whose chunk `awaited` accepts (among its
        first few, up to PEEK_KEYS, read in place in one call), the chain whose such chunk was
        published first first; chains with none there last, as they were."""
        few = max(1, min(PEEK_KEYS, MAX_PRODUCERS // len(queue)))
        peeked = [(token, keys[:few]) for token, keys in queue]
        prefixes = iter(self._values.prefixes([key for _, keys in peeked for key in keys]))
        ordered, rest = [], []
        for (token, keys), (_, heads) in zip(queue, peeked):
            tags = [peek(raw) if raw is not None else None for raw in
                    (next(prefixes) for _ in heads)]
            first = next((i for i, tag in enumerate(tags) if tag is not None
                          and awaited.accepts(tag)), None)
            if first is None:
                rest.append((token, keys))
            else:
                ordered.append((tags[first].published_at, token, keys[first:]))
        return [(token, keys) for _, token, keys in sorted(ordered)] + rest

    def _take_key(self, key: str, request_id: str, accepts: Callable[[ChunkTag | None], bool]
                  ) -> torch.Tensor | None:
        """The bytes of `key` if this take removed it; None if it is gone, another took it, or
        `accepts` refuses its tag (then it stays)."""
        size = self._store.get_size(key)
        if size in _ABSENT:
            return None
        if size < 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: looking up the entry for request {request_id} "
                f"failed with Mooncake code {size}")
        data = torch.empty(size, dtype=torch.uint8)
        with self._registered(data) as ptr:
            read = self._store.get_into(key, ptr, size)
        if read in _ABSENT:
            return None  # taken by another reader since the lookup
        if read != size:  # left in place: a later get may still read it
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: reading the entry for request {request_id} "
                f"failed (read returned {read} for {size} bytes); the entry is kept")
        if not accepts(peek(data[:PREFIX_BYTES].numpy().tobytes())):
            return None
        removed = self._store.remove(key, force=True)
        if removed == OBJECT_NOT_FOUND:
            return None  # another reader claimed it first
        if removed != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: taking the entry for request {request_id} "
                f"failed (remove returned {removed})")
        with self._lock:
            live = self._live.pop(key, None)
            if live is not None:
                self._used -= live.nbytes
        return data

    def _sweep(self) -> None:
        now, due = time.time(), []
        with self._lock:
            while self._live and next(iter(self._live.values())).deadline <= now:
                key, live = self._live.popitem(last=False)
                self._used -= live.nbytes
                due.append(key)
            ended = [head for head, chain in self._chains.items() if chain.deadline <= now]
        if due:
            self._store.batch_remove(due, force=True)  # those consumed meanwhile: not found
        for head in ended:
            self._end_chain(head, now)
            self._refresh_lease_if_due()  # a long sweep does not starve the lease

    def _end_chain(self, head: str, now: float) -> None:
        """Removes this handle's record under `head` if its chain expired by `now`. Under the
        id's lock, so no put of this handle writes it meanwhile (an id whose put is in flight
        is left for the next sweep: that put renews the chain); no other handle writes it."""
        with self._id_locks.hold(head, wait=False) as held:
            if not held:
                return
            with self._lock:
                chain = self._chains.get(head)
                if chain is None or chain.deadline > now:
                    return
                del self._chains[head]
            self._store.remove(self._record_key(head, self._producer.token), force=True)

    def _next_deadline(self) -> float | None:
        """When the next of this handle's entries or chains expires (`time.time()`), if any."""
        with self._lock:
            times = [c.deadline for c in self._chains.values()]
            if self._live:
                times.append(next(iter(self._live.values())).deadline)
        return min(times, default=None)

    def _register_producer(self) -> None:
        with self._register_lock:
            if self._held.slot is not None:
                return
            exists = self._store.batch_is_exist(self._leases.slots)
            for slot, e in zip(self._leases.slots, exists, strict=True):
                if e == 0 and self._create(slot, self._producer.record(0)):
                    self._held.closed_record = self._producer.record(CLOSED)
                    self._held.slot = slot
                    self._lease_due = time.monotonic() + LEASE_REFRESH_S
                    self._start_keeper()
                    return
        raise OmniPrefixCacheChannelError(
            f"mooncake channel {self.spec}: all {MAX_PRODUCERS} producer slots are taken; "
            f"producers that died or closed free theirs {self.ttl_s:g} s after")

    def _create(self, key: str, value: bytes) -> bool:
        try:
            return self._values.create(key, value)
        except ValueError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: the producer slot {key} {e}") from e

    def _expect_key(self, head: str, token: str) -> str:
        """The key of the producer `token`'s expectation of the id under `head`."""
        return f"{self.namespace}/.expect/{head.rpartition('/')[2]}/{token}"

    def _expect(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            key = self._expect_key(self.entry_key(request_id), self._producer.token)
            self._check_stored(self._values.upsert(key, self._producer.record(0)),
                               f"the expectation of request {request_id}", _RECORD.size)
            with self._lock:
                self._held.expected.add(key)

    def _fulfil(self, head: str) -> None:
        """Removes this handle's expectation of the id `head`, if any: its entry is out."""
        key = self._expect_key(head, self._producer.token)
        with self._lock:
            if key not in self._held.expected:
                return
            self._held.expected.discard(key)
        self._store.remove(key, force=True)

    def _producer_name(self) -> str:
        return self._producer.token if self._held.slot is not None else ""

    def _dead_producer(self, request_id: str, producer: str) -> str | None:
        self._leases.scan(LIVENESS_CHECK_S)
        if producer:
            found = self._leases.find(producer)
            if found is None:  # a producer that published this chunk: read its slot afresh
                self._leases.scan(0.0, wait=True)
                found = self._leases.find(producer)
            if found is not None and not found[1] and not self._leases.dead(found[0]):
                return None
            # its promise of the id is broken: reported here, once
            self._store.batch_remove([self._expect_key(self.entry_key(request_id), producer)],
                                     force=True)
            return f"with token {producer} (its slot was reclaimed)" if found is None \
                else f"{found[0]} (closed)" if found[1] else str(found[0])
        producers = self._leases.producers()
        keys = [self._expect_key(self.entry_key(request_id), p.token) for p in producers]
        try:
            expected = self._values.get_all(keys)
        except ValueError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: the expectation of request {request_id} "
                f"{e}") from e
        expecting = [(p, key) for p, key, raw in zip(producers, keys, expected) if raw]
        if expecting:
            if not all(self._leases.dead(p) for p, _ in expecting):
                return None
            # reported once: clients reuse ids, and a later request's wait is its own
            self._store.batch_remove([key for _, key in expecting], force=True)
            return ", ".join(str(p) for p, _ in expecting)
        dead = self._leases.all_dead()
        return ", ".join(map(str, dead)) if dead else None

    def _refresh_lease_if_due(self) -> None:
        """Rewrites this producer's lease if LEASE_REFRESH_S passed since it last was."""
        with self._lock:
            if self._held.slot is None or time.monotonic() < self._lease_due:
                return
            self._lease_due = time.monotonic() + LEASE_REFRESH_S
            self._lease_counter += 1
            record = self._producer.record(self._lease_counter)
        self._values.upsert(self._held.slot, record)

    def _start_keeper(self) -> None:
        with self._lock:
            if self._keeper is None:
                self._keeper = threading.Thread(
                    target=_keep_until_stopped, args=(weakref.ref(self), self._stop),
                    name="omni-prefix-cache-mooncake-keeper", daemon=True)
                self._keeper.start()

    def _keep(self) -> float:
        """One round of the keeper: the lease rewritten where due, expired entries swept.
        Seconds until the next round."""
        self._refresh_lease_if_due()
        due = self._next_deadline()
        if due is not None and due <= time.time():
            self._sweep()
            due = self._next_deadline()
        with self._lock:
            lease_in = self._lease_due - time.monotonic() if self._held.slot is not None \
                else LEASE_REFRESH_S
        return max(0.0, min(lease_in, LEASE_REFRESH_S if due is None else due - time.time()))

    def _close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()  # no store call may run past the store's close
        if self._held.slot is not None:
            self._forget_consumed()
            with self._lock:
                self._held.drained = not self._live
        self._finalizer()


def _keep_until_stopped(channel_ref: weakref.ref[MooncakeChannel], stop: threading.Event
                        ) -> None:
    """Keeps the channel's lease fresh and sweeps its entries as they expire, so none outlives
    its time to live while its publisher is idle; ends when the channel closes or is dropped."""
    while not stop.is_set():
        channel = channel_ref()
        if channel is None:
            return
        try:
            wait_s = channel._keep()
        except Exception:  # a store gone: the next put or get reports it
            logger.exception("mooncake channel %s: keeping the lease or sweeping failed",
                             channel.spec)
            wait_s = LEASE_REFRESH_S
        del channel  # no strong reference while waiting: the handle may be dropped
        stop.wait(wait_s)
