"""The errors a stage channel raises; each names the channel and the request or address involved."""

from prefix_cache.errors import OmniPrefixCacheError


class OmniPrefixCacheChannelError(OmniPrefixCacheError):
    """A stage channel cannot serve: its backend is missing or unreachable, or an entry is bad."""


class OmniPrefixCacheChannelTimeoutError(OmniPrefixCacheChannelError):
    """No entry for the request arrived on the channel within the caller's timeout."""


class OmniPrefixCacheChannelFullError(OmniPrefixCacheChannelError):
    """The channel's byte capacity had no room for an entry within the put's bounded wait."""


class OmniPrefixCacheChannelProducerError(OmniPrefixCacheChannelError):
    """The process that was to publish the request's entry died before it did."""
