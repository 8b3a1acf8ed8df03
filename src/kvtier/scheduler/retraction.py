"""Pages short for a decode token: the reference scheduler's retractions (a mixin of
:class:`kvtier.scheduler.reference.ReferenceScheduler`, which holds the state it uses)."""

from __future__ import annotations

from collections import deque
from ..tiered import TieredCache
from .executor import Executor
from .requests import SchedRequest, StepPlan
from .stats import RunStats

__all__ = ["Retractions"]


class Retractions:
    """Retracting a running request when a decode token finds pages short."""

    cache: TieredCache  # the timed cache (kvtier.scheduler.stats.TimedCache)
    _real_cache: TieredCache
    executor: Executor
    stats: RunStats
    _running: list[SchedRequest]
    _retracted: deque[SchedRequest]

    def _submit(self) -> float:
        raise NotImplementedError

    def _decode_short(self, r: SchedRequest, plan: StepPlan) -> bool:
        """Pages are short for ``r``'s decode token: retract the newest decoding request not in
        the batch (a loading one cannot retract; when that is ``r``, the newest running prefill,
        older ones included: a prefill spared while ``r`` retracts itself and recomputes into the
        same pages is a livelock) until it fits, unless ``r`` never fits (:meth:`_never_fits`);
        whether it did."""
        running = self._running
        while not self._never_fits(r):  # each pass retracts one request of `running`, or stops
            victims = [x for x in running if all(x is not b for b, _ in plan.batch)
                       and self.cache.state(x.request_id) == "running"]
            decoding = [x for x in victims if x.tokens >= x.kv_target]
            if not decoding:
                return False
            victim = max(decoding, key=lambda x: x.admitted_order)
            if victim is r:  # the newest prefill, older ones too: r retracting itself would recompute into the
                prefills = [x for x in victims if x.tokens < x.kv_target]  # same pages, every step (a livelock)
                victim = max(prefills, key=lambda x: x.admitted_order) if prefills else r
            self._retract(victim)
            if victim is r:
                return False
            if self.cache.reserve(r.request_id, 1) is not None:
                return True
        return False

    def _never_fits(self, r: SchedRequest) -> bool:
        """Short of pages after eviction with no other request running and nothing in flight,
        ``r`` never fits: abort it (``"cache capacity exhausted"``, as :meth:`_idle`); whether it did."""
        others = self.cache.states([x.request_id for x in self._running if x is not r])
        if self.cache.in_flight() or "running" in others or "loading" in others:
            return False
        self.cache.abort(r.request_id, "cache capacity exhausted")
        self._submit()  # the next step's filter drops it from the running list
        return True

    def _retract(self, victim: SchedRequest) -> None:
        """Retract ``victim``: it resumes later by recomputing what it had."""
        adopted = self.cache.retract(victim.request_id)
        if adopted:  # the engine fills the checkpoint pages the tree adopted
            self.executor.checkpointed(self._real_cache, victim.request_id, adopted, victim.tokens)
        self.stats.retractions += 1
        self._running.remove(victim)
        if victim.tokens >= victim.kv_target:  # decoding: recompute what it had (a prefill resumes as it was)
            victim.resume_to = victim.kv_target = victim.tokens
        self._retracted.append(victim)
