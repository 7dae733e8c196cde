"""The runner mixin inside vLLM's real CPU engine: rows leave off the engine thread, omni forward
outputs are read (or refused out loud)."""

from __future__ import annotations

import logging
import re
import random
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

from prefix_cache import HIDDEN_KEY  # noqa: E402
from prefix_cache.channel import (OmniPrefixCacheChannelError, StageEntry,  # noqa: E402
                                  open_channel)
from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker  # noqa: E402
from prefix_cache.tools.pipelines.pipeline import StageRequest, run_pipeline  # noqa: E402
from prefix_cache.integration.runner_mixin import (PrefixCacheRunnerMixin,  # noqa: E402
                                                   external_request_id, external_request_ids)
from prefix_cache.vllm_runners import PrefixCacheCPUWorker  # noqa: E402
from tests.vllm_fixtures import (PREEMPTING_SHAPE, FirstPreemptedAborter,  # noqa: E402,F401
                                 cpu_async_scheduling, engine_runner, thinker_model_dir,
                                 unrelated_decoding_requests)

pytestmark = [pytest.mark.vllm]

#: Seconds each finished request's read-back is held back in the slow-copy test.
SLOW_S = 0.25


def shared_prefix_requests(num: int = 4, seed: int = 0) -> list[StageRequest]:
    """Requests sharing a 64-token (two-block) prefix, one arriving every other step."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(64)]
    return [StageRequest(f"r{i}", prefix + [rng.randrange(1, 1000) for _ in range(5 + 7 * i)],
                         3, arrive_at_step=2 * i) for i in range(num)]


def test_steps_return_before_finished_requests_rows_are_read_back(
        thinker_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps are only discarded on the engine thread; a finished request's rows are read back
    from the pool and published on the output thread, and however long that takes, the engine
    steps on meanwhile."""
    requests = shared_prefix_requests()
    events: list[tuple[str, str | None, float, str]] = []

    def record(what: str, req_id: str | None) -> None:
        events.append((what, req_id, time.perf_counter(), threading.current_thread().name))

    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True)
        try:
            runner = engine_runner(engine)
            manager = runner.omni_prefix_cache
            plan = manager.plan_request_rows

            def planned(requests_standing: Any, starts: Any = None) -> Any:
                reads = plan(requests_standing, starts)
                for req_id, rows in reads.items():
                    record("planned", req_id)
                    hold = rows.hold

                    def slow_hold(req_id: str = req_id, hold: Any = hold) -> Any:
                        time.sleep(SLOW_S)  # a device copy that takes its time
                        out = hold()
                        record("read", req_id)
                        return out

                    rows.hold = slow_hold
                return reads

            def timed_step() -> Any:
                out = step()
                record("stepped", None)
                return out

            step = engine.step
            monkeypatch.setattr(manager, "plan_request_rows", planned)
            monkeypatch.setattr(engine, "step", timed_step)
            run = run_pipeline(engine, channel, requests)  # which then waits for the rows
        finally:
            engine.close()

    read = {e[1]: e for e in events if e[0] == "read"}
    assert {req_id.rsplit("-", 1)[0] for req_id in read} == {r.req_id for r in requests}
    for i, (what, req_id, planned_at, engine_thread) in enumerate(events):
        if what != "planned":
            continue
        _, _, done_at, output_thread = read[req_id]
        assert output_thread != engine_thread
        stepped_at = next(e[2] for e in events[i:] if e[0] == "stepped")
        assert stepped_at < done_at, f"request {req_id}: its step waited for its rows"
    for request in requests:  # the rows still all arrive, from position 0
        result = run.results[request.req_id]
        assert result.rows.shape[0] == len(request.prompt) + request.max_tokens - 1


# ---------------------------------------------------------------------- omni forward outputs

class OmniOutput(NamedTuple):
    """vllm-omni's forward output shape (model_executor/models/output_templates.py)."""

    text_hidden_states: torch.Tensor
    multimodal_outputs: dict[str, Any] | None = None
    intermediate_tensors: Any = None
    next_token_id: torch.Tensor | None = None


def audio_codes(hidden: torch.Tensor) -> torch.Tensor:
    return hidden[:, :4] * 2  # a per-token mm output the test can recompute from the rows


FORMS = {
    "tensor": lambda h: h,
    "tuple": lambda h: (h, {"codes": {"audio": audio_codes(h)}, "speaker": h[0].sum()}),
    "object": lambda h: OmniOutput(h, {"codes": {"audio": audio_codes(h)},
                                       "speaker": h[0].sum()}),
    "unreadable": lambda h: {"hidden": h},
}


class _ModelForm:
    """Below the mixin: the model's forward returns its output in the form under test."""

    form = "tensor"

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        return FORMS[self.form](super()._model_forward(*args, **kwargs))


