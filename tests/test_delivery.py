"""What the next stage receives from the runner: rows by position, across steps and preemption."""

from __future__ import annotations

import pytest
import torch

from prefix_cache import OmniPrefixCacheUnmatchError
from prefix_cache.delivery import StageDelivery


def rows(start: int, end: int) -> dict[str, torch.Tensor]:
    positions = torch.arange(start, end, dtype=torch.float32)
    return {"hidden": positions[:, None].repeat(1, 2), "mm.audio": positions[:, None]}


def test_steps_concatenate_by_position() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 5))
    delivery.add("a", 5, rows(5, 6))
    out = delivery.pop("a")
    assert torch.equal(out["hidden"], rows(0, 6)["hidden"])
    assert torch.equal(out["mm.audio"], rows(0, 6)["mm.audio"])
    assert delivery.pop("a") == {}


def test_rows_recomputed_after_preemption_replace_the_delivered_ones() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 8))
    delivery.add("a", 8, rows(8, 10))
    delivery.add("a", 4, {k: v + 100 for k, v in rows(4, 12).items()})  # resumed at its hit
    hidden = delivery.pop("a")["hidden"]
    assert hidden.shape == (12, 2)
    assert torch.equal(hidden[:4], rows(0, 4)["hidden"])
    assert torch.equal(hidden[4:], rows(4, 12)["hidden"] + 100)


def test_rows_past_the_delivered_ones_are_refused_naming_the_gap() -> None:
    delivery = StageDelivery()
    delivery.add("a", 0, rows(0, 4))
    with pytest.raises(OmniPrefixCacheUnmatchError, match=r"request a: .*positions 4\.\.7"):
        delivery.add("a", 8, rows(8, 9))
