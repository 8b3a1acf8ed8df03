"""The reference scheduler's resumption of a retracted request: a resume that failed is
tried again only once capacity may have come back (a request event or a completion since,
or a smaller first chunk), never every step.

Families, not single cases: every write policy x with and without a host tier x output
lengths that double, with two and three requests on a device that holds one. Each asserts
the number of resume attempts (bounded by the retractions and the events, not by the
decode steps), and that the run decides exactly as a scheduler that retries every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtier.fsm.presets import preset
from kvtier.scheduler import ReferenceScheduler, RunStats, SchedRequest
from kvtier.tiered import Admission, TieredCache

LAYOUT = preset("llama-3-8b", page_tokens=16, num_layers=2)  # 16-token units


class CountingCache(TieredCache):
    """A cache that counts the resume attempts and the failed ones."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.resumes = self.failed_resumes = 0

    def resume(self, request_id: str, chunk_tokens: int) -> Admission | None:
        self.resumes += 1
        adm = super().resume(request_id, chunk_tokens)
        self.failed_resumes += adm is None
        return adm


class RetriesEveryStep(ReferenceScheduler):
    """The scheduler without the back-off: it forgets every failed resume."""

    @property
    def _resume_failed(self) -> None:  # type: ignore[override]
        return None

    @_resume_failed.setter
    def _resume_failed(self, value: object) -> None:
        pass


def _requests(n: int, output: int) -> list[SchedRequest]:
    return [SchedRequest(f"r{i}", 0.001 * i, 40, output, tuple((i, u) for u in range(2))) for i in range(n)]


def _run(sched_cls: type[ReferenceScheduler], n: int, output: int, policy: str,
         host: int | None) -> tuple[RunStats, CountingCache]:
    # the device holds one request's prompt and output (plus a unit), never two
    device = -(-(40 + output) // 16) + 1
    cache = CountingCache(LAYOUT, device, host, policy=policy)
    stats = sched_cls(cache, token_budget=256).run(_requests(n, output))
    assert stats.finished + stats.aborts == n
    assert cache.quiescent(), cache.outstanding()
    return stats, cache


def _decisions(stats: RunStats, cache: TieredCache) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(stats).items() if k not in ("kvtier_s", "kvtier_decode_s", "timeline")}
    core = cache.stats()
    return {**out, **{k: core[k] for k in ("loadbacks", "writebacks")}}


CASES = [(policy, host) for policy in ("write_through", "write_through_selective", "write_back")
         for host in (None, 256)]


@pytest.mark.parametrize(("policy", "host"), CASES, ids=[f"{p}-host{h}" for p, h in CASES])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("output", [200, 800])
def test_a_failed_resume_waits_for_capacity_to_come_back(policy: str, host: int | None, n: int,
                                                          output: int) -> None:
    """At most one attempt per retraction and one after each change that may free pages (a
    request's end or retraction, a transfer's completion): none per decode step."""
    stats, cache = _run(ReferenceScheduler, n, output, policy, host)
    core = cache.stats()
    assert stats.retractions >= 1  # the device holds one request: a decoding one is retracted
    changes = n + stats.retractions + core["writebacks"] + core["loadbacks"]
    assert cache.resumes <= stats.retractions + changes, (cache.resumes, stats.retractions, changes)
    assert cache.failed_resumes < stats.steps / 10
    if host is None:  # no transfers: the attempts do not grow with the output length
        assert cache.resumes <= 2 * stats.retractions + n


@pytest.mark.parametrize(("policy", "host"), CASES, ids=[f"{p}-host{h}" for p, h in CASES])
def test_the_back_off_decides_as_a_retry_every_step(policy: str, host: int | None) -> None:
    """Skipping a resume that would fail again changes nothing but the attempts and what
    the failed attempts evicted on the way (device evictions and the device occupancy
    samples): the same steps, admissions, hits, retractions, tokens and transfers as
    retrying every step."""
    stats, cache = _run(ReferenceScheduler, 3, 300, policy, host)
    every, every_cache = _run(RetriesEveryStep, 3, 300, policy, host)
    assert _decisions(stats, cache) == _decisions(every, every_cache)
    assert every_cache.failed_resumes > 300 and every_cache.failed_resumes > 10 * cache.failed_resumes
