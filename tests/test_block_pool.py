"""PrefixBlockPool: its tiered tables read as one entry per slot, and every gather path returns
the rows at the given slots, in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_cache.devices.cpu import CpuBackend
from prefix_cache.core.block_pool import PrefixBlockPool
from prefix_cache.core.runs import slot_runs

BS = 4


def filled_pool(num_blocks: int = 32) -> PrefixBlockPool:
    pool = PrefixBlockPool(num_blocks, BS, CpuBackend())
    pool.install(pool.allocate("k", (3,), torch.float32))
    pool.keys["k"].flat.copy_(torch.arange(num_blocks * BS * 3, dtype=torch.float32).view(-1, 3))
    return pool


@pytest.mark.parametrize("slots", [
    np.array([8, 9, 10, 11, 40, 41, 42, 43, 4, 5, 6, 7]),  # whole blocks
    np.array([9, 40, 41, 4, 127, 5, 6]),                    # runs and single slots
], ids=["blocks", "slots"])
def test_gather_returns_the_rows_at_the_slots_in_order(slots: np.ndarray) -> None:
    pool = filled_pool()
    out = torch.empty((len(slots), 3))
    pool.gather("k", slots, out)
    assert torch.equal(out, pool.keys["k"].flat[torch.from_numpy(slots)])
    pool.close()


class PerSlotTables:
    """The pool's rule kept one entry per slot, as it was before the tables were tiered: the
    reference the tiered pool must agree with."""

    def __init__(self, num_slots: int, keys: tuple[str, ...]) -> None:
        self.claim = np.zeros(num_slots, dtype=np.int64)
        self.version = {k: np.zeros(num_slots, dtype=np.int64) for k in keys}
        self.producer = {k: np.zeros(num_slots, dtype=np.int64) for k in keys}

    def write(self, slots: np.ndarray, claim: int, keys: list[str], producer: int) -> None:
        self.claim[slots] = claim
        for k in keys:
            self.version[k][slots], self.producer[k][slots] = claim, producer

    def mark_lost(self, producer: int) -> None:
        for k, version in self.version.items():
            mine = (self.producer[k] == producer) & (version > 0)
            version[mine] = -version[mine]

    def copy_block(self, src: np.ndarray, dst: np.ndarray, claim: int) -> None:
        self.claim[dst] = claim
        for k, version in self.version.items():
            keep, lost = version[src] == self.claim[src], version[src] == -self.claim[src]
            keep &= self.claim[src] != 0
            lost &= self.claim[src] != 0
            version[dst] = np.where(keep, claim, np.where(lost, -claim, 0))
            self.producer[k][dst] = 0


_ops = st.one_of(
    st.tuples(st.just("write"), st.lists(st.integers(0, 8 * BS - 1), min_size=1, max_size=14,
                                         unique=True), st.sampled_from([["a"], ["b"], ["a", "b"]])),
    st.tuples(st.just("lose"), st.integers(0, 6)),
    st.tuples(st.just("copy"), st.integers(0, 7), st.integers(0, 7)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_ops, min_size=1, max_size=12))
def test_tiered_tables_read_as_one_entry_per_slot(ops) -> None:
    """Claims, records, losses and block copies, mixing whole blocks and partial ones: every
    read of the pool agrees with tables kept one entry per slot."""
    pool = PrefixBlockPool(8, BS, CpuBackend())
    for name in ("a", "b"):
        pool.install(pool.allocate(name, (1,), torch.float32))
    ref = PerSlotTables(pool.num_slots, ("a", "b"))
    producer = 0
    for op in ops:
        if op[0] == "write":
            slots = np.array(sorted(op[1]), dtype=np.int64)
            producer += 1
            claim = pool.claim(slot_runs(slots)[0])
            pool.record_write(op[2], slot_runs(slots)[0], claim, producer)
            ref.write(slots, claim, op[2], producer)
        elif op[0] == "lose":
            pool.mark_lost(op[1])
            ref.mark_lost(op[1])
        elif op[1] != op[2]:
            pool.copy_block(op[1], op[2])
            dst = np.arange(op[2] * BS, (op[2] + 1) * BS)
            ref.copy_block(np.arange(op[1] * BS, (op[1] + 1) * BS), dst,
                           int(pool.claims_at(dst[:1])[0]))
        every = np.arange(pool.num_slots)
        assert pool.claims_at(every).tolist() == ref.claim.tolist()
        for name in ("a", "b"):
            present = (ref.version[name] == ref.claim) & (ref.claim != 0)
            lost = (ref.version[name] == -ref.claim) & (ref.claim != 0)
            assert pool.present(name, every).tolist() == present.tolist()
            assert pool.lost(name, every).tolist() == lost.tolist()
            producers = set(np.unique(ref.producer[name][present]).tolist())
            assert pool.producer_ids(every, [name]) == producers
            mask, of_present = pool.present_and_producers(name, every)
            assert mask.tolist() == present.tolist() and of_present == producers
            # each present row's own producer, in the order of the slots asked about
            back = every[::-1].copy()
            _, _, of_rows = pool.row_states(name, back)
            assert of_rows.tolist() == ref.producer[name][back][present[back]].tolist()
        for first in range(0, pool.num_slots, 3):
            runs = np.array([[first, min(first + 6, pool.num_slots)]], dtype=np.int64)
            for held_from in (1, 3, 6):
                assert pool.any_held(runs, held_from, pins=False) is bool(
                    (ref.claim[first:first + 6] >= held_from).any())
    pool.close()


def test_pins_count_per_slot_and_per_block() -> None:
    pool = PrefixBlockPool(4, BS, CpuBackend())
    claim = pool.claim(np.array([[0, 16]], dtype=np.int64))
    whole, part = np.array([[4, 8]], dtype=np.int64), np.array([[5, 6]], dtype=np.int64)
    pool.pin(np.array([6, 7]))
    assert pool.any_held(whole, claim + 1) and not pool.any_held(part, claim + 1)
    assert pool.any_pinned(np.array([7])) and not pool.any_pinned(np.array([5]))
    pool.unpin(np.array([6, 7]))
    assert not pool.any_held(whole, claim + 1)
    assert not pool.any_held(whole, claim + 1, pins=False) and pool.any_held(whole, claim)
    pool.close()
