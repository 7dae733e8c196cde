"""The step contract of SPEC §4, scenario by scenario, on every available backend."""

from __future__ import annotations

import contextlib
import threading
from contextlib import closing
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from prefix_cache import devices
from prefix_cache import (HIDDEN_KEY, ModelCachePolicy, OmniPrefixCacheError,
                          OmniPrefixCacheManager, OmniPrefixCacheStagingTimeoutError,
                          OmniPrefixCacheUnmatchError, PrefixCacheConfig, TaskState, WriteTask)
from prefix_cache.channel import StageChunk, open_channel
from prefix_cache.core.pool_rows import PoolRows
from tests.sim import StepDriver, token_rows

BS = 4


def make(backend: devices.DeviceBackend, *, num_blocks: int = 8, block_size: int = BS,
         **config) -> tuple[OmniPrefixCacheManager, StepDriver]:
    config.setdefault("staging_claim_timeout_s", 5.0)
    driver = StepDriver(block_size=block_size)
    manager = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks, block_size, **config), driver,
                                     backend=backend)
    return manager, driver


def run_step(manager: OmniPrefixCacheManager, driver: StepDriver, so: SimpleNamespace,
             device: torch.device, *, mm_width: int | None = 16, materialize: bool = True,
             plan_reads: bool = True):
    manager.new_step_starts(so)
    n = sum(driver.scheduled.values())
    mm = {"mm_feature": driver.outputs(mm_width, salt=1).to(device)} if mm_width else None
    sid = manager.save_outputs(driver.outputs(2).to(device), mm, num_tokens_unpadded=n,
                               num_tokens_padded=n, plan_reads=plan_reads)
    out = manager.materialize(sid, driver.batch) if materialize else sid
    driver.advance()
    return out


def test_every_save_hands_the_backend_its_host_slots(backend, monkeypatch):
    """The backend may copy by runs of host slots (CUDA's copy engine) even when the runner
    gives its device slot mapping: each save passes the view's slots as `host_slots`."""
    manager, d = make(backend)
    calls = []
    scatter_rows = backend.scatter_rows

    def recording(rows, slots, pool, **kwargs):
        calls.append(kwargs.get("host_slots"))
        return scatter_rows(rows, slots, pool, **kwargs)

    monkeypatch.setattr(backend, "scatter_rows", recording)
    tokens = list(range(100, 110))
    with manager:
        manager.new_step_starts(d.step(new=[("a", tokens, [2, 5, 3], 0, 10)]))
        slots = d.step_slots_cpu(d.batch_req_ids(), d.scheduled)
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=10,
                                   num_tokens_padded=10, slot_mapping=slots.to(backend.device))
        out = manager.materialize(sid, ["a"])
    assert len(calls) == 1 and np.array_equal(calls[0], slots.numpy())
    assert torch.equal(out.hidden_states["a"], token_rows(tokens, 2))


def test_materialize_step_hands_the_step_rows_once_and_each_hit_from_position_0(backend):
    """The output thread's form of `materialize`: the step's rows in its row order, one tensor
    per key, and a hit's rows from position 0; the same rows `materialize` gives per request."""
    manager, d = make(backend, num_blocks=16)
    first = list(range(100, 112))
    hit = first[:8] + [900, 901]             # blocks 1 and 2 cached, then its own block 6
    other = list(range(300, 306))
    with manager:
        run_step(manager, d, d.step(new=[("a", first, [1, 2, 3], 0, 12)]), backend.device)
        saved = []
        for as_step in (True, False):
            so = d.step(new=[(f"b{as_step}", hit, [1, 2, 6 + as_step], 8, 2),
                             (f"c{as_step}", other, [8 + 2 * as_step, 9 + 2 * as_step], 0, 6)])
            saved.append(run_step(manager, d, so, backend.device, materialize=False))
        step = manager.materialize_step(saved[0], ["bTrue", "cTrue"])
        per_request = manager.materialize(saved[1], ["bFalse", "cFalse"])
    assert step.order == ["bTrue", "cTrue"] and step.ends == [2, 8]
    assert set(step.hits) == {"bTrue"} and step.rows[HIDDEN_KEY].shape == (8, 2)
    assert torch.equal(step.rows[HIDDEN_KEY][:2], token_rows(hit, 2)[8:])
    assert torch.equal(step.rows[HIDDEN_KEY][2:], token_rows(other, 2))
    assert torch.equal(step.rows["mm_feature"][2:], token_rows(other, 16, salt=1))
    for key, rows in step.hits["bTrue"].items():
        want = token_rows(hit, 2 if key == HIDDEN_KEY else 16, salt=0 if key == HIDDEN_KEY else 1)
        assert torch.equal(rows, want), key
    assert torch.equal(per_request.hidden_states["bFalse"], step.hits["bTrue"][HIDDEN_KEY])
    assert torch.equal(per_request.hidden_states["cFalse"], step.rows[HIDDEN_KEY][2:])


# --------------------------------------------------------------------------- the seed's examples

def test_seed_example_second_request_gets_cached_block_rows_then_its_own(backend):
    """num_blocks=8, block_size=4, hidden 2, mm_feature 16: 'The quick brown fox ...'."""
    manager, d = make(backend)
    first = list(range(100, 112))                    # 12 tokens, blocks 1, 2, 3
    second = first[:4] + [900, 901, 902, 903]        # shares block 1, then block 4
    with manager:
        out = run_step(manager, d, d.step(new=[("a", first, [1, 2, 3], 0, 12)]), backend.device)
        assert torch.equal(out.hidden_states["a"], token_rows(first, 2))
        out = run_step(manager, d, d.step(new=[("b", second, [1, 4], 4, 4)]), backend.device)
        assert out.hidden_states["b"].shape == (8, 2)
        assert torch.equal(out.hidden_states["b"], token_rows(second, 2))
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(second, 16, salt=1))
        stats = manager.stats()
        assert stats["hit_tokens"] == 4 and stats["miss_tokens"] == 16


