"""Staging slots: a claim that finds none free waits for the release of one, and no longer."""

from __future__ import annotations

import threading
import time

import pytest

from prefix_cache import devices
from prefix_cache.core.staging import StagingPool
from prefix_cache.errors import OmniPrefixCacheStagingTimeoutError


def test_a_waiting_claim_takes_the_slot_its_last_holder_releases_at_once() -> None:
    staging = StagingPool(1, 4, devices.get_backend("cpu"))
    slot = staging.claim(1, 1.0, lambda: 0)
    staging.hold(slot, ("write", 7))
    taken: list[tuple[int, float]] = []
    waiter = threading.Thread(target=lambda: taken.append((staging.claim(2, 30.0, lambda: 0),
                                                          time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    staging.release(slot, ("step", 1))  # the write still holds it: the claim keeps waiting
    time.sleep(0.2)
    assert not taken
    released_at = time.monotonic()
    staging.release(slot, ("write", 7))
    waiter.join(10.0)
    assert taken and taken[0][0] == slot
    assert taken[0][1] - released_at < 5.0  # woken by the release, not its 30 s timeout
    assert staging.waits == 1


def test_a_claim_that_finds_no_slot_in_time_names_the_steps_holding_them() -> None:
    staging = StagingPool(1, 4, devices.get_backend("cpu"))
    staging.claim(1, 1.0, lambda: 0)
    with pytest.raises(OmniPrefixCacheStagingTimeoutError,
                       match=r"step 2: .*unused step ids \[1\]"):
        staging.claim(2, 0.1, lambda: 0)
    staging.release(0, ("step", 1))
    assert staging.claim(3, 0.1, lambda: 0) == 0  # free again once its step released it
