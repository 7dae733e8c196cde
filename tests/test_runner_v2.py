"""Model Runner V2's block-id mirror and step view, on CPU (the engine itself needs a GPU: its
end-to-end test is in tests/test_gpu_engine.py).

`FakeBlockTables` stands in for `vllm.v1.worker.gpu.block_table.BlockTables`, whose table lives on
the device: it keeps what `append_block_ids` was given (per group; `overwrite` restarts the row),
the way vLLM's does before expanding to kernel blocks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefix_cache import OmniPrefixCacheUnmatchError
from prefix_cache.core.runs import runs_slots
from prefix_cache.integration.runner_v2 import (BlockIdMirror, PrefixCacheV2RunnerMixin,
                                               StepBatchGroupView)

BLOCK = 16


class FakeBlockTables:
    """append_block_ids(req_index, new_block_ids per group, overwrite), kept as Python lists."""

    def __init__(self, groups: int = 2) -> None:
        self.rows: dict[tuple[int, int], list[int]] = {}
        self.groups = groups

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...],
                         overwrite: bool) -> None:
        for g in range(self.groups):
            row = [] if overwrite else self.rows.get((g, req_index), [])
            self.rows[(g, req_index)] = row + list(new_block_ids[g])


def expected_slots(blocks: list[int], start: int, count: int) -> list[int]:
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)]


def test_the_mirror_follows_appends_and_overwrites_of_its_group() -> None:
    tables = FakeBlockTables()
    mirror = BlockIdMirror(tables, group_id=1, max_num_reqs=4, max_blocks=8)
    tables.append_block_ids(2, ([9], [3, 4]), overwrite=True)
    tables.append_block_ids(2, ([10], [5]), overwrite=False)
    assert mirror.ids[2, :3].tolist() == tables.rows[(1, 2)] == [3, 4, 5]
    tables.append_block_ids(2, ([11], [7]), overwrite=True)  # a request re-added (resumed)
    assert mirror.counts[2] == 1 and mirror.ids[2, 0] == 7
    with pytest.raises(OmniPrefixCacheUnmatchError, match="more than the 8"):
        tables.append_block_ids(0, ([], list(range(1, 10))), overwrite=True)


def test_the_view_gives_each_scheduled_position_its_slot_in_batch_order() -> None:
    rng = random.Random(0)
    tables = FakeBlockTables(groups=1)
    mirror = BlockIdMirror(tables, group_id=0, max_num_reqs=8, max_blocks=16)
    blocks, computed, scheduled = {}, {}, {}
    for row in range(8):
        blocks[row] = rng.sample(range(1, 200), 12)
        half = rng.randrange(1, 12)
        tables.append_block_ids(row, (blocks[row][:half],), overwrite=True)
        tables.append_block_ids(row, (blocks[row][half:],), overwrite=False)
    batch = [5, 0, 3]  # V2's per-step order: rows of the request states, not 0..n
    req_ids = [f"r{row}" for row in batch]
    for req_id in req_ids:
        computed[req_id] = rng.randrange(0, 100)
        scheduled[req_id] = rng.randrange(1, 60)
    view = StepBatchGroupView(mirror, BLOCK,
                              lambda req_id: int(req_id[1:]) if req_id != "gone" else None)
    slot_mapping = torch.arange(10)
    view.bind(req_ids, np.array([computed[r] for r in req_ids], dtype=np.int32),
              np.array(batch, dtype=np.int32), slot_mapping)
    assert view.batch_req_ids() == req_ids and view.device_slot_mapping() is slot_mapping
    want = [s for req_id, row in zip(req_ids, batch, strict=True)
            for s in expected_slots(blocks[row], computed[req_id], scheduled[req_id])]
    assert view.step_slots_cpu(req_ids, scheduled).tolist() == want
    # a request's positions from 0 or from a chunk's start, whether or not the bound step
    # schedules it
    for row in (5, 7):
        assert runs_slots(view.request_positions_runs(f"r{row}", 150)).tolist() == \
            expected_slots(blocks[row], 0, 150)
        assert runs_slots(view.request_positions_runs(f"r{row}", 150, 37)).tolist() == \
            expected_slots(blocks[row], 37, 113)
    assert view.request_positions_runs("gone", 10) is None
    # every request's at once (a step's chunks), end to end
    assert runs_slots(view.requests_positions_runs(["r7", "r5"], [37, 0], [150, 150])
                      ).tolist() == expected_slots(blocks[7], 37, 113) + \
        expected_slots(blocks[5], 0, 150)
    assert view.requests_positions_runs(["r5", "gone"], [0, 0], [1, 1]) is None


class FakeRequestStates:
    """`RequestStates`' request index and prompt lengths, as V2 keeps them on the host."""

    def __init__(self, prompt_lens: dict[str, int]) -> None:
        self.req_id_to_index = {r: i for i, r in enumerate(prompt_lens)}
        self.prompt_len = SimpleNamespace(np=np.array(list(prompt_lens.values())))


def step(preempted: set[str] = frozenset(), scheduled: tuple[str, ...] = (),
         finished: set[str] = frozenset()) -> SimpleNamespace:
    return SimpleNamespace(preempted_req_ids=set(preempted), finished_req_ids=set(finished),
                           num_scheduled_tokens=dict.fromkeys(scheduled, 1))


def test_a_preempted_requests_prompt_length_outlives_its_state_until_it_is_scheduled() -> None:
    """V2 drops a request's state when vLLM preempts it: its prompt length stays known (an abort
    before it resumes publishes its rows, not an entry marked aborted) until a step schedules
    it again or it finishes."""
    runner = PrefixCacheV2RunnerMixin()
    runner.req_states = FakeRequestStates({"a": 48, "b": 30, "c": 7})
    runner._omni_note_preempted(step(preempted={"a", "b"}, scheduled=("c",)))
    runner.req_states = FakeRequestStates({"c": 7})  # vLLM's finish_requests inside the step
    assert [runner._omni_prompt_len(r) for r in "abcd"] == [48, 30, 7, None]
    runner._omni_note_preempted(step(scheduled=("a", "c")))  # `a` comes back as a new request
    runner._omni_note_preempted(step(scheduled=("c",), finished={"b"}))  # `b` aborted
    assert [runner._omni_prompt_len(r) for r in "abc"] == [None, None, 7]


class RecordingStage:
    """A stage driver's `turn_off`, recorded."""

    def __init__(self) -> None:
        self.off: list[str] = []

    def turn_off(self, reason: str) -> None:
        self.off.append(reason)


def test_a_step_state_v2_cannot_read_turns_the_stage_off_and_never_reaches_the_engine() -> None:
    """V2 hands the step's rows over in its execute-model state; one whose batch cannot be read
    turns the stage off, naming why, as V1's forward output does, and raises nothing (the GPU
    engine's V2 case met an AttributeError here once: the containment was V1's alone)."""
    runner = PrefixCacheV2RunnerMixin()
    runner._omni_stage = stage = RecordingStage()
    runner.omni_prefix_cache = None
    runner._omni_save_contained(SimpleNamespace(hidden_states=torch.zeros(2, 4)))  # no batch
    assert len(stage.off) == 1
    assert stage.off[0].startswith("reading the step's outputs failed: AttributeError")