def test_seed_partial_block_multimodal_prefix_hits_only_the_full_block(backend):
    """[Im0..Im3][Im4 Im5 foo] then [Im0..Im3][Im4 Im5 bar baz]: only block 1 is a hit."""
    manager, d = make(backend)
    image = [500, 501, 502, 503, 504, 505]
    with manager:
        run_step(manager, d, d.step(new=[("a", image + [7], [1, 2], 0, 7)]), backend.device)
        second = image + [8, 9]
        out = run_step(manager, d, d.step(new=[("b", second, [1, 3], 4, 4)], finished=["a"]),
                       backend.device)
        assert torch.equal(out.hidden_states["b"], token_rows(second, 2))
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(second, 16, salt=1))


def test_a_hit_keeps_its_cached_mm_rows_when_its_step_emits_no_such_key(backend):
    """a: 8 tokens with an `mm_feature` row each; b hits a's first block and its step emits
    hidden states only: b still gets a's mm rows there, then zeros (rules 5 and 6)."""
    manager, d = make(backend)
    first = list(range(100, 108))                    # blocks 1, 2
    second = first[:4] + [900, 901, 902, 903]        # shares block 1, then block 3
    with manager:
        run_step(manager, d, d.step(new=[("a", first, [1, 2], 0, 8)]), backend.device)
        out = run_step(manager, d, d.step(new=[("b", second, [1, 3], 4, 4)]), backend.device,
                       mm_width=None)
        rows = out.mm_outputs["mm_feature"]["b"]
        assert rows.shape == (8, 16)
        assert torch.equal(rows[:4], token_rows(first[:4], 16, salt=1))
        assert not rows[4:].any()
        assert torch.equal(out.hidden_states["b"], token_rows(second, 2))
        # a hit on blocks that never had such rows gets no such key
        out = run_step(manager, d, d.step(new=[("c", second[4:] + [7], [3, 4], 4, 1)]),
                       backend.device, mm_width=None)
        assert "c" not in out.mm_outputs.get("mm_feature", {})


def test_hits_planned_together_each_get_the_cached_keys_of_their_own_blocks(backend):
    """Two hits in one step, planned in one pass: b's block has cached mm rows and c's never
    had any, so b gets them (then zeros) and c gets no such key; each its own hidden rows."""
    manager, d = make(backend)
    first = list(range(100, 108))                    # blocks 1, 2, with mm rows
    other = list(range(200, 204))                    # block 3, hidden rows only
    b, c = first[:4] + [900], other + [901]
    with manager:
        run_step(manager, d, d.step(new=[("a", first, [1, 2], 0, 8)]), backend.device)
        run_step(manager, d, d.step(new=[("o", other, [3], 0, 4)]), backend.device,
                 mm_width=None)
        out = run_step(manager, d, d.step(new=[("b", b, [1, 4], 4, 1), ("c", c, [3, 5], 4, 1)]),
                       backend.device, mm_width=None)
    rows = out.mm_outputs["mm_feature"]
    assert torch.equal(rows["b"][:4], token_rows(first[:4], 16, salt=1)) and not rows["b"][4:].any()
    assert "c" not in rows
    assert torch.equal(out.hidden_states["b"], token_rows(b, 2))
    assert torch.equal(out.hidden_states["c"], token_rows(c, 2))


# --------------------------------------------------------------------------- step rules

def test_finished_request_blocks_handed_to_new_tenant_in_same_step(backend):
    manager, d = make(backend)
    with manager:
        a = list(range(10, 18))
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        c = list(range(40, 48))  # a miss that reuses a's freed blocks in the same output
        out = run_step(manager, d, d.step(new=[("c", c, [2, 1], 0, 8)], finished=["a"]),
                       backend.device)
        assert torch.equal(out.hidden_states["c"], token_rows(c, 2))
        e = c[:4] + [1, 2, 3, 4]
        out = run_step(manager, d, d.step(new=[("e", e, [2, 3], 4, 4)]), backend.device)
        assert torch.equal(out.hidden_states["e"], token_rows(e, 2))


def test_live_request_reentering_new_requests_gets_no_hit_span(backend):
    manager, d = make(backend)
    tokens = list(range(20, 32))
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2, 3], 0, 8)]), backend.device)
        # an async_chunk continuation: same id, num_computed = what it computed itself
        out = run_step(manager, d, d.step(new=[("a", tokens, [1, 2, 3], 8, 4)]), backend.device)
        assert out.hidden_states["a"].shape == (4, 2)
        assert torch.equal(out.hidden_states["a"], token_rows(tokens, 2)[8:12])


def test_unaligned_hit_is_refused_naming_the_request(backend):
    manager, d = make(backend)
    with manager, pytest.raises(OmniPrefixCacheUnmatchError, match="request x.*not aligned"):
        manager.new_step_starts(d.step(new=[("x", list(range(8)), [1, 2], 3, 5)]))


def test_same_step_hit_on_blocks_computed_in_that_forward(backend):
    manager, d = make(backend)
    a = list(range(60, 68))
    b = a[:4] + [5, 6]
    with manager:
        out = run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8), ("b", b, [1, 3], 4, 2)]),
                       backend.device)
        assert torch.equal(out.hidden_states["a"], token_rows(a, 2))
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))


def test_padded_per_token_key_is_sliced_and_leftover_returned_unsplit(backend):
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        manager.new_step_starts(d.step(new=[("a", tokens, [1, 2], 0, 6)]))
        padded = torch.cat([d.outputs(3), torch.full((2, 3), 99.0)]).to(backend.device)
        ref = torch.arange(5.0).to(backend.device)
        sid = manager.save_outputs(
            torch.cat([d.outputs(2), torch.zeros(2, 2)]).to(backend.device),
            {"codes": {"audio": padded}, "ref": ref, "meta": [1, 2]},
            num_tokens_unpadded=6, num_tokens_padded=8)
        out = manager.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["codes.audio"]["a"], token_rows(tokens, 3)[:6])
        assert out.hidden_states["a"].shape == (6, 2)
        assert torch.equal(out.leftover["ref"], torch.arange(5.0))
        assert out.leftover["ref"].device.type == "cpu" and out.leftover["meta"] == [1, 2]