class _Unwrap:
    """Above the mixin: as an omni runner does, vLLM's sampler gets the hidden states alone."""

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._model_forward(*args, **kwargs)
        if isinstance(out, dict):
            return out["hidden"]
        return out if isinstance(out, torch.Tensor) else out[0]


def _form_worker(form: str) -> type:
    runner = type(f"{form.title()}FormRunner", (_Unwrap, PrefixCacheRunnerMixin, _ModelForm,
                                                CPUModelRunner), {"form": form})
    return type(f"{form.title()}FormWorker", (PrefixCacheCPUWorker,), {"runner_cls": runner})


TensorFormWorker, TupleFormWorker, ObjectFormWorker, UnreadableFormWorker = map(
    _form_worker, FORMS)


class _HookedMm:
    """Above the mixin: a model that hands its mm outputs over through the runner's hook, its
    forward returning the hidden states alone."""

    def omni_mm_outputs(self, model_output: Any) -> dict[str, Any]:
        return {"codes": {"audio": audio_codes(model_output)}}


HookFormWorker = type("HookFormWorker", (PrefixCacheCPUWorker,), {"runner_cls": type(
    "HookFormRunner", (_HookedMm, PrefixCacheRunnerMixin, CPUModelRunner), {})})


class _RaisingMm:
    """Above the mixin: a model whose `omni_mm_outputs` override raises."""

    def omni_mm_outputs(self, model_output: Any) -> dict[str, Any]:
        raise KeyError("audio codes missing from the forward's output")


RaisingHookWorker = type("RaisingHookWorker", (PrefixCacheCPUWorker,), {"runner_cls": type(
    "RaisingHookRunner", (_RaisingMm, PrefixCacheRunnerMixin, CPUModelRunner), {})})


@pytest.mark.parametrize(("disabled", "published_as"), [("0", "req-7"), ("1", "req-7-ab12cd34")])
def test_rows_are_published_under_the_id_the_engines_caller_gave(
        monkeypatch: pytest.MonkeyPatch, disabled: str, published_as: str) -> None:
    """vLLM appends a random suffix to a request's id unless told not to; the delivery's mapping
    reads that setting once, when the stage starts, and maps each id as the setting says."""
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", disabled)
    mapping = external_request_ids()
    assert mapping("req-7-ab12cd34") == external_request_id("req-7-ab12cd34") == published_as


@pytest.mark.parametrize("form", ["tensor", "tuple", "object", "hook"])
def test_omni_forward_outputs_reach_the_next_stage(thinker_model_dir: Path, form: str) -> None:
    """Each form of forward output, and mm outputs a runner's `omni_mm_outputs` override hands
    over (`hook`), reach the next stage at every position."""
    requests = shared_prefix_requests()
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               worker_cls=f"{__name__}.{form.title()}FormWorker")
        try:
            run = run_pipeline(engine, channel, requests)
            stats = engine.stats()
        finally:
            engine.close()
    assert stats["hit_tokens"] >= 64 * (len(requests) - 1)  # the later requests hit the prefix
    assert stats["calls.save_outputs"] == stats["calls.new_step_starts"]  # one save per step
    for request in requests:
        outputs = run.results[request.req_id].entry.outputs
        hidden = outputs[HIDDEN_KEY]
        assert hidden.shape == (len(request.prompt) + request.max_tokens - 1, 256)
        if form == "tensor":
            assert set(outputs) == {HIDDEN_KEY}
        else:  # per-token mm rows at every position, hit positions included; no leftovers
            assert set(outputs) == {HIDDEN_KEY, "codes.audio"}
            assert torch.equal(outputs["codes.audio"], audio_codes(hidden))


@pytest.mark.parametrize(("worker", "why"), [
    ("UnreadableFormWorker", "dict, which it cannot read"),
    ("RaisingHookWorker", "reading the step's outputs failed: KeyError: .*audio codes missing"),
], ids=["unreadable", "raising-hook"])
def test_an_unreadable_forward_output_turns_the_cache_off_with_one_warning(
        thinker_model_dir: Path, caplog: pytest.LogCaptureFixture, worker: str,
        why: str) -> None:
    """A forward output the runner cannot read, or an `omni_mm_outputs` override that raises,
    never reaches the forward: the engine runs on, the cache turns off with one warning, and
    every request gets a failure naming why."""
    requests = shared_prefix_requests()
    with multiprocessing_mode(False), open_channel() as channel, \
            caplog.at_level(logging.WARNING, logger="prefix_cache"):
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               worker_cls=f"{__name__}.{worker}")
        try:
            runner = engine_runner(engine)
            for request in requests:
                engine.engine.add_request(request.req_id, {"prompt_token_ids": request.prompt},
                                          _greedy(request.max_tokens))
            tokens: dict[str, list[int]] = {}
            while engine.has_work():
                for out in engine.step():
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            assert runner.omni_prefix_cache is None
            for request in requests:  # in place of its rows, at once: no consumer waits
                with pytest.raises(OmniPrefixCacheChannelError, match=why):
                    channel.get(request.req_id, timeout_s=5)
        finally:
            engine.close()
    warnings = [r for r in caplog.records if r.name.startswith("prefix_cache")]
    assert len(warnings) == 1
    assert re.search(why, warnings[0].getMessage())
    assert all(len(tokens[r.req_id]) == r.max_tokens for r in requests)  # the engine ran on


