"""`VllmOmniPrefixCache` beside vllm-omni 0.30's own manager, call for call: the same steps, the
same answers (vllm-omni's types, its leftover split), and the steps vllm-omni's runner starts
without saving. Needs vllm-omni (the vllm-omni environment, ci/setup-vllm-omni.sh)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed (ci/setup-vllm-omni.sh "
                                        "builds its environment)")

from vllm_omni.core.prefix_cache import (ModelCachePolicy, OmniPrefixCacheManager,  # noqa: E402
                                         PrefixCacheConfig, StageCacheOutputs)

from prefix_cache.errors import OmniPrefixCacheUnmatchError  # noqa: E402
from prefix_cache.integration.vllm_omni import plugin  # noqa: E402
from prefix_cache.integration.vllm_omni.adapter import VllmOmniPrefixCache  # noqa: E402

BLOCK = 32
WIDTH = 8


class Batch:
    """A runner's batch as both managers' views read it: request order, and each request's
    computed tokens and blocks; `step_slots_cpu` gives the slots of its next positions."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[int, list[int]]] = {}

    def batch_req_ids(self) -> list[str]:
        return list(self.requests)

    def step_slots_cpu(self, req_ids: list[str], num_scheduled: dict[str, int]) -> torch.Tensor:
        slots = []
        for req_id in req_ids:
            computed, blocks = self.requests[req_id]
            for pos in range(computed, computed + num_scheduled[req_id]):
                slots.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        return torch.tensor(slots, dtype=torch.int64)


def scheduler_output(new: list[tuple[str, int, list[int]]], scheduled: dict[str, int],
                     finished: tuple[str, ...] = ()) -> SimpleNamespace:
    """vLLM's SchedulerOutput fields both managers read: (id, computed tokens, blocks) per new
    request, tokens scheduled per request, finished ids."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(b,))
                            for r, c, b in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r in scheduled
                                                       if r not in {n[0] for n in new}],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(scheduled), finished_req_ids=set(finished))


def step_outputs(rows: int, seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """A forward's outputs: hidden rows, a per-token mm key, and two that are not per token
    (a tensor of another length and a list): vllm-omni's leftovers."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, WIDTH, generator=gen),
            {"codes": torch.randn(rows, 4, generator=gen),
             "speaker": torch.randn(3, 5, generator=gen), "tags": [f"step{seed}"]})


def run(cache: Any, batch: Batch) -> list[StageCacheOutputs]:
    """Through `cache` viewing `batch`: request a computes 64 tokens; a step with no forward
    starts (and is never saved); b arrives with a's 64 tokens cached (a has finished) and
    computes 16 more, then decodes."""
    cache.register_policy(ModelCachePolicy())
    answers = []

    def step(so: SimpleNamespace, computed: dict[str, tuple[int, list[int]]], seed: int) -> None:
        cache.new_step_starts(so)
        batch.requests = computed
        rows = sum(so.num_scheduled_tokens.values())
        hidden, mm = step_outputs(rows, seed)
        step_id = cache.save_outputs(hidden, mm, num_tokens_unpadded=rows,
                                     num_tokens_padded=rows)
        answers.append(cache.materialize(step_id, list(so.num_scheduled_tokens)))

    step(scheduler_output([("a", 0, [1, 2])], {"a": 64}), {"a": (0, [1, 2])}, seed=1)
    cache.new_step_starts(scheduler_output([], {}))  # no forward: vllm-omni saves nothing
    step(scheduler_output([("b", 64, [1, 2, 3])], {"b": 16}, finished=("a",)),
         {"b": (64, [1, 2, 3])}, seed=2)
    step(scheduler_output([], {"b": 1}), {"b": (80, [1, 2, 3])}, seed=3)
    return answers


def assert_same(ours: StageCacheOutputs, theirs: StageCacheOutputs) -> None:
    assert isinstance(ours, StageCacheOutputs)
    assert ours.hidden_states.keys() == theirs.hidden_states.keys()
    for req_id, rows in theirs.hidden_states.items():
        torch.testing.assert_close(ours.hidden_states[req_id], rows, rtol=0, atol=0)
    assert ours.mm_outputs.keys() == theirs.mm_outputs.keys()
    for key, per_request in theirs.mm_outputs.items():
        assert ours.mm_outputs[key].keys() == per_request.keys(), key
        for req_id, value in per_request.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours.mm_outputs[key][req_id], value, rtol=0, atol=0)
            else:
                assert ours.mm_outputs[key][req_id] == value, (key, req_id)


def test_every_step_answers_as_vllm_omnis_own_manager_does() -> None:
    """Hidden rows (b's from position 0: a's 64 cached, then its own), the per-token key
    merged the same way, the leftovers split vllm-omni's way, over a step that was started and
    never saved."""
    config = PrefixCacheConfig(num_blocks=8, block_size=BLOCK, staging_capacity_tokens=128)
    peer_batch, batch = Batch(), Batch()
    peer, cache = (OmniPrefixCacheManager(config, peer_batch, eager=True),
                   VllmOmniPrefixCache(config, batch, eager=True))
    theirs, ours = run(peer, peer_batch), run(cache, batch)
    peer.shutdown()
    cache.shutdown()
    assert len(ours) == len(theirs) == 3
    assert set(ours[0].mm_outputs) == {"codes", "speaker", "tags"}
    for mine, peer in zip(ours, theirs):
        assert_same(mine, peer)
    assert ours[1].hidden_states["b"].shape == (80, WIDTH)


def test_stats_count_the_hit_and_every_started_step_is_consumed() -> None:
    """`stats()` is this cache's: the hit counted; the step started without a save left no
    step behind; a step started last, unsaved, is closed by shutdown."""
    config = PrefixCacheConfig(num_blocks=8, block_size=BLOCK, staging_capacity_tokens=128)
    batch = Batch()
    cache = VllmOmniPrefixCache(config, batch)
    run(cache, batch)
    stats = cache.stats()
    assert stats["hit_tokens"] == 64 and stats["hit_requests"] == 1
    assert stats["steps_unconsumed"] == 0
    cache.new_step_starts(scheduler_output([], {}, finished=("b",)))
    cache.shutdown()
    cache.shutdown()  # idempotent, as vllm-omni's


def test_the_plugin_acts_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OMNI_PREFIX_CACHE_IN_VLLM_OMNI vllm-omni's runner keeps its own manager; with
    it, the runner's mixin constructs this one."""
    import vllm_omni.core.prefix_cache.runner_mixin as runner_mixin

    monkeypatch.setattr(runner_mixin, "OmniPrefixCacheManager", OmniPrefixCacheManager)
    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    assert plugin.install() is False
    assert runner_mixin.OmniPrefixCacheManager is OmniPrefixCacheManager
    monkeypatch.setenv(plugin.ENABLE_ENV, "0")
    assert plugin.install() is False
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    assert plugin.install() is True and plugin.install() is True
    assert runner_mixin.OmniPrefixCacheManager is VllmOmniPrefixCache


def test_the_plugin_refuses_another_vllm_omni_release(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_omni.core.prefix_cache.runner_mixin as runner_mixin

    monkeypatch.setattr(runner_mixin, "OmniPrefixCacheManager", OmniPrefixCacheManager)
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.setattr(plugin.importlib.metadata, "version", lambda name: "0.26.0")
    with pytest.raises(OmniPrefixCacheUnmatchError, match="this is vllm-omni 0.26.0"):
        plugin.install()
    assert runner_mixin.OmniPrefixCacheManager is OmniPrefixCacheManager
