"""The errors the cache raises; every message names the request, step, task or state involved."""


class OmniPrefixCacheError(RuntimeError):
    """Base of every error raised by the prefix cache."""


class OmniPrefixCacheUnmatchError(OmniPrefixCacheError):
    """The stage configuration is refused, or a caller or vLLM broke the cache's contract."""


class OmniPrefixCacheInputError(OmniPrefixCacheUnmatchError, ValueError):
    """A public call got input it cannot use (type, shape, dtype, device, size); nothing changed."""


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """No staging slot became free within `staging_claim_timeout_s`."""
