"""Builds the C modules: prefix_cache.core._core, the loops of a step's bookkeeping and the
host row copies; prefix_cache.channel._shm, the shm channel's puts and expectations with the
GIL released and its chunk ring; prefix_cache.devices.cuda._dma, the copy-engine issuer,
prefix_cache.devices.cuda._events, the recycled done events, and prefix_cache.devices.cuda._launch,
the scatter kernel's launch (none links a CUDA library: the runtime's and the driver's functions
are passed in). Everything else is in pyproject.toml. Needs a
C compiler and the Python headers (python3-dev)."""

from setuptools import Extension, setup

FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

#: The CUDA backend's modules share the header that reads the functions they are handed.
CUDA_DEPENDS = ["prefix_cache/devices/cuda/_functions.h"]

setup(ext_modules=[
    Extension("prefix_cache.core._core", ["prefix_cache/core/_core.c"], extra_compile_args=FLAGS),
    Extension("prefix_cache.channel._shm",
              ["prefix_cache/channel/_shm.c", "prefix_cache/channel/_ring.c"],
              depends=["prefix_cache/channel/_shm.h"], extra_compile_args=[*FLAGS, "-D_GNU_SOURCE"]),
    Extension("prefix_cache.devices.cuda._dma", ["prefix_cache/devices/cuda/_dma.c"],
              depends=CUDA_DEPENDS, extra_compile_args=[*FLAGS, "-D_GNU_SOURCE", "-pthread"],
              extra_link_args=["-pthread"]),
    Extension("prefix_cache.devices.cuda._events", ["prefix_cache/devices/cuda/_events.c"],
              depends=CUDA_DEPENDS, extra_compile_args=FLAGS),
    Extension("prefix_cache.devices.cuda._launch", ["prefix_cache/devices/cuda/_launch.c"],
              depends=CUDA_DEPENDS, extra_compile_args=FLAGS),
])
