"""What a stage's forward returns, read as omni runners do: hidden rows and per-token mm outputs.

Three forms are understood:

- a tensor: the hidden states (plain LMs, vLLM's `_model_forward`);
- a `(hidden, aux)` pair: vLLM's and vllm-ascend's form when auxiliary hidden
  states are on. `aux` is a dict of multimodal outputs when it is a mapping;
  anything else (EAGLE-3's list of layer outputs) is not a stage output;
- an object with hidden states (`text_hidden_states`, as vllm-omni's `OmniOutput`,
  or `hidden_states`) and a `multimodal_outputs` dict (or None).

Anything else cannot be read: `read_forward_output` returns None and the
caller decides (the runner warns once and turns the cache off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Attribute names of the hidden states on an omni output object, in the order tried.
HIDDEN_ATTRS = ("text_hidden_states", "hidden_states")


@dataclass(frozen=True)
class ForwardOutput:
    """One forward's hidden rows (padded like the batch) and its mm outputs (None: none)."""

    hidden: torch.Tensor
    mm: Mapping[str, Any] | None


def read_forward_output(output: Any) -> ForwardOutput | None:
    """The hidden rows and mm outputs of `output`, or None when its form is not understood."""
    if hasattr(output, "multimodal_outputs"):  # before tuples: OmniOutput is a NamedTuple
        hidden = next((h for h in (getattr(output, a, None) for a in HIDDEN_ATTRS)
                       if isinstance(h, torch.Tensor)), None)
        mm = output.multimodal_outputs
        if hidden is None or not (mm is None or isinstance(mm, Mapping)):
            return None
        return ForwardOutput(hidden, mm)
    if isinstance(output, torch.Tensor):
        return ForwardOutput(output, None)
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        aux = output[1]
        return ForwardOutput(output[0], aux if isinstance(aux, Mapping) else None)
    return None


def describe(output: Any) -> str:
    """A short description of an output's form, for the warning about an unreadable one."""
    if isinstance(output, tuple):
        return f"{type(output).__name__} of ({', '.join(type(v).__name__ for v in output)})"
    fields = [a for a in (*HIDDEN_ATTRS, "multimodal_outputs") if hasattr(output, a)]
    return f"{type(output).__name__}" + (f" with {', '.join(fields)}" if fields else "")
