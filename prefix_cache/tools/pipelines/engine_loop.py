"""A vLLM engine stepped by a thread of its own, so pipeline stages run side by side.

`Engine.step()` blocks for a step, so one thread stepping two stages would make
each wait on the other. An `EngineLoop` owns its engine from start to `close()`:
other threads only `submit` requests and `wait` for them, and every timing it
records (submission, first token, finish, each step) is taken on its thread.
Loops step side by side only engines in engine-core processes of their own:
vLLM's forward context is one per process, so two in-process engines stepped by
two threads fail ("Forward context is not set").
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prefix_cache.tools.pipelines.engines import Engine
from prefix_cache.tools.pipelines.pipeline import min_margin

#: How long an idle loop waits for a submission before it looks at its stop flag again.
IDLE_POLL_S = 0.002
#: How long `close()` waits for the loop's thread to end (a step in flight finishes first).
CLOSE_WAIT_S = 60.0


@dataclass
class Finished:
    """One request through one engine: its tokens and when things happened (perf_counter s)."""

    req_id: str
    submitted_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    min_margin: float = float("inf")  # smallest top-1 minus top-2 logprob, when asked for


class EngineLoop:
    """Invariant: after `__init__` only the loop's thread touches `engine` (add, step, abort)."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, dict[str, Any], Any]] = queue.Queue()
        self._requests: dict[str, Finished] = {}
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.step_seconds: list[float] = []  # each step() call's duration, in order
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, req_id: str, prompt: dict[str, Any], params: Any) -> None:
        """Queue `prompt` (an engine prompt dict) under `req_id`; its clock starts now."""
        with self._lock:
            self._requests[req_id] = Finished(req_id, time.perf_counter())
            self._done[req_id] = threading.Event()
        self._inbox.put((req_id, prompt, params))

    def wait(self, req_id: str, timeout_s: float) -> Finished:
        """`req_id` once finished, waiting up to `timeout_s`; raises if the loop failed."""
        if not self._done[req_id].wait(timeout_s):
            self._raise_if_failed()
            raise TimeoutError(f"request {req_id} did not finish within {timeout_s:g} s")
        self._raise_if_failed()
        with self._lock:
            self._done.pop(req_id)
            return self._requests.pop(req_id)

    def close(self) -> None:
        """Stop the loop (its step in flight ends first); the engine stays up."""
        self._stop.set()
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} still stepping {CLOSE_WAIT_S:g} s after "
                               f"close()")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._thread.name} failed: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_submissions(block=not self.engine.has_work())
                if self.engine.has_work():
                    start = time.perf_counter()
                    outputs = self.engine.step()
                    now = time.perf_counter()
                    self.step_seconds.append(now - start)
                    self._record(outputs, now)
        except BaseException as exc:  # surfaced by wait() and close()
            self._error = exc
            for event in list(self._done.values()):
                event.set()

    def _take_submissions(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            req_id, prompt, params = item
            self.engine.engine.add_request(req_id, prompt, params)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _record(self, outputs: list[Any], now: float) -> None:
        for out in outputs:
            with self._lock:
                request = self._requests.get(out.request_id)
            if request is None:  # a request another caller added (a warm-up's)
                continue
            completion = out.outputs[0]
            request.cached_tokens = max(request.cached_tokens, out.num_cached_tokens or 0)
            if request.first_token_at is None and completion.token_ids:
                request.first_token_at = now
            if out.finished:
                request.finished_at = now
                request.tokens = list(completion.token_ids)
                request.min_margin = min_margin(completion.logprobs)
                self._done[out.request_id].set()
