"""The Mooncake Store channel: entries are objects in a Mooncake Store, for stages across machines.

Mooncake Store (the store vLLM and vllm-ascend deployments use for KV transfer) keeps values in
the memory segments of its clients. This channel's clients contribute none, so a holder
(`mooncake_client --global_segment_size=...`) must run for entries to outlive their publisher.
Entries move through buffers registered with the store, so their size is bounded by the
holder's segment, not by a client-side buffer.

The store has no compare-and-swap, so no key is ever written twice: the entries of one id form
a chain of keys `NAMESPACE/HMAC(id)/TOKEN.I`, I = 0, 1, 2..., and the key `NAMESPACE/HMAC(id)`
(the tail) holds TOKEN, the lowest index that may be unconsumed and the next index. A take reads
the tail, then the chain's oldest existing key, then removes that key: exactly one take's remove
succeeds, and it removes exactly the bytes it read. One handle publishes under an id at a time:
a handle that finds another's unconsumed chain under the id refuses to publish there.

The store keeps values until removed or evicted; a handle's sweeper thread removes what the
handle published once it expired (by the handle's monotonic clock), and the handle counts the
bytes of its unconsumed entries against the channel's capacity. Size the holder's segment above
the capacity of the channels using it: the master evicts old keys silently at 90% of its
segments.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlencode

import numpy as np
import torch

from prefix_cache.channel.base import DEFAULT_FULL_WAIT_S, DEFAULT_TTL_S, StageChannel
from prefix_cache.channel.codec import EncodedEntry, join
from prefix_cache.channel.errors import OmniPrefixCacheChannelError

logger = logging.getLogger(__name__)

# Mooncake ErrorCodes that mean "no entry to take yet": none stored, or one still being stored.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
_ABSENT = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]+")
_TAIL = struct.Struct("<8s16sQQ")  # magic, chain token, first index maybe unconsumed, next index
_TAIL_MAGIC = b"OPCTAIL1"
#: Bytes of unconsumed entries a namespace's publisher keeps in the store unless told otherwise.
DEFAULT_CAPACITY = 1 << 30
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


def _release(store: Any, tails: TailBuffer, namespace: str | None, owner_pid: int,
             stop: threading.Event) -> None:
    stop.set()  # the sweeper ends before its next store call
    if namespace is not None and os.getpid() == owner_pid:
        store.remove_by_regex(f"^{re.escape(namespace)}/", force=True)
    tails.close()
    store.close()


@dataclass
class _Chain:
    """The chain this handle writes under one id: its token, lowest maybe-unconsumed index,
    next index, and when its last entry expires (monotonic)."""

    token: bytes
    first: int
    next: int
    expires_at: float

    def key(self, head: str, index: int) -> str:
        return f"{head}/{self.token.decode()}.{index}"


class TailBuffer:
    """One tail's bytes, in a buffer registered with a store once (a registration costs about
    a millisecond on loopback, several gets' worth, and every poll of a get reads a tail).

    Invariant: one read or write of the buffer at a time; registered until `close`.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._data = torch.zeros(_TAIL.size, dtype=torch.uint8)
        self._ptr = self._data.data_ptr()
        self._lock = threading.Lock()
        rc = store.register_buffer(self._ptr, _TAIL.size)
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: registering a {_TAIL.size}-byte buffer failed with Mooncake "
                f"code {rc}")

    def read(self, head: str) -> _Chain | None:
        """The chain the tail `head` names (expiry unknown: 0), None if there is no tail; a
        ValueError if it cannot be read or is not a tail."""
        with self._lock:
            read = self._store.get_into(head, self._ptr, _TAIL.size)
            raw = self._data.numpy().tobytes()
        if read in _ABSENT:
            return None
        if read != _TAIL.size:
            raise ValueError(f"could not be read (Mooncake code {read})")
        magic, token, first, nxt = _TAIL.unpack(raw)
        if magic != _TAIL_MAGIC or first > nxt:
            raise ValueError("is not one this channel wrote")
        return _Chain(token, first, nxt, 0.0)

    def write(self, head: str, chain: _Chain, next_index: int) -> int:
        """Stores `chain`'s tail with `next_index` under `head`; Mooncake's return code."""
        with self._lock:
            self._data.numpy()[:] = np.frombuffer(
                _TAIL.pack(_TAIL_MAGIC, chain.token, chain.first, next_index), dtype=np.uint8)
            return self._store.upsert_from(head, self._ptr, _TAIL.size)

    def close(self) -> None:
        with self._lock:
            self._store.unregister_buffer(self._ptr)


