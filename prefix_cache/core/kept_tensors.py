"""The cache's own tensors are never inference tensors.

vLLM runs a step under `torch.inference_mode()`; a tensor made there is an inference tensor,
which the cache's threads, outside inference mode, could not write in place. So every tensor
the cache keeps past a call is made under `keeping_tensors()`. It is entered only where one is
made: after a forward has evicted torch's code from the caches, leaving and re-entering
inference mode cost the engine thread 77 µs (2-core CPU machine, after a 64 MiB matrix
product).
"""

from __future__ import annotations

import torch


def keeping_tensors() -> torch.inference_mode:
    """A context in which the tensors made are normal ones, inside vLLM's inference mode too."""
    return torch.inference_mode(False)
