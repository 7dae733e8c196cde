"""The Mooncake Store channel: entries are objects in a Mooncake Store, for stages across machines.

Mooncake Store (the store vLLM and vllm-ascend deployments use for KV transfer) keeps values in
the memory segments of its clients. This channel's clients contribute none, so a holder
(`mooncake_client --global_segment_size=...`) must run for entries to outlive their publisher.
Entries move through buffers registered with the store, so their size is bounded by the
holder's segment, not by a client-side buffer.

The store has no compare-and-swap, so no entry key is ever written twice: the entries of one id
form a chain of keys `NAMESPACE/HMAC(id)/TOKEN.I`, I = 0, 1, 2..., and the key
`NAMESPACE/HMAC(id)` (the tail) holds TOKEN, the lowest index that may be unconsumed, the next
index and the deadline of the chain's newest entry (the publisher's wall clock plus its time to
live). A take reads the tail, then the chain's oldest existing key, then removes that key:
exactly one take's remove succeeds, and it removes exactly the bytes it read. A put writes the
entry at the next index, then the tail; a new chain's tail is written first, so every key a put
leaves, even one killed between its calls, is named by a tail (at most one index past `next`).

One handle publishes under an id at a time, and a handle's puts of one id run one at a time
(a lock per id; different ids never wait for each other). A handle that finds another's chain
under an id takes it over once it is drained or expired, removing what is left of it; while
it has unexpired unconsumed entries, the put is refused. Expiry needs no publisher: a take
removes the entries of an expired chain rather than return them, a put under the id clears
them, and each handle's keeper thread removes what it published once expired. Clocks of the
machines are assumed synchronised well within the time to live. The handle counts the bytes of
its unconsumed entries against the channel's capacity. Size the holder's segment above the
capacity of the channels using it: the master evicts old keys silently at 90% of its segments.

A producer (`register_producer`) holds a lease, slot `NAMESPACE/.producer/K`, that its keeper
rewrites every LEASE_REFRESH_S; `expect(id)` stores `NAMESPACE/.expect/HMAC(id)` naming it,
removed by its put. A waiter judges a producer dead when its lease has not changed, or has
been gone, for LEASE_S of the waiter's own clock; a clean close removes the expectations first,
so a producer that closed is never judged dead for them.

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
# magic, chain token, first index maybe unconsumed, next index, newest entry's deadline (time())
_TAIL = struct.Struct("<8s16sQQd")
_TAIL_MAGIC = b"OPCTAIL2"
_RECORD = struct.Struct("<16sQQ32s")  # a producer's token, pid, lease counter, host
#: Bytes of each buffer small values (tails, producer records) move through.
SMALL_BYTES = 64
#: Producer slots of a namespace; a waiter reads them all in one call.
MAX_PRODUCERS = 64
#: How often a producer's keeper rewrites its lease.
LEASE_REFRESH_S = 1.0
#: How long a lease may stay unchanged (or gone), by a waiter's clock, before its producer is dead.
LEASE_S = 4.0
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


@dataclass
class _Held:
    """The keys this handle holds as a producer, removed when it closes: its lease slot and
    the expectations it has not fulfilled (expectations first: then no waiter mistakes the
    close for a death)."""

    slot: str | None = None
    expected: set[str] = field(default_factory=set)


def _release(store: Any, tails: TailBuffer, leases: _Leases, held: _Held,
             namespace: str | None, owner_pid: int, stop: threading.Event) -> None:
    stop.set()  # the keeper ends before its next store call
    if os.getpid() == owner_pid:
        if held.expected:
            store.batch_remove(sorted(held.expected), force=True)
        if held.slot is not None:
            store.remove(held.slot, force=True)
        if namespace is not None:
            store.remove_by_regex(f"^{re.escape(namespace)}/", force=True)
    leases.close()
    tails.close()
    store.close()


@dataclass
class _Chain:
    """A chain of one id's entries as its tail holds it: its token, lowest maybe-unconsumed
    index, next index, and when its newest entry expires (the publisher's `time.time()`)."""

    token: bytes
    first: int
    next: int
    deadline: float

    def key(self, head: str, index: int) -> str:
        return f"{head}/{self.token.decode()}.{index}"

    def keys(self, head: str, *, past_next: bool = False) -> list[str]:
        """The keys of indices `first` to `next`, and `next` itself if `past_next` (where a put
        killed before writing the tail left its entry)."""
        return [self.key(head, i) for i in range(self.first, self.next + past_next)]

    def expired(self) -> bool:
        return self.deadline <= time.time()


@dataclass(frozen=True)
class _Producer:
    """A producing handle as its lease and its expectations name it."""

    token: bytes
    pid: int
    host: str

    def record(self, counter: int) -> bytes:
        return _RECORD.pack(self.token, self.pid, counter, self.host.encode()[:32])

    @staticmethod
    def from_record(raw: bytes) -> _Producer:
        token, pid, _, host = _RECORD.unpack(raw)
        return _Producer(token, pid, host.rstrip(b"\0").decode(errors="replace"))

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}"


