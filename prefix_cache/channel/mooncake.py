"""The Mooncake Store channel: entries are objects in a Mooncake Store, for stages across machines.

Mooncake Store (the store vLLM and vllm-ascend deployments use for KV transfer) keeps values in
the memory segments of its clients. This channel's clients contribute none, so a holder
(`mooncake_client --global_segment_size=...`) must run for entries to outlive their publisher.
Entries move through buffers registered with the store, so their size is bounded by the
holder's segment, not by a client-side buffer.

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
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlencode

import torch

from prefix_cache.channel.base import DEFAULT_TTL_S, StageChannel
from prefix_cache.channel.codec import EncodedEntry, join
from prefix_cache.channel.errors import OmniPrefixCacheChannelError

# Mooncake ErrorCodes that mean "no entry to take yet": none stored, or one still being stored.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
_ABSENT = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]+")
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


def _release(store: Any, namespace: str | None, owner_pid: int) -> None:
    if namespace is not None and os.getpid() == owner_pid:
        store.remove_by_regex(f"^{re.escape(namespace)}/", force=True)
    store.close()


class MooncakeChannel(StageChannel):
    """Entries of a namespace are the store's objects `NAMESPACE/HMAC(request id)`; each handle
    removes what it published once expired, and the owner's close removes them all."""

    def __init__(self, master: str, metadata: str, namespace: str, *, ttl_s: float,
                 owner: bool, protocol: str = "tcp", device: str = "") -> None:
        super().__init__(ttl_s=ttl_s)
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"mooncake channel namespace {namespace!r} is not [A-Za-z0-9_-]+")
        self.master, self.metadata, self.namespace = master, metadata, namespace
        self._protocol, self._device = protocol, device
        self._store = self._connect()
        self._expiry: OrderedDict[str, float] = OrderedDict()  # published key -> monotonic expiry
        self._expiry_lock = threading.Lock()  # puts, gets and sweeps may run on several threads
        self._finalizer = weakref.finalize(self, _release, self._store,
                                           namespace if owner else None, os.getpid())

    @classmethod
    def from_spec(cls, netloc: str, query: str) -> MooncakeChannel:
        """`mooncake://HOST:PORT?metadata=URL[&namespace=NS&ttl=S&protocol=P&device=D]`."""
        options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        unknown = options.keys() - {"metadata", "namespace", "ttl", "protocol", "device"}
        if unknown:
            raise ValueError(f"mooncake channel spec: unknown option(s) {sorted(unknown)}; "
                             f"known: metadata, namespace, ttl, protocol, device")
        if not netloc.rpartition(":")[2].isdigit() or "metadata" not in options:
            raise ValueError(f"mooncake channel spec needs the master's HOST:PORT and "
                             f"?metadata=URL (the metadata server), got {netloc!r} and {query!r}")
        namespace = options.get("namespace") or secrets.token_hex(16)
        return cls(netloc, options["metadata"], namespace,
                   ttl_s=float(options.get("ttl", DEFAULT_TTL_S)),
                   owner="namespace" not in options,
                   protocol=options.get("protocol", "tcp"), device=options.get("device", ""))

    @property
    def spec(self) -> str:
        options = {"metadata": self.metadata, "namespace": self.namespace,
                   "ttl": f"{self.ttl_s:g}", "protocol": self._protocol}
        if self._device:
            options["device"] = self._device
        return f"mooncake://{self.master}?{urlencode(options, safe=':/')}"

    def entry_key(self, request_id: str) -> str:
        """The store key of `request_id`'s entry."""
        digest = hmac.new(self.namespace.encode(), request_id.encode(), hashlib.sha256)
        return f"{self.namespace}/{digest.hexdigest()}"

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

    def _publish(self, request_id: str, encoded: EncodedEntry) -> None:
        key, data = self.entry_key(request_id), join(encoded)
        with self._registered(data) as ptr:
            rc = self._store.upsert_from(key, ptr, data.numel())
        if rc != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: storing the entry for request {request_id} "
                f"({data.numel()} bytes) failed with Mooncake code {rc}; is a segment holder "
                f"(mooncake_client --global_segment_size=...) running with room for it?")
        with self._expiry_lock:
            self._expiry.pop(key, None)
            self._expiry[key] = time.monotonic() + self.ttl_s

    def _take(self, request_id: str) -> torch.Tensor | None:
        key = self.entry_key(request_id)
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
            return None  # taken by another reader, or being replaced, since the lookup
        removed = self._store.remove(key, force=True) if read == size else None
        if removed == OBJECT_NOT_FOUND:
            return None  # another reader claimed it first
        if removed != 0:
            raise OmniPrefixCacheChannelError(
                f"mooncake channel {self.spec}: taking the entry for request {request_id} "
                f"failed (read returned {read} for {size} bytes, remove returned {removed})")
        with self._expiry_lock:
            self._expiry.pop(key, None)
        return data

    def _sweep(self) -> None:
        now, due = time.monotonic(), []
        with self._expiry_lock:
            while self._expiry and next(iter(self._expiry.values())) <= now:
                due.append(self._expiry.popitem(last=False)[0])
        if due:
            self._store.batch_remove(due, force=True)  # those consumed meanwhile: not found

    def _close(self) -> None:
        self._finalizer()
