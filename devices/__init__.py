"""Hardware layer: one backend per device type, found by name or auto-detected.

Built in: `cpu`, `cuda`, `npu`. Third-party backends (ROCm, XPU, ...) register a
`DeviceBackend` subclass under the entry-point group `prefix_cache.devices`.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from prefix_cache.devices.base import DeviceBackend, DeviceEvent, HostBuffer, Transfer, wait_event
from prefix_cache.errors import OmniPrefixCacheUnmatchError

__all__ = ["DeviceBackend", "DeviceEvent", "HostBuffer", "Transfer", "available",
           "backend_classes", "get_backend", "parse_device", "wait_event"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "prefix_cache.devices"
#: Auto-detection order: an Ascend machine's torch.cuda names may be rebound to
#: torch.npu by vllm-ascend, so npu is asked first.
_BUILTIN = {"npu": "prefix_cache.devices.npu:NpuBackend",
            "cuda": "prefix_cache.devices.cuda:CudaBackend",
            "cpu": "prefix_cache.devices.cpu:CpuBackend"}


def _load(target: str) -> type[DeviceBackend]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_classes() -> dict[str, type[DeviceBackend]]:
    """Every known backend class by device type: built-ins, then entry points."""
    classes = {name: _load(target) for name, target in _BUILTIN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not hide the built-ins
            logger.warning("device backend entry point %r failed to load: %s", ep.name, exc)
            continue
        classes.setdefault(ep.name, cls)
    return classes


def available() -> list[str]:
    """Device types usable in this process, in auto-detection order."""
    return [name for name, cls in backend_classes().items() if cls.is_available()]


def get_backend(name: str | None = None) -> DeviceBackend:
    """The backend for `name` (`"cuda"`, `"cuda:1"`, case-insensitive), or for the first
    available device type when None; `OmniPrefixCacheUnmatchError` naming what is missing
    where the device type is known but not usable here."""
    classes = backend_classes()
    if name is None:
        name = next(n for n in _BUILTIN if classes[n].is_available())
    device_type, index = parse_device(name)
    cls = classes.get(device_type)
    if cls is None:
        raise ValueError(f"unknown device type {name!r}; known: {sorted(classes)}")
    if not cls.is_available():
        raise OmniPrefixCacheUnmatchError(
            f"device {name!r} is not usable in this process: {cls.missing()}; usable here: "
            f"{', '.join(available())}")
    return cls() if index is None else cls(index)


def parse_device(device: str) -> tuple[str, int | None]:
    """`"CUDA:1"` -> `("cuda", 1)`, `"npu"` -> `("npu", None)`; ValueError if malformed."""
    device_type, _, index = device.strip().lower().partition(":")
    if not device_type or (index and not index.isdigit()) or (index and device_type == "cpu"):
        raise ValueError(f"device {device!r} is not a device type with an optional "
                         f"accelerator index (cpu, cuda, cuda:1, npu:0, ...)")
    return device_type, int(index) if index else None
