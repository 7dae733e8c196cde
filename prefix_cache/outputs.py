"""How a step's outputs split: per-token rows (immediate or deferred) and leftover.

A tensor whose first dimension is this step's token count (unpadded, or padded
for CUDA graphs) is per-token: it is cached under its key, sliced to the
unpadded rows. Everything else is leftover, returned unsplit. Nested mm dicts
are flattened with dotted keys (`codes.audio`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy


@dataclass
class StepOutputs:
    """One step's outputs by destination; `immediate` holds the hidden rows first when cached."""

    immediate: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: dict[str, torch.Tensor] = field(default_factory=dict)
    leftover: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.immediate.get(HIDDEN_KEY)

    def per_token(self) -> dict[str, torch.Tensor]:
        return {**self.immediate, **self.deferred}

    def feature_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape[1:]) for k, v in self.per_token().items()}


def flatten_mm(mm_outputs: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """`{"codes": {"audio": t}}` -> `{"codes.audio": t}`."""
    flat: dict[str, Any] = {}
    for key, value in (mm_outputs or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_mm(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def split_outputs(hidden_states: torch.Tensor | None, mm_outputs: Mapping[str, Any] | None,
                  num_tokens: int, num_tokens_padded: int, policy: ModelCachePolicy
                  ) -> StepOutputs:
    """Sort a step's outputs into immediate, deferred and leftover (see the module docstring)."""
    out = StepOutputs()
    if policy.needs_full_hidden_states:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1 \
                or hidden_states.shape[0] < num_tokens:
            shape = None if hidden_states is None else tuple(getattr(hidden_states, "shape", ()))
            raise ValueError(f"save_outputs: hidden_states must be a tensor of at least "
                             f"{num_tokens} rows, got {shape}")
        out.immediate[HIDDEN_KEY] = hidden_states[:num_tokens]
    for key, value in flatten_mm(mm_outputs).items():
        if key == HIDDEN_KEY:
            raise ValueError(f"save_outputs: mm output key {HIDDEN_KEY!r} is reserved")
        per_token = (isinstance(value, torch.Tensor) and value.dim() >= 1
                     and value.shape[0] in (num_tokens, num_tokens_padded))
        if not per_token:
            out.leftover[key] = value
        elif key in policy.deferred_keys:
            out.deferred[key] = value[:num_tokens]
        else:
            out.immediate[key] = value[:num_tokens]
    return out
