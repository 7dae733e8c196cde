"""`prefix_cache.__version__`: the installed distribution's version, with a fallback."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

import prefix_cache

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_version_is_pyprojects_once_installed() -> None:
    import tomllib
    try:
        installed = metadata.version("omni-prefix-cache")
    except metadata.PackageNotFoundError:
        pytest.skip("omni-prefix-cache is not installed in this environment")
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert prefix_cache.__version__ == installed == declared


def test_version_falls_back_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", not_installed)
    assert prefix_cache._installed_version() == "0+unknown"
