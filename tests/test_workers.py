"""The cache's vLLM workers on vLLM's real CPU engine: the runner is adopted however a release
builds it (or the engine is refused), naming a GPU worker leaves torch's CUDA classes alone, and
every finished request's entry reaches the channel without another engine step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import vllm  # noqa: E402
import vllm.v1.worker.cpu_worker as cpu_worker  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

from prefix_cache import HIDDEN_KEY, OmniPrefixCacheUnmatchError  # noqa: E402
from prefix_cache.channel import OmniPrefixCacheChannelTimeoutError, open_channel  # noqa: E402
from prefix_cache.integration.delivery import FinishedRequest, StageDelivery  # noqa: E402
from prefix_cache.tools.pipelines.engines import multiprocessing_mode, start_thinker  # noqa: E402
from prefix_cache.integration.runner_mixin import PrefixCacheRunnerMixin  # noqa: E402
from prefix_cache.integration.stage_outputs import scheduled_prompt_lens  # noqa: E402
from prefix_cache.vllm_runners import PrefixCacheCPUWorker  # noqa: E402
from prefix_cache.integration.workers.base import PrefixCacheWorkerMixin, adopt_runner  # noqa: E402
from prefix_cache.integration.workers.finishes import FinishReporting, report_finishes  # noqa: E402
from tests.vllm_fixtures import (  # noqa: E402
    FAKE_TOKEN_ID,
    engine_runner,
    fake_model_step,
    make_request,
    make_scheduler,
    thinker_model_dir,
)

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- import hygiene

#: Prints which of torch's device classes a set of imports rebinds, and whether vLLM's CPU
#: worker got loaded (one JSON object). argv: a setup snippet, then the imports.
IMPORT_PROBE = textwrap.dedent("""
    import importlib, json, operator, sys
    import torch
    NAMES = ("cuda.Stream", "cuda.Event", "cuda.current_stream", "Event", "Stream")
    before = {n: operator.attrgetter(n)(torch) for n in NAMES}
    exec(sys.argv[1])
    for name in sys.argv[2:]:
        module, _, attr = name.partition(":")
        loaded = importlib.import_module(module)
        if attr:
            getattr(loaded, attr)
    print(json.dumps({
        "rebound": [n for n in NAMES if operator.attrgetter(n)(torch) is not before[n]],
        "cpu_worker": "vllm.v1.worker.cpu_worker" in sys.modules}))
""")

#: Stands in for vllm-ascend (not installable here): its worker and V1 runner modules, as
#: plain subclasses of vLLM's base worker and GPU runner, importing nothing of the CPU worker.
FAKE_VLLM_ASCEND = textwrap.dedent("""
    import types
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase
    runner = types.ModuleType("vllm_ascend.worker.model_runner_v1")
    runner.NPUModelRunner = type("NPUModelRunner", (GPUModelRunner,), {})
    worker = types.ModuleType("vllm_ascend.worker.worker")
    worker.NPUWorker = type("NPUWorker", (WorkerBase,), {})
    for name, module in {"vllm_ascend": types.ModuleType("vllm_ascend"),
                         "vllm_ascend.worker": types.ModuleType("vllm_ascend.worker"),
                         runner.__name__: runner, worker.__name__: worker}.items():
        sys.modules[name] = module
""")


def probe_imports(*imports: str, setup: str = "") -> dict[str, Any]:
    """What `imports` ("module" or "module:attribute") do to torch, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE, setup, *imports], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_worker_modules() -> list[str]:
    """Every module a GPU worker process may load of this package (all but the CPU and NPU
    workers, vllm-omni's CPU worker among them, and the vllm-omni adapter, which needs
    vllm_omni: tests/vllm_omni loads it), and the vLLM GPU worker and runner modules it builds
    on."""
    import pkgutil

    import prefix_cache
    ours = [m.name for m in pkgutil.walk_packages(prefix_cache.__path__, "prefix_cache.")
            if m.name not in ("prefix_cache.integration.workers.cpu",
                              "prefix_cache.integration.workers.npu",
                              "prefix_cache.integration.vllm_omni.cpu_worker",
                              "prefix_cache.integration.vllm_omni.adapter",
                              "prefix_cache.__main__")]
    return ["prefix_cache.vllm_runners:PrefixCacheGPUWorker", *ours,
            "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"]


