"""Attention kernels' block sizes per platform: which kernel layouts a block-slot mirror follows.

A kernel block size k that divides the allocator block size B gives the same
slot for every token (`(b*B/k + j)*k + o == b*B + pos % B`), so such a layout
is mirrored as is. What each platform's attention backends accept is listed
here so the device modules can refuse a layout at the first step, not later.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MultipleOf:
    """Any positive multiple of `base` tokens."""

    base: int

    def accepts(self, size: int) -> bool:
        return size > 0 and size % self.base == 0


KernelSizes = tuple[int | MultipleOf, ...]


def accepts(sizes: KernelSizes, size: int) -> bool:
    return any(s.accepts(size) if isinstance(s, MultipleOf) else s == size for s in sizes)


# vLLM's CUDA attention backends (get_supported_kernel_block_sizes, vLLM 0.12-0.33).
CUDA_KERNEL_BLOCK_SIZES: dict[str, KernelSizes] = {
    "FLASH_ATTN": (MultipleOf(16),),
    "TRITON_ATTN": (MultipleOf(16),),
    "FLASH_ATTN_MLA": (MultipleOf(16),),
    "TRITON_MLA": (MultipleOf(16),),
    "FLASHINFER": (16, 32, 64, 128, 256, 512, 1024),
    "FLASHINFER_MLA": (32, 64),
    "FLASHMLA": (64,),
    "CUTLASS_MLA": (128,),
}

# vllm-ascend's attention backends (attention_v1, mla_v1, sfa, fa3): 128 only.
NPU_KERNEL_BLOCK_SIZES: dict[str, KernelSizes] = {
    "ASCEND": (128,),
    "ASCEND_MLA": (128,),
    "ASCEND_SFA": (128,),
    "ASCEND_FA": (128,),
}


def check_kernel_block(table: dict[str, KernelSizes], platform: str, kernel_block_size: int,
                       block_size: int, attention_backend: str | None) -> str | None:
    """Why `kernel_block_size` cannot be mirrored on `platform`, or None."""
    if block_size % kernel_block_size:
        return (f"kernel block size {kernel_block_size} does not divide block_size {block_size}")
    if attention_backend is None:
        if not any(accepts(sizes, kernel_block_size) for sizes in table.values()):
            return f"no {platform} attention backend uses kernel block size {kernel_block_size}"
        return None
    sizes = table.get(attention_backend.upper())
    if sizes is None:
        return f"unknown {platform} attention backend {attention_backend!r}"
    if not accepts(sizes, kernel_block_size):
        return (f"{platform} attention backend {attention_backend} does not use kernel block "
                f"size {kernel_block_size} (supports {sizes})")
    return None
