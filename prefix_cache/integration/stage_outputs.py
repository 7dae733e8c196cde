"""One stage's outputs on their way out: saved on the engine thread, assembled and published off it.

Per engine step, on the engine thread:

    begin_step(scheduler_output, finished)  # before the runner updates its batch
    save_step(hidden, mm, batch, padded)    # right after the forward (skipped: no forward)
    end_step()                              # once the step's output is built

With the cache, `begin_step` is the manager's `new_step_starts` and `save_step` its
`save_outputs` (a step without a forward saves zero rows and is discarded at once, so every
`new_step_starts` is followed by exactly one `save_outputs`). `end_step` discards the step on
the engine thread, its rows staying in the pool, and has the output thread tell the channel of
the requests it saw first. Nothing is handed over per step, nor read (steps are saved with
`plan_reads=False`): that hand-over cost the engine step more than its work. Rows are read
back from the pool instead, pinned on the engine thread and read and published by the output
thread (the channel's writer copies them from the pool into the entry):

- at a request's finish, where `begin_step` reports it (before the step forgets the request)
  or earlier, by `finish_now`, when the scheduler does
  (`prefix_cache.integration.workers.finishes`): its rows from position 0
  (`plan_request_rows`), or, streaming, those after its last chunk;
- a streaming stage's chunks (`prefix_cache.integration.chunks`): a prefix hit's cached rows
  at the step's start (`plan_hit_rows`), published while the forward runs, as the request's
  first chunk; then, at `end_step`, each chunk the step made due (`plan_chunk_rows`).

Without the cache (prefix caching off), `save_step` starts device->host copies of the step's
per-token rows and the output thread waits for them and hands them to `StageDelivery` step by
step, which publishes chunks and entries from them. The requests a step retires are published
after their last rows: a request's finish is queued at the step that reports it, after the
hand-over of the step before, or earlier, by `finish_now`.

A fault never takes the engine down. One in a job of the output thread fails the
entries of that job's requests, each naming the cause, and the stage goes on;
`MAX_FAULTED_STEPS` steps in a row whose rows fault stop publishing (one error
line), and every later request gets a failure naming why. One on the engine thread
(the cache refusing a step, say) turns the stage off the same way at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefix_cache.config import ModelCachePolicy
from prefix_cache.integration.chunks import ChunkSchedule
from prefix_cache.integration.delivery import FinishedRequest, RowsReadBack, StageDelivery
from prefix_cache.devices.base import DeviceBackend, Transfer, wait_event
from prefix_cache.errors import OmniPrefixCacheError, OmniPrefixCacheUnmatchError
from prefix_cache.manager import OmniPrefixCacheManager
from prefix_cache.integration.output_thread import OutputThread
from prefix_cache.core.outputs import split_outputs

logger = logging.getLogger(__name__)

#: Jobs that may wait behind one running past its time before the output thread counts as
#: stuck (a step queues three at most: a finish, a prefix hit's chunks and the step's rows or
#: chunks); below that, or behind a job still in its time, they just queue.
MAX_PENDING_JOBS = 16
#: Steps in a row whose rows may fault on the output thread before the stage stops publishing.
MAX_FAULTED_STEPS = 3


@dataclass(frozen=True)
class StepBatch:
    """A step's rows in batch order: request i has rows `ends[i-1]:ends[i]`, from `starts[i]` on."""

    req_ids: Sequence[str]
    starts: Sequence[int]
    ends: Sequence[int]

    @property
    def num_rows(self) -> int:
        return self.ends[-1] if self.ends else 0

    def spans(self) -> list[tuple[str, int, int, int]]:
        """(request, first row, end row, position of the first row) per request."""
        firsts = [0, *self.ends[:-1]]
        return list(zip(self.req_ids, firsts, self.ends, self.starts, strict=True))


