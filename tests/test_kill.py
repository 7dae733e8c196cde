"""Stage 1's engine-core process SIGKILLed mid-round on vLLM's real CPU engine, restarted each
time, on shared memory and on Mooncake Store (loopback): every request whose entry was out
before a kill arrives exactly once with exactly its rows, every other request's consumer gets a
failure naming the dead producer within seconds, stage 2's tokens never change, and nothing is
left behind.

The short form of `python -m prefix_cache.tools.kill_test` (docs/benchmarks-history.md,
Reliability, has the long one)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prefix_cache.tools import kill_test  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KILLS = 2


@pytest.mark.parametrize("backend", ["shm", "mooncake"])
def test_stage_one_killed_mid_round_loses_nothing_and_every_cut_request_fails_fast(
        backend: str, request: pytest.FixtureRequest) -> None:
    spec = "shm" if backend == "shm" else request.getfixturevalue("mooncake_store").spec
    reports, left = kill_test.run(KILLS, spec, seed=3, say=lambda line: None)
    assert [p for r in reports for p in r.problems] == []
    assert [r.killed_at_s is not None for r in reports] == [True] * KILLS + [False]
    assert all(r.delivered + r.producer_failures == r.submitted for r in reports)
    assert reports[-1].delivered == reports[-1].submitted  # the engine serves after the kills
    assert sum(r.producer_failures for r in reports) > 0  # some kill cut a request
    assert left == []