def test_loading_the_gpu_worker_leaves_torchs_cuda_classes_alone() -> None:
    assert probe_imports(*gpu_worker_modules()) == {"rebound": [], "cpu_worker": False}


def test_loading_the_npu_worker_leaves_torchs_cuda_classes_alone() -> None:
    assert probe_imports("prefix_cache.vllm_runners:PrefixCacheNPUWorker",
                         setup=FAKE_VLLM_ASCEND) == {"rebound": [], "cpu_worker": False}


def test_the_probe_sees_vllms_cpu_worker_rebind_them() -> None:
    # vLLM's CPU worker imports cpu/shm.py, which swaps in placeholders process-wide: the
    # hazard the GPU and NPU workers avoid, shown so the probes above can be trusted
    probe = probe_imports("prefix_cache.vllm_runners:PrefixCacheCPUWorker")
    assert probe["cpu_worker"] and {"cuda.Stream", "cuda.Event", "Event"} <= set(
        probe["rebound"])


# ---------------------------------------------------------------------- runner adoption

class _BuildsByItsOwnReference(cpu_worker.CPUWorker):
    """A worker that builds its runner as vLLM 0.26's GPU worker does: through a reference of
    its own (a local import there), so swapping a module-level name changes nothing."""

    def init_device(self) -> None:
        own = CPUModelRunner
        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = lambda *args, **kwargs: own(*args, **kwargs)
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original


class LocalImportWorker(PrefixCacheCPUWorker, _BuildsByItsOwnReference):
    """The cache's CPU worker over a release that builds its runner by its own reference."""


class _BuildsNoRunner(cpu_worker.CPUWorker):
    """A release whose init_device leaves the runner for later."""

    def init_device(self) -> None:
        super().init_device()
        del self.model_runner


class NoRunnerWorker(PrefixCacheCPUWorker, _BuildsNoRunner):
    """The cache's CPU worker over a release it cannot hook."""


def test_a_runner_built_through_a_releases_own_reference_carries_the_cache(
        thinker_model_dir: Path) -> None:
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True,
                               worker_cls=f"{__name__}.LocalImportWorker")
        try:
            assert isinstance(engine_runner(engine), PrefixCacheRunnerMixin)
            from vllm import SamplingParams
            [out] = engine.llm.generate([{"prompt_token_ids": list(range(1, 41))}],
                                        SamplingParams(max_tokens=3, ignore_eos=True),
                                        use_tqdm=False)
            rows = channel.get(out.request_id, timeout_s=10)[HIDDEN_KEY]
        finally:
            engine.close()
    assert rows.shape == (40 + 3 - 1, 256)


def test_a_worker_whose_runner_cannot_carry_the_cache_refuses_at_start_naming_the_release(
        thinker_model_dir: Path) -> None:
    with multiprocessing_mode(False), open_channel() as channel, \
            pytest.raises(Exception) as refused:
        start_thinker(thinker_model_dir, channel, prefix_caching=True,
                      worker_cls=f"{__name__}.NoRunnerWorker")
    chain = [refused.value, *iter_causes(refused.value)]
    message = next(str(e) for e in chain if isinstance(e, OmniPrefixCacheUnmatchError))
    assert f"vLLM {vllm.__version__}" in message and "no model runner" in message