def test_policy_without_hidden_returns_no_hidden(backend):
    manager, d = make(backend)
    manager.register_policy(ModelCachePolicy(needs_full_hidden_states=False))
    with manager:
        out = run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]), backend.device)
        assert out.hidden_states is None
        assert HIDDEN_KEY not in manager.pool.keys


def test_deferred_key_written_on_finish_and_served_to_a_later_hit(backend):
    manager, d = make(backend)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    a = list(range(70, 78))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        assert manager.stats()["deferred_device_bytes"] > 0  # held until the finish
        b = a[:4] + [3, 3]
        out = run_step(manager, d, d.step(new=[("b", b, [1, 3], 4, 2)], finished=["a"]),
                       backend.device)
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(b, 16, salt=1))
        assert manager.pool.present("mm_feature", np.arange(4, 8)).all()


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred-mm"])
def test_a_finished_requests_rows_read_back_whole_after_its_blocks_go_to_a_new_tenant(
        backend, deferred):
    """What a finish-time delivery relies on: planned at the finish, while the view holds the
    request, the read keeps its rows though the next step's new tenant rewrites its blocks;
    deferred rows (held on the device until the finish) are launched and read too."""
    manager, d = make(backend)
    if deferred:
        manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    a, c = list(range(40, 50)), list(range(300, 308))
    with manager:
        sids = [run_step(manager, d, d.step(new=[("a", a, [1, 2, 3], 0, 8)]), backend.device,
                         materialize=False)]
        for _ in range(2):  # two decode steps
            sids.append(run_step(manager, d, d.step(cached={"a": 1}), backend.device,
                                 materialize=False))
        for sid in sids:
            manager.discard_step(sid)  # what the runner does with a step it reads at the finish
        whole, standing = manager.plan_request_rows({"a": None})["a"], None
        assert whole.num_rows == 10 and sorted(whole.keys) == [HIDDEN_KEY, "mm_feature"]
        standing = manager.plan_request_rows({"a": 9})["a"]  # the last row's token discarded
        assert manager.plan_request_rows({"never-scheduled": None}) == {}
        sid_c = run_step(manager, d, d.step(new=[("c", c, [2, 1], 0, 8)], finished=["a"]),
                         backend.device, materialize=False)
        assert manager.stats()["copy_on_write_reads"] >= 1
        rows = whole.resolve()
        assert torch.equal(rows[HIDDEN_KEY], token_rows(a, 2))
        assert torch.equal(rows["mm_feature"], token_rows(a, 16, salt=1))
        assert standing.num_rows == 9 and torch.equal(standing.resolve()[HIDDEN_KEY],
                                                      token_rows(a, 2)[:9])
        assert torch.equal(manager.materialize(sid_c, ["c"]).hidden_states["c"],
                           token_rows(c, 2))


def test_rows_held_for_the_channel_move_out_of_the_pool_when_a_new_tenant_writes_their_blocks(
        backend):
    """The one-copy read-back: a finished request's rows held for the channel's writer
    (`hold`) stay in the pool, pinned, until the step whose new tenant rewrites their blocks:
    that step moves them into memory of their own and goes on, without waiting for the writer,
    and the entry the writer makes later holds the request's own rows."""
    manager, d = make(backend)
    a, c = list(range(40, 50)), list(range(300, 308))
    with manager, open_channel("shm") as channel:
        sids = [run_step(manager, d, d.step(new=[("a", a, [1, 2, 3], 0, 8)]), backend.device,
                         materialize=False)]
        sids.append(run_step(manager, d, d.step(cached={"a": 2}), backend.device,
                             materialize=False))
        for sid in sids:
            manager.discard_step(sid)
        rows = manager.plan_request_rows({"a": None})["a"]
        held = rows.hold()
        assert {key: type(r) for key, r in held.items()} == {HIDDEN_KEY: PoolRows,
                                                            "mm_feature": PoolRows}
        new_tenant = threading.Thread(target=run_step, args=(
            manager, d, d.step(new=[("c", c, [2, 1], 0, 8)], finished=["a"]), backend.device),
            kwargs={"materialize": False})
        new_tenant.start()
        new_tenant.join(30)
        assert not new_tenant.is_alive()  # its write of blocks 2 and 1 did not wait
        assert manager.stats()["copy_on_write_reads"] >= 1
        assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))
        channel.put("a", held)  # the writer copies the moved rows into the entry
        rows.cancel()  # let go already: nothing is left to release
        got = channel.get("a", timeout_s=5)
        assert torch.equal(got[HIDDEN_KEY], token_rows(a, 2))
        assert torch.equal(got["mm_feature"], token_rows(a, 16, salt=1))


