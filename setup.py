"""Builds prefix_cache.core._core, the C loops of a step's bookkeeping; everything else is in
pyproject.toml. Needs a C compiler and the Python headers (python3-dev)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefix_cache.core._core", ["prefix_cache/core/_core.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra",
                                                 "-Wno-unused-parameter"])])
