"""What the cache is configured with: sizes and bounds (PrefixCacheConfig), and what a model emits (ModelCachePolicy)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

#: Pool key of the stage's last hidden states.
HIDDEN_KEY = "__hidden_states__"

_DEFAULT_STAGING_CAPACITY = 8192


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

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "staging_depth", "staging_capacity_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.gpu_budget_bytes, bool) or not isinstance(self.gpu_budget_bytes, int) \
                or self.gpu_budget_bytes < 0:
            raise ValueError(f"PrefixCacheConfig.gpu_budget_bytes must be an int >= 0, "
                             f"got {self.gpu_budget_bytes!r}")
        timeout = self.staging_claim_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"PrefixCacheConfig.staging_claim_timeout_s must be a positive "
                             f"number of seconds, got {timeout!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ValueError(f"PrefixCacheConfig.device must be a device type name or None, "
                             f"got {self.device!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

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


@dataclass(frozen=True)
class ModelCachePolicy:
    """Which of a model's outputs the cache keeps, and when it writes them."""

    needs_full_hidden_states: bool = True
    deferred_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.deferred_keys, frozenset):
            object.__setattr__(self, "deferred_keys", frozenset(self.deferred_keys))
        if HIDDEN_KEY in self.deferred_keys:
            raise ValueError(f"ModelCachePolicy.deferred_keys may not hold {HIDDEN_KEY!r}")

    @classmethod
    def from_model(cls, model: Any) -> ModelCachePolicy:
        """Read `requires_full_prefix_cached_hidden_states` (default True) and
        `deferred_prefix_cache_mm_keys` (default empty) off the model."""
        return cls(
            needs_full_hidden_states=bool(
                getattr(model, "requires_full_prefix_cached_hidden_states", True)),
            deferred_keys=frozenset(getattr(model, "deferred_prefix_cache_mm_keys", ()) or ()),
        )