def test_a_steps_hits_that_earlier_steps_wrote_are_read_before_its_forward(backend):
    """What a streaming stage's first chunk relies on (`plan_hit_rows`, at the step's start):
    a hit on blocks earlier steps wrote reads them at once; a hit on a block vLLM cached in the
    step under way (filled by its forward) is left to the step, though the pool still holds
    the block's former tenant's rows, which would read as present. Rows read early are the
    caller's to hand over: the step's materialize gives that request's rows from its hit's end."""
    manager, d = make(backend)
    manager.track_allocations()
    a, z = list(range(40, 48)), [7, 7, 7, 7]
    c = list(range(90, 98))
    with manager:
        manager.discard_step(run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8),
                                                              ("z", z, [4], 0, 4)]),
                                      backend.device, materialize=False))
        b = a + [5, 5, 5, 5]
        manager.new_step_starts(d.step(new=[("b", b, [1, 2, 3], 8, 4)], finished=["a", "z"]))
        hits = manager.plan_hit_rows()
        assert list(hits) == ["b"] and hits["b"].num_rows == 8
        rows = hits["b"].resolve()
        assert torch.equal(rows[HIDDEN_KEY], token_rows(a, 2))
        assert torch.equal(rows["mm_feature"], token_rows(a, 16, salt=1))
        sid = manager.save_outputs(d.outputs(2).to(backend.device), {"mm_feature": d.outputs(
            16, salt=1).to(backend.device)}, num_tokens_unpadded=4, num_tokens_padded=4)
        got = manager.materialize(sid, ["b"])  # its hit rows were handed over: not read again
        assert torch.equal(got.hidden_states["b"], token_rows(b, 2)[8:])
        d.advance()
        # block 4, z's until now, goes to c, which fills it in this step; e hits it at once
        e = c[:4] + [6, 6, 6, 6]
        _hit_is_left_to_the_step_filling_it(
            manager, d, backend, d.step(new=[("c", c, [4, 5], 0, 8), ("e", e, [4, 6], 4, 4)]),
            "e", e)
        assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))


def _hit_is_left_to_the_step_filling_it(manager: OmniPrefixCacheManager, d: StepDriver,
                                        backend: Any, scheduler_output: Any, req_id: str,
                                        prompt: list[int]) -> None:
    """Runs `scheduler_output`, in which `req_id` hits a block the step itself fills: no hit
    is read before the forward, and the step's own reads give `req_id` its `prompt`'s rows."""
    manager.new_step_starts(scheduler_output)
    assert manager.plan_hit_rows() == {}
    n = sum(scheduler_output.num_scheduled_tokens.values())
    sid = manager.save_outputs(d.outputs(2).to(backend.device),
                               {"mm_feature": d.outputs(16, salt=1).to(backend.device)},
                               num_tokens_unpadded=n, num_tokens_padded=n)
    got = manager.materialize(sid, [req_id])  # the step's own reads serve it
    assert torch.equal(got.hidden_states[req_id], token_rows(prompt, 2))
    d.advance()


@pytest.mark.parametrize("step_path", ["c", "python"])
def test_a_block_a_running_request_got_in_a_decode_step_reads_as_its_new_tenants(backend,
                                                                                step_path):
    """A decode step (running requests only: one C call on the C step path) that gives a
    running request a new block, a finished request's written one, marks it allocated: a hit
    in the step that fills it (vLLM cached it at scheduling) is left to the step, though the
    block's last slot still holds its former tenant's row."""
    manager, d = make(backend, step_path=step_path)
    manager.track_allocations()
    z, a = [7, 7, 7, 7], list(range(40, 52))
    with manager:
        manager.discard_step(run_step(manager, d, d.step(new=[("z", z, [4], 0, 4),
                                                              ("a", a, [1], 0, 3)]),
                                      backend.device, materialize=False))
        manager.discard_step(run_step(manager, d, d.step(cached={"a": 1}, finished=["z"]),
                                      backend.device, materialize=False))
        manager.discard_step(run_step(manager, d, d.step(cached={"a": 1},
                                                         new_blocks={"a": [4]}),
                                      backend.device, materialize=False))
        for _ in range(2):  # positions 5 and 6 into block 4 (position 3 and 4 before)
            manager.discard_step(run_step(manager, d, d.step(cached={"a": 1}), backend.device,
                                          materialize=False))
        e = a[:8] + [6, 6, 6, 6]  # a fills block 4 in this step; e hits it at once
        _hit_is_left_to_the_step_filling_it(
            manager, d, backend, d.step(new=[("e", e, [1, 4, 5], 8, 4)], cached={"a": 1}),
            "e", e)


def test_hits_read_before_the_forward_need_allocations_tracked_from_the_first_step(backend):
    manager, d = make(backend)
    with manager:
        manager.new_step_starts(d.step(new=[("a", [1, 2, 3, 4], [1], 0, 4)]))
        with pytest.raises(OmniPrefixCacheUnmatchError, match="plan_hit_rows needs "
                                                              "track_allocations"):
            manager.plan_hit_rows()
        with pytest.raises(OmniPrefixCacheUnmatchError, match="after the first step"):
            manager.track_allocations()


def test_steps_saved_without_reads_are_only_discarded_and_read_back_at_the_finish(backend):
    """A stage that reads every request back at its finish saves steps with
    `plan_reads=False`: its hits hold no slots, `materialize` refuses such a step by name, and
    the finish reads a hit request's rows whole, a prefix that a live request's deferred
    write still holds on the device included (launched by the finish, not waited for)."""
    manager, d = make(backend, staging_claim_timeout_s=2.0)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    a = list(range(70, 82))
    b = a[:8] + [5, 5]
    with manager:
        manager.discard_step(run_step(manager, d, d.step(new=[("a", a, [1, 2, 3], 0, 12)]),
                                      backend.device, materialize=False, plan_reads=False))
        assert manager.stats()["deferred_device_bytes"] > 0  # a runs on: its rows on the device
        sid = run_step(manager, d, d.step(new=[("b", b, [1, 2, 4], 8, 2)]), backend.device,
                       materialize=False, plan_reads=False)
        assert manager.stats()["hit_requests"] == 1
        assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))
        with pytest.raises(OmniPrefixCacheUnmatchError, match=rf"step {sid}.*plan_reads=False"):
            manager.materialize(sid, ["b"])
        manager.discard_step(sid)  # the refusal consumed nothing
        rows = manager.plan_request_rows({"b": None})["b"].resolve()  # b finishes before a
        assert torch.equal(rows[HIDDEN_KEY], token_rows(b, 2))
        assert torch.equal(rows["mm_feature"], token_rows(b, 16, salt=1))