def test_a_worker_with_no_channel_configured_refuses_at_start_saying_how_to_configure_one(
        thinker_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefix_cache.tools.pipelines.engines import Engine, EngineShape, default_worker
    monkeypatch.delenv("PREFIX_CACHE_CHANNEL", raising=False)
    with multiprocessing_mode(False), pytest.raises(Exception) as refused:
        Engine(thinker_model_dir, EngineShape(), enable_prefix_caching=True,
               worker_cls=default_worker())
    chain = [refused.value, *iter_causes(refused.value)]
    message = next(str(e) for e in chain if isinstance(e, OmniPrefixCacheUnmatchError))
    assert "no stage channel is configured" in message and "PREFIX_CACHE_CHANNEL" in message


@pytest.mark.parametrize("spec", ["shm", "shm://?ttl=5"])
def test_a_channel_spec_naming_no_namespace_is_refused_and_leaves_none(
        spec: str) -> None:
    """A spec without a namespace would make the worker a namespace of its own that no consumer
    knows: refused as no channel is, and the namespace it opened to find that out is gone."""
    from prefix_cache.integration.runner_mixin import open_stage_channel
    before = set(Path("/dev/shm").glob("omni-prefix-cache-*"))
    config = SimpleNamespace(additional_config={"prefix_cache": {"channel": spec}})
    with pytest.raises(OmniPrefixCacheUnmatchError,
                       match=f"additional_config\\['prefix_cache'\\]\\['channel'\\] "
                             f"'{re.escape(spec)}' names no namespace.*channel.spec"):
        open_stage_channel(config)
    assert set(Path("/dev/shm").glob("omni-prefix-cache-*")) <= before


def iter_causes(error: BaseException) -> list[BaseException]:
    out = []
    while (error := error.__cause__ or error.__context__) is not None:
        out.append(error)
    return out


def test_model_runner_v2_is_refused_naming_the_setting() -> None:
    # vLLM's CPU build has no V2 runner before 0.33: a worker that built one is stood in
    worker = SimpleNamespace(model_runner=object(), use_v2_model_runner=True)
    with pytest.raises(OmniPrefixCacheUnmatchError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        adopt_runner(worker, PrefixCacheCPUWorker.runner_hooks)


# ---------------------------------------------------------------------- finishes

def test_the_scheduler_reports_each_finish_once_as_it_decides_it() -> None:
    heard: list[list[str]] = []

    def listener(req_ids: Any) -> None:
        heard.append(list(req_ids))

    def in_process_worker(vllm_config: Any) -> None:  # what the worker's init_device does
        vllm_config.parallel_config.distributed_executor_backend = "uni"
        assert report_finishes(vllm_config, listener)

    scheduler = make_scheduler(num_blocks=16, block_size=16, max_num_seqs=4,
                               max_num_batched_tokens=64, configure=in_process_worker)
    assert isinstance(scheduler, FinishReporting)
    for req_id, max_tokens in (("a", 1), ("b", 3), ("c", 5)):
        scheduler.add_request(make_request(req_id, [5] * 20, max_tokens))
    output = scheduler.schedule()
    fake_model_step(scheduler, output, FAKE_TOKEN_ID)
    assert heard == [["a"]]  # at update_from_output, before any later step
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert heard == [["a"], ["c"]]
    output = scheduler.schedule()
    assert set(output.finished_req_ids) == {"a", "c"}  # the runner still hears of both
    fake_model_step(scheduler, output, FAKE_TOKEN_ID)
    fake_model_step(scheduler, scheduler.schedule(), FAKE_TOKEN_ID)
    assert heard == [["a"], ["c"], ["b"]]  # each once


@pytest.mark.parametrize("engine_core_process, async_scheduling, refusal", [
    (False, False, "VLLM_ENABLE_V1_MULTIPROCESSING=1"),  # the finish's step may never run
    (True, True, "async_scheduling=False"),  # a stop token's row cannot be told apart
    (True, False, None),
])
def test_a_worker_away_from_the_scheduler_is_refused_where_its_finishes_would_be_wrong(
        engine_core_process: bool, async_scheduling: bool, refusal: str | None) -> None:
    worker = SimpleNamespace(vllm_config=SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="mp"),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling)))
    check = PrefixCacheWorkerMixin._check_finishes_reach_a_separate_worker
    with multiprocessing_mode(engine_core_process):
        if refusal is None:
            check(worker)
            return
        with pytest.raises(OmniPrefixCacheUnmatchError, match=refusal):
            check(worker)


class FinishedRows:
    """vLLM's real scheduler with the finish reporting installed, a worker's rows per step
    (each row holds its position) and the delivery they go to, as the runner wires them."""

    def __init__(self, channel: Any, prompt_len: int, async_scheduling: bool,
                 stream_every: int | None = None) -> None:
        self.delivery = StageDelivery(channel, stream_every=stream_every)
        self.fed: dict[str, int] = {}

        def heard(finished: Any) -> None:  # as the runner's omni_requests_finished
            for req_id, rows in finished.items():
                self.delivery.finish_early(FinishedRequest(req_id, req_id, prompt_len, rows))

        def in_process_worker(vllm_config: Any) -> None:
            vllm_config.parallel_config.distributed_executor_backend = "uni"
            vllm_config.scheduler_config.async_scheduling = async_scheduling
            assert report_finishes(vllm_config, heard)

        self._heard = heard  # the scheduler holds its listener weakly
        self.scheduler = make_scheduler(num_blocks=32, block_size=16, max_num_seqs=4,
                                        max_num_batched_tokens=128, configure=in_process_worker)

    def worker_step(self, output: Any) -> None:
        """The rows of every token the step feeds (the new requests' prompt lengths first, as
        the stage's driver notes them)."""
        self.delivery.note_prompts(scheduled_prompt_lens(output))
        for req_id, n in output.num_scheduled_tokens.items():
            start = self.fed.get(req_id, 0)
            self.delivery.add(req_id, start, {HIDDEN_KEY: torch.arange(
                start, start + n, dtype=torch.float32)[:, None]}, n)
            self.fed[req_id] = start + n