def unconsumed_keys(store: Any, tails: TailBuffer, head: str) -> list[str]:
    """The keys of the unconsumed entries of the chain whose tail is `head`, oldest first."""
    tail = tails.read(head)
    if tail is None:
        return []
    keys = [tail.key(head, i) for i in range(tail.first, tail.next)]
    exists = store.batch_is_exist(keys) if keys else []
    return [k for k, e in zip(keys, exists, strict=True) if e == 1]


@dataclass
class _Live:
    """An entry this handle published and has not seen consumed: its chain, size and expiry."""

    head: str
    nbytes: int
    expires_at: float


class MooncakeChannel(StageChannel):
    """Entries of a namespace are the store's objects under `NAMESPACE/`; each handle removes
    what it published once expired, and the owner's close removes them all.

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
        self._lock = threading.Lock()  # puts, gets and sweeps may run on several threads
        self._publish_lock = threading.Lock()
        self._live: OrderedDict[str, _Live] = OrderedDict()  # in put order: expiry order
        self._chains: dict[str, _Chain] = {}
        self._used = 0
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._finalizer = weakref.finalize(self, _release, self._store, self._tails,
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
        if not netloc.rpartition(":")[2].isdigit() or "metadata" not in options:
            raise ValueError(f"mooncake channel spec needs the master's HOST:PORT and "
                             f"?metadata=URL (the metadata server), got {netloc!r} and {query!r}")
        namespace = options.get("namespace") or secrets.token_hex(16)
        return cls(netloc, options["metadata"], namespace,
                   ttl_s=float(options.get("ttl", DEFAULT_TTL_S)),
                   owner="namespace" not in options,
                   protocol=options.get("protocol", "tcp"), device=options.get("device", ""),
                   capacity_bytes=int(options.get("capacity", DEFAULT_CAPACITY)),
                   full_wait_s=float(options.get("wait", DEFAULT_FULL_WAIT_S)))

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
        os.environ["MC_TCP_BIND_ADDRESS"] = _local_address(host.strip("[]"), int(port))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # fail in seconds, not 90
        rc = store.setup(os.environ["MC_TCP_BIND_ADDRESS"], self.metadata, 0, 0,
                         self._protocol, self._device, self.master)
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel: cannot reach the Mooncake master at {self.master} with "
                f"metadata server {self.metadata} (setup returned {rc}); is mooncake_master "
                f"running there?")
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

    def _chain_for(self, head: str, request_id: str) -> _Chain:
        """The chain a new entry of `request_id` joins, its `first` moved past consumed ones.

        The tail is read every time: once this handle's entries were consumed, another handle
        may have started a chain of its own under the id, which writing ours would orphan."""
        with self._lock:
            chain = self._chains.get(head)
        tail = self._read_tail(head, request_id)
        if chain is None or tail is None or tail.token != chain.token:
            if tail is not None and any(
                    e == 1 for e in self._store.batch_is_exist(
                        [tail.key(head, i) for i in range(tail.first, tail.next)])):
                raise OmniPrefixCacheChannelError(
                    f"request {request_id}: another handle's entries under this id are "
                    f"unconsumed on channel {self.spec}; one handle publishes under an id at "
                    f"a time")
            return _Chain(secrets.token_hex(8).encode(), 0, 0, 0.0)
        keys = [chain.key(head, i) for i in range(chain.first, chain.next)]
        exists = self._store.batch_is_exist(keys) if keys else []
        chain.first += next((i for i, e in enumerate(exists) if e == 1), len(keys))
        return chain

    def _publish(self, request_id: str, encoded: EncodedEntry, reservation: int) -> None:
        with self._publish_lock:  # a chain's next index is taken by one put at a time
            self._append(request_id, encoded, reservation)

    def _append(self, request_id: str, encoded: EncodedEntry, reservation: int) -> None:
        head = self.entry_key(request_id)
        chain = self._chain_for(head, request_id)
        key = chain.key(head, chain.next)
        self._put_bytes(key, join(encoded), f"the entry for request {request_id}")
        try:
            self._check_stored(self._tails.write(head, chain, chain.next + 1),
                               f"the tail of request {request_id}", _TAIL.size)
        except BaseException:
            self._store.remove(key, force=True)
            raise
        expires_at = time.monotonic() + self.ttl_s
        with self._lock:
            chain.next += 1
            chain.expires_at = expires_at
            self._chains[head] = chain
            self._live[key] = _Live(head, reservation, expires_at)
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=_sweep_until_stopped, args=(weakref.ref(self), self._stop),
                    name="omni-prefix-cache-mooncake-sweeper", daemon=True)
                self._sweeper.start()

    def _take(self, request_id: str) -> torch.Tensor | None:
        head = self.entry_key(request_id)
        tail = self._read_tail(head, request_id)
        if tail is None:
            return None
        keys = [tail.key(head, i) for i in range(tail.first, tail.next)]
        if len(keys) > 1:
            exists = self._store.batch_is_exist(keys)
            keys = [k for k, e in zip(keys, exists, strict=True) if e == 1]
        for key in keys:
            data = self._take_key(key, request_id)
            if data is not None:
                return data
        return None

    def _take_key(self, key: str, request_id: str) -> torch.Tensor | None:
        """The bytes of `key` if this take removed it; None if it is gone or another took it."""
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
        now, due = time.monotonic(), []
        with self._lock:
            while self._live and next(iter(self._live.values())).expires_at <= now:
                key, live = self._live.popitem(last=False)
                self._used -= live.nbytes
                due.append(key)
        with self._publish_lock:  # no put of this handle rewrites a tail meanwhile
            with self._lock:
                expired = {h: c for h, c in self._chains.items() if c.expires_at <= now}
                for head in expired:
                    del self._chains[head]
            for head, chain in expired.items():  # a tail another handle wrote since stays
                try:
                    tail = self._tails.read(head)
                except ValueError:
                    continue  # unreadable: not for this sweep to remove
                if tail is not None and tail.token == chain.token:
                    due.append(head)
        if due:
            self._store.batch_remove(due, force=True)  # those consumed meanwhile: not found

    def _next_expiry(self) -> float | None:
        """When the next of this handle's entries or chains expires (monotonic), if any."""
        with self._lock:
            times = [c.expires_at for c in self._chains.values()]
            if self._live:
                times.append(next(iter(self._live.values())).expires_at)
        return min(times, default=None)

    def _close(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join()  # no store call may run past the store's close
        self._finalizer()


def _sweep_until_stopped(channel_ref: weakref.ref[MooncakeChannel], stop: threading.Event
                         ) -> None:
    """Sweeps the channel as its entries expire, so none outlives its time to live while its
    publisher is idle; ends when the channel closes or is dropped."""
    while not stop.is_set():
        channel = channel_ref()
        if channel is None:
            return
        due = channel._next_expiry()
        wait_s = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
        if wait_s == 0.0:
            try:
                channel._sweep()
            except Exception:  # a store gone: the next put or get reports it
                logger.exception("mooncake channel %s: sweeping expired entries failed",
                                 channel.spec)
                wait_s = 1.0
        del channel  # no strong reference while waiting: the handle may be dropped
        stop.wait(wait_s)
