"""The Prometheus label sets at their bounds (``model_label_bounds``).

:mod:`kvtier.metrics` bounds the ``reason`` label of ``kvtier:aborts_total``: kvtier's own
abort reasons (:data:`kvtier.fsm.request.counters.KNOWN_ABORT_REASONS`, zeros included), the
first :data:`~kvtier.metrics.MAX_ABORT_REASONS` other reasons in the order they first occurred,
and ``other`` for every later one and for a reason spelled ``other``; a label value is cut to
:data:`~kvtier.metrics.MAX_LABEL_CHARS` characters after what UTF-8 cannot encode is written as
a backslash escape, and label values that then coincide add up (the module's doc).

:func:`abort_series` computes the rows that rule gives from the counts by reason, restated
from that doc (sharing no code with the collector); :func:`check_abort_series` compares
them with what the collector exports: the same label values (exactly the first N distinct
reasons get rows of their own) and the same counts. :func:`abort_reason` hands the kit's
machines the reason of their n-th abort, from :data:`REASONS`: more distinct engine reasons
than the bound, ``other``, two long reasons that coincide once cut, one that is cut, and one
with a lone surrogate, so that an example with enough aborts drives the label set to and
past its bound.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .models import ModelViolation

__all__ = ["REASONS", "abort_reason", "abort_series", "call_abort", "check_abort_series", "drive_abort_reasons"]

_LONG = "engine reason cut at the label bound " * 5  # 185 characters: both below cut to the same 128
#: the reasons the kit's aborts cycle through (module doc)
REASONS: tuple[str, ...] = (
    "aborted by client", "engine reason 0", "other", "engine reason 1", _LONG + "A", "engine reason 2",
    _LONG + "B", "bad \udc80 reason", *(f"engine reason {i}" for i in range(3, 20)))


def abort_reason(n: int) -> str:
    """The reason of an example's ``n``-th abort (0-based), from :data:`REASONS`."""
    return REASONS[n % len(REASONS)]


def call_abort(sched: Any, request_id: str, reason: str) -> None:
    """``sched.abort(request_id, reason)``, or ``sched.abort(request_id)`` for a scheduler
    adapter whose ``abort`` takes no reason (an engine's own plug)."""
    try:
        takes = len(inspect.signature(sched.abort).parameters) >= 2
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        takes = False
    if takes:
        sched.abort(request_id, reason)
    else:
        sched.abort(request_id)


def _label(value: str, max_chars: int) -> str:
    out = []
    for ch in value:
        if 0xD800 <= ord(ch) <= 0xDFFF:  # a lone surrogate: UTF-8 cannot encode it
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)[:max_chars]


def abort_series(aborts: Iterable[tuple[str, int]], known: tuple[str, ...], bound: int,
                 max_chars: int) -> dict[str, int]:
    """The ``reason`` rows (label value -> count) for ``aborts`` (reason, count) in the
    order the reasons first occurred: every ``known`` reason and ``other`` (zeros
    included), the first ``bound`` other reasons, and ``other`` for the rest."""
    rows = dict.fromkeys((*known, "other"), 0)
    own = 0
    for reason, n in aborts:
        if reason in known:
            key = reason
        elif reason == "other":
            key = "other"
        else:
            own += 1
            key = _label(reason, max_chars) if own <= bound else "other"
        rows[key] = rows.get(key, 0) + n
    return rows


def check_abort_series(got: Mapping[str, float], aborts: Mapping[str, int]) -> None:
    """The collector's ``kvtier:aborts_total`` rows (``got``: label value -> value) against
    :func:`abort_series` of ``aborts`` (reason -> count, in the order they first occurred).

    Raises:
        ModelViolation: ``model_label_bounds``, naming the rows that differ.
    """
    from kvtier.fsm.request.counters import KNOWN_ABORT_REASONS

    from ..metrics import MAX_ABORT_REASONS, MAX_LABEL_CHARS

    want = abort_series(aborts.items(), tuple(KNOWN_ABORT_REASONS), MAX_ABORT_REASONS, MAX_LABEL_CHARS)
    if dict(got) != want:
        diff = {k: (got.get(k), want.get(k)) for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)}
        raise ModelViolation("model_label_bounds", "kvtier:aborts_total{reason}",
                             f"{len(aborts)} distinct reasons ({sum(aborts.values())} aborts): the rows that differ "
                             f"(label: exported, expected with the first {MAX_ABORT_REASONS} own reasons kept) "
                             f"{diff}")


def drive_abort_reasons(cache: Any, first: int, count: int, poll: Callable[[], Any] | None = None) -> int:
    """On a drained ``cache`` (a :class:`~kvtier.tiered.TieredCache`: nothing in flight, no
    request tracked), admit ``count`` one-token requests and abort each with the next
    reason of :data:`REASONS` from the ``first``-th on (the abort waits for the forward
    pass the admission owes, which then returns), polling their ends (through ``poll``, the
    machine's own poll that keeps its models in step; default ``cache.poll``); returns the aborts
    made. The label set is then driven to and past its bound whatever the example did."""
    made = 0
    for i in range(count):
        rid = f"label-bound-{first + i}"
        if cache.admit(rid, [], 1, 1) is None:
            break
        cache.abort(rid, abort_reason(first + i))
        cache.step_done(rid, 1, new_units=(), checkpoint=False)
        (poll or cache.poll)()
        made += 1
    return made
