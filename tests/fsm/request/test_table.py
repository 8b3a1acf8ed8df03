"""The request table (kvtier.fsm.request.table): bad calls raise and change nothing; an
unknown request and a call refused in a state are named with the accepted states, a guard
is named as the lifecycle names it, release gives back the deferred pages too, and the
quiescence report counts what is held."""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import h1
from facade_helpers import ack, borrowing, fsnap, prefill

from kvtier.fsm import ConfigError, GuardRejected, KvtierError, UsageError
from kvtier.fsm.errors import IllegalTransition
from kvtier.fsm.request import Request
from kvtier.tiered import TieredCache


@pytest.mark.parametrize("history", [0, 3])
def test_an_unknown_request_id_names_the_id_and_how_many_ended_requests_are_remembered(history: int) -> None:
    c = TieredCache(h1(), 32, None, ended_history=history)
    for ask in (c.request, c.state):
        with pytest.raises(UsageError) as e:
            ask("nope")
        assert str(e.value) == f"unknown request 'nope' (the last {history} ended requests are remembered)"


def finished() -> TieredCache:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.finish("a")
    return c


# ----------------------------------------------------------------------------- request_table
def test_unknown_request_is_named() -> None:
    c = TieredCache(h1(), 12, None)
    with pytest.raises(UsageError) as exc:
        c.table.get("nope")
    assert str(exc.value) == "unknown request 'nope'"
    with pytest.raises(UsageError) as exc:
        c.table.get(5)
    assert str(exc.value) == "unknown request 5"


def test_a_call_refused_in_a_state_names_the_accepted_states() -> None:
    c = finished()
    with pytest.raises(UsageError) as exc:
        c.reserve("a", 1)
    assert str(exc.value) == "request 'a': reserve in state 'finished' (accepted in loading, running)"
    with pytest.raises(UsageError) as exc:
        c.step_done("a", 1)
    assert str(exc.value) == ("request 'a': step_done in state 'finished' "
                              "(accepted in aborting, fenced, loading, running)")


def test_a_guard_of_a_single_row_is_named_as_the_lifecycle_names_it() -> None:
    """``abort`` in ``loading`` has one row ([!settled]); a settled record is refused with it."""
    t = TieredCache(h1(), 12, None).table
    r = Request("x", ["a"], 3)
    r.state = "loading"
    with pytest.raises(GuardRejected) as exc:
        t.check(r, "abort")
    assert exc.value.guards == ("!settled",)
    assert str(exc.value) == "request 'x': event 'abort' refused in state 'loading': guard '!settled' rejected it"
    r.ops.add(7)
    assert t.check(r, "abort") == "aborting"
    assert r.state == "loading"


def test_a_guard_shared_by_every_row_is_named_alone() -> None:
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    with pytest.raises(GuardRejected) as exc:
        c.retract("a")
    assert exc.value.guards == ("settled",)
    assert str(exc.value) == "request 'a': event 'retract' refused in state 'running': guard 'settled' rejected it"
    assert c.state("a") == "running"


def test_release_frees_deferred_pages_too_exactly_once() -> None:
    """Releasing an overlapped request (as every path into a state that owns nothing does)
    gives back its deferred copies with its own pages."""
    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    r = c.table.get("b")
    assert (r.deferred_pages(), r.own) == ({"kv": [5, 6, 7, 8]}, {"kv": [9]})
    before = c.core.external_pages("kv")
    assert {5, 6, 7, 8, 9} <= before
    c.table.release(r)
    assert (list(r.deferred), r.own, r.lock, r.pins) == ([], {"kv": []}, None, [])
    assert c.core.external_pages("kv") == before - {5, 6, 7, 8, 9}


def test_the_quiescence_report_counts_a_borrowed_checkpoint_and_the_lock_beside_it() -> None:
    """outstanding(): request 'b' holds one lock and one borrow (its hit's checkpoint, until
    its pass returns); no pin (a device hit); once the pass returns, the borrow is gone."""
    c = borrowing()
    out = c.outstanding()
    assert (out.locks, out.pins, out.borrows) == (len(c.core.receipts.locks()), 0, 1)
    c.step_done("b", 4)
    assert c.outstanding().borrows == 0


