"""Exact-size page-locked host memory, mapped into the CUDA device address space.

`torch.empty(..., pin_memory=True)` goes through the caching host allocator,
which rounds every block up to a power of two (1.78-1.92x observed for pools of
1-2 GiB). Registering a plain allocation with `cudaHostRegister` pins exactly
its bytes, and under unified addressing its pointer is valid on the device, so
a kernel can write straight into the pool.

Where the runtime refuses a registration (a memlock or IOMMU limit, a virtualized
GPU, a range registered already), `pin_mapped` raises, and the backend falls back
to memory torch pins. The runtime also keeps the refusal as the thread's last
error, which torch's launch check after the thread's next kernel would raise from
that unrelated kernel (the forward): it is cleared before the raise.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from prefix_cache.devices.base import HostBuffer
from prefix_cache.devices.cuda.libraries import loaded_cudart

_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped
_CUDA_SUCCESS = 0


class _DeviceArray:
    """A raw device pointer presented through `__cuda_array_interface__`."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


@functools.cache
def _runtime() -> ctypes.CDLL:
    """The libcudart torch loaded (its contexts are torch's), typed for the calls made here."""
    lib = loaded_cudart()
    lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
    lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
    lib.cudaGetErrorName.restype = ctypes.c_char_p
    return lib


def register_host(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> HostBuffer:
    """Allocate `shape` of `dtype` on the host, pin exactly those bytes and map them."""
    tensor = torch.empty(tuple(shape), dtype=dtype)
    if tensor.nbytes == 0:
        return HostBuffer(tensor, pinned=False)
    with torch.cuda.device(device):
        release = pin_mapped(tensor)
    buffer = HostBuffer(tensor, pinned=True, release=release)
    buffer.device_view = device_view(tensor, device)
    return buffer


def pin_mapped(tensor: torch.Tensor) -> Callable[[], None]:
    """Page-lock exactly `tensor`'s bytes and map them into the current device's address
    space; returns the call that undoes it. Raises RuntimeError naming the runtime's error
    where it refuses, that error cleared from the thread's last error."""
    runtime = _runtime()
    ptr, nbytes = tensor.data_ptr(), tensor.nbytes
    err = runtime.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_MAPPED)
    if err != _CUDA_SUCCESS:
        runtime.cudaGetLastError()  # not left for torch's next launch check on this thread
        name = (runtime.cudaGetErrorName(err) or b"?").decode()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {name} ({err})")

    def release() -> None:
        if runtime.cudaHostUnregister(ptr) != _CUDA_SUCCESS:
            runtime.cudaGetLastError()  # the runtime unloading at exit, say: nothing to undo

    return release


def device_view(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`'s registered host bytes as a CUDA tensor of the same shape and dtype."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.as_tensor(_DeviceArray(tensor.data_ptr(), nbytes), device=device)
    return raw.view(tensor.dtype).view(tensor.shape)