class TailBuffer:
    """Tails and other values of at most SMALL_BYTES, moved through buffers registered with the
    store once each (a registration costs about a millisecond on loopback, several gets' worth,
    and every poll of a get reads a tail). Threads take buffers of their own: none waits for
    another's store call.

    Invariant: a buffer serves one store call at a time; each stays registered until `close`.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()  # guards the lists, never held across a store call
        self._all: list[torch.Tensor] = []
        self._free = [self._register()]  # a store that refuses registrations fails at open

    def _register(self) -> torch.Tensor:
        buffer = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
        rc = self._store.register_buffer(buffer.data_ptr(), SMALL_BYTES)
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: registering a {SMALL_BYTES}-byte buffer failed with Mooncake "
                f"code {rc}")
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
        with self._buffer() as buffer:
            read = self._store.get_into(key, buffer.data_ptr(), SMALL_BYTES)
            raw = buffer.numpy()[:max(read, 0)].tobytes()
        if read in _ABSENT:
            return None
        if read < 0:
            raise ValueError(f"could not be read (Mooncake code {read})")
        return raw

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

    def read(self, head: str) -> _Chain | None:
        """The chain the tail `head` names, None if there is no tail; a ValueError if it cannot
        be read or is not a tail."""
        raw = self.get(head)
        if raw is None:
            return None
        if len(raw) != _TAIL.size:
            raise ValueError(f"is not one this channel wrote ({len(raw)} bytes)")
        magic, token, first, nxt, deadline = _TAIL.unpack(raw)
        if magic != _TAIL_MAGIC or first > nxt:
            raise ValueError("is not one this channel wrote")
        return _Chain(token, first, nxt, deadline)

    def write(self, head: str, chain: _Chain) -> int:
        """Stores `chain` as the tail `head`; Mooncake's return code."""
        return self.upsert(head, _TAIL.pack(_TAIL_MAGIC, chain.token, chain.first, chain.next,
                                            chain.deadline))

    def close(self) -> None:
        with self._lock:
            buffers, self._all, self._free = self._all, [], []
        for buffer in buffers:
            self._store.unregister_buffer(buffer.data_ptr())


def unconsumed_keys(store: Any, tails: TailBuffer, head: str) -> list[str]:
    """The keys of the unconsumed entries of the chain whose tail is `head`, oldest first."""
    tail = tails.read(head)
    keys = [] if tail is None else tail.keys(head)
    exists = store.batch_is_exist(keys) if keys else []
    return [k for k, e in zip(keys, exists, strict=True) if e == 1]


