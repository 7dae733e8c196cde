"""StepLayout: each request's rows in batch order, checked against the scheduler's counts."""

from __future__ import annotations

import pytest

from prefix_cache import OmniPrefixCacheUnmatchError
from prefix_cache.layout import StepLayout
from tests.sim import StepDriver

BS = 4


def driver_with(scheduled: dict[str, int]) -> StepDriver:
    driver = StepDriver(block_size=BS)
    driver.step(new=[(req_id, list(range(n)), [i + 1], 0, n)
                     for i, (req_id, n) in enumerate(scheduled.items())])
    return driver


def test_rows_follow_the_batch_order_not_the_scheduler_dict() -> None:
    driver = driver_with({"a": 2, "b": 3})
    driver.batch = ["b", "a"]
    layout = StepLayout.of_step(driver, {"a": 2, "b": 3}, 5, BS, 64)
    assert layout.order == ["b", "a"]
    assert (layout.rows("b"), layout.rows("a")) == ((0, 3), (3, 5))
    assert list(layout.items()) == [("b", (0, 3)), ("a", (3, 5))]
    assert layout.slots.tolist() == [8, 9, 10, 4, 5]
    assert "a" in layout and "c" not in layout


def test_a_request_scheduled_for_zero_tokens_has_no_rows() -> None:
    driver = driver_with({"a": 2, "b": 3})
    layout = StepLayout.of_step(driver, {"a": 2, "b": 3, "idle": 0}, 5, BS, 64)
    assert layout.order == ["a", "b"]


@pytest.mark.parametrize("scheduled, num_rows", [
    ({"a": 2, "b": 3}, 4),            # fewer rows than tokens scheduled
    ({"a": 2, "b": 3, "c": 1}, 5),    # c is scheduled but not in the batch
], ids=["row-count", "missing-request"])
def test_rows_that_do_not_match_the_schedule_are_refused(scheduled: dict[str, int],
                                                         num_rows: int) -> None:
    driver = driver_with({"a": 2, "b": 3})
    with pytest.raises(OmniPrefixCacheUnmatchError, match="save_outputs: .* rows but the batch"):
        StepLayout.of_step(driver, scheduled, num_rows, BS, 64)


def test_slots_in_the_null_block_are_refused() -> None:
    driver = StepDriver(block_size=BS)
    driver.step(new=[("a", [1, 2], [0], 0, 2)])
    with pytest.raises(OmniPrefixCacheUnmatchError, match="null block"):
        StepLayout.of_step(driver, {"a": 2}, 2, BS, 64)
