"""Illegal event logs made from legal ones: ``kvtier check`` must reject each, by the right rule.

A recorded run's log (:mod:`kvtier.testing.logged`) conforms; :func:`mutants` turns it into
logs that break one of the spec's invariants (``spec/lifecycle.toml``, ``[invariants]``; the
record kinds and fields of ``docs/eventlog-format.md``), each at one record, and
:func:`check_mutants` requires :func:`kvtier.cli.check.check_records` to reject every one
naming a rule of the mutation's ``rules``. The mutations come from the invariants' statements
and the format's fields, not from the checker:

========================  ================================================  ===========================
mutation                  what the log then says                            rules
========================  ================================================  ===========================
``failed_settles_ok``     an operation some rank failed (or that expired)  failure_not_success,
                          settles ok                                        host_means_acked
``poisoned_settles_ok``   a poisoned writeback settles ok                   failure_not_success,
                                                                            host_means_acked
``settles_twice``         an operation settles a second time                operation_ends_once
``issued_twice``          a command is handed out a second time             operation_ends_once
``completion_twice``      a (rank, layer) completion is taken twice while   operation_ends_once
                          its operation is in flight
``ack_without_command``   a completion of an operation never issued         operation_ends_once
``early_ok``              an operation settles ok before every rank         failure_not_success,
                          acknowledged it (tensor parallel logs)            host_means_acked
``wrong_destination``     a node transition lands in another state than     spec
                          the spec's row gives
``wrong_source``          a node transition starts from a state the log     spec
                          did not leave it in
``flipped_guard``         a guard the producer evaluated is reported with   guard
                          the other value
``host_with_device``      a node in ``host`` keeps device pages             state_matches_resources
``loading_unpinned``      a node enters ``loading`` with no host pin        loadback_source_pinned
``release_before_fence``  an ``aborting`` request's page table shrinks      release_once_after_fence
                          before its fence
========================  ================================================  ===========================

A mutant is the log up to its mutated record, which must be the record the checker rejects
(it may not let the record through and trip later), so the cost is a handful of short
replays per recorded example.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..cli.check import check_records
from .models import ModelViolation

__all__ = ["Mutant", "MUTATIONS", "mutants", "check_mutants", "check_mutants_or_fail"]

Record = dict[str, Any]

@dataclass(frozen=True)
class Mutant:
    """An illegal log: ``records`` (the mutated prefix), broken at its last record (index ``at``)."""

    name: str
    rules: frozenset[str]
    at: int
    records: list[Record]


_OK_RULES = frozenset({"failure_not_success", "host_means_acked"})
_ONCE = frozenset({"operation_ends_once"})


def _segment_world(records: list[Record]) -> list[int]:
    """Each record's segment ``world_size`` (1 before any ``cache`` record)."""
    out, world = [], 1
    for rec in records:
        if rec.get("k") == "cache" and isinstance(rec.get("world_size"), int):
            world = rec["world_size"]
        out.append(world)
    return out


def _replace(records: list[Record], i: int, new: Record) -> list[Record]:
    """The log up to record ``i``, replaced by ``new``."""
    return records[:i] + [new]


def _insert(records: list[Record], i: int, new: Record) -> list[Record]:
    """The log up to record ``i``, ``new`` inserted there (before the record ``i`` was)."""
    return records[:i] + [new]


def _settles_ok(records: list[Record]) -> Iterator[Mutant]:
    failed: set[tuple[int, int]] = set()  # (segment index, op) some rank failed
    poisoned: set[tuple[int, int]] = set()
    seg = 0
    seen_failed = seen_poison = False
    for i, rec in enumerate(records):
        k = rec.get("k")
        if k == "cache":
            seg += 1
        elif k == "completion" and rec.get("ok") is False:
            failed.add((seg, rec.get("op")))  # type: ignore[arg-type]
        elif k == "poison":
            poisoned.add((seg, rec.get("op")))  # type: ignore[arg-type]
        elif k == "settled" and rec.get("ok") is False:
            key = (seg, rec.get("op"))
            new = dict(rec, ok=True, expired=False)
            if key in poisoned and not seen_poison:
                seen_poison = True
                yield Mutant("poisoned_settles_ok", _OK_RULES, i, _replace(records, i, new))
            elif (key in failed or rec.get("expired")) and not seen_failed:
                seen_failed = True
                yield Mutant("failed_settles_ok", _OK_RULES, i, _replace(records, i, new))