@pytest.mark.parametrize("stream_every", [None, 1, 16], ids=["whole", "streamed", "every-16"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_entry_has_one_row_per_token_fed_however_the_engine_schedules(
        async_scheduling: bool, stream_every: int | None) -> None:
    """An asynchronous engine core runs the worker's step N+1 before the scheduler reads step
    N's output: a request whose stop token step N sampled has it fed in step N+1, a row a
    synchronous engine never computes. Steps are driven as vLLM's batch queue drives them.
    Streamed, no chunk carries that row: chunks cannot be taken back."""
    prompt_len, stop = 20, 2
    with open_channel() as channel:
        run = FinishedRows(channel, prompt_len, async_scheduling, stream_every)
        scheduler = run.scheduler
        # tokens each generates: a stop token last, or (d) as many as max_tokens allows
        generated = {"a": 1, "b": 3, "c": 5, "d": 4}
        for req_id, n in generated.items():
            scheduler.add_request(make_request(req_id, [10 + ord(req_id)] * prompt_len,
                                               n if req_id == "d" else 16, stop_token_ids=[stop]))

        def sample(request: Any) -> int:
            last = request.num_output_tokens + 1 == generated[request.request_id]
            return stop if last and request.request_id != "d" else FAKE_TOKEN_ID

        queue: list[Any] = []  # steps run, their outputs not yet read: 2 when asynchronous
        while scheduler.has_requests() or queue:
            if scheduler.has_requests():
                queue.append(scheduler.schedule())
                run.worker_step(queue[-1])
            if len(queue) == (2 if async_scheduling else 1) or not scheduler.has_requests():
                fake_model_step(scheduler, queue.pop(0), sample)
        entries = {r: channel.get_entry(r, timeout_s=1) for r in generated}
    stale = {r: run.fed[r] - (prompt_len + n - 1) for r, n in generated.items()}
    # each stop token fed by a step in flight; vLLM schedules no step past max_tokens
    assert stale == {r: int(async_scheduling and r != "d") for r in generated}
    assert run.delivery.stats()["delivery_rows_cut"] == sum(stale.values())
    assert (run.delivery.stats()["delivery_chunks"] > 0) == (stream_every is not None)
    for req_id, n in generated.items():
        assert not entries[req_id].aborted
        assert torch.equal(entries[req_id].outputs[HIDDEN_KEY][:, 0],
                           torch.arange(prompt_len + n - 1, dtype=torch.float32)), req_id


@pytest.mark.parametrize("stream_every", [None, 1, 16], ids=["whole", "streamed", "every-16"])
def test_an_abort_while_a_step_is_in_flight_publishes_what_a_synchronous_engine_would(
        stream_every: int | None) -> None:
    """The step after the prefill runs before the scheduler reads the prefill's token; an abort
    then retires the request, and that step's row (its output never read) is cut: 20 rows, as
    a synchronous engine that ran the prefill alone would publish."""
    with open_channel() as channel:
        run = FinishedRows(channel, prompt_len=20, async_scheduling=True,
                           stream_every=stream_every)
        scheduler = run.scheduler
        scheduler.add_request(make_request("e", [77] * 20, 16))
        prefill = scheduler.schedule()
        run.worker_step(prefill)
        run.worker_step(scheduler.schedule())  # feeds the prefill's token, not yet read
        fake_model_step(scheduler, prefill)
        scheduler.finish_requests(["e"], RequestStatus.FINISHED_ABORTED)
        entry = channel.get_entry("e", timeout_s=1)
    assert run.fed["e"] == 21 and run.delivery.stats()["delivery_rows_cut"] == 1
    assert torch.equal(entry.outputs[HIDDEN_KEY][:, 0], torch.arange(20, dtype=torch.float32))


@pytest.mark.parametrize("stream_every", [1, 16])
def test_a_streamed_prompt_goes_out_whole_once_computed_and_later_rows_a_step_after(
        stream_every: int) -> None:
    """A prompt position's row stands once computed (a prompt token is never a stop token): the
    chunk after the prefill carries all 20, whatever the policy; a row fed a sampled token
    stands one step later, under an asynchronous scheduler too."""
    with open_channel() as channel:
        run = FinishedRows(channel, prompt_len=20, async_scheduling=True,
                           stream_every=stream_every)
        scheduler = run.scheduler
        scheduler.add_request(make_request("p", [55] * 20, 40))
        stream = channel.stream("p", timeout_s=1)
        prefill = scheduler.schedule()
        run.worker_step(prefill)
        first = next(stream)
        assert (first.start, first.rows[HIDDEN_KEY].shape[0], first.final) == (0, 20, False)
        queue = [prefill]
        for _ in range(stream_every + 1):  # decode steps, one in flight
            queue.append(scheduler.schedule())
            run.worker_step(queue[-1])
            fake_model_step(scheduler, queue.pop(0))
        second = next(stream)
        # rows 20.. were fed sampled tokens: the newest of them waits a step
        assert (second.start, second.rows[HIDDEN_KEY].shape[0]) == (20, stream_every)
        assert torch.equal(second.rows[HIDDEN_KEY][:, 0],
                           torch.arange(20, 20 + stream_every, dtype=torch.float32))


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "multiprocess"])
def test_every_entry_arrives_though_the_engine_never_steps_again(
        thinker_model_dir: Path, multiprocessing: bool) -> None:
    from vllm import SamplingParams
    prefix = list(range(100, 164))
    prompts = [{"prompt_token_ids": prefix + list(range(1, 3 + i))} for i in range(6)]
    with multiprocessing_mode(multiprocessing), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True)
        try:
            outs = engine.llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True),
                                       use_tqdm=False)
            # nothing steps the engine from here on
            entries = {o.request_id: channel.get_entry(o.request_id, timeout_s=10)
                       for o in outs}
            engine.engine.add_request("aborted", {"prompt_token_ids": prefix * 10},
                                      SamplingParams(max_tokens=4))
            if not multiprocessing:  # a multiprocess engine core steps on its own
                engine.step()  # the first of its 20 prefill chunks
            engine.engine.abort_request(["aborted"])
            aborted = channel.get_entry("aborted", timeout_s=10)
        finally:
            engine.close()
    for out in outs:
        entry = entries[out.request_id]
        expected = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert not entry.aborted and entry.outputs[HIDDEN_KEY].shape[0] == expected
    assert aborted.aborted  # mid-prefill, or before its first step (prompt_len None)
    assert aborted.meta["prompt_len"] in (None, 640)
    assert aborted.meta["num_rows"] < 640


