"""The request side's operator counters (``RequestTable.counters``, ``TieredCache.counters``),
read by :meth:`kvtier.TieredCache.stats` and the Prometheus collector (:mod:`kvtier.metrics`).

Plain integer increments on the request paths (a few per request, one per settled
operation): :meth:`~kvtier.fsm.request.table.RequestTable.fire` counts retractions and
aborts, :class:`~kvtier.fsm.request.admission.Admitter` admissions and hit tokens,
:class:`~kvtier.fsm.request.completions.CompletionRouter` settled operations, and
:func:`kvtier.fsm.request.fence.check_all` invariant checks. Everything else an operator sees is
computed at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lifecycle.names import REQUEST_EVENT as RE, REQUEST_STATE as RS

__all__ = ["FacadeCounters", "OUTCOMES", "KNOWN_ABORT_REASONS"]

#: How an operation ended: ``ok``, ``failed`` (a rank reported failure, or it was
#: poisoned by an abort), ``deadline`` (its deadline passed first).
OUTCOMES = ("ok", "failed", "deadline")
#: Abort reasons kvtier itself gives (an engine's own reasons are counted as they come).
KNOWN_ABORT_REASONS = ("aborted by client", "cache capacity exhausted", "retract writeback failed",
                       "scheduler stalled")


@dataclass
class FacadeCounters:
    """Cumulative counters of one request table (one :class:`~kvtier.tiered.TieredCache`).

    Attributes:
        admissions: requests admitted (``admit``).
        resumptions: retracted requests re-admitted (``resume``).
        prompt_tokens: prompt tokens of admitted requests (tokens).
        hit_tokens_device: of those, prefix-hit tokens found on the device (tokens;
            resumptions not counted).
        hit_tokens_host: of those, prefix-hit tokens loaded back from the host (tokens).
        retractions: requests preempted (``retract``).
        aborts: abort reason -> requests that ended ``aborted`` with it.
        settled: (direction, outcome) -> operations that ended so (see :data:`OUTCOMES`).
        invariant_checks: ``check_invariants()`` calls.
        invariant_failures: of those, the calls that raised.
    """

    admissions: int = 0
    resumptions: int = 0
    prompt_tokens: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    retractions: int = 0
    aborts: dict[str, int] = field(default_factory=dict)
    settled: dict[tuple[str, str], int] = field(default_factory=dict)
    invariant_checks: int = 0
    invariant_failures: int = 0

    def admitted(self, event: str, prompt_tokens: int, hit_tokens: int, device_hit_tokens: int) -> None:
        """An admission (``event`` ``schedule``) or resumption (``resume``) succeeded."""
        if event == RE.resume:
            self.resumptions += 1
            return
        self.admissions += 1
        self.prompt_tokens += prompt_tokens
        self.hit_tokens_device += device_hit_tokens
        self.hit_tokens_host += hit_tokens - device_hit_tokens

    def transition(self, event: str, state: str, reason: str | None) -> None:
        """A request changed state (called by the facade after each such transition)."""
        if event == RE.retract:
            self.retractions += 1
        elif state == RS.aborted:
            key = reason or "unknown"
            self.aborts[key] = self.aborts.get(key, 0) + 1

    def operation_settled(self, direction: str, ok: bool, expired: bool) -> None:
        """An operation ended (``direction``: ``writeback`` or ``loadback``)."""
        key = (direction, "ok" if ok else "deadline" if expired else "failed")
        self.settled[key] = self.settled.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (``settled`` keyed ``"direction/outcome"``)."""
        return {"admissions": self.admissions, "resumptions": self.resumptions,
                "prompt_tokens": self.prompt_tokens, "hit_tokens_device": self.hit_tokens_device,
                "hit_tokens_host": self.hit_tokens_host, "retractions": self.retractions,
                "aborts": dict(self.aborts), "settled": {f"{d}/{o}": n for (d, o), n in self.settled.items()},
                "invariant_checks": self.invariant_checks, "invariant_failures": self.invariant_failures}
