"""translate_step against vLLM 0.32's real SchedulerOutput, taken from a real v1 Scheduler.

Model steps are faked with `Scheduler.update_from_output` (tests/vllm_fixtures.py), so no
model runs; the scheduler, KV-cache manager, prefix hashing and preemption are vLLM's own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prefix_cache import OmniPrefixCacheUnmatchError  # noqa: E402
from prefix_cache.core.adapter import StartedRequest, StepEvents, translate_step  # noqa: E402
from tests.vllm_fixtures import (  # noqa: E402, F401  (tiny_model_dir is a fixture)
    fake_model_step,
    make_request,
    make_scheduler,
    tiny_model_dir,
)

pytestmark = pytest.mark.vllm

BLOCK = 16
PREFIX = list(range(500, 532))  # 32 tokens: two full blocks


def scheduler_for(model_dir: Path, num_blocks: int = 64, max_num_batched_tokens: int = 256,
                  ) -> Any:
    return make_scheduler(num_blocks, BLOCK, max_num_seqs=8,
                          max_num_batched_tokens=max_num_batched_tokens, model_dir=model_dir)


def step(scheduler: Any) -> tuple[Any, StepEvents]:
    out = scheduler.schedule()
    events = translate_step(out)
    fake_model_step(scheduler, out)
    return out, events


def test_first_step_starts_request_with_no_computed_tokens(tiny_model_dir: Path) -> None:
    scheduler = scheduler_for(tiny_model_dir)
    scheduler.add_request(make_request("A", PREFIX + list(range(8)), max_tokens=4))

    out, events = step(scheduler)

    (new,) = out.scheduled_new_reqs
    assert events.started == (StartedRequest("A", 0, tuple(new.block_ids[0])),)
    assert len(events.started[0].block_ids) == 3  # 40 tokens in 16-token blocks
    assert events.num_scheduled_tokens == {"A": 40} == out.num_scheduled_tokens
    assert events.finished == () and events.resumed == frozenset()


def test_prefix_hit_starts_with_shared_blocks_and_32_computed_tokens(
        tiny_model_dir: Path) -> None:
    scheduler = scheduler_for(tiny_model_dir)
    scheduler.add_request(make_request("A", PREFIX + list(range(8)), max_tokens=4))
    _, first = step(scheduler)
    scheduler.add_request(make_request("B", PREFIX + list(range(900, 904)), max_tokens=4))

    out, events = step(scheduler)

    (b,) = events.started
    assert b.req_id == "B" and b.num_computed_tokens == 32
    assert b.block_ids == tuple(out.scheduled_new_reqs[0].block_ids[0])
    assert b.block_ids[:2] == first.started[0].block_ids[:2]  # the shared prefix blocks
    assert b.block_ids[2] not in first.started[0].block_ids
    assert events.num_scheduled_tokens == {"A": 1, "B": 4}
    assert "A" in out.scheduled_cached_reqs.req_ids and events.resumed == frozenset()


def test_chunked_prefill_reports_each_chunk_size(tiny_model_dir: Path) -> None:
    scheduler = scheduler_for(tiny_model_dir, max_num_batched_tokens=32)
    scheduler.add_request(make_request("A", list(range(80)), max_tokens=2))

    sizes = []
    for _ in range(3):
        out, events = step(scheduler)
        sizes.append(events.num_scheduled_tokens["A"])
        assert events.num_scheduled_tokens == out.num_scheduled_tokens

    assert sizes == [32, 32, 16]


def test_finished_request_is_reported_in_the_next_step(tiny_model_dir: Path) -> None:
    scheduler = scheduler_for(tiny_model_dir)
    scheduler.add_request(make_request("A", PREFIX, max_tokens=2))
    scheduler.add_request(make_request("B", list(range(40)), max_tokens=6))

    finished_at = None
    for i in range(8):
        _, events = step(scheduler)
        if events.finished:
            finished_at = i
            break

    assert events.finished == ("A",)
    assert finished_at == 2  # sampled at steps 0 and 1; the worker hears of it at step 2
    assert "A" not in events.num_scheduled_tokens


def test_preempted_request_comes_back_as_resumed(tiny_model_dir: Path) -> None:
    # 7 usable blocks: two 48-token prompts take 3 each, so the first decode that needs
    # a 4th block for both preempts one of them (vLLM preempts the last running).
    scheduler = scheduler_for(tiny_model_dir, num_blocks=8)
    scheduler.add_request(make_request("A", list(range(100, 148)), max_tokens=3))
    scheduler.add_request(make_request("B", list(range(200, 248)), max_tokens=3))

    preempted: set[str] = set()
    resumed: tuple[Any, StepEvents] | None = None
    for _ in range(12):
        out, events = step(scheduler)
        assert events.preempted == frozenset(out.preempted_req_ids or ())
        preempted |= events.preempted
        if events.resumed:
            resumed = (out, events)
            break

    assert preempted == {"B"}
    assert resumed is not None
    out, events = resumed
    assert events.resumed == frozenset({"B"}) == out.scheduled_cached_reqs.resumed_req_ids
    assert "B" not in {s.req_id for s in events.started}  # MRV1: resumed, not new
    assert events.num_scheduled_tokens["B"] == out.num_scheduled_tokens["B"] > 0


def test_real_scheduler_output_with_block_copies_and_new_request_data() -> None:
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(req_id="n", prompt_token_ids=[1, 2, 3], mm_features=[],
                         sampling_params=None, pooling_params=None, block_ids=([4, 5], [9]),
                         num_computed_tokens=16, lora_request=None)
    cached = CachedRequestData(req_ids=["r", "s"], resumed_req_ids={"s"}, new_token_ids=[],
                               all_token_ids={}, new_block_ids=[None, ([6, 7], [10])],
                               num_computed_tokens=[3, 16], num_output_tokens=[1, 0])
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [new]
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {"n": 5, "r": 1, "s": 7}
    out.total_num_scheduled_tokens = 13
    out.finished_req_ids = {"f"}
    out.preempted_req_ids = {"p"}
    out.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=3, dst_block_id=8)]

    events = translate_step(out)
    group1 = translate_step(out, group_id=1)

    assert events.started == (StartedRequest("n", 16, (4, 5)),)
    assert group1.started == (StartedRequest("n", 16, (9,)),)
    assert events.resumed == frozenset({"s"}) and events.preempted == frozenset({"p"})
    # a resume restarts from its own prefix hit on all of its (new) blocks
    assert events.resumed_starts == (StartedRequest("s", 16, (6, 7)),)
    assert group1.resumed_starts == (StartedRequest("s", 16, (10,)),)
    assert events.finished == ("f",) and events.block_copies == ((3, 8),)
    assert events.num_scheduled_tokens == {"n": 5, "r": 1, "s": 7}


def test_empty_real_scheduler_output_means_no_events() -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    events = translate_step(SchedulerOutput.make_empty())

    assert events == StepEvents(finished=(), preempted=frozenset(), block_copies=(),
                                started=(), resumed=frozenset(), resumed_starts=(),
                                num_scheduled_tokens={})


def test_namespace_with_pre_0_11_1_resumed_flags_and_copy_objects() -> None:
    out = SimpleNamespace(
        finished_req_ids={"done"},
        scheduled_new_reqs=[SimpleNamespace(req_id="n", num_computed_tokens=32,
                                            block_ids=([1, 2, 3],))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b", "c"],
                                              resumed_from_preemption=[False, True, True]),
        num_scheduled_tokens={"n": 4, "a": 1, "b": 9, "c": 2},
        kv_cache_block_copies=[SimpleNamespace(src_block_id=5, dst_block_id=11),
                               SimpleNamespace(src_block_id=6, dst_block_id=12)],
    )

    events = translate_step(out)

    assert events.resumed == frozenset({"b", "c"})
    assert events.block_copies == ((5, 11), (6, 12))
    assert events.started == (StartedRequest("n", 32, (1, 2, 3)),)
    assert events.finished == ("done",) and events.preempted == frozenset()
    assert events.num_scheduled_tokens == {"n": 4, "a": 1, "b": 9, "c": 2}


def test_namespace_block_ids_for_a_missing_group_are_refused() -> None:
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="n", num_computed_tokens=0,
                                                              block_ids=([1],))],
                          num_scheduled_tokens={"n": 1})

    with pytest.raises(OmniPrefixCacheUnmatchError, match="group 1"):
        translate_step(out, group_id=1)


def test_negative_num_computed_tokens_is_refused() -> None:
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="n", num_computed_tokens=-1,
                                                              block_ids=([1],))],
                          num_scheduled_tokens={"n": 1})

    with pytest.raises(OmniPrefixCacheUnmatchError, match="negative"):
        translate_step(out)