def scheduled_prompt_lens(scheduler_output: Any) -> dict[str, int]:
    """Prompt lengths of the requests `scheduler_output` schedules anew (vLLM's
    `NewRequestData`: token ids, else prompt embeddings; a continuation's is its whole prompt)."""
    lens = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
        if new.prompt_token_ids is not None:
            lens[new.req_id] = len(new.prompt_token_ids)
        elif getattr(new, "prompt_embeds", None) is not None:
            lens[new.req_id] = int(new.prompt_embeds.shape[0])
    return lens


@dataclass
class _SavedStep:
    batch: StepBatch
    step_id: int | None = None                                  # with the cache
    host_rows: dict[str, tuple[torch.Tensor, Transfer]] | None = None  # without it


class StageOutputDriver:
    """One stage's output path: the engine thread calls it, its output thread does the row work."""

    def __init__(self, delivery: StageDelivery, backend: DeviceBackend, *,
                 cache: OmniPrefixCacheManager | None, policy: ModelCachePolicy,
                 empty_hidden: Callable[[], torch.Tensor], timeout_s: float = 30.0) -> None:
        self.delivery = delivery
        self.backend = backend
        self.cache = cache
        self.policy = policy
        self._empty_hidden = empty_hidden
        self._timeout_s = timeout_s
        # a job may wait for room in the channel besides its own bounded waits
        self._thread = OutputThread("omni-stage-outputs", max_pending=MAX_PENDING_JOBS,
                                    timeout_s=timeout_s + delivery.put_wait_s)
        self._step: _SavedStep | None = None
        self._in_step = False
        self._off = False
        self._closed = False
        self._faulted_steps = 0  # steps in a row whose rows faulted (output thread)
        self._stopped_by_faults: str | None = None  # set by the output thread: why it stopped
        # with the cache, a request's rows are read back from the pool (at its finish, and as
        # chunks fall due): a step is only discarded (on this thread), never handed over
        self._chunks: ChunkSchedule | None = None
        if cache is not None:
            if not callable(getattr(cache.view, "request_positions_runs", None)):
                raise OmniPrefixCacheUnmatchError(
                    f"the stage's cache view {type(cache.view).__name__} cannot give a "
                    f"request's positions (request_positions_runs): its rows are read back "
                    f"from the pool by them")
            if delivery.stream_every is not None:
                self._chunks = ChunkSchedule(delivery.stream_every)
                cache.track_allocations()  # a hit's rows go out before its forward
        self._finished_early: set[str] = set()  # read at `finish_now`; the runner's to come
        # a preempted request's rows, pinned before new tenants take its blocks: published if
        # it finishes before it is scheduled again (an abort), let go once it is
        self._preempted_rows: dict[str, RowsReadBack] = {}

    # ------------------------------------------------------------------ engine thread

    def begin_step(self, scheduler_output: Any, finished: Sequence[FinishedRequest]) -> None:
        """Start a step; the requests it retires are published after their last rows (once
        turned off, no step starts, and they get their failures)."""
        if self._stopped_by_faults is not None and not self._off:
            self.turn_off(self._stopped_by_faults)  # the output thread stopped publishing
        if finished and self.cache is not None and not self._off:
            self._finish_read_back(list(finished), early=False)  # before the step forgets them
            finished = ()
        if self.cache is not None and not self._off:
            self._pin_preempted(scheduler_output)
        if not self._off:
            try:
                self._thread.check()
                if self.cache is not None:
                    self.cache.new_step_starts(scheduler_output)
                    if self._chunks is not None:
                        self._chunks.note_prompts(scheduled_prompt_lens(scheduler_output))
                        self._publish_hits(self.cache.plan_hit_rows())
                elif self.delivery.streaming:
                    self.delivery.note_prompts(scheduled_prompt_lens(scheduler_output))
                self._step, self._in_step = None, True
            except Exception as exc:
                self._engine_fault("starting a step", exc)
        if finished:
            requests = list(finished)
            self._submit(f"publishing {len(requests)} finished requests",
                         [r.req_id for r in requests],
                         lambda: self.delivery.finish_all(requests))

    def finish_now(self, finished: Sequence[FinishedRequest]) -> None:
        """The scheduler retired these requests before the runner heard of it: publish them
        now (their rows read back, or after every step queued so far); `begin_step` will skip
        them."""
        if self.cache is not None and not self._off:
            self._finish_read_back(list(finished), early=True)
            return
        requests = list(finished)
        self._submit(f"publishing {len(requests)} requests the scheduler retired",
                     [r.req_id for r in requests],
                     lambda: self.delivery.finish_all(requests, early=True))

    def _pin_preempted(self, scheduler_output: Any) -> None:
        """Let go of the rows of preempted requests the step schedules again (recomputed from
        their hit on), and pin those of the requests it preempts, while the view still holds
        their blocks."""
        try:
            if self._preempted_rows:
                for req_id in self._preempted_rows.keys() & scheduler_output.num_scheduled_tokens:
                    self._preempted_rows.pop(req_id).cancel()
            if preempted := getattr(scheduler_output, "preempted_req_ids", None):
                self._preempted_rows.update(self.cache.plan_request_rows(
                    dict.fromkeys(preempted),
                    None if self._chunks is None else self._chunks.reach(list(preempted))))
        except Exception as exc:
            self._engine_fault("pinning preempted requests' rows", exc)

    def _finish_read_back(self, requests: list[FinishedRequest], *, early: bool) -> None:
        """Pin the rows of finished requests (those after its chunks where one streamed), read
        back and published by the output thread (`early`: the scheduler's finish, before the
        runner's; a request read then is not read again; one finished while preempted: the
        rows pinned then). Where planning fails, the stage turns off and they get failures (the
        output thread stops publishing before their job)."""
        fresh = {r.req_id for r in requests} - self._finished_early
        if early:
            self._finished_early.update(fresh)
        else:
            self._finished_early.difference_update(r.req_id for r in requests)
        starts = None if self._chunks is None else self._chunks.forget(list(fresh))
        reads = {}
        try:
            for request in requests:  # finished while preempted: its rows pinned then
                pinned = self._preempted_rows.pop(request.req_id, None)
                if pinned is None:
                    continue
                if request.req_id in fresh and (request.rows_standing is None
                                                or pinned.num_rows <= request.rows_standing):
                    reads[request.req_id] = pinned
                else:  # pinned past the rows that stand, which a pin cannot cut: none
                    pinned.cancel()
            if planned := fresh - reads.keys():
                reads.update(self.cache.plan_request_rows(
                    {r.req_id: r.rows_standing for r in requests if r.req_id in planned},
                    starts))
        except Exception as exc:
            self._engine_fault("reading back finished requests' rows", exc)
        self._submit(f"publishing {len(requests)} finished requests", [r.req_id for r in requests],
                     lambda: self.delivery.publish_reads(
                         [(r, reads.get(r.req_id)) for r in requests], early=early),
                     step_rows=True)

    def _publish_hits(self, hits: Mapping[str, RowsReadBack]) -> None:
        """A streaming stage's prefix hits: the output thread publishes each new request's
        cached rows as its first chunk as soon as they are read, while the step's forward runs
        (a request resumed after preemption streamed its positions already)."""
        if not hits:
            return
        first = []
        for rows in hits.values():
            if self._chunks.first_chunk(rows.req_id, rows.num_rows):
                first.append(rows)
            else:
                rows.cancel()
        if first:
            self._publish_chunks("the prefix hits", self.delivery.hold(
                [rows.req_id for rows in first]), first)

    def _publish_chunks(self, what: str, fresh: list[str], chunks: list[RowsReadBack]) -> None:
        """Queue the announcement of the requests seen first (`fresh`), then the publishing
        of `chunks`, on the output thread (where there is either)."""
        if not fresh and not chunks:
            return
        if not chunks:
            self._submit(f"announcing {len(fresh)} requests", fresh,
                         lambda: self.delivery.announce(fresh))
            return

        def publish() -> None:
            if fresh:
                self.delivery.announce(fresh)
            self.delivery.publish_chunks(chunks)

        self._submit(f"publishing the chunks of {what} of {len(chunks)} requests",
                     [*fresh, *(rows.req_id for rows in chunks)], publish, step_rows=True)

    def save_step(self, hidden: torch.Tensor, mm: Mapping[str, Any] | None, batch: StepBatch,
                  num_tokens_padded: int, slot_mapping: torch.Tensor | None = None) -> None:
        """Take this step's rows (the cache copies them; nothing here waits for a copy);
        `slot_mapping`: the runner's device slot mapping, for the cache's write. Outside a
        step (turned off) there is nothing to take."""
        if not self._in_step:
            return
        try:
            self._step = self._take_rows(hidden, mm, batch, num_tokens_padded, slot_mapping)
        except Exception as exc:
            self._engine_fault("saving a step's rows", exc)

    def _take_rows(self, hidden: torch.Tensor, mm: Mapping[str, Any] | None, batch: StepBatch,
                   num_tokens_padded: int, slot_mapping: torch.Tensor | None) -> _SavedStep:
        n = batch.num_rows
        if self.cache is not None:
            # only a backend that reads the device's slots takes the mapping (and its checks)
            step_id = self.cache.save_outputs(hidden, mm, num_tokens_unpadded=n,
                                              num_tokens_padded=num_tokens_padded,
                                              slot_mapping=slot_mapping
                                              if self.cache.backend.device_slots else None,
                                              plan_reads=False)
            return _SavedStep(batch, step_id=step_id)
        with torch.inference_mode(False):
            per_token = split_outputs(hidden, mm, n, num_tokens_padded, self.policy).per_token()
            if not self.backend.synchronous:  # the next forward may overwrite the originals
                per_token = {key: self.backend.snapshot(rows) for key, rows in per_token.items()}
            ready = self.backend.record_event()
            host_rows = {key: self.backend.copy_to_host(rows, ready=ready)
                         for key, rows in per_token.items()}
        return _SavedStep(batch, host_rows=host_rows)

    @property
    def active(self) -> bool:
        """False once turned off: the engine runs on, nothing is saved, and each request gets
        a failure in place of its rows."""
        return not self._off

    def turn_off(self, reason: str) -> None:
        """Stop saving and publishing from this step on; queued work still runs, then every
        request still held, and each one that finishes later, gets a failure naming `reason`
        in place of its rows."""
        self._off, self._in_step, self._step = True, False, None
        cause = f"the stage stopped publishing before the request finished: {reason}"
        try:
            self._thread.submit("stop publishing rows",
                                lambda: self.delivery.stop_publishing(cause))
        except OmniPrefixCacheError:  # the thread failed or is stuck: nothing goes out from now
            self.delivery.stop(cause)  # on, and `close` fails the requests held

    def end_step(self) -> None:
        """The step's output is built: discard it (read back: its chunks made due pinned) or
        queue its rows (a step without rows ends here)."""
        if not self._in_step:
            return
        step, self._step, self._in_step = self._step, None, False
        try:
            if step is not None and self.cache is not None:
                self.cache.discard_step(step.step_id)
                due = None if self._chunks is None else self._chunks.due(step.batch,
                                                                         self._finished_early)
                self._publish_chunks(f"a {step.batch.num_rows}-row step",
                                     self.delivery.hold(step.batch.req_ids),
                                     list(self.cache.plan_chunk_rows(due).values()) if due
                                     else [])
            elif step is not None:
                self._submit(f"delivering the rows of a {step.batch.num_rows}-row step",
                             step.batch.req_ids, lambda: self._deliver_unless_stopped(step),
                             step_rows=True)
            elif self.cache is not None:  # no forward ran: still exactly one save per step
                step_id = self.cache.save_outputs(self._empty_hidden(), None,
                                                  num_tokens_unpadded=0, num_tokens_padded=0,
                                                  plan_reads=False)
                self.cache.discard_step(step_id)
        except Exception as exc:
            self._engine_fault("ending a step", exc)

    def _engine_fault(self, what: str, exc: Exception) -> None:
        """A fault on the engine thread: the engine goes on, the stage turns off naming it
        (said once: a stage already off only logs it)."""
        reason = f"{what} failed: {type(exc).__name__}: {exc}"
        logger.debug("stage outputs: %s failed", what, exc_info=exc)
        if self._off:
            return
        logger.error("stage outputs off, the engine goes on: %s", reason)
        self.turn_off(reason)

    # ------------------------------------------------------------------ output thread

    def _submit(self, what: str, req_ids: Sequence[str], job: Callable[[], None], *,
                step_rows: bool = False) -> None:
        """Queue `job` on the output thread; a fault in it fails the entries of `req_ids`, and
        a step's rows delivered whole (`step_rows`) end a run of faulted steps."""
        try:
            self._thread.submit(what, lambda: self._contained(what, list(req_ids), job,
                                                              step_rows))
        except OmniPrefixCacheError as exc:  # the thread is stuck or stopped
            self._engine_fault(f"queueing {what}", exc)
            # the job's requests get their failures now: nothing else will publish them
            self.delivery.fail_requests(req_ids, f"queueing {what} failed: {exc}")

    def _contained(self, what: str, req_ids: list[str], job: Callable[[], None],
                   step_rows: bool) -> None:
        try:
            job()
        except Exception as exc:
            self._output_fault(what, req_ids, exc)
            return
        if step_rows:
            self._faulted_steps = 0

    def _output_fault(self, what: str, req_ids: list[str], exc: Exception) -> None:
        """Fail the requests a faulted job was for; after `MAX_FAULTED_STEPS` faulted steps in
        a row, stop publishing (the engine thread turns the stage off at its next step)."""
        cause = f"{what} failed: {type(exc).__name__}: {exc}"
        logger.error("stage outputs: %s; failing its %d requests, the stage goes on", cause,
                     len(req_ids))
        logger.debug("stage outputs: %s failed", what, exc_info=exc)
        self.delivery.fail_requests(req_ids, cause)
        self._faulted_steps += 1
        if self._faulted_steps == MAX_FAULTED_STEPS and self._stopped_by_faults is None:
            reason = f"{MAX_FAULTED_STEPS} steps in a row failed to deliver their rows, the " \
                     f"last: {cause}"
            logger.error("stage outputs off, the engine goes on: %s", reason)
            self.delivery.stop_publishing(f"the stage stopped publishing before the request "
                                          f"finished: {reason}")
            self._stopped_by_faults = reason

    def _deliver_unless_stopped(self, step: _SavedStep) -> None:
        """Deliver the step's rows, unless faults stopped publishing (steps the engine thread
        queued before it turned the stage off)."""
        if self._stopped_by_faults is None:
            self._deliver(step)

    def _deliver(self, step: _SavedStep) -> None:
        """Hand the step's host rows to the delivery once copied: a span per request, so the
        Python per request stays a tuple (see `StageDelivery.add_step`)."""
        batch = step.batch
        host: dict[str, torch.Tensor] = {}
        for key, (rows, transfer) in step.host_rows.items():
            wait_event(transfer.event, self._timeout_s, lambda key=key: f"step rows {key!r}")
            if transfer.finish is not None:
                transfer.finish()
            host[key] = rows
        self.delivery.add_step([(r, start, first, end) for r, first, end, start in batch.spans()],
                               host)

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {} if self.cache is None else self.cache.stats()
        out.update(self.delivery.stats())
        return out

    def close(self) -> None:
        """Publish what is queued (bounded), fail every request still held, then stop the
        thread and the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.close()
        finally:
            try:  # after whatever the thread published, and whether or not it failed
                self.delivery.fail_held("the stage shut down before the request finished")
            finally:
                if self.cache is not None:
                    self.cache.shutdown()