# ---------------------------------------------------------------------------- bad calls
def bad_call_cache() -> TieredCache:
    """Requests in several states: running (settled), aborting, retracted, waiting."""
    c = TieredCache(h1(), 10, 8, policy="write_back")
    prefill(c, "run", "ab", 5)
    c.admit("owes", list("cd"), prompt_tokens=3, chunk_tokens=3)
    prefill(c, "ret", "ef", 4)
    c.retract("ret")
    (cmd,) = c.poll().commands
    ack(c, cmd.op_id)
    assert c.state("ret") == "retracted"
    prefill(c, "ab", "gh", 2)
    c.reserve("ab", 1)
    c.abort("ab")
    assert c.state("ab") == "aborting"
    assert c.admit("wait", list("ijkl"), prompt_tokens=9, chunk_tokens=9) is None
    c.check_invariants()
    return c


BAD_CALLS = [
    ("unknown abort", "nope", lambda c: c.abort("nope"), UsageError, "unknown"),
    ("unknown finish", "nope", lambda c: c.finish("nope"), UsageError, "unknown"),
    ("unknown step_done", "nope", lambda c: c.step_done("nope", 1), UsageError, "unknown"),
    ("unknown resume", "nope", lambda c: c.resume("nope", 1), UsageError, "unknown"),
    ("unknown retract", "nope", lambda c: c.retract("nope"), UsageError, "unknown"),
    ("unknown reserve", "nope", lambda c: c.reserve("nope", 1), UsageError, "unknown"),
    ("unknown request", "nope", lambda c: c.request("nope"), UsageError, "unknown"),
    ("finish before admit", "wait", lambda c: c.finish("wait"), IllegalTransition, "waiting"),
    ("resume of a running request", "run", lambda c: c.resume("run", 2), IllegalTransition, "running"),
    ("resume of a waiting request", "wait", lambda c: c.resume("wait", 2), IllegalTransition, "waiting"),
    ("double abort", "ab", lambda c: c.abort("ab"), IllegalTransition, "aborting"),
    ("step_done with nothing owed", "run", lambda c: c.step_done("run", 0), UsageError, "owes no forward"),
    ("step_done of a retracted request", "ret", lambda c: c.step_done("ret", 0), UsageError, "retracted"),
    ("finish while a forward result is owed", "owes", lambda c: c.finish("owes"), GuardRejected, "settled"),
    ("retract while a forward result is owed", "owes", lambda c: c.retract("owes"), GuardRejected, "settled"),
    ("retract of a waiting request", "wait", lambda c: c.retract("wait"), IllegalTransition, "waiting"),
    ("retract of an aborting request", "ab", lambda c: c.retract("ab"), IllegalTransition, "aborting"),
    ("reserve of a retracted request", "ret", lambda c: c.reserve("ret", 1), UsageError, "retracted"),
    ("finish of a retracted request", "ret", lambda c: c.finish("ret"), IllegalTransition, "retracted"),
    ("admit of a running request", "run", lambda c: c.admit("run", list("ab"), prompt_tokens=5, chunk_tokens=1),
     UsageError, "is already admitted: admit in state 'running'"),
    ("more tokens than reserved", "owes", lambda c: c.step_done("owes", 4), UsageError, "owes"),
    ("resume with no tokens", "ret", lambda c: c.resume("ret", 0), UsageError, "chunk_tokens"),
    ("reserve of no tokens", "run", lambda c: c.reserve("run", 0), UsageError, "tokens"),
    ("layer outside the model", "run", lambda c: c.layer_ready("run", 2), UsageError, "layer"),
    ("a numpy-like bool as tokens", "run", lambda c: c.reserve("run", True), UsageError, "tokens"),
]


@pytest.mark.parametrize(("what", "rid", "call", "error", "state"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(what: str, rid: str, call: Any, error: type, state: str) -> None:
    c = bad_call_cache()
    before = fsnap(c)
    with pytest.raises(error) as info:
        call(c)
    message = str(info.value)
    assert isinstance(info.value, KvtierError)
    if error is not ConfigError:
        assert repr(rid) in message, f"{what}: the error does not name the request: {message}"
    assert state in message, f"{what}: the error does not name {state!r}: {message}"
    assert fsnap(c) == before, f"{what} changed something"
    c.check_invariants()
