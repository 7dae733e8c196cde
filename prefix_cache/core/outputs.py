"""How a step's outputs split, per-token rows (immediate or deferred) and leftover, and the
checks they pass before anything is claimed (`OutputChecker`).

A tensor whose first dimension is this step's token count (unpadded, or padded
for CUDA graphs) is per-token: it is cached under its key, sliced to the
unpadded rows. Everything else, and every key the policy names per-request, is
leftover, returned unsplit. Nested mm dicts are flattened with dotted keys
(`codes.audio`). Every tensor is detached: the pool never joins an autograd graph.

On the C step path a step of hidden states alone (no mm outputs) whose pool exists is checked
in one C call (`_core.hidden_rows`); a step it does not pass, for whatever reason, goes
through the reference's checks, which name what is wrong.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy
from prefix_cache.core import _core
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.host_copies import HostCopy
from prefix_cache.devices.base import DeviceBackend
from prefix_cache.errors import OmniPrefixCacheInputError


@dataclass
class StepOutputs:
    """One step's outputs by destination; `immediate` holds the hidden rows first when cached."""

    immediate: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: dict[str, torch.Tensor] = field(default_factory=dict)
    leftover: dict[str, Any] = field(default_factory=dict)
    #: each per-token key's shape (its rows first), read once at the split: after a forward,
    #: each torch attribute read costs the engine thread microseconds
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.immediate.get(HIDDEN_KEY)

    def per_token(self) -> dict[str, torch.Tensor]:
        return {**self.immediate, **self.deferred}

    def feature_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: shape[1:] for k, shape in self.shapes.items()}

    def add(self, key: str, tensor: torch.Tensor, shape: tuple[int, ...], num_tokens: int,
            *, deferred: bool = False) -> None:
        """File `tensor`'s first `num_tokens` rows (detached) under `key`, immediate or
        deferred; a view only where the tensor has more rows (a view costs the engine thread
        about 1.5 µs)."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        if shape[0] != num_tokens:
            tensor, shape = tensor[:num_tokens], (num_tokens, *shape[1:])
        (self.deferred if deferred else self.immediate)[key] = tensor
        self.shapes[key] = shape


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with each tensor (or HostCopy) in it, through dicts, lists and tuples, replaced
    by `fn` of it; everything else as it is."""
    if isinstance(value, (torch.Tensor, HostCopy)):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def flatten_mm(mm_outputs: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """`{"codes": {"audio": t}}` -> `{"codes.audio": t}`."""
    if mm_outputs is None:
        return {}
    if not isinstance(mm_outputs, Mapping):
        raise OmniPrefixCacheInputError(
            f"save_outputs: mm_outputs must be a mapping of key -> output or None, got "
            f"{type(mm_outputs).__name__}")
    flat: dict[str, Any] = {}
    for key, value in mm_outputs.items():
        if not isinstance(key, str):
            raise OmniPrefixCacheInputError(
                f"save_outputs: mm output keys must be strings, got {key!r}")
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
        if hidden_states is None and num_tokens == 0:
            pass  # an empty step may come without a forward
        else:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else ()
            if not shape or shape[0] < num_tokens:
                what = (f"shape {shape}" if isinstance(hidden_states, torch.Tensor)
                        else type(hidden_states).__name__)
                raise OmniPrefixCacheInputError(
                    f"save_outputs: hidden_states must be a tensor of at least {num_tokens} "
                    f"rows, got {what}")
            out.add(HIDDEN_KEY, hidden_states, shape, num_tokens)
    for key, value in flatten_mm(mm_outputs).items():
        if key == HIDDEN_KEY:
            raise OmniPrefixCacheInputError(
                f"save_outputs: mm output key {HIDDEN_KEY!r} is reserved")
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        if not (shape and shape[0] in (num_tokens, num_tokens_padded)
                and key not in policy.per_request_keys):
            out.leftover[key] = value.detach() if isinstance(value, torch.Tensor) else value
        else:
            out.add(key, value, shape, num_tokens, deferred=key in policy.deferred_keys)
    return out


class OutputChecker:
    """Everything `save_outputs` checks of what it is handed, in one place: the token counts,
    the split, each tensor's device, the step's size and each key's pool. A step it refuses
    changes nothing."""

    def __init__(self, backend: DeviceBackend, pool: PrefixBlockPool, capacity_tokens: int,
                 *, step_path: str = "c") -> None:
        self._backend = backend
        self._device = backend.device
        self._pool = pool
        self._capacity_tokens = capacity_tokens
        #: a step of hidden states alone checked in one C call (`_core.hidden_rows`)
        self._c_path = step_path == "c"

    def step_outputs(self, hidden_states: torch.Tensor | None,
                     mm_outputs: Mapping[str, Any] | None, unpadded: Any, padded: Any,
                     policy: ModelCachePolicy
                     ) -> tuple[int, StepOutputs, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """The step's token count, its outputs split and checked, and the keys seen first
        (key -> feature shape and dtype); on the C step path, a step of hidden states alone
        whose pool exists in one call, where every check passes (else as the reference)."""
        pool_key = self._pool.keys.get(HIDDEN_KEY) if (
            self._c_path and mm_outputs is None and policy.needs_full_hidden_states) else None
        if pool_key is not None:
            checked = _core.hidden_rows(hidden_states, unpadded, padded, torch.Tensor,
                                        self._device, pool_key.feat_shape, pool_key.dtype,
                                        self._capacity_tokens)
            if checked is not None:
                rows, shape = checked
                return unpadded, StepOutputs({HIDDEN_KEY: rows}, shapes={HIDDEN_KEY: shape}), {}
        n, padded_n = self._token_counts(unpadded, padded)
        outputs = split_outputs(hidden_states, mm_outputs, n, padded_n, policy)
        return n, outputs, self._new_keys(outputs, n)

    def check_device(self, what: str, tensor: torch.Tensor, *, host_ok: bool = False
                     ) -> torch.device:
        """The tensor's device, after the backend's device check, refusing as bad input;
        `host_ok`: a host tensor passes (a leftover is copied in the call)."""
        device = tensor.device
        if device == self._device or (host_ok and device.type == "cpu"):
            return device
        try:
            self._backend.check_rows(what, tensor)
        except ValueError as exc:
            raise OmniPrefixCacheInputError(str(exc)) from None
        return device

    @staticmethod
    def _token_counts(unpadded: Any, padded: Any) -> tuple[int, int]:
        n, padded_n = unpadded, padded
        if type(n) is not int or type(padded_n) is not int:  # numpy ints, say; never a bool
            counts = []
            for name, value in (("num_tokens_unpadded", n), ("num_tokens_padded", padded_n)):
                try:
                    if isinstance(value, bool):
                        raise TypeError
                    counts.append(operator.index(value))
                except TypeError:
                    raise OmniPrefixCacheInputError(
                        f"save_outputs: {name} must be an int, got {value!r}") from None
            n, padded_n = counts
        if not 0 <= n <= padded_n:
            raise OmniPrefixCacheInputError(
                f"save_outputs: num_tokens_unpadded={n} must be within "
                f"0..num_tokens_padded={padded_n}")
        return n, padded_n

    def _new_keys(self, outputs: StepOutputs, n: int
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Check every tensor against the device, the capacity and its pool; the keys seen first
        (each per-token tensor has the step's `n` rows)."""
        if n > self._capacity_tokens and (outputs.immediate or outputs.deferred):
            raise OmniPrefixCacheInputError(
                f"save_outputs: step of {n} tokens exceeds staging_capacity_tokens="
                f"{self._capacity_tokens}")
        new_keys = {}
        for key, rows in itertools.chain(outputs.immediate.items(), outputs.deferred.items()):
            self.check_device(f"save_outputs: {key!r} rows", rows)
            feat, dtype = outputs.shapes[key][1:], rows.dtype
            pool_key = self._pool.keys.get(key)
            if pool_key is None:
                new_keys[key] = (feat, dtype)
            elif (pool_key.feat_shape, pool_key.dtype) != (feat, dtype):
                raise OmniPrefixCacheInputError(
                    f"save_outputs: {key!r} rows are {feat} {dtype}, its pool holds "
                    f"{pool_key.feat_shape} {pool_key.dtype}")
        for key, value in outputs.leftover.items():
            map_tensors(value, lambda t, key=key: self.check_device(
                f"save_outputs: leftover {key!r}", t, host_ok=True))
        return new_keys
