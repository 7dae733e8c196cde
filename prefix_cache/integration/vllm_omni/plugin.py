"""The `vllm.general_plugins` entry point that makes vllm-omni's runners build this cache.

vLLM loads general plugins in every process that runs a model (vllm-omni's workers load them
too, through `load_omni_general_plugins`). `install` acts only when the user asks, with
`OMNI_PREFIX_CACHE_IN_VLLM_OMNI=1` in the stage's environment (the process's, or the `env:` of
a stage in vllm-omni's deploy config), and only when `vllm_omni` is importable: then it rebinds
the module attribute `vllm_omni.core.prefix_cache.runner_mixin.OmniPrefixCacheManager`, the
name vllm-omni's runner mixin constructs its manager by, to `VllmOmniPrefixCache`. No file is
changed; a stage without the variable, or a stage with prefix caching off, runs as before.
Asked for beside a vllm-omni release other than 0.30, it refuses with the release's name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os

from prefix_cache.errors import OmniPrefixCacheUnmatchError

#: The setting that turns this cache on inside vllm-omni.
ENABLE_ENV = "OMNI_PREFIX_CACHE_IN_VLLM_OMNI"
#: vllm-omni's module whose `OmniPrefixCacheManager` its runners construct.
RUNNER_MIXIN = "vllm_omni.core.prefix_cache.runner_mixin"
#: The vllm-omni releases whose manager API the adapter presents.
SUPPORTED_RELEASES = ("0.30.",)

logger = logging.getLogger(__name__)


def requested() -> bool:
    """Whether this process's environment asks for this cache inside vllm-omni."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> bool:
    """Make vllm-omni's runners build `VllmOmniPrefixCache` if asked and vllm-omni is here;
    True if it is installed now. Safe to call again (vLLM loads plugins once a process, vllm-omni
    again in its workers). Asked for beside another vllm-omni release, it refuses: the engine
    does not start."""
    if not requested() or importlib.util.find_spec("vllm_omni") is None:
        return False
    release = importlib.metadata.version("vllm-omni")
    if not release.startswith(SUPPORTED_RELEASES):
        raise OmniPrefixCacheUnmatchError(
            f"{ENABLE_ENV}=1: omni-prefix-cache presents the prefix-cache API of vllm-omni "
            f"{' / '.join(r + 'x' for r in SUPPORTED_RELEASES)}, this is vllm-omni {release}; "
            f"unset {ENABLE_ENV} to run vllm-omni's own cache")
    import vllm_omni.core.prefix_cache.runner_mixin as runner_mixin

    from prefix_cache.integration.vllm_omni.adapter import VllmOmniPrefixCache

    if runner_mixin.OmniPrefixCacheManager is not VllmOmniPrefixCache:
        runner_mixin.OmniPrefixCacheManager = VllmOmniPrefixCache
        logger.info("%s=1: vllm-omni's prefix cache is served by omni-prefix-cache in this "
                    "process (pid %d)", ENABLE_ENV, os.getpid())
    return True
