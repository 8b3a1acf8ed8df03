"""The replay in rank-parallel mode: every rank process runs the reference scheduler over
its own :class:`~kvtier.parallel.cache.RankCache` and its own executor (metadata only, or
real bytes in its own pools through a transfer backend, fingerprint-checked), agreeing on
completions and decisions every step (:func:`run_rank`, for
:func:`~kvtier.parallel.launch.launch`).

Real bytes: each rank's pools hold its shard (:func:`~kvtier.parallel.rank.shard_layout`,
then scaled by ``byte_scale`` as the single-process replay does), and its fingerprints
are salted with its rank, so a page read back on one rank must hold what that rank wrote.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.fsm import Completion, KvtierError, TransferCommand, units_to_pages
from kvtier.fsm.layout import CacheLayout

from ..scheduler import Executor, InstantExecutor, ReferenceScheduler, SchedRequest, percentile
from ..tiered import Admission, TieredCache
from .launch import RankError
from .cache import RankCache
from .rank import RankExecutor, drain_report, check_drained, shard_layout
from .sync import StepSync, SyncStats

__all__ = ["RankJob", "run_rank", "run_jobs", "reference_run", "fresh"]


def fresh(requests: Sequence[SchedRequest]) -> list[SchedRequest]:
    """Unrun copies of ``requests``."""
    return [SchedRequest(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.units) for r in requests]


@dataclass(frozen=True)
class RankJob:
    """One rank-parallel replay (every rank gets the same job).

    Attributes:
        requests: the scheduler's requests (copied fresh on every rank).
        layout: the full model's layout (each rank's pools hold ``1 / world_size`` of it).
        device_units, host_units: capacities in cache units (``host_units`` None: device only).
        policy: write policy.
        backend: ``none`` (metadata) or a transfer backend (``cpu`` on the CPU).
        byte_scale: page bytes of the shard divided by it for the real copies (>= 64 B kept).
        seed: fingerprint salt (each rank adds its rank).
        token_budget: tokens per scheduler step.
        fail: op id -> the rank that reports it failed (injected failures).
        device_units_of: rank -> a different device capacity (to make a rank diverge, in tests).
        keep_history: keep every exchange's digest.
        check_every: check the core's invariants every this many steps (0: at the end only).
    """

    requests: tuple[SchedRequest, ...]
    layout: CacheLayout
    device_units: int
    host_units: int | None
    policy: str = "write_through_selective"
    backend: str = "none"
    byte_scale: int = 64
    seed: int = 0
    token_budget: int = 8192
    fail: Mapping[int, int] = field(default_factory=dict)
    device_units_of: Mapping[int, int] = field(default_factory=dict)
    keep_history: bool = False
    check_every: int = 0


def _executor(job: RankJob, rank: int, world: int, device_units: int) -> Executor:
    if job.backend == "none":
        return InstantExecutor(world_size=1)
    from ..replay.fingerprint import BytesExecutor, scaled_layout

    layout = scaled_layout(shard_layout(job.layout, world), job.byte_scale)
    return BytesExecutor(layout, units_to_pages(job.layout, device_units),
                         units_to_pages(job.layout, job.host_units) if job.host_units else None, job.backend,
                         salt=job.seed * 1009 + rank)


def run_rank(sync: StepSync, job: RankJob) -> dict[str, Any]:
    """Run ``job`` on this rank (call it on every rank, e.g. through
    :func:`~kvtier.parallel.launch.launch`).

    Returns:
        This rank's result: ``digest`` (final), ``history`` (with ``keep_history``),
        ``run`` (the scheduler's counts), ``core`` (the core's counters), ``failed_ops``
        (loadback and writeback failures its core saw), ``injected`` (op ids this rank
        failed), ``fingerprints`` (pages checked / written), ``drain``
        (:func:`~kvtier.parallel.rank.drain_report`, checked), ``sync`` (agreement cost),
        ``shard_bytes_per_unit``.

    Raises:
        RankDivergence: the ranks' decisions differed (on every rank, same step).
        InvariantViolation: an invariant failed or something leaked after draining.
        FingerprintMismatch: a page read back on this rank held the wrong bytes.
    """
    rank, world = sync.rank, sync.world_size
    dev_units = int(job.device_units_of.get(rank, job.device_units))
    cache = RankCache(job.layout, dev_units, job.host_units, policy=job.policy, world_size=world)
    local = _executor(job, rank, world, dev_units)
    fail = [op for op, r in job.fail.items() if r == rank]
    sched: ReferenceScheduler | None = None

    def step() -> int:
        return sched.stats.steps if sched is not None else 0

    ex = RankExecutor(local, sync, cache, fail_ops=fail, step=step)
    sync.history = [] if job.keep_history else None
    sync.stats = SyncStats()  # this run's exchanges (every rank starts its run here, in step)
    sched = ReferenceScheduler(cache, ex, token_budget=job.token_budget)
    if job.check_every:
        _check_each(ex, cache, job.check_every)
    t0 = time.perf_counter()
    st = sched.run(fresh(job.requests))
    wall = time.perf_counter() - t0
    drain = drain_report(cache)
    check_drained(cache)
    cs = cache.core.stats
    ss = sync.stats
    samples = ss.samples_us
    return {
        "rank": rank, "world_size": world, "digest": cache.digest.value(), "decisions": cache.digest.updates,
        "history": list(sync.history) if sync.history is not None else None,
        "run": {"finished": st.finished, "aborts": st.aborts, "steps": st.steps, "hit_tokens": st.hit_tokens,
                "prefill_tokens": st.prefill_tokens, "retractions": st.retractions,
                "loadback_pages": st.loadback_pages, "writeback_pages": st.writeback_pages,
                "abort_reasons": dict(st.abort_reasons), "bookkeeping_s": st.kvtier_s, "wall_s": wall},
        "core": {k: v for k, v in vars(cs).items() if k != "extra"},
        "failed_ops": cs.loadback_failures + cs.writeback_failures,
        "failed_op_ids": sorted(cache.failed_ops), "settled_ops": cache.settled_ops,
        "injected": sorted(ex.injected),
        "fingerprints": {"checked": int(getattr(local, "pages_checked", 0)),
                         "written": int(getattr(local, "pages_written", 0))},
        "drain": drain,
        "shard_bytes_per_unit": (shard_layout(job.layout, world).unit_bytes()),
        "sync": {"exchanges": ss.exchanges, "exchange_s": ss.exchange_s, "completion_gathers": ss.completion_gathers,
                 "completions": ss.completions,
                 "mean_us": statistics.fmean(samples) if samples else 0.0,
                 "p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)},
    }


def _check_each(ex: RankExecutor, cache: RankCache, every: int) -> None:
    """Check the invariants at every ``every``-th collect (after the exchange's completions
    are fed back: at the next collect, before its own)."""
    collect = ex.collect
    count = [0]

    def checked() -> list[Any]:
        count[0] += 1
        if count[0] % every == 0:
            cache.check_invariants()
        return collect()

    ex.collect = checked  # type: ignore[method-assign]


def run_jobs(sync: StepSync, jobs: Sequence[RankJob]) -> list[dict[str, Any] | RankError]:
    """:func:`run_rank` for each job in turn; a kvtier error of a job (a divergence, on
    every rank at the same exchange) is returned in its place and the next job runs."""
    out: list[dict[str, Any] | RankError] = []
    for job in jobs:
        try:
            out.append(run_rank(sync, job))
        except KvtierError as e:
            out.append(RankError(sync.rank, type(e).__name__, str(e),
                                 {k: v for k, v in vars(e).items() if isinstance(v, (int, str, tuple))}))
    return out


class _AllRanks:
    """Metadata-only completions of ``world_size`` ranks in one process, in the order the
    exchange delivers them (rank by rank), with ``fail`` applied."""

    def __init__(self, world_size: int, fail: Mapping[int, int], cache: RankCache) -> None:
        self.ranks = [InstantExecutor(world_size=1) for _ in range(world_size)]
        self.fail = fail
        self.cache = cache
        self.history: list[int] = []

    def submit(self, commands: Sequence[TransferCommand]) -> None:
        for ex in self.ranks:
            ex.submit(commands)

    def collect(self) -> list[Completion]:
        self.history.append(self.cache.digest.value())  # what an exchange would compare now
        out = []
        for r, ex in enumerate(self.ranks):
            for c in ex.collect():
                out.append(Completion(c.op_id, r, c.ok and self.fail.get(c.op_id) != r, c.layer))
        return out

    def forward(self, cache: TieredCache, batch: Sequence[tuple[str, int, int]]) -> None:
        return None

    def transfer_seconds(self) -> float:
        return 0.0

    def admitted(self, cache: TieredCache, adm: Admission) -> None:
        return None

    def checkpointed(self, cache: TieredCache, request_id: str, pages: dict[str, list[int]], tokens: int) -> None:
        return None


def reference_run(job: RankJob, world_size: int) -> dict[str, Any]:
    """The same job in one process: one core with ``world_size`` ranks' completions
    (metadata only, ``job.fail`` applied), delivered as the exchange delivers them.
    A rank-parallel run must reach the same digest on every rank.

    Returns:
        ``digest``, ``decisions``, ``failed_ops``, ``failed_op_ids``, ``run`` (counts),
        ``drain`` (checked) and ``history`` (the digest at every collect: what the
        exchanges of a rank-parallel run compare, in order).
    """
    cache = RankCache(job.layout, job.device_units, job.host_units, policy=job.policy, world_size=world_size)
    ranks = _AllRanks(world_size, job.fail, cache)
    sched = ReferenceScheduler(cache, ranks, token_budget=job.token_budget)
    st = sched.run(fresh(job.requests))
    cs = cache.core.stats
    return {"digest": cache.digest.value(), "decisions": cache.digest.updates,
            "failed_ops": cs.loadback_failures + cs.writeback_failures, "failed_op_ids": sorted(cache.failed_ops),
            "run": {"finished": st.finished, "aborts": st.aborts, "steps": st.steps, "hit_tokens": st.hit_tokens},
            "drain": check_drained(cache), "history": ranks.history}
