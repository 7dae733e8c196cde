"""What the cache is configured with: sizes and bounds (PrefixCacheConfig), and what a model emits (ModelCachePolicy)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from prefix_cache.devices import backend_classes, parse_device

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

#: Pool key of the stage's last hidden states.
HIDDEN_KEY = "__hidden_states__"

_DEFAULT_STAGING_CAPACITY = 8192
#: Where a step's writes are issued: on the caller's (compute) stream right after the
#: forward, reading its rows in place; or on the cache's copy stream, after a private copy.
WRITE_STREAMS = ("compute", "copy")
#: How the engine thread's step bookkeeping runs: "c" (the default), the step's claim with
#: its write record, and its layout, each in one C call; "python", the same work in Python
#: calls, the reference the tests compare the C path with.
STEP_PATHS = ("c", "python")
#: Environment variable naming the default `PrefixCacheConfig.step_path` (a benchmark's switch).
STEP_PATH_ENV = "OMNI_PREFIX_CACHE_STEP_PATH"

#: Host bytes every slot costs whatever the model: its claim, read pins, and the hidden key's
#: version and producer; a pool the host cannot even index is refused up front.
_MIN_HOST_BYTES_PER_SLOT = 8 + 4 + 8 + 8

#: Share of the host's physical memory the pools of all its devices may take by default: each
#: pool mirrors its engine's whole KV cache, and a pinned page is one the OS can never reclaim,
#: so half is left to the engines' own processes, page cache and the next stage's entries.
HOST_POOL_SHARE = 0.5


def devices_on_host(device_type: str) -> int:
    """The devices of `device_type` this process sees, each of which may run an engine that
    builds a pool on this host (CPU: one)."""
    if device_type == "cpu":
        return 1
    import torch
    return max(1, torch.get_device_module(device_type).device_count())


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Sizes and bounds of one stage's cache; mirrors the stage's KV cache (num_blocks x block_size)."""

    num_blocks: int
    block_size: int
    staging_depth: int = 4
    staging_capacity_tokens: int = _DEFAULT_STAGING_CAPACITY
    staging_claim_timeout_s: float = 30.0
    gpu_budget_bytes: int = 512 << 20
    device: str | None = None
    write_stream: str = "compute"
    #: host bytes kept for reuse from outputs their callers dropped (0: none kept)
    output_cache_bytes: int = 256 << 20
    #: host bytes the stage's pools may take (None: `HOST_POOL_SHARE` of the host's memory,
    #: split evenly over its devices of the pool's type; see `host_budget`)
    host_budget_bytes: int | None = None
    #: blocks of rows the host pool holds, pool block 0 unused as vLLM's null block is (None:
    #: one per KV block, the mirror); fewer than `num_blocks` caps the pool, and its scheduler
    #: side then decides which KV blocks' rows it holds (`prefix_cache.core.residency`)
    pool_blocks: int | None = None
    #: one of STEP_PATHS (default: $OMNI_PREFIX_CACHE_STEP_PATH, else "c"); both keep the same
    #: pool, stats and rows, step for step
    step_path: str = field(default_factory=lambda: os.environ.get(STEP_PATH_ENV) or "c")

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "staging_depth", "staging_capacity_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be a positive int, got {value!r}")
        for name in ("gpu_budget_bytes", "output_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be an int >= 0, got {value!r}")
        budget = self.host_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"PrefixCacheConfig.host_budget_bytes must be an int >= 0 or None, "
                             f"got {budget!r}")
        pool = self.pool_blocks
        if pool is not None and (isinstance(pool, bool) or not isinstance(pool, int)
                                 or not 1 < pool <= self.num_blocks):
            raise ValueError(f"PrefixCacheConfig.pool_blocks must be an int in "
                             f"2..num_blocks={self.num_blocks} or None, got {pool!r}")
        timeout = self.staging_claim_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"PrefixCacheConfig.staging_claim_timeout_s must be a finite "
                             f"positive number of seconds, got {timeout!r}")
        if self.step_path not in STEP_PATHS:
            raise ValueError(f"PrefixCacheConfig.step_path must be one of {STEP_PATHS}, got "
                             f"{self.step_path!r} (${STEP_PATH_ENV} sets its default)")
        if self.write_stream not in WRITE_STREAMS:
            raise ValueError(f"PrefixCacheConfig.write_stream must be one of {WRITE_STREAMS}, "
                             f"got {self.write_stream!r}")
        host = _host_memory_bytes()
        if host is not None and self.num_slots * _MIN_HOST_BYTES_PER_SLOT > host:
            raise ValueError(
                f"PrefixCacheConfig.num_blocks={self.num_blocks} x block_size={self.block_size} "
                f"needs at least {self.num_slots * _MIN_HOST_BYTES_PER_SLOT} bytes of host "
                f"bookkeeping; this host has {host}")
        if self.device is not None:
            object.__setattr__(self, "device", self._checked_device(self.device))

    @staticmethod
    def _checked_device(device: Any) -> str:
        """The device name normalized (`"CUDA:1"` -> `"cuda:1"`), refused if no backend knows it."""
        if not isinstance(device, str):
            raise ValueError(f"PrefixCacheConfig.device must be a device type name or None, "
                             f"got {device!r}")
        try:
            name, index = parse_device(device)
        except ValueError as exc:
            raise ValueError(f"PrefixCacheConfig.device: {exc}") from None
        known = backend_classes()
        if name not in known:
            raise ValueError(f"PrefixCacheConfig.device={device!r}: unknown device type; "
                             f"known: {sorted(known)}")
        return name if index is None else f"{name}:{index}"

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def capped(self) -> bool:
        """Whether the pool holds fewer blocks than the KV cache has."""
        return self.pool_blocks is not None and self.pool_blocks < self.num_blocks

    def pool_config(self) -> PrefixCacheConfig:
        """This config in pool blocks: what the cache below the capped pool's map works on
        (itself where the pool mirrors the KV cache)."""
        if not self.capped:
            return self
        return replace(self, num_blocks=self.pool_blocks, pool_blocks=None)

    def key_bytes(self, feat_shape: Sequence[int], dtype: torch.dtype) -> int:
        """Host bytes of one key's pool: a row of `feat_shape` for every KV slot."""
        return self.num_slots * math.prod(feat_shape) * dtype.itemsize

    def host_budget(self, devices_on_host: int) -> int | None:
        """`host_budget_bytes`, else `HOST_POOL_SHARE` of the host's physical memory over the
        `devices_on_host` that may each build a pool (None: the host's memory is unknown)."""
        if self.host_budget_bytes is not None:
            return self.host_budget_bytes
        host = _host_memory_bytes()
        return None if host is None else int(host * HOST_POOL_SHARE) // max(1, devices_on_host)

    @classmethod
    def from_vllm_config(cls, *, num_blocks: int, block_size: int, scheduler_config: Any = None,
                         model_config: Any = None, **overrides: Any) -> PrefixCacheConfig:
        """Size staging for the largest step vLLM schedules: `max_num_batched_tokens`,
        else `max_model_len`, else 8192."""
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"PrefixCacheConfig has no field(s) {sorted(unknown)}")
        capacity = (getattr(scheduler_config, "max_num_batched_tokens", None)
                    or getattr(scheduler_config, "max_model_len", None)
                    or getattr(model_config, "max_model_len", None)
                    or _DEFAULT_STAGING_CAPACITY)
        kwargs: dict[str, Any] = {"num_blocks": num_blocks, "block_size": block_size,
                                  "staging_capacity_tokens": int(capacity)}
        kwargs.update(overrides)
        return cls(**kwargs)