def _twice(records: list[Record]) -> Iterator[Mutant]:
    done: set[str] = set()
    settled_at: dict[tuple[int, Any], int] = {}
    seg = 0
    for i, rec in enumerate(records):
        seg += rec.get("k") == "cache"
        if rec.get("k") == "settled":
            settled_at.setdefault((seg, rec.get("op")), i)
    seg = 0
    for i, rec in enumerate(records):
        k = rec.get("k")
        seg += k == "cache"
        if k == "settled" and "settles_twice" not in done:
            done.add("settles_twice")
            yield Mutant("settles_twice", _ONCE, i + 1, _insert(records, i + 1, dict(rec)))
        elif k == "command" and "issued_twice" not in done:
            done.add("issued_twice")
            yield Mutant("issued_twice", _ONCE, i + 1, _insert(records, i + 1, dict(rec)))
        elif k == "completion" and "completion_twice" not in done:
            end = settled_at.get((seg, rec.get("op")))
            # still in flight after it: a later completion of the same op comes before its settle
            later = end is not None and any(
                r.get("k") == "completion" and r.get("op") == rec.get("op") for r in records[i + 1:end])
            nxt = records[i + 1] if i + 1 < len(records) else {}
            if later and not (nxt.get("k") == "refused" and nxt.get("name") == "complete"):
                done.add("completion_twice")
                yield Mutant("completion_twice", _ONCE, i + 1, _insert(records, i + 1, dict(rec)))


def _unissued(records: list[Record]) -> Iterator[Mutant]:
    ops = [r.get("op") for r in records if r.get("k") in ("command", "completion", "settled")]
    ints = [o for o in ops if isinstance(o, int)]
    for i, rec in enumerate(records):
        if rec.get("k") == "completion" and rec.get("layer") is None:
            new = dict(rec, op=max(ints, default=0) + 1000, ok=True)
            yield Mutant("ack_without_command", _ONCE, i, _insert(records, i, new))
            return


def _early_ok(records: list[Record]) -> Iterator[Mutant]:
    worlds = _segment_world(records)
    for i, rec in enumerate(records):
        if rec.get("k") != "completion" or rec.get("ok") is not True or rec.get("layer") is not None:
            continue
        if worlds[i] < 2:
            continue
        # the first rank's acknowledgement of an op whose settle comes later: settle it ok at once
        op = rec.get("op")
        rest = records[i + 1:]
        acks = [r for r in rest if r.get("k") == "completion" and r.get("op") == op and r.get("layer") is None]
        settle = next((r for r in rest if r.get("k") == "settled" and r.get("op") == op), None)
        if acks and settle is not None and settle.get("ok") is True:
            yield Mutant("early_ok", _OK_RULES, i + 1, _insert(records, i + 1, dict(settle)))
            return


