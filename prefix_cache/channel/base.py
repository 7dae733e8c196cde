"""The stage channel: one entry per request id, published whole, taken once, freed after a TTL.

A backend supplies four primitives: publish an encoded entry atomically, take (claim, free and
return) the entry of a request if it is there, sweep entries older than the time to live, and
release its resources. This class builds the bounded wait, expiry and lifecycle on them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from prefix_cache.channel.codec import EncodedEntry, StageEntry, decode, encode
from prefix_cache.channel.errors import (OmniPrefixCacheChannelError,
                                        OmniPrefixCacheChannelTimeoutError)
from prefix_cache.devices.base import check_timeout

DEFAULT_TTL_S = 600.0
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.02


class StageChannel(ABC):
    """Entries live from their put until one get consumes them or `ttl_s` passes, never longer."""

    def __init__(self, *, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"channel ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._sweep_every_s = min(ttl_s, 60.0) / 4
        self._next_sweep = 0.0
        self._closed = False

    @property
    @abstractmethod
    def spec(self) -> str:
        """The string `open_channel` takes in another process to reach this same namespace."""

    def put(self, request_id: str, outputs: Mapping[str, torch.Tensor], *,
            aborted: bool = False, meta: Mapping[str, Any] | None = None) -> None:
        """Publishes `outputs` (CPU tensors by key) for `request_id`, replacing an unconsumed
        entry of the same id. `aborted` marks a request that ended early; `meta` is JSON."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty str, got {request_id!r}")
        if not isinstance(outputs, Mapping):
            raise TypeError(f"request {request_id}: outputs must be a mapping of str keys to CPU "
                            f"tensors, e.g. {{HIDDEN_KEY: rows}}; got {type(outputs).__name__}")
        self._put_entry(StageEntry(request_id, dict(outputs), aborted, dict(meta or {}),
                                   time.time()))

    def fail(self, request_id: str, cause: str) -> None:
        """Publishes, in place of `request_id`'s rows, that they could not be published and why:
        its consumer's get raises a channel error naming the request and `cause`."""
        self._check_open()
        self._put_entry(StageEntry(request_id, {}, True, {}, time.time(), error=str(cause)))

    def _put_entry(self, entry: StageEntry) -> None:
        self._publish(entry.request_id, encode(entry))
        self._maybe_sweep()

    def get(self, request_id: str, timeout_s: float = 30.0) -> dict[str, torch.Tensor]:
        """The outputs published for `request_id`, waiting up to `timeout_s`; consumes the entry.

        The tensors are the caller's own. `get_entry` also tells whether the request was aborted.
        """
        return self.get_entry(request_id, timeout_s).outputs

    def get_entry(self, request_id: str, timeout_s: float = 30.0) -> StageEntry:
        """The entry published for `request_id`, waiting up to `timeout_s`; consumes it. An
        entry the publisher failed (`fail`) raises a channel error naming its cause."""
        check_timeout(timeout_s, f"get for request {request_id}")
        self._check_open()
        deadline = time.monotonic() + timeout_s
        pause = _FIRST_POLL_S
        while True:
            self._maybe_sweep()
            entry = self._take_entry(request_id)
            if entry is not None and entry.error is not None:
                raise OmniPrefixCacheChannelError(
                    f"request {request_id}: its stage could not publish its rows on channel "
                    f"{self.spec}: {entry.error}")
            if entry is not None:
                return entry
            left = deadline - time.monotonic()
            if left <= 0:
                raise OmniPrefixCacheChannelTimeoutError(
                    f"no entry for request {request_id} on channel {self.spec} within "
                    f"{timeout_s:g} s (entries live {self.ttl_s:g} s unless consumed)")
            time.sleep(min(pause, left))
            pause = min(2 * pause, _MAX_POLL_S)

    def close(self) -> None:
        """Releases this handle (idempotent); the namespace's owner also frees every entry."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> StageChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}{', closed' if self._closed else ''})"

    def _take_entry(self, request_id: str) -> StageEntry | None:
        data = self._take(request_id)
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
        if time.time() - entry.published_at > self.ttl_s:
            return None  # expired before it was consumed: freed by the take, as a sweep would
        return entry

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_every_s
            self._sweep()

    def _check_open(self) -> None:
        if self._closed:
            raise OmniPrefixCacheChannelError(f"channel {self.spec} is closed")

    @abstractmethod
    def _publish(self, request_id: str, encoded: EncodedEntry) -> None:
        """Stores the entry so that a reader sees all of it or none of it."""

    @abstractmethod
    def _take(self, request_id: str) -> torch.Tensor | None:
        """Claims and frees the request's entry; its bytes (flat uint8, the caller's) or None."""

    @abstractmethod
    def _sweep(self) -> None:
        """Frees the entries this handle can see that are older than `ttl_s`."""

    @abstractmethod
    def _close(self) -> None:
        """Releases the backend; the namespace's owner also frees every entry in it."""
