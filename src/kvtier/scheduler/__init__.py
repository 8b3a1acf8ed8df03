"""The reference scheduler: continuous batching over :class:`TieredCache`, the way an
engine's scheduler would drive it.

Each step: deliver transfer completions, advance deadlines, schedule decode tokens
(retracting the newest request when decode pages run out), continue chunked prefills,
resume retracted requests, admit waiting ones within a token budget, submit the cache's
transfer commands, run the forward pass (through an :class:`Executor`), report its
results, finish requests that are done, and abort one deterministic victim when nothing
could be scheduled, nothing is in flight and every blocked request is short of cache.

Time is modeled (:class:`CostModel`) unless a :class:`Clock` is given: then it is
measured (the executor's forward pass must return only once its work is done), arrivals
are replayed against it, and idle gaps (nothing running, nothing in flight) are skipped.
The cache's decisions never depend on time.

Modules: :mod:`.requests` (:class:`SchedRequest`, :class:`SchedulerStalled`),
:mod:`.executor` (:class:`Executor`, :class:`Clock`, :class:`InstantExecutor`), :mod:`.stats`
(:class:`RunStats`) and :mod:`.reference` (:class:`ReferenceScheduler`); the step-time model
is :class:`kvtier.replay.costmodel.CostModel`.
"""

from __future__ import annotations

from .executor import Clock, Executor, InstantExecutor
from .reference import DEFAULT_MAX_IDLE_STEPS, ReferenceScheduler
from .requests import MAX_ARRIVAL_S, SchedRequest, SchedulerStalled
from .stats import RunStats, percentile

__all__ = ["SchedRequest", "Executor", "InstantExecutor", "ReferenceScheduler", "RunStats", "Clock", "SchedulerStalled",
           "DEFAULT_MAX_IDLE_STEPS", "MAX_ARRIVAL_S", "percentile"]