def _nodes(records: list[Record], spec_states: tuple[str, ...]) -> Iterator[Mutant]:
    done: set[str] = set()
    last: dict[tuple[int, Any], str] = {}
    seg = 0
    for i, rec in enumerate(records):
        k = rec.get("k")
        seg += k == "cache"
        if k != "node":
            continue
        to, frm = rec.get("to"), rec.get("from")
        if "wrong_destination" not in done and isinstance(to, str) and to != frm:
            other = next((s for s in spec_states if s not in (to, frm, "new")), None)
            if other is not None:
                done.add("wrong_destination")
                yield Mutant("wrong_destination", frozenset({"spec"}), i, _replace(records, i, dict(rec, to=other)))
        prev = last.get((seg, rec.get("id")))
        if "wrong_source" not in done and prev is not None and prev == frm:
            other = next((s for s in spec_states if s not in (frm, "new")), None)
            if other is not None:
                done.add("wrong_source")
                yield Mutant("wrong_source", frozenset({"spec"}), i, _replace(records, i, dict(rec, **{"from": other})))
        guards = rec.get("guards")
        if "flipped_guard" not in done and isinstance(guards, dict) and guards:
            g = sorted(guards)[0]
            if isinstance(guards[g], bool):
                done.add("flipped_guard")
                new = dict(rec, guards=dict(guards, **{g: not guards[g]}))
                yield Mutant("flipped_guard", frozenset({"guard"}), i, _replace(records, i, new))
        pages = rec.get("pages")
        if "host_with_device" not in done and to == "host" and isinstance(pages, dict):
            done.add("host_with_device")
            new = copy.deepcopy(rec)
            new["pages"]["dev"] = int(pages.get("dev", 0)) + 1
            yield Mutant("host_with_device", frozenset({"state_matches_resources"}), i, _replace(records, i, new))
        if "loading_unpinned" not in done and to == "loading" and frm != "loading":
            done.add("loading_unpinned")
            yield Mutant("loading_unpinned", frozenset({"loadback_source_pinned"}), i,
                         _replace(records, i, dict(rec, pin=0)))
        if isinstance(to, str):
            last[(seg, rec.get("id"))] = to


def _fence(records: list[Record]) -> Iterator[Mutant]:
    seg = 0
    aborting: dict[tuple[int, Any], int] = {}  # request -> its page table on entering aborting
    for i, rec in enumerate(records):
        k = rec.get("k")
        seg += k == "cache"
        if k == "request" and rec.get("to") == "aborting" and isinstance(rec.get("table"), int):
            aborting[(seg, rec.get("id"))] = rec["table"]
        elif k == "request" and rec.get("to") != "aborting":
            aborting.pop((seg, rec.get("id")), None)
        elif k == "return" and rec.get("state") == "aborting" and aborting.get((seg, rec.get("id")), 0) > 0:
            new = dict(rec, table=aborting[(seg, rec.get("id"))] - 1)
            yield Mutant("release_before_fence", frozenset({"release_once_after_fence"}), i,
                         _replace(records, i, new))
            return


#: the mutations, by name (module doc)
MUTATIONS = ("failed_settles_ok", "poisoned_settles_ok", "settles_twice", "issued_twice", "completion_twice",
             "ack_without_command", "early_ok", "wrong_destination", "wrong_source", "flipped_guard",
             "host_with_device", "loading_unpinned", "release_before_fence")


def mutants(records: list[Record]) -> Iterator[Mutant]:
    """The illegal logs :data:`MUTATIONS` make from the legal ``records`` (at most one per
    mutation: its first site in the log), each at the first site the log offers."""
    from kvtier.fsm.lifecycle.spec import load_spec

    states = tuple(load_spec().node.state_names)
    yield from _settles_ok(records)
    yield from _twice(records)
    yield from _unissued(records)
    yield from _early_ok(records)
    yield from _nodes(records, states)
    yield from _fence(records)


def check_mutants(records: list[Record]) -> list[str]:
    """Replay every mutant of ``records`` through ``kvtier check``; returns the mutations
    checked.

    Raises:
        AssertionError: naming the mutation, when ``kvtier check`` accepts a mutant or
            rejects it by another rule than the mutation's (with the checker's verdict).
    """
    names = []
    for m in mutants(records):
        result = check_records(enumerate((dict(r) for r in m.records), 1))  # (the checker marks records)
        v = result.violation
        if v is None or v.rule not in m.rules or v.line != m.at + 1:
            got = ("accepts it" if v is None else f"rejects it by {v.rule!r} at record {v.line}: {v.message}")
            raise AssertionError(f"kvtier check {got}; the log mutated by {m.name} (its last record {m.at + 1}: "
                                 f"{m.records[m.at]}) breaks {' or '.join(sorted(m.rules))}")
        names.append(m.name)
    return names


def check_mutants_or_fail(records: list[Record]) -> list[str]:
    """:func:`check_mutants`, its failure raised as :class:`~kvtier.testing.models.ModelViolation`
    ``model_log_checker`` (what a kit machine reports)."""
    try:
        return check_mutants(records)
    except AssertionError as e:
        raise ModelViolation("model_log_checker", "kvtier check", str(e)) from None