class _Leases:
    """The producers' leases of a namespace as one handle watches them: a producer is dead
    once its lease's value has stayed the same, or been gone, for LEASE_S of this handle's
    monotonic clock (no clock is compared across machines).

    Invariant: `_changed[token]` is when this handle last saw that producer's lease change;
    first hearing of a producer counts as a change.
    """

    def __init__(self, store: Any, namespace: str, reclaim_after_s: float) -> None:
        self._store = store
        self.slots = [f"{namespace}/.producer/{k}" for k in range(MAX_PRODUCERS)]
        self._reclaim_after_s = reclaim_after_s
        self._buffer = torch.zeros(MAX_PRODUCERS * _RECORD.size, dtype=torch.uint8)
        self._registered = False
        self._lock = threading.Lock()  # one scan at a time; others use its result
        self._values: dict[bytes, bytes] = {}
        self._changed: dict[bytes, float] = {}
        self._in_slots: dict[bytes, tuple[str, _Producer]] = {}  # at the last scan
        self._next_scan = 0.0

    def scan(self) -> None:
        """Reads every slot in one call, at most every LIVENESS_CHECK_S; a scan in progress on
        another thread serves instead. Removes the slots of producers long dead."""
        if time.monotonic() < self._next_scan or not self._lock.acquire(blocking=False):
            return
        try:
            self._read_slots()
            self._reclaim()
            self._next_scan = time.monotonic() + LIVENESS_CHECK_S
        finally:
            self._lock.release()

    def _read_slots(self) -> None:
        ptr, size = self._buffer.data_ptr(), _RECORD.size
        if not self._registered:
            if self._store.register_buffer(ptr, self._buffer.numel()) != 0:
                raise OmniPrefixCacheChannelError(
                    f"mooncake channel: registering a {self._buffer.numel()}-byte buffer failed")
            self._registered = True
        reads = self._store.batch_get_into(self.slots, [ptr + k * size for k in range(
            MAX_PRODUCERS)], [size] * MAX_PRODUCERS)
        now, raw = time.monotonic(), self._buffer.numpy().tobytes()
        self._in_slots = {}
        for k, (slot, read) in enumerate(zip(self.slots, reads, strict=True)):
            if read != size:
                continue
            value = raw[k * size:(k + 1) * size]
            producer = _Producer.from_record(value)
            self._in_slots[producer.token] = (slot, producer)
            if self._values.get(producer.token) != value:
                self._values[producer.token], self._changed[producer.token] = value, now

    def _reclaim(self) -> None:
        """Frees the slots of producers dead for `reclaim_after_s` more than LEASE_S, and
        forgets producers gone from the slots as long."""
        now = time.monotonic()
        for token, changed in list(self._changed.items()):
            if now - changed < LEASE_S + self._reclaim_after_s:
                continue
            if token in self._in_slots:
                self._store.remove(self._in_slots.pop(token)[0], force=True)
            else:
                del self._changed[token]
                self._values.pop(token, None)

    def named(self, token: bytes) -> _Producer | None:
        """The producer whose token is `token`, if a scan saw it in the slots."""
        found = self._in_slots.get(token)
        return found[1] if found is not None else None

    def dead(self, producer: _Producer) -> bool:
        changed = self._changed.setdefault(producer.token, time.monotonic())
        return time.monotonic() - changed >= LEASE_S

    def all_dead(self) -> list[_Producer]:
        """The producers in the slots, if there are some and all are dead; else none."""
        producers = [p for _, p in self._in_slots.values()]
        return producers if all(map(self.dead, producers)) else []

    def close(self) -> None:
        if self._registered:
            self._store.unregister_buffer(self._buffer.data_ptr())


