"""The Mooncake Store channel under races and crashes (a loopback store, real processes).

A put racing the handle's own sweeper survives; entries expire whoever published them, and a
closed or killed publisher's id can be published again after their time to live; a slow id
stalls no other; a consumer learns within seconds that its producer died; a process killed at
any store call of a put or a take leaves the id's other entries whole, in order, and no key
that outlives its time to live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from prefix_cache.channel import open_channel
from prefix_cache.channel.mooncake import MooncakeChannel
from tests.mooncake_store import MooncakeStoreProcesses
from tests.test_channel import _mark, _marked


def test_a_put_in_the_sweepers_gap_keeps_its_entry(
        mooncake_store: MooncakeStoreProcesses) -> None:
    """The handle's chain under `r` expires; the sweeper decides to remove its tail, and a
    put of `r` by the same handle lands just before the remove. The put returned: its entry
    must stay reachable."""
    with open_channel(mooncake_store.spec + "&ttl=0.5") as channel, \
            open_channel(channel.spec) as reader:
        assert isinstance(channel, MooncakeChannel)
        channel.put("r", _marked(1))
        assert _mark(reader.get("r", timeout_s=5)) == 1
        channel._stop.set()  # the keeper thread stays out of the way
        time.sleep(0.6)  # the chain under `r` expired, not yet swept
        store = channel._store
        raced: list[threading.Thread] = []

        def put_first(remove: Callable[..., Any]) -> Callable[..., Any]:
            """`remove`, with another thread's put of `r` started just before the first call
            (waited for up to 2 s: the sweep may hold what that put needs)."""
            def removing(*args: Any, **kwargs: Any) -> Any:
                if not raced:
                    raced.append(threading.Thread(target=channel.put, args=("r", _marked(2))))
                    raced[0].start()
                    raced[0].join(2)
                return remove(*args, **kwargs)
            return removing

        class PutInTheGap:
            remove = staticmethod(put_first(store.remove))
            batch_remove = staticmethod(put_first(store.batch_remove))

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

        channel._store = PutInTheGap()
        try:
            channel._sweep()
        finally:
            channel._store = store
        raced[0].join(10)
        assert raced
        assert _mark(reader.get("r", timeout_s=5)) == 2
