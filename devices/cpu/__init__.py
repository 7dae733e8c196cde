"""The host backend: synchronous, no streams; the reference every other backend matches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefix_cache.devices.base import DeviceBackend, DeviceEvent, HostBuffer, Transfer


class CpuBackend(DeviceBackend):
    """Rows already live in host memory, so every transfer completes in its call."""

    name = "cpu"
    synchronous = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def record_event(self) -> DeviceEvent | None:
        return None

    def alloc_host(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        return HostBuffer(torch.empty(tuple(shape), dtype=dtype), pinned=False)

    def scatter_rows(self, rows: torch.Tensor, slots: torch.Tensor, pool: HostBuffer, *,
                     ready: DeviceEvent | None, staging: torch.Tensor | None,
                     in_stream: bool = False) -> Transfer:
        pool.tensor.index_copy_(0, slots, rows.to(pool.tensor.dtype))
        return Transfer()

    def copy_to_host(self, tensor: torch.Tensor, *, ready: DeviceEvent | None,
                     out: torch.Tensor | None = None,
                     in_stream: bool = False) -> tuple[torch.Tensor, Transfer]:
        if out is None:
            return tensor.detach().to("cpu", copy=True), Transfer()
        return out.copy_(tensor), Transfer()