class _IdLocks:
    """A lock per id (tail key), kept while some thread holds or waits for it."""

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

    Invariant: `_used` is the sum of `_live` sizes plus reservations not yet published.
    """

    def __init__(self, master: str, metadata: str, namespace: str, *, ttl_s: float,
                 owner: bool, protocol: str = "tcp", device: str = "",
                 capacity_bytes: int = DEFAULT_CAPACITY,
                 full_wait_s: float = DEFAULT_FULL_WAIT_S) -> None:
        super().__init__(ttl_s=ttl_s, capacity_bytes=capacity_bytes, full_wait_s=full_wait_s)
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"mooncake channel namespace {namespace!r} is not [A-Za-z0-9_-]+")
        self.master, self.metadata, self.namespace = master, metadata, namespace
        self._protocol, self._device = protocol, device
        self._store = self._connect()
        try:
            self._tails = TailBuffer(self._store)
        except BaseException:
            self._store.close()  # nothing else holds the connection to close it
            raise
        self._leases = _Leases(self._store, namespace, reclaim_after_s=ttl_s)
        self._producer = _Producer(secrets.token_hex(8).encode(), os.getpid(),
                                   socket.gethostname())
        self._held = _Held()
        self._lease_counter = 0
        self._lock = threading.Lock()  # bookkeeping only: never held across a store call
        self._id_locks = _IdLocks()
        self._register_lock = threading.Lock()
        self._live: OrderedDict[str, _Live] = OrderedDict()  # in put order: expiry order
        self._chains: dict[str, _Chain] = {}
        self._used = 0
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(
            self, _release, self._store, self._tails, self._leases, self._held,
            namespace if owner else None, os.getpid(), self._stop)

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
        """The store key of `request_id`'s tail; its entries are keys under it."""
        digest = hmac.new(self.namespace.encode(), request_id.encode(), hashlib.sha256)
        return f"{self.namespace}/{digest.hexdigest()}"

    def entry_keys(self, request_id: str) -> list[str]:
        """The store keys of `request_id`'s unconsumed entries, oldest first."""
        with self._operation(request_id):
            return unconsumed_keys(self._store, self._tails, self.entry_key(request_id))

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
        ptr = buffer.data_ptr()
        rc = self._store.register_buffer(ptr, buffer.numel())
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: registering a {buffer.numel()}-byte buffer "
                f"failed with Mooncake code {rc}")
        try:
            yield ptr
        finally:
            self._store.unregister_buffer(ptr)

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

    def _read_tail(self, head: str, request_id: str) -> _Chain | None:
        try:
            return self._tails.read(head)
        except ValueError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: the tail of request {request_id} {e}") from e

    def _write_tail(self, head: str, chain: _Chain, request_id: str) -> None:
        self._check_stored(self._tails.write(head, chain), f"the tail of request {request_id}",
                           _TAIL.size)

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
        head = self.entry_key(request_id)
        data = join(encoded)  # a pool's rows read (and let go) before any store call
        with self._id_locks.hold(head):  # a chain's next index is taken by one put at a time
            self._append(head, request_id, data, reservation)
        if final:
            self._fulfil(head)

    def _append(self, head: str, request_id: str, data: torch.Tensor,
                reservation: int) -> None:
        chain = self._chain_for(head, request_id)
        key = chain.key(head, chain.next)
        self._put_bytes(key, data, f"the entry for request {request_id}")
        grown = replace(chain, next=chain.next + 1, deadline=time.time() + self.ttl_s)
        try:
            self._write_tail(head, grown, request_id)
        except BaseException:
            self._store.remove(key, force=True)
            raise
        with self._lock:
            self._chains[head] = grown
            self._live[key] = _Live(reservation, grown.deadline)
        self._start_keeper()

    def _chain_for(self, head: str, request_id: str) -> _Chain:
        """The chain a new entry of `request_id` joins: this handle's own, `first` moved past
        consumed entries, or a new one whose tail is stored before any entry.

        The tail is read every time: once this handle's entries were consumed, another handle
        may have started a chain of its own under the id, which writing ours would orphan."""
        with self._lock:
            chain = self._chains.get(head)
        tail = self._read_tail(head, request_id)
        if chain is not None and tail is not None and tail.token == chain.token \
                and not tail.expired():
            exists = self._store.batch_is_exist(chain.keys(head)) if chain.next > chain.first \
                else []
            return replace(chain, first=chain.first + next(
                (i for i, e in enumerate(exists) if e == 1), len(exists)))
        if tail is not None:
            self._take_over(head, tail, request_id)
        chain = _Chain(secrets.token_hex(8).encode(), 0, 0, time.time() + self.ttl_s)
        self._write_tail(head, chain, request_id)
        return chain

    def _take_over(self, head: str, tail: _Chain, request_id: str) -> None:
        """Removes what is left of the chain `tail` names, the key a killed put may have left
        past it included; refused while that chain has unexpired unconsumed entries."""
        keys = tail.keys(head, past_next=True)
        if not tail.expired() and any(e == 1 for e in self._store.batch_is_exist(keys[:-1])):
            raise OmniPrefixCacheChannelError(
                f"request {request_id}: another handle's entries under this id are "
                f"unconsumed on channel {self.spec}; one handle publishes under an id at "
                f"a time")
        self._store.batch_remove(keys, force=True)

    def _take(self, request_id: str, awaited: Awaited) -> torch.Tensor | None:
        accepts = awaited.accepts
        head = self.entry_key(request_id)
        tail = self._read_tail(head, request_id)
        if tail is None or tail.next == tail.first:
            return None
        keys = tail.keys(head)
        if tail.expired():  # whoever published them: never returned, removed
            self._store.batch_remove(keys, force=True)
            return None
        if len(keys) > 1:
            exists = self._store.batch_is_exist(keys)
            keys = [k for k, e in zip(keys, exists, strict=True) if e == 1]
        for key in keys:
            data = self._take_key(key, request_id, accepts)
            if data is not None:
                return data
        return None

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

    def _end_chain(self, head: str, now: float) -> None:
        """Removes the tail of this handle's chain under `head` if it expired by `now`. Under
        the id's lock: no put of this handle rewrites the tail between the read and the remove;
        an id whose put is in flight is left for the next sweep (that put renews the chain)."""
        with self._id_locks.hold(head, wait=False) as held:
            if not held:
                return
            with self._lock:
                chain = self._chains.get(head)
                if chain is None or chain.deadline > now:
                    return
                del self._chains[head]
            try:
                tail = self._tails.read(head)
            except ValueError:
                return  # unreadable: not for this sweep to remove
            if tail is not None and tail.token == chain.token:  # another handle's tail stays
                self._store.remove(head, force=True)

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
                    self._held.slot = slot
                    self._start_keeper()
                    return
        raise OmniPrefixCacheChannelError(
            f"mooncake channel {self.spec}: all {MAX_PRODUCERS} producer slots are taken; "
            f"producers that died free theirs {self.ttl_s:g} s after")

    def _create(self, key: str, value: bytes) -> bool:
        try:
            return self._tails.create(key, value)
        except ValueError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: the producer slot {key} {e}") from e

    def _expect_key(self, head: str) -> str:
        return f"{self.namespace}/.expect/{head.rpartition('/')[2]}"

    def _expect(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            key = self._expect_key(self.entry_key(request_id))
            self._check_stored(self._tails.upsert(key, self._producer.record(0)),
                               f"the expectation of request {request_id}", _RECORD.size)
            with self._lock:
                self._held.expected.add(key)

    def _fulfil(self, head: str) -> None:
        """Removes this handle's expectation of the id `head`, if any: its entry is out."""
        key = self._expect_key(head)
        with self._lock:
            if key not in self._held.expected:
                return
            self._held.expected.discard(key)
        self._store.remove(key, force=True)

    def _producer_name(self) -> str:
        return self._producer.token.decode() if self._held.slot is not None else ""

    def _dead_producer(self, request_id: str, producer: str) -> str | None:
        self._leases.scan()
        if producer:
            named = self._leases.named(producer.encode())
            return str(named) if named is not None and self._leases.dead(named) else None
        key = self._expect_key(self.entry_key(request_id))
        try:
            expected = self._tails.get(key)
        except ValueError as e:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: the expectation of request {request_id} "
                f"{e}") from e
        if expected is not None and len(expected) == _RECORD.size:
            producer = _Producer.from_record(expected)
            if not self._leases.dead(producer):
                return None
            # reported once: clients reuse ids, and a later request's wait is its own (a new
            # producer's expectation written since is lost with it: its death then shows as
            # the namespace's, or at the get's timeout)
            self._store.remove(key, force=True)
            return str(producer)
        dead = self._leases.all_dead()
        return ", ".join(map(str, dead)) if dead else None

    def _refresh_lease(self) -> None:
        if self._held.slot is not None:
            self._lease_counter += 1
            self._tails.upsert(self._held.slot, self._producer.record(self._lease_counter))

    def _start_keeper(self) -> None:
        with self._lock:
            if self._keeper is None:
                self._keeper = threading.Thread(
                    target=_keep_until_stopped, args=(weakref.ref(self), self._stop),
                    name="omni-prefix-cache-mooncake-keeper", daemon=True)
                self._keeper.start()

    def _keep(self) -> float:
        """One round of the keeper: the lease rewritten, expired entries swept. Seconds until
        the next round."""
        self._refresh_lease()
        due = self._next_deadline()
        if due is not None and due <= time.time():
            self._sweep()
            due = self._next_deadline()
        return LEASE_REFRESH_S if due is None else min(LEASE_REFRESH_S,
                                                       max(0.0, due - time.time()))

    def _close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()  # no store call may run past the store's close
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
