"""The requests of the reference scheduler (:class:`SchedRequest`), their checks, what one
step runs (:class:`StepPlan`), and the error a run that stops making progress raises
(:class:`SchedulerStalled`)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvtier.fsm import ConfigError, KvtierError
from kvtier.fsm.checks import finite

from ..replay.trace import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH, MAX_TIMESTAMP_MS

__all__ = ["SchedRequest", "SchedulerStalled", "StepPlan", "MAX_ARRIVAL_S", "as_index", "check_fresh"]

MAX_ARRIVAL_S = MAX_TIMESTAMP_MS / 1000
"""Latest arrival time accepted, in seconds (1e10 s: the trace reader's ``MAX_TIMESTAMP_MS``)."""


class SchedulerStalled(KvtierError):  # type: ignore[misc,unused-ignore]  # Any when mypy cannot map kvtier.fsm
    """The reference scheduler stopped making progress, or ran past its bound on steps.

    Attributes:
        steps: scheduler iterations run.
        live: ids of the requests that had not ended (at most 10 listed in the message).
    """

    def __init__(self, detail: str, steps: int, live: Sequence[str]) -> None:
        self.steps = steps
        self.live = tuple(live)
        shown = ", ".join(self.live[:10]) + (", ..." if len(self.live) > 10 else "")
        super().__init__(f"{detail} after {steps:,} iterations; {len(self.live):,} request(s) not ended "
                         f"({shown})")


def as_index(value: object, name: str, low: int, high: int) -> int:
    """``value`` as an int in ``low .. high`` (anything ``operator.index`` accepts but bool;
    the wording of ``kvtier.fsm.checks.as_int``)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an int in {low}..{high}, got {value!r}") from None
    if not low <= n <= high:
        raise ConfigError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return n


@dataclass(slots=True, eq=False)
class SchedRequest:
    """A request as the reference scheduler sees it.

    Attributes:
        request_id: unique id (a non-empty str).
        arrival_s: arrival time (seconds, finite, 0 .. :data:`MAX_ARRIVAL_S`).
        prompt_tokens: prompt length (tokens, 1 .. ``kvtier.replay.trace.MAX_INPUT_LENGTH``).
        output_tokens: tokens to generate (0 .. ``kvtier.replay.trace.MAX_OUTPUT_LENGTH``; 0 behaves as 1).
        units: unit keys of the prompt's full units (a list is stored as a tuple).

    Raises:
        ConfigError: any of these out of range or of the wrong type (checked again by
            :meth:`ReferenceScheduler.run`, since the fields can be reassigned).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    units: tuple[Hashable, ...]
    tokens: int = 0
    generated: int = 0
    admitted_order: int = -1
    first_token_s: float | None = None
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    history_hit_tokens: int = 0
    computed_tokens: int = 0
    done: bool = False
    aborted: str | None = None
    decode_units: int = 0
    resume_to: int = 0
    kv_target: int = 0  # tokens whose KV must exist before it decodes (prompt, or what it had)

    def __post_init__(self) -> None:
        self.check()
        self.kv_target = self.prompt_tokens

    def check(self) -> None:
        """Validate (and normalise) the request's inputs.

        Raises:
            ConfigError: a bad ``request_id``, ``arrival_s``, ``prompt_tokens``,
                ``output_tokens`` or ``units``; the message names the request and the field.
        """
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"SchedRequest: request_id must be a non-empty str, got {rid!r}")
        where = f"SchedRequest {rid!r}"
        t = self.arrival_s
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not finite(t) \
                or not 0 <= t <= MAX_ARRIVAL_S:
            raise ConfigError(f"{where}: arrival_s must be a finite number of seconds in 0 .. {MAX_ARRIVAL_S:.0e}, "
                              f"got {t!r}")
        self.arrival_s = float(t)
        self.prompt_tokens = as_index(self.prompt_tokens, f"{where}: prompt_tokens", 1, MAX_INPUT_LENGTH)
        self.output_tokens = as_index(self.output_tokens, f"{where}: output_tokens", 0, MAX_OUTPUT_LENGTH)
        if not isinstance(self.units, (tuple, list)):
            raise ConfigError(f"{where}: units must be a tuple of unit keys, got {type(self.units).__name__}")
        self.units = tuple(self.units)


def check_fresh(requests: Sequence[SchedRequest]) -> int:
    """Check the requests of one run before anything runs; returns their work (prompt tokens
    plus output tokens, at least one each).

    Raises:
        ConfigError: not a sequence of :class:`SchedRequest`, a bad field (see
            :meth:`SchedRequest.check`), a request run before, or a repeated request id.
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ConfigError(f"requests must be a sequence of SchedRequest, got {type(requests).__name__}")
    seen: set[str] = set()
    work = 0
    for i, r in enumerate(requests):
        if not isinstance(r, SchedRequest):
            raise ConfigError(f"requests[{i}] must be a SchedRequest, got {type(r).__name__}")
        r.check()
        if r.request_id in seen:
            raise ConfigError(f"requests[{i}]: request id {r.request_id!r} appears twice")
        if r.done or r.tokens or r.generated or r.admitted_order >= 0:
            raise ConfigError(f"requests[{i}] ({r.request_id!r}) was run before; pass a fresh SchedRequest")
        seen.add(r.request_id)
        work += r.prompt_tokens + max(1, r.output_tokens)
    return work


@dataclass
class StepPlan:
    """What one step runs: ``(request, tokens)`` items, the token budget left (tokens), and
    the ids of the requests that could not get pages."""

    budget: int
    batch: list[tuple[SchedRequest, int]] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    def add(self, r: SchedRequest, tokens: int) -> None:
        self.batch.append((r, tokens))
        self.budget -= tokens