def copy_an_unwritten_block_into_a(manager: OmniPrefixCacheManager, d: StepDriver,
                                    tokens: list[int], device: torch.device) -> None:
    """`a` and `b` prefill `tokens` (blocks 1-2 and 3-4); then vLLM copies block 7, which
    nobody wrote, into `a`'s block 2 in a step without a forward."""
    manager.discard_step(run_step(
        manager, d, d.step(new=[("a", tokens, [1, 2], 0, 8), ("b", tokens, [3, 4], 0, 8)]),
        device, materialize=False, plan_reads=False))
    so = d.step()
    so.kv_cache_block_copies = [SimpleNamespace(src_block_id=7, dst_block_id=2)]
    manager.new_step_starts(so)
    manager.discard_step(manager.save_outputs(
        d.outputs(2).to(device), None, num_tokens_unpadded=0, num_tokens_padded=0,
        plan_reads=False))


def test_a_finish_read_back_fails_a_request_whose_hidden_rows_are_not_all_there(backend):
    """Hidden rows are never absent: read back at the finish, a request one of whose blocks
    got a copy of a block nobody wrote fails by name (zeros would pass for rows nobody
    computed); the other request reads back whole."""
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        copy_an_unwritten_block_into_a(manager, d, tokens, backend.device)
        rows = manager.plan_request_rows({"a": None, "b": None})
        with pytest.raises(OmniPrefixCacheError, match=r"hidden rows of 4 of its positions 0\.\.7 "
                                                           r"\(first 4\) were never written"):
            rows["a"].resolve()
        assert torch.equal(rows["b"].resolve()[HIDDEN_KEY], token_rows(tokens, 2))


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred-mm"])
def test_a_steps_chunks_are_read_together_in_place_and_let_go_once_written(backend, deferred):
    """A streaming stage's chunks (`plan_chunk_rows`): one read per key for all of a step's
    chunks, each request's rows of its positions left in the pool for the channel's writer,
    with an mm key only where the chunk has rows of it (deferred rows, held on the device until
    the finish, launched for it); the pins go once every chunk's rows are written, and the
    entries hold each request's own rows."""
    manager, d = make(backend)
    if deferred:
        manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    a, b = list(range(40, 50)), list(range(300, 310))
    with manager, open_channel("shm") as channel:
        sids = [run_step(manager, d, d.step(new=[("a", a, [1, 2, 3], 0, 8),
                                                 ("b", b, [4, 5, 6], 0, 8)]),
                         backend.device, materialize=False)]
        sids.append(run_step(manager, d, d.step(cached={"a": 1, "b": 1}), backend.device,
                             mm_width=None, materialize=False))  # hidden rows only
        for sid in sids:
            manager.discard_step(sid)
        with torch.inference_mode():  # as vLLM's engine thread calls it
            chunks = manager.plan_chunk_rows({"a": (6, 9), "b": (8, 9), "gone": (0, 1)})
        assert sorted(chunks) == ["a", "b"]  # a request the view does not hold: none
        assert [(c.start, c.num_rows) for c in chunks.values()] == [(6, 9), (8, 9)]
        held = {req_id: rows.hold() for req_id, rows in chunks.items()}
        assert {key: type(r) for key, r in held["a"].items()} == {HIDDEN_KEY: PoolRows,
                                                                 "mm_feature": PoolRows}
        assert list(held["b"]) == [HIDDEN_KEY]  # no mm row in its chunk's position
        assert manager.pool.any_pinned(np.arange(manager.pool.num_slots))
        failures = channel.put_all([(req_id, StageChunk(rows, 0, final=False))
                                    for req_id, rows in held.items()])
        assert failures == [None, None]  # written: the pins went with the last
        assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))
        for rows in chunks.values():
            rows.cancel()
        got = {req_id: next(iter(channel.stream(req_id, timeout_s=5))).rows for req_id in held}
    assert torch.equal(got["a"][HIDDEN_KEY], token_rows(a, 2)[6:9])
    assert torch.equal(got["a"]["mm_feature"],
                       torch.cat([token_rows(a, 16, salt=1)[6:8], torch.zeros(1, 16)]))
    assert torch.equal(got["b"][HIDDEN_KEY], token_rows(b, 2)[8:9])


def test_a_chunk_without_its_hidden_rows_fails_alone_and_the_others_read(backend):
    """A chunk some of whose positions have no hidden row (its block got a copy of a block
    nobody wrote) fails by name, its positions said; the step's other chunks read."""
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        copy_an_unwritten_block_into_a(manager, d, tokens, backend.device)
        chunks = manager.plan_chunk_rows({"a": (2, 8), "b": (2, 8)})
        with pytest.raises(OmniPrefixCacheError, match=r"hidden rows of 4 of its positions "
                                                       r"2\.\.7 \(first 4\) were never written"):
            chunks["a"].hold()
        rows = chunks["b"].hold()
        assert type(rows[HIDDEN_KEY]) is PoolRows and rows[HIDDEN_KEY].shape == (6, 2)
        for chunk in chunks.values():
            chunk.cancel()
        assert not manager.pool.any_pinned(np.arange(manager.pool.num_slots))


def test_deferred_budget_flush_splits_writes_and_a_hit_reads_both(backend):
    # each chunk of 4 rows x 16 floats is 256 bytes: a 300-byte budget flushes every step
    manager, d = make(backend, num_blocks=8, gpu_budget_bytes=300)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    tokens = list(range(80, 92))
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2, 3], 0, 4)]), backend.device)
        run_step(manager, d, d.step(cached={"a": 4}), backend.device)
        run_step(manager, d, d.step(cached={"a": 4}), backend.device)
        b = tokens[:8] + [1]
        out = run_step(manager, d, d.step(new=[("b", b, [1, 2, 4], 8, 1)]), backend.device)
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(b, 16, salt=1))


