"""Stage outputs from a stage's worker to the next stage, by request id (SPEC §3, §7 Delivery).

`open_channel(spec)` opens a namespace of entries; `channel.spec` is the string another process
passes to `open_channel` to reach the same namespace. Specs:

- `None`, `"shm"` or `"shm://"`: a new shared-memory namespace on this machine, owned (and
  removed on close) by the returned handle (`shm://?capacity=BYTES` sizes it);
  `shm://NAMESPACE?dir=ROOT&ttl=S&wait=S` joins one.
- `mooncake://HOST:PORT?metadata=URL`: a new namespace in the Mooncake Store whose master listens
  at HOST:PORT; `&namespace=NS` joins one. Options: `ttl`, `wait`, `capacity`, `protocol`,
  `device`.

`ttl` is each entry's time to live in seconds (default 600); `capacity` the bytes of unconsumed
entries a namespace holds, `wait` how long a put waits for room before it fails (default 10 s).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from prefix_cache.channel.base import DEFAULT_TTL_S, StageChannel, StageChunk
from prefix_cache.channel.codec import StageEntry
from prefix_cache.channel.errors import (OmniPrefixCacheChannelError,
                                         OmniPrefixCacheChannelFullError,
                                         OmniPrefixCacheChannelProducerError,
                                         OmniPrefixCacheChannelTimeoutError)

__all__ = [
    "DEFAULT_TTL_S", "OmniPrefixCacheChannelError", "OmniPrefixCacheChannelFullError",
    "OmniPrefixCacheChannelProducerError", "OmniPrefixCacheChannelTimeoutError",
    "StageChannel", "StageChunk", "StageEntry", "open_channel",
]


def open_channel(spec: str | None = None) -> StageChannel:
    """The channel `spec` names (see the module docstring); None is a new shared-memory one."""
    parts = urlsplit("shm://" if spec in (None, "", "shm") else spec)
    if parts.scheme == "shm" and not parts.path:
        from prefix_cache.channel.shm import ShmChannel
        return ShmChannel.from_spec(parts.netloc, parts.query)
    if parts.scheme == "mooncake" and parts.path in ("", "/"):
        from prefix_cache.channel.mooncake import MooncakeChannel
        return MooncakeChannel.from_spec(parts.netloc, parts.query)
    raise ValueError(f"unknown channel spec {spec!r}: expected 'shm', 'shm://NAMESPACE?...' or "
                     f"'mooncake://HOST:PORT?metadata=URL'")
