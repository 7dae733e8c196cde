"""The CUDA libraries this process loaded, and the addresses of their functions that the
backend's C modules are handed (they link no CUDA library: `_functions.h`)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence


def loaded_cudart() -> ctypes.CDLL:
    """The libcudart this process (torch) loaded: its contexts are torch's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return ctypes.CDLL(path)
    raise RuntimeError("no libcudart is loaded in this process")


def loaded_driver() -> ctypes.CDLL:
    """The CUDA driver (libcuda), loaded already where a kernel was."""
    return ctypes.CDLL("libcuda.so.1")


def function_addresses(lib: ctypes.CDLL, names: Sequence[str]) -> tuple[int, ...]:
    """The address of each of `names` in `lib`; AttributeError names one it lacks."""
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
