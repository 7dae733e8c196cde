"""Where a `vllm serve` stage's rows are on the channel: the key of each choice of a response.

vLLM's OpenAI server names each engine request after the response's `id`
(`cmpl-<X-Request-Id>` or `chatcmpl-<X-Request-Id>`; a random id without the
header): a completion's requests add `-<prompt index>`, a chat's add nothing,
and `n > 1` runs each sample as a request of its own, `<sample>_<request>`.
The worker publishes under that name (vLLM's random suffix stripped, see
`runner_mixin.external_request_id`), so a client derives every key from the
response it got; a streamed response's chunks carry the same `id` and `index`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def served_channel_keys(response: Mapping[str, Any], n: int = 1) -> list[str]:
    """The channel key of each of `response["choices"]`, in their order; `n` is the `n` the
    request asked for (a completion numbers its choices prompt by prompt, n per prompt)."""
    if n < 1:
        raise ValueError(f"n must be the request's n (>= 1), got {n!r}")
    completion = response["object"].startswith("text_completion")
    keys = []
    for choice in response["choices"]:
        prompt, sample = divmod(choice["index"], n)
        request = f"{response['id']}-{prompt}" if completion else response["id"]
        keys.append(request if n == 1 else f"{sample}_{request}")
    return keys