def test_absent_hidden_rows_on_a_hit_are_fatal_but_absent_mm_rows_read_zeros(backend):
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="never written"):
            run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 4, 4)]), backend.device)
    manager, d = make(backend)
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 0, 8)]), backend.device,
                 mm_width=None)
        b = tokens[:4] + [9]
        out = run_step(manager, d, d.step(new=[("b", b, [1, 3], 4, 1)]), backend.device)
        mm = out.mm_outputs["mm_feature"]["b"]
        assert torch.equal(mm[:4], torch.zeros(4, 16))
        assert torch.equal(mm[4:], token_rows(b, 16, salt=1)[4:])


def test_a_step_without_an_mm_key_leaves_zeros_on_a_hit_and_the_rows_around_them(backend):
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 0, 2)]), backend.device)
        run_step(manager, d, d.step(cached={"a": 1}), backend.device, mm_width=None)
        run_step(manager, d, d.step(cached={"a": 5}), backend.device)
        b = tokens[:4] + [9]
        out = run_step(manager, d, d.step(new=[("b", b, [1, 3], 4, 1)]), backend.device)
        expected = token_rows(b, 16, salt=1)
        expected[2] = 0
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], expected)
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))


def test_delayed_read_keeps_its_rows_when_the_next_step_reuses_the_slots(backend):
    manager, d = make(backend)
    a = list(range(30, 38))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        b = a[:4] + [1]
        sid_b = run_step(manager, d, d.step(new=[("b", b, [1, 3], 4, 1)], finished=["a"]),
                         backend.device, materialize=False)
        c = list(range(200, 208))  # block 1 handed to a new tenant before b is materialized
        sid_c = run_step(manager, d, d.step(new=[("c", c, [1, 2], 0, 8)], finished=["b"]),
                         backend.device, materialize=False)
        out_b = manager.materialize(sid_b, ["b"])
        assert torch.equal(out_b.hidden_states["b"], token_rows(b, 2))
        assert torch.equal(manager.materialize(sid_c, ["c"]).hidden_states["c"],
                           token_rows(c, 2))


@pytest.mark.parametrize("engine_mode", [contextlib.nullcontext, torch.inference_mode],
                         ids=["plain", "inference-mode"])
def test_unread_step_keeps_its_own_rows_when_a_new_tenant_rewrites_its_slots(backend,
                                                                             engine_mode):
    """Also with the engine thread's calls under vLLM's inference mode: the read resolved on
    the engine thread hands its consumer a normal tensor."""
    manager, d = make(backend)
    a, c = list(range(40, 48)), list(range(300, 308))
    with manager:
        with engine_mode():
            sid_a = run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device,
                             materialize=False)
            # a aborted before its step was read: c takes both its blocks and writes them
            sid_c = run_step(manager, d, d.step(new=[("c", c, [2, 1], 0, 8)], finished=["a"]),
                             backend.device, materialize=False)
        assert manager.stats()["copy_on_write_reads"] >= 1
        rows = manager.materialize(sid_a, ["a"]).hidden_states["a"]
        assert torch.equal(rows, token_rows(a, 2))
        rows.add_(1)  # the caller owns what it is handed
        assert torch.equal(manager.materialize(sid_c, ["c"]).hidden_states["c"],
                           token_rows(c, 2))


def test_preempted_request_resumes_with_only_the_rows_it_recomputes(backend):
    manager, d = make(backend)
    tokens = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2], 0, 4)]), backend.device)
        d.reqs["a"].computed = 0  # preempted: vLLM resets num_computed_tokens
        d.reqs["a"].blocks = [3, 4]
        so = d.step(cached={"a": 8})
        so.scheduled_cached_reqs.resumed_req_ids = {"a"}
        out = run_step(manager, d, so, backend.device)
        assert torch.equal(out.hidden_states["a"], token_rows(tokens, 2))


def test_block_copy_is_mirrored_so_the_copy_serves_the_same_rows(backend):
    manager, d = make(backend)
    a = list(range(8))
    with manager:
        run_step(manager, d, d.step(new=[("a", a, [1, 2], 0, 8)]), backend.device)
        so = d.step(new=[("b", a[:4] + [9], [5, 6], 4, 1)], finished=["a"])
        so.kv_cache_block_copies = [SimpleNamespace(src_block_id=1, dst_block_id=5)]
        out = run_step(manager, d, so, backend.device)
        assert torch.equal(out.hidden_states["b"], token_rows(a[:4] + [9], 2))


# --------------------------------------------------------------------------- consumption and bounds

def test_each_step_id_is_consumed_exactly_once(backend):
    manager, d = make(backend)
    with manager:
        sid = run_step(manager, d, d.step(new=[("a", list(range(4)), [1], 0, 4)]),
                       backend.device, materialize=False)
        with pytest.raises(OmniPrefixCacheUnmatchError, match=r"requests \['zz'\]"):
            manager.materialize(sid, ["zz"])
        manager.materialize(sid, ["a"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match=f"step {sid} is unknown"):
            manager.materialize(sid, ["a"])
        with pytest.raises(OmniPrefixCacheUnmatchError, match="step 999 is unknown"):
            manager.discard_step(999)


def test_staging_backpressure_times_out_naming_unused_step_ids(backend):
    manager, d = make(backend, staging_depth=2, staging_claim_timeout_s=0.3)
    with manager:
        sids = [run_step(manager, d, d.step(new=[(f"r{i}", [i] * 4, [i + 1], 0, 4)]),
                         backend.device, materialize=False) for i in range(2)]
        manager.new_step_starts(d.step(new=[("late", [9] * 4, [5], 0, 4)]))
        with pytest.raises(OmniPrefixCacheStagingTimeoutError,
                           match=rf"unused step ids \[{sids[0]}, {sids[1]}\].*write tasks pending"):
            manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=4,
                                 num_tokens_padded=4)
        manager.discard_step(sids[0])  # the timed-out save changed nothing: retry it as is
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None,
                                   num_tokens_unpadded=4, num_tokens_padded=4)
        assert torch.equal(manager.materialize(sid, ["late"]).hidden_states["late"],
                           token_rows([9] * 4, 2))
        assert manager.stats()["staging_waits"] == 0


