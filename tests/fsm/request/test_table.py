"""The request table (kvtier.fsm.request_table): an unknown request and a call refused in a
state are named with the accepted states, a guard is named as the lifecycle names it,
release gives back the deferred pages too, and the quiescence report counts what is held."""

from __future__ import annotations

import pytest
from core_helpers import h1

from kvtier.fsm import GuardRejected, UsageError
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


def borrowing() -> TieredCache:
    """src(): ``a`` published 2 units with the checkpoint at 8 tokens; ``b`` hit them and
    owes its first pass, which copies that checkpoint (borrowed)."""
    from core_helpers import src

    c = TieredCache(src(), 16, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert c.step_done("a", 9, checkpoint=True) == {"swa": [4, 5, 6, 7]}
    c.finish("a")
    adm = c.admit("b", list("abcd"), prompt_tokens=12, chunk_tokens=4)
    assert adm is not None and adm.checkpoint_pages == {"swa": [4, 5, 6, 7]}
    r = c.table.get("b")
    assert (r.canon, r.own, r.ckpt_pages) == ({"fh": [0, 1]}, {"fh": [2], "swa": [3, 2, 1, 0]}, {"swa": [4, 5, 6, 7]})
    c.check_invariants()
    return c


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