def _greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False)


def _aborted_while_preempted(model_dir: Path, *, prefix_caching: bool, asynchronous: bool,
                             streaming: bool = False, after_resume: bool = False
                             ) -> tuple[str, dict[str, StageEntry]]:
    """Four requests whose decodes outgrow an 8-block KV cache; the first one vLLM preempts
    is aborted right after that step, before any step resumes it (`after_resume`: right after
    the first step that resumes it): its id and every entry (`streaming`: its chunks joined)."""
    requests = unrelated_decoding_requests()
    with multiprocessing_mode(False), open_channel() as channel:
        with cpu_async_scheduling() if asynchronous else nullcontext():
            engine = start_thinker(model_dir, channel, prefix_caching=prefix_caching,
                                   shape=PREEMPTING_SHAPE, stage_options={"stream": streaming})
        try:
            aborter = FirstPreemptedAborter(engine, [r.req_id for r in requests],
                                            after_resume=after_resume)
            run = run_pipeline(engine, channel, requests, aborts_now=aborter)
        finally:
            engine.close()
    assert aborter.aborted is not None, "no request was preempted: the KV cache did not run out"
    return aborter.aborted, {r: result.entry for r, result in run.results.items()}


@pytest.mark.parametrize("asynchronous,streaming", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "async-streaming"])
def test_a_request_aborted_while_preempted_publishes_the_rows_it_would_without_the_cache(
        thinker_model_dir: Path, asynchronous: bool, streaming: bool) -> None:
    """vLLM frees a preempted request's blocks, which new tenants may overwrite, while the V1
    runner keeps its cached state, block ids included, until it resumes. The stage pins the
    request's rows when vLLM preempts it: aborted before it resumes, it is published with the
    rows it had, as a stage without the cache publishes its own copies of them, never rows
    read from blocks that are no longer its own. A streaming stage's chunks join to the same
    rows."""
    aborted, on = _aborted_while_preempted(thinker_model_dir, prefix_caching=True,
                                           asynchronous=asynchronous, streaming=streaming)
    aborted_off, off = _aborted_while_preempted(thinker_model_dir, prefix_caching=False,
                                                asynchronous=asynchronous)
    assert aborted_off == aborted
    assert 48 < on[aborted].num_rows < 48 + 99 and not on[aborted].aborted  # cut mid-decode
    for request_id, entry in on.items():
        assert (entry.aborted, entry.num_rows) == (off[request_id].aborted,
                                                   off[request_id].num_rows), request_id
        torch.testing.assert_close(entry.outputs[HIDDEN_KEY], off[request_id].outputs[HIDDEN_KEY],
                                   rtol=0, atol=1e-4)


def test_a_streamed_request_aborted_while_it_recomputes_ends_where_its_chunks_reached(
        thinker_model_dir: Path) -> None:
    """A request preempted after its chunks went out is recomputed from its hit on, 32
    positions a step; aborted right after its first such step, the positions its saved steps
    reached stand behind those it streamed. Its stream still ends with a final chunk from
    where its chunks reached (none again, none missing), as a stage without the cache ends it,
    and every request's streamed rows are those (found by the soak: the final chunk started
    where the recompute stood, and the channel refused it)."""
    aborted, on = _aborted_while_preempted(thinker_model_dir, prefix_caching=True,
                                           asynchronous=False, streaming=True, after_resume=True)
    aborted_off, off = _aborted_while_preempted(thinker_model_dir, prefix_caching=False,
                                                asynchronous=False, streaming=True,
                                                after_resume=True)
    assert aborted_off == aborted
    assert on[aborted] is not None and 48 < on[aborted].num_rows < 48 + 99
    for request_id, entry in on.items():
        assert (entry.aborted, entry.num_rows) == (off[request_id].aborted,
                                                   off[request_id].num_rows), request_id
        torch.testing.assert_close(entry.outputs[HIDDEN_KEY], off[request_id].outputs[HIDDEN_KEY],
                                   rtol=0, atol=1e-4)