def test_each_of_n_samples_is_published_under_its_index_and_the_request_id(
        thinker_model_dir: Path) -> None:
    """`SamplingParams(n=2)`: vLLM runs each sample as a request of its own, so each has its
    own rows, under `f"{completion.index}_{out.request_id}"`; their prompt rows agree."""
    from vllm import SamplingParams
    prompt = list(range(100, 140))
    with multiprocessing_mode(False), open_channel() as channel:
        engine = start_thinker(thinker_model_dir, channel, prefix_caching=True)
        try:
            (out,) = engine.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                n=2, max_tokens=3, temperature=1.0, ignore_eos=True), use_tqdm=False)
            entries = [channel.get_entry(f"{c.index}_{out.request_id}", timeout_s=10)
                       for c in out.outputs]
            with pytest.raises(OmniPrefixCacheChannelTimeoutError):  # none for the parent
                channel.get_entry(out.request_id, timeout_s=0.5)
        finally:
            engine.close()
    assert sorted(c.index for c in out.outputs) == [0, 1]
    for completion, entry in zip(out.outputs, entries, strict=True):
        assert not entry.aborted
        assert entry.outputs[HIDDEN_KEY].shape[0] == len(prompt) + len(completion.token_ids) - 1
    first, second = (e.outputs[HIDDEN_KEY][:len(prompt)] for e in entries)
    torch.testing.assert_close(first, second)
