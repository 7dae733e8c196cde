"""omni-prefix-cache: stage outputs of multi-stage vLLM pipelines, cached by KV-cache block and slot.

Nothing here imports vLLM at module scope: vLLM objects are read by attribute.
"""

from importlib import metadata

try:
    from prefix_cache.core import _core  # noqa: F401
except ImportError as exc:  # a checkout used without installing it
    raise ImportError(
        "prefix_cache.core._core, the C loops of the cache's step bookkeeping, is not built: run "
        "`pip install --no-deps -e .` (or `python setup.py build_ext --inplace`) in the "
        "checkout; it needs a C compiler and Python.h") from exc

from prefix_cache.config import HIDDEN_KEY, ModelCachePolicy, PrefixCacheConfig
from prefix_cache.errors import (OmniPrefixCacheError, OmniPrefixCacheInputError,
                                 OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError)
from prefix_cache.integration.gate import stage_prefix_cache_config
from prefix_cache.integration.group_view import FullAttentionGroupView
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.manager import OmniPrefixCacheManager, StageCacheOutputs, StepRows
from prefix_cache.core.tasks import TaskState, WriteTask



def _installed_version() -> str:
    """The distribution's version (pyproject.toml's, once installed); "0+unknown" in a checkout
    used without installing it."""
    try:
        return metadata.version("omni-prefix-cache")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "HIDDEN_KEY", "FullAttentionGroupView", "ModelCachePolicy", "OmniPrefixCacheError",
    "OmniPrefixCacheInputError",
    "OmniPrefixCacheManager", "OmniPrefixCacheStagingTimeoutError", "OmniPrefixCacheUnmatchError",
    "PrefixBlockPool", "PrefixCacheConfig", "StageCacheOutputs", "StepRows", "TaskState",
    "WriteTask",
    "stage_prefix_cache_config",
]