def _key_set(field_name: str, keys: Any) -> frozenset[str]:
    """A set of mm keys; a single string is one key, never a set of characters."""
    if keys is None:
        return frozenset()
    if isinstance(keys, str):
        keys = (keys,)
    if not isinstance(keys, Iterable) or isinstance(keys, (bytes, dict)):
        raise ValueError(f"ModelCachePolicy.{field_name} must be a set of key names, "
                         f"got {keys!r}")
    out = frozenset(keys)
    bad = sorted(repr(k) for k in out if not isinstance(k, str) or not k)
    if bad:
        raise ValueError(f"ModelCachePolicy.{field_name}: keys must be non-empty strings, "
                         f"got {', '.join(bad)}")
    if HIDDEN_KEY in out:
        raise ValueError(f"ModelCachePolicy.{field_name} may not hold {HIDDEN_KEY!r}")
    return out


@dataclass(frozen=True)
class ModelCachePolicy:
    """Which of a model's outputs the cache keeps, and when it writes them.

    `deferred_keys` are per-token keys written once, when their request
    finishes; `per_request_keys` are never per-token (always leftover), even
    when their first dimension happens to equal the step's token count.
    """

    needs_full_hidden_states: bool = True
    deferred_keys: frozenset[str] = frozenset()
    per_request_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.needs_full_hidden_states, bool):
            raise ValueError(f"ModelCachePolicy.needs_full_hidden_states must be a bool, "
                             f"got {self.needs_full_hidden_states!r}")
        deferred = _key_set("deferred_keys", self.deferred_keys)
        per_request = _key_set("per_request_keys", self.per_request_keys)
        both = sorted(deferred & per_request)
        if both:
            raise ValueError(f"ModelCachePolicy: keys {both} are both deferred (per-token) and "
                             f"per-request")
        object.__setattr__(self, "deferred_keys", deferred)
        object.__setattr__(self, "per_request_keys", per_request)

    @classmethod
    def from_model(cls, model: Any) -> ModelCachePolicy:
        """Read `requires_full_prefix_cached_hidden_states` (default True),
        `deferred_prefix_cache_mm_keys` and `prefix_cache_per_request_mm_keys`
        (default empty) off the model."""
        return cls(
            needs_full_hidden_states=getattr(
                model, "requires_full_prefix_cached_hidden_states", True),
            deferred_keys=getattr(model, "deferred_prefix_cache_mm_keys", None),
            per_request_keys=getattr(model, "prefix_cache_per_request_mm_keys", None),
        )
