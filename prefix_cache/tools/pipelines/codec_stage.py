"""A Code2Wav-like last stage: the talker's rows to output frames, chunk by chunk, no cache.

Codec stages of an omni pipeline (Qwen-Omni's Code2Wav) turn each step of the
talker into a short stretch of waveform. This stand-in is a fixed random linear
map from a row to `samples_per_frame` samples followed by a frame-wise `tanh`:
seeded, so two runs agree, and frame `i` a function of row `i` alone, so the
frames of a stream are those of the whole entry bit for bit however it was cut.
"""

from __future__ import annotations

import torch


class Code2WavLike(torch.nn.Module):
    """Invariant: `forward(rows)[i]` depends on `rows[i]` only (chunking never changes a frame)."""

    def __init__(self, hidden_size: int, samples_per_frame: int = 240, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(samples_per_frame, hidden_size, generator=generator)
        self.register_buffer("weight", weight / hidden_size ** 0.5)

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` rows to `[n, samples_per_frame]` frames; one row per product, so a
        row's frame never depends on how many rows came with it (a batched GEMM may pick its
        kernel, and its reduction order, by the batch size)."""
        rows = rows.to(self.weight.dtype)
        return torch.stack([torch.tanh(self.weight @ row) for row in rows]) if len(rows) \
            else rows.new_zeros((0, self.weight.shape[0]))
