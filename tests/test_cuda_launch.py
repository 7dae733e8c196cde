"""`_launch.Kernel`, the scatter kernel's cuLaunchKernel: how it packs a launch's parameters and
what it refuses, against stand-ins for the CUDA driver's functions (ctypes callbacks; no driver
exists on a CPU machine). A CUDA machine launches the real kernel through it in
tests/test_devices.py (every word width and alignment, int32 and int64 slots)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_int32, c_size_t, c_uint, c_uint64, c_void_p

import pytest

from prefix_cache.devices.cuda import _launch

_PARAM_INFO = ctypes.CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t))
_LAUNCH = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                           c_uint, c_void_p, POINTER(c_void_p), POINTER(c_void_p))
_ERROR_NAME = ctypes.CFUNCTYPE(c_int, c_int, POINTER(c_char_p))
_INVALID_VALUE = 1  # the driver's answer past a kernel's last parameter

#: the scatter kernel's parameters as Triton compiles it: four pointers, three i32 values, then
#: its scratch pointers
SCATTER_SIZES = (8, 8, 8, 8, 4, 4, 4, 8, 8)


class _Driver:
    """cuLaunchKernel, cuFuncGetParamInfo and cuGetErrorName for a kernel of `sizes`; each launch
    is recorded with the values its parameters held."""

    def __init__(self, sizes: tuple[int, ...], launch_error: int = 0) -> None:
        self.sizes = sizes
        self.launches: list[dict[str, object]] = []

        def param_info(function: int, i: int, offset: object, size: object) -> int:
            if i >= len(self.sizes):
                return _INVALID_VALUE
            offset[0], size[0] = 0, self.sizes[i]  # type: ignore[index]
            return 0

        def launch(function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                   shared: int, stream: int | None, params: object, extra: object) -> int:
            values = [ctypes.cast(params[i],  # type: ignore[index]
                                  POINTER(c_uint64 if size == 8 else c_int32))[0]
                      for i, size in enumerate(self.sizes)]
            self.launches.append({"function": function, "grid": (gx, gy, gz),
                                  "block": (bx, by, bz), "shared": shared, "stream": stream or 0,
                                  "values": values})
            return launch_error

        def error_name(error: int, out: object) -> int:
            out[0] = b"CUDA_ERROR_LAUNCH_FAILED"  # type: ignore[index]
            return 0

        self._callbacks = (_LAUNCH(launch), _PARAM_INFO(param_info), _ERROR_NAME(error_name))

    @property
    def functions(self) -> tuple[int, ...]:
        return tuple(ctypes.cast(f, c_void_p).value for f in self._callbacks)


def test_a_launch_packs_pointers_and_values_at_the_kernels_sizes_and_nulls_its_scratch() -> None:
    driver = _Driver(SCATTER_SIZES)
    kernel = _launch.Kernel(driver.functions, 0xF00, 256, 1024, 7)
    assert kernel.param_sizes == SCATTER_SIZES
    high = (1 << 63) + 16  # an address above INT64_MAX
    kernel.launch(3, 0x1234, 1 << 40, high, 16, 32, 37, -5, 2**31 - 1)
    assert driver.launches == [{"function": 0xF00, "grid": (3, 1, 1), "block": (256, 1, 1),
                                "shared": 1024, "stream": 0x1234,
                                "values": [1 << 40, high, 16, 32, 37, -5, 2**31 - 1, 0, 0]}]


def test_a_value_that_does_not_fit_its_parameter_or_a_wrong_count_is_refused() -> None:
    driver = _Driver(SCATTER_SIZES)
    kernel = _launch.Kernel(driver.functions, 0xF00, 256, 0, 7)
    with pytest.raises(OverflowError, match="parameter 6, 2147483648, does not fit its 4 bytes"):
        kernel.launch(1, 0, 1, 2, 3, 4, 5, 6, 2**31)
    with pytest.raises(TypeError, match="grid, stream and 7 parameters, got 8 arguments"):
        kernel.launch(1, 0, 1, 2, 3, 4, 5, 6)
    assert driver.launches == []


def test_a_kernel_whose_parameters_past_those_given_are_not_pointers_is_refused() -> None:
    with pytest.raises(ValueError, match="parameter 1, past those given, is 4 bytes"):
        _launch.Kernel(_Driver((8, 4)).functions, 0xF00, 32, 0, 1)
    with pytest.raises(ValueError, match="8 parameters given, the kernel has 7"):
        _launch.Kernel(_Driver(SCATTER_SIZES[:7]).functions, 0xF00, 32, 0, 8)
    with pytest.raises(ValueError, match="parameter 2 is 2 bytes"):
        _launch.Kernel(_Driver((8, 8, 2)).functions, 0xF00, 32, 0, 3)


def test_a_failed_launch_raises_naming_the_call_and_the_drivers_error() -> None:
    kernel = _launch.Kernel(_Driver(SCATTER_SIZES, launch_error=719).functions, 0xF00, 32, 0, 7)
    with pytest.raises(RuntimeError,
                       match=r"cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED \(719\)"):
        kernel.launch(1, 0, 1, 2, 3, 4, 5, 6, 7)