def test_oversized_step_and_wrong_shapes_are_refused_before_any_state_changes(backend):
    manager, d = make(backend, staging_capacity_tokens=4)
    with manager:
        manager.new_step_starts(d.step(new=[("a", list(range(8)), [1, 2], 0, 8)]))
        with pytest.raises(OmniPrefixCacheUnmatchError, match="staging_capacity_tokens=4"):
            manager.save_outputs(d.outputs(2), None, num_tokens_unpadded=8, num_tokens_padded=8)
        with pytest.raises(ValueError, match="num_tokens_unpadded=9"):
            manager.save_outputs(d.outputs(2), None, num_tokens_unpadded=9, num_tokens_padded=8)
        assert manager.stats()["steps_unconsumed"] == 0


def test_task_states_move_one_step_at_a_time():
    task = WriteTask(7, "step 3")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="PENDING -> COPYING of write task 7"):
        task.transition(TaskState.COPYING)
    for state in (TaskState.QUEUED, TaskState.COPYING, TaskState.HOST_READY, TaskState.WRITTEN):
        task.transition(state)
    assert task.landed.is_set()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="WRITTEN -> FAILED"):
        task.transition(TaskState.FAILED)
    settled = WriteTask(9, "step 4")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="PENDING -> WRITTEN of write task 9"):
        settled.settle()
    settled.transition(TaskState.QUEUED)
    settled.settle()  # a landing with no host half: QUEUED to WRITTEN in one step
    assert settled.state is TaskState.WRITTEN and settled.landed.is_set()
    with pytest.raises(OmniPrefixCacheUnmatchError, match="WRITTEN -> WRITTEN"):
        settled.settle()
    failing = WriteTask(8, "request r deferred write 1")
    failing.transition(TaskState.QUEUED)
    assert failing.fail(RuntimeError("dma"))
    with pytest.raises(OmniPrefixCacheError, match="write task 8 .*FAILED.*dma"):
        failing.wait(1.0)


# --------------------------------------------------------------------------- threads

def test_materialize_one_step_behind_on_another_thread(backend):
    """The output builder consumes step k while the engine already runs step k + 1."""
    manager, d = make(backend, num_blocks=64, block_size=8, staging_depth=2)
    prompts = {f"r{i}": [i % 3] * 8 + [100 + i] * 8 for i in range(40)}
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    pending: list[tuple[int, list[str]]] = []
    ready = threading.Condition()

    def builder() -> None:
        try:
            while True:
                with ready:
                    while not pending:
                        ready.wait()
                    sid, reqs = pending.pop(0)
                if sid < 0:
                    return
                out = manager.materialize(sid, reqs)
                results.update(out.hidden_states)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=builder, daemon=True)
    thread.start()
    free = list(range(1, 64))
    cached: dict[tuple, int] = {}
    with manager:
        for req_id, tokens in prompts.items():
            prefix = tuple(tokens[:8])
            hit = 8 if prefix in cached else 0
            if not hit:
                cached[prefix] = free.pop(0)
            blocks = [cached[prefix], free.pop(0)]
            so = d.step(new=[(req_id, tokens, blocks, hit, 16 - hit)])
            manager.new_step_starts(so)
            n = 16 - hit
            sid = manager.save_outputs(d.outputs(2).to(backend.device), None,
                                       num_tokens_unpadded=n, num_tokens_padded=n)
            with ready:
                pending.append((sid, [req_id]))
                ready.notify()
            d.advance()
        with ready:
            pending.append((-1, []))
            ready.notify()
        thread.join(30)
    assert not errors, errors
    for req_id, tokens in prompts.items():
        assert torch.equal(results[req_id], token_rows(tokens, 2)), req_id


def test_engine_calls_under_inference_mode_and_materialize_outside_it(backend):
    """vLLM runs execute_model under torch.inference_mode(); the output builder may not."""
    manager, d = make(backend, gpu_budget_bytes=300)
    manager.register_policy(ModelCachePolicy(deferred_keys=frozenset({"mm_feature"})))
    a = list(range(40, 52))
    b = a[:8] + [5, 6]
    with manager:
        with torch.inference_mode():
            sid = run_step(manager, d, d.step(new=[("a", a, [1, 2, 3], 0, 12)]), backend.device,
                           materialize=False)
        assert torch.equal(manager.materialize(sid, ["a"]).hidden_states["a"], token_rows(a, 2))
        with torch.inference_mode():  # a's deferred write is flushed inside inference mode
            sid = run_step(manager, d, d.step(new=[("b", b, [1, 2, 4], 8, 2)], finished=["a"]),
                           backend.device, materialize=False)
        out = manager.materialize(sid, ["b"])
        assert torch.equal(out.hidden_states["b"], token_rows(b, 2))
        assert torch.equal(out.mm_outputs["mm_feature"]["b"], token_rows(b, 16, salt=1))
        out.hidden_states["b"].add_(1)  # the caller owns what it is handed


