"""The reference scheduler's admission of a waiting request: an admission that failed is
tried again only once something it depends on has changed (a request event or a
completion, a node lifecycle event, a pool's count of pages in use), or with a smaller
first chunk; never at every step in which nothing changed.

Families, not single cases: every write policy x with and without a host tier, with two
and three requests on a device that holds one. Each asserts that the run decides exactly
as a scheduler that retries every step, with fewer failed attempts.
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
    """A cache that counts the admission attempts that failed."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.failed_admits = 0

    def admit(self, request_id: str, units: Any, prompt_tokens: int, chunk_tokens: int) -> Admission | None:
        adm = super().admit(request_id, units, prompt_tokens, chunk_tokens)
        self.failed_admits += adm is None
        return adm


class RetriesEveryStep(ReferenceScheduler):
    """The scheduler without the admission back-off: it forgets every failed admission."""

    @property
    def _admit_failed(self) -> None:  # type: ignore[override]
        return None

    @_admit_failed.setter
    def _admit_failed(self, value: object) -> None:
        pass


def _run(sched_cls: type[ReferenceScheduler], n: int, prompt: int, output: int, policy: str,
         host: int | None) -> tuple[RunStats, CountingCache]:
    # the device holds one request's prompt and output (plus a unit), never two: a request
    # that arrives while another decodes waits for its pages
    device = -(-(prompt + output) // 16) + 1
    cache = CountingCache(LAYOUT, device, host, policy=policy)
    reqs = [SchedRequest(f"r{i}", 0.001 * i, prompt, output, tuple((i, u) for u in range(prompt // 16)))
            for i in range(n)]
    stats = sched_cls(cache, token_budget=256).run(reqs)
    assert stats.finished + stats.aborts == n
    assert cache.quiescent(), cache.outstanding()
    return stats, cache


def _decisions(stats: RunStats, cache: TieredCache) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(stats).items() if k not in ("kvtier_s", "kvtier_decode_s")}
    core = cache.stats()
    return {**out, **{k: core[k] for k in ("loadbacks", "writebacks", "device_evictions", "host_evictions",
                                           "demotions", "triggers") if k in core}}


CASES = [(policy, host) for policy in ("write_through", "write_through_selective", "write_back")
         for host in (None, 256)]


@pytest.mark.parametrize(("policy", "host"), CASES, ids=[f"{p}-host{h}" for p, h in CASES])
@pytest.mark.parametrize(("n", "prompt", "output"), [(2, 200, 100), (3, 200, 100), (3, 400, 300)])
def test_the_admission_back_off_decides_as_a_retry_every_step(policy: str, host: int | None, n: int, prompt: int,
                                                               output: int) -> None:
    """Skipping an admission that would fail again changes nothing but the failed attempts:
    the same steps, admissions, hits, retractions, tokens, evictions and transfers as
    retrying every step, and no more failed attempts (fewer where requests wait)."""
    stats, cache = _run(ReferenceScheduler, n, prompt, output, policy, host)
    every, every_cache = _run(RetriesEveryStep, n, prompt, output, policy, host)
    assert _decisions(stats, cache) == _decisions(every, every_cache)
    assert every_cache.failed_admits >= 50  # a request waited while another decoded
    assert 1 <= cache.failed_admits < every_cache.failed_admits / 4, (cache.failed_admits, every_cache.failed_admits)
