"""The reference scheduler on a device too small for some of its requests: a request that can
never fit is aborted with ``"cache capacity exhausted"`` (what the idle path does when nothing
runs), while the others finish, and decode pressure never retract-resumes two requests in turn
(a livelock that only the run's bound on iterations used to stop: ``SchedulerStalled``).

The layout of the kit machines (alignment 4 tokens; ``kv`` holds 2 tokens a page): a device of
``d`` units holds ``4 d`` tokens. Each case also asserts the run stays far below its bound.
"""

from __future__ import annotations

import pytest

from kvtier.scheduler import InstantExecutor, ReferenceScheduler, RunStats, SchedRequest
from kvtier.testing.base import kit_layout
from kvtier.testing.scheduler_machine import FaultyExecutor
from kvtier.tiered import TieredCache

LAYOUT = kit_layout()
ALIGN = LAYOUT.alignment  # 4 tokens


def _req(i: int, arrival: float, units: str, tail: int, output: int) -> SchedRequest:
    return SchedRequest(f"s{i}", arrival, len(units) * ALIGN + tail, output, tuple(units))


def _run(device: int, host: int | None, requests: list[SchedRequest], budget: int,
         executor: InstantExecutor | None = None) -> tuple[RunStats, TieredCache, int]:
    cache = TieredCache(LAYOUT, device, host, op_deadline_steps=None)
    sched = ReferenceScheduler(cache, executor or InstantExecutor(1, layer_chunk=1), token_budget=budget,
                               max_idle_steps=200)
    iterations = [0]

    def count() -> None:
        iterations[0] += 1

    stats = sched.run(requests, on_step=count)
    cache.check_invariants()
    assert cache.quiescent()
    return stats, cache, iterations[0]


@pytest.mark.parametrize("host", [None, 6])
def test_a_prompt_larger_than_the_device_is_aborted_while_another_request_decodes(host: int | None) -> None:
    # 25 prompt tokens on a 20-token device: s0 prefills 16 tokens, then can never go on;
    # s1 (4 tokens, 7 out) decodes beside it, short of pages, and used to retract itself
    # and resume every step while s0 stayed blocked
    reqs = [_req(0, 0.0, "cabaab", 1, 2), _req(1, 0.01, "b", 0, 7)]
    stats, _, iterations = _run(5, host, reqs, 16)
    assert (stats.finished, stats.aborts) == (1, 1)
    assert stats.abort_reasons == {"cache capacity exhausted": 1}
    assert reqs[0].aborted == "cache capacity exhausted" and reqs[1].aborted is None
    assert reqs[1].generated == 7
    assert iterations < 40


@pytest.mark.parametrize("host", [None, 6])
def test_requests_that_outgrow_the_device_are_aborted_not_retracted_in_turn(host: int | None) -> None:
    # each needs 26 or 28 tokens on a 20-token device: alone at 20 tokens and short of a
    # page, each used to retract itself while the other resumed, in turn, without end
    reqs = [_req(0, 0.0, "ccaa", 0, 10), _req(1, 0.01, "cabc", 2, 10)]
    stats, _, iterations = _run(5, host, reqs, 16)
    assert (stats.finished, stats.aborts, stats.retractions) == (0, 2, 0)
    assert stats.abort_reasons == {"cache capacity exhausted": 2}
    assert [r.tokens for r in reqs] == [20, 20]
    assert iterations < 40


def test_a_decode_short_of_pages_retracts_the_newer_prefill_not_itself() -> None:
    # a 12-token device; s1 (4 + 8 tokens) and s2 (4 + 6) each fit alone, never together.
    # s2, retracted, recomputes while s1 decodes: s1 short used to retract itself (s2 was no
    # decode victim), then s2 short did the same, in turn, until the bound. Now the newer
    # prefill s2 is retracted, s1 finishes, then s2. The three others can never fit.
    reqs = [_req(0, 0.0, "acbba", 0, 7), _req(1, 0.01, "a", 0, 8), _req(2, 0.01, "b", 0, 6),
            _req(3, 0.02, "ab", 1, 11), _req(4, 0.03, "acbbbc", 2, 4), _req(5, 0.03, "ac", 1, 5)]
    stats, _, iterations = _run(3, None, reqs, 4, FaultyExecutor(1, 0, 0.0, 0))
    assert [r.aborted for r in reqs] == ["cache capacity exhausted", None, None, "cache capacity exhausted",
                                         "cache capacity exhausted", "cache capacity exhausted"]
    assert [reqs[1].generated, reqs[2].generated] == [8, 6]
    assert stats.finished == 2 and stats.retractions <= 4
    assert iterations < 200