def test_what_the_cache_keeps_is_never_an_inference_tensor(backend):
    """Steps saved under vLLM's inference mode leave it only where the cache makes a tensor it
    keeps (a key's pool, a staging page): those are normal tensors, which its threads write
    outside inference mode; a common step (immediate rows, known keys) never leaves it."""
    manager, d = make(backend)
    a = list(range(40, 52))
    b = a[:8] + [5, 6, 7]

    def step(so: SimpleNamespace, req_id: str) -> torch.Tensor:
        with torch.inference_mode():  # the engine thread's calls, as vLLM makes them
            sid = run_step(manager, d, so, backend.device, mm_width=None, materialize=False)
        return manager.materialize(sid, [req_id]).hidden_states[req_id]  # the output thread's

    with manager:  # a's first step allocates the hidden pool; b hits a's first two blocks
        rows = [step(d.step(new=[("a", a, [1, 2, 3], 0, 8)]), "a")]
        rows += [step(d.step(cached={"a": 1}), "a") for _ in range(4)]
        assert torch.equal(torch.cat(rows), token_rows(a, 2))
        rows = step(d.step(new=[("b", b, [1, 2, 4], 8, 3)], finished=["a"]), "b")
        assert torch.equal(rows, token_rows(b, 2))
        rows.add_(1)  # the caller owns what it is handed
        kept = [key.storage.tensor for key in manager.pool.keys.values()]
        kept += [buf.tensor for buf in manager.staging._buffers.values()]
        assert kept and not any(t.is_inference() for t in kept)


def test_resumed_request_hitting_past_its_own_rows_gets_the_hit_span(backend):
    """A preempted request may resume on blocks another request computed further than it had;
    it then gets every row up to its hit, as a new request would (its own rows stop short)."""
    manager, d = make(backend, num_blocks=12)
    tokens = list(range(60, 72))                                  # 3 blocks of 4
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2, 3], 0, 4),     # a: 1 chunk
                                         ("b", tokens, [4, 5, 6], 0, 12)]), backend.device)
        d.reqs["a"].computed, d.reqs["a"].blocks = 8, [4, 5, 7]  # resumed on b's blocks
        so = d.step(cached={"a": 4})
        so.scheduled_cached_reqs.resumed_req_ids = {"a"}
        so.scheduled_cached_reqs.num_computed_tokens = [8]
        so.scheduled_cached_reqs.new_block_ids = [([4, 5, 7],)]
        out = run_step(manager, d, so, backend.device)
        assert torch.equal(out.hidden_states["a"], token_rows(tokens, 2))
        assert manager.stats()["hit_tokens"] == 8


def test_resumed_request_within_its_own_rows_gets_only_what_it_recomputes(backend):
    manager, d = make(backend, num_blocks=12)
    tokens = list(range(60, 72))
    with manager:
        run_step(manager, d, d.step(new=[("a", tokens, [1, 2, 3], 0, 8)]), backend.device)
        d.reqs["a"].computed, d.reqs["a"].blocks = 4, [1, 8, 9]  # its first block survived
        so = d.step(cached={"a": 8})
        so.scheduled_cached_reqs.resumed_req_ids = {"a"}
        so.scheduled_cached_reqs.num_computed_tokens = [4]
        so.scheduled_cached_reqs.new_block_ids = [([1, 8, 9],)]
        out = run_step(manager, d, so, backend.device)
        assert torch.equal(out.hidden_states["a"], token_rows(tokens, 2)[4:12])
        assert manager.stats().get("hit_tokens", 0) == 0


def test_stats_reads_the_pool_keys_under_the_lock_the_engine_thread_installs_them_under(backend):
    # stats() runs on another thread (the worker's RPC) while a step may install a key
    manager, driver = make(backend)
    with manager:
        locked: list[bool] = []
        nbytes = manager.pool.nbytes

        def observed_nbytes() -> dict[str, int]:
            locked.append(manager._lock.locked())
            return nbytes()

        manager.pool.nbytes = observed_nbytes
        manager.preallocate(HIDDEN_KEY, (2,), torch.float32)
        assert "pool_bytes." + HIDDEN_KEY in manager.stats()
    assert locked == [True]


@pytest.mark.cuda
def test_a_pool_the_device_cannot_map_sends_every_save_through_staging_with_host_slots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`cudaHostRegister` refused for the pool (a memlock limit, say) after the backend's self-
    test mapped its small buffers: the pool is pinned through torch, and each save, given the
    runner's device slot mapping on a busy stream, lands through staging by host slots."""
    import prefix_cache.devices.cuda as cuda_backend

    def refused(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cudaHostRegister: out of memory (memlock limit)")

    backend = cuda_backend.CudaBackend()  # its own: the fallback is for the rest of its life
    assert backend.zero_copy
    monkeypatch.setattr(cuda_backend, "register_host", refused)
    manager, d = make(backend)
    tokens = [list(range(100, 110)), list(range(200, 206))]
    with closing(backend), manager:
        for turn, (req, blocks) in enumerate((("a", [2, 5, 3]), ("b", [6, 7]))):
            manager.new_step_starts(d.step(new=[(req, tokens[turn], blocks, 0,
                                                 len(tokens[turn]))]))
            n = len(tokens[turn])
            slots = d.step_slots_cpu(d.batch_req_ids(), d.scheduled).to(backend.device)
            rows = d.outputs(2).to(backend.device)
            torch.cuda._sleep(50_000_000)  # the forward still running when the save returns
            sid = manager.save_outputs(rows, None, num_tokens_unpadded=n, num_tokens_padded=n,
                                       slot_mapping=slots)
            rows.fill_(-1)  # the runner reuses its output buffer at once
            assert not backend.zero_copy and backend.needs_staging
            out = manager.materialize(sid, [req])
            assert torch.equal(out.hidden_states[req], token_rows(tokens[turn], 2))
            d.advance()
        manager.new_step_starts(d.step(new=[("c", tokens[0][:8] + [7, 7], [2, 5, 4], 8, 2)]))
        sid = manager.save_outputs(d.outputs(2).to(backend.device), None, num_tokens_unpadded=2,
                                   num_tokens_padded=2)
        hit = manager.materialize(sid, ["c"]).hidden_states["c"]
    assert torch.equal(hit, token_rows(tokens[0][:8] + [7, 7], 2))  # 8 rows from the pool
