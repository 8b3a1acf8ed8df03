"""Request records (kvtier.fsm.request): the views an engine reads of an overlapped and a
settled request, the frozen records crossing the facade and their defaults, and a new
record that holds and owes nothing."""

from __future__ import annotations

import pytest
from core_helpers import h1

from kvtier.fsm.request import Request
from kvtier.tiered import TieredCache


# ----------------------------------------------------------------------------- request
def test_views_of_an_overlapped_request_and_a_settled_one() -> None:
    """``b`` reserved pass 2 before pass 1 returned: its copies of ``a``'s published pages
    wait in its deferred frees; ``a`` is settled."""
    from kvtier.fsm.request import RequestView

    c = TieredCache(h1(), 12, None)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.admit("b", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.reserve("b", 1)
    c.step_done("b", 9)
    assert c.request("b") == RequestView("b", "running", 9, 10, 0, 1, (), None, False, {"kv": [9]},
                                         {"kv": [5, 6, 7, 8]}, (3,), 4)
    assert c.request("a") == RequestView("a", "running", 9, 9, 0, 0, (), None, True, {"kv": [4]}, {}, (2,), 4)
    r = c.table.get("b")
    assert (r.label, r.owed_forward, r.settled) == ("'b'", 1, False)
    c.step_done("b", 1)
    assert c.request("b").deferred_pages == {}
    assert (r.owed_forward, r.settled) == (0, True)


def test_request_records_crossing_the_facade_are_frozen() -> None:
    from dataclasses import FrozenInstanceError

    from kvtier.fsm.request import Admission, PollResult, RequestEvent, RequestView

    c = TieredCache(h1(), 12, None)
    adm = c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    assert isinstance(adm, Admission)
    poll = c.poll()
    records = [adm, poll, poll.events[0], c.request("a")]
    assert [type(x) for x in records] == [Admission, PollResult, RequestEvent, RequestView]
    for rec in records:
        # frozen and slotted: CPython 3.11 raises TypeError from the frozen __setattr__ of a
        # slotted class (its super() has no class cell), later versions FrozenInstanceError
        with pytest.raises((FrozenInstanceError, TypeError)):
            rec.commands = ()  # type: ignore[misc]
        assert not hasattr(rec, "__dict__")
    assert poll.commands == () and adm.request_id == "a"


def test_request_records_defaults() -> None:
    """The optional fields of the public records default to "nothing": engines and tests
    build them with the required fields only."""
    from kvtier.fsm.request import Admission, RequestEvent, RequestView

    adm = Admission("a", 0, 4, 0, 0, {"kv": [1, 2]}, None, ())
    assert (adm.recompute_tokens, adm.history_hit_tokens, adm.checkpoint_pages) == (0, 0, {})
    assert RequestEvent("a", "finished").reason is None
    v = RequestView("a", "running", 4, 4, 0, 0, (), None)
    assert (v.settled, v.own_pages, v.deferred_pages, v.receipts, v.units) == (True, {}, {}, (), 0)
    other = Admission("b", 0, 4, 0, 0, {}, None, ())
    assert other.checkpoint_pages == {} and other.checkpoint_pages is not adm.checkpoint_pages


def test_a_new_request_record_holds_and_owes_nothing() -> None:
    r = Request("x", ["a", "b"], 5)
    assert (r.request_id, r.state, r.units, r.prompt_tokens) == ("x", "waiting", ["a", "b"], 5)
    assert (r.tokens, r.reserved, r.published, r.hit_tokens, r.room, r.passes, r.results) == (0, 0, 0, 0, 0, 0, 0)
    assert (r.canon, r.own, r.lock, r.pins, r.ops, r.layers, r.ckpt_borrow, r.ckpt_pages, list(r.deferred)) == (
        {}, {}, None, [], set(), {}, None, {}, [])
    assert (r.reason, r.has_loadback, r.has_own_writeback, r.layers_failed, r.poisoned, r.retract_ckpt) == (
        None, False, False, False, False, False)
    assert (r.settled, r.owed_forward, r.receipts(), r.deferred_pages()) == (True, 0, (), {})
