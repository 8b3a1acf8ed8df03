"""Exact values of the batched step (``fsm/batch.py``: ``Batcher.step``, ``reserve_one``,
``_ids``) that the session 6 mutation run found unchecked: several hot-path items in one
batch (each applied, none dropped), hot-path and general items mixed in several orders,
the checkpoint flag and new unit keys of 3- and 4-field results, arguments the hot path
must leave to the general path's checks, a reservation of a request in a state that does
not accept it, ``stop_on_short`` skipping every later reservation, and the exact messages
and field-count bounds of a refused batch.

Layouts (``tests/core_helpers.py``): ``h1`` (alignment 2, one history group ``kv`` of 2
tokens per page) and ``src`` (alignment 2, history ``fh`` of 4 tokens per page and the
state group ``swa``, 4 pages per checkpoint)."""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import h1, src

from kvtier.fsm import UsageError
from kvtier.tiered import ForwardResult, Reservation, TieredCache


def _decoding(c: TieredCache, rid: str, key: str, *, reserve: int = 1) -> None:
    """``rid``: a prompt of 8 tokens (4 units ``key``) computed in one pass and published,
    then ``reserve`` more tokens reserved (its next pass owed)."""
    assert c.admit(rid, list(key), prompt_tokens=8, chunk_tokens=8) is not None
    assert c.step_done(rid, 8) == {}
    if reserve:
        assert c.reserve(rid, reserve) is not None


def _rec(c: TieredCache, rid: str) -> tuple[Any, ...]:
    """What a step may change on ``rid``'s record."""
    r = c.table.get(rid)
    return (r.state, r.tokens, r.reserved, r.passes, r.results, list(r.units), r.published, r.room,
            r.retract_ckpt, {g: list(p) for g, p in r.own.items()})


def _free(c: TieredCache) -> dict[str, int]:
    return {g: a.free for g, a in c.core.device.items()}


# ---------------------------------------------------------------------------- every item applied
def test_hot_path_items_mixed_with_general_ones_are_all_applied() -> None:
    """a and b are decoding (their results complete no unit, their pages cover the next
    token: both hot paths); "nobody" is refused and c needs new pages (general paths).
    Every item gets its outcome, in order, and every hot-path item is applied."""
    c = TieredCache(h1(), 32, None)
    _decoding(c, "a", "abcd")
    _decoding(c, "b", "efgh")
    _decoding(c, "c", "ijkl", reserve=0)
    for rid in "ab":
        assert _rec(c, rid)[1:5] == (8, 9, 2, 1)  # tokens, reserved, passes, results
        assert c.table.get(rid).room == 10  # 5 pages of 2 tokens
    free = _free(c)["kv"]
    out = c.step(results=[("a", 1), ("nobody", 1), ("b", 1)],
                 reserve=[("a", 1), ("nobody", 1), ("b", 1), ("c", 3)])
    assert out.result_ids == ("a", "nobody", "b") and out.result_status == ("ok", "refused", "ok")
    assert out.reserve_ids == ("a", "nobody", "b", "c")
    assert out.reserve_status == ("ok", "refused", "ok", "ok")
    assert list(out.errors) == [("results", 1), ("reserve", 1)]
    assert str(out.errors[("results", 1)]) == "unknown request 'nobody'"
    assert str(out.errors[("reserve", 1)]) == "unknown request 'nobody'"
    assert out.adopted == {}
    (pages,) = out.new_pages[3].values()  # c: 11 tokens need 6 pages, it held 4
    assert list(out.new_pages) == [3] and len(pages) == 2 and _free(c)["kv"] == free - 2
    for rid in "ab":  # the result counted its token; the reservation one pass more
        assert _rec(c, rid)[:5] == ("running", 9, 10, 3, 2)
    assert _rec(c, "c")[:5] == ("running", 8, 11, 2, 1) and c.table.get("c").room == 12
    # another order: three hot-path results; a refused reservation first, then c's on the
    # hot path (its 12 tokens fit its 6 pages), then b's and a's, each needing an 11th token's page
    out = c.step(results=[("c", 3), ("a", 1), ("b", 1)], reserve=[("nobody", 1), ("c", 1), ("b", 1), ("a", 1)])
    assert out.result_status == ("ok", "ok", "ok")
    assert out.reserve_status == ("refused", "ok", "ok", "ok")
    assert list(out.errors) == [("reserve", 0)] and out.adopted == {}
    assert out.new_pages == {2: {"kv": [16]}, 3: {"kv": [17]}}
    assert [_rec(c, rid)[1:5] for rid in "abc"] == [(10, 11, 4, 3), (10, 11, 4, 3), (11, 12, 3, 2)]
    c.check_invariants()


def test_stop_on_short_skips_every_later_reservation() -> None:
    """a, b and d hold all 12 device pages, locked: no reservation that needs a page can
    be met. With ``stop_on_short`` every reservation after the first short one is skipped
    and changes nothing; without it each is tried (and is short)."""
    c = TieredCache(h1(), 12, None)
    for rid, key in (("a", "abcd"), ("b", "efgh"), ("d", "ijkl")):
        _decoding(c, rid, key, reserve=0)
    assert _free(c) == {"kv": 0}
    before = [_rec(c, rid) for rid in "abd"]
    out = c.step(reserve=[("a", 1), ("b", 1), Reservation("d", 1)], stop_on_short=True)
    assert out.reserve_status == ("short", "skipped", "skipped") and not out.ok
    assert [o.status for o in out.reserved] == ["short", "skipped", "skipped"]
    assert [_rec(c, rid) for rid in "abd"] == before
    out = c.step(reserve=[("a", 1), ("b", 1), ("d", 1)])
    assert out.reserve_status == ("short", "short", "short")
    assert [_rec(c, rid) for rid in "abd"] == before
    c.check_invariants()


# ----------------------------------------------------------------------- 3- and 4-field results
def test_a_checkpoint_flag_of_a_four_field_result_is_honoured() -> None:
    """src layout (alignment 4): a and b computed 8 of their 9 prompt tokens (2 units,
    published) and reserved the 9th. A result of that token completes no unit; with the checkpoint flag
    (4 fields) the tree adopts a's state at 2 units; b's 2-field result asks for none."""
    c = TieredCache(src(), 16, None)
    for rid, key in (("a", "ab"), ("b", "ef")):
        assert c.admit(rid, list(key), prompt_tokens=9, chunk_tokens=8) is not None
    out = c.step(results=[("a", 8), ("b", 8)], reserve=[("a", 1), ("b", 1)])
    assert out.ok and out.adopted == {}
    assert [c.table.get(rid).published for rid in "ab"] == [2, 2]
    swa = _free(c)["swa"]
    out = c.step(results=[("b", 1), ForwardResult("a", 1, (), True)])
    assert out.result_status == ("ok", "ok") and out.errors == {}
    assert out.adopted == {1: {"swa": [8, 9, 10, 11]}}  # the next 4 free state pages
    assert [o.pages for o in out.results] == [{}, {"swa": [8, 9, 10, 11]}]
    assert _free(c)["swa"] == swa - 4
    ra, rb = c.table.get("a"), c.table.get("b")
    assert (ra.tokens, ra.retract_ckpt, rb.tokens, rb.retract_ckpt) == (9, True, 9, False)
    c.check_invariants()
    # and a 4-field result whose flag is False adopts nothing (a plain tuple this time)
    c.step(reserve=[("a", 1), ("b", 1)])
    out = c.step(results=[("a", 1, (), False), ("b", 1, ())])
    assert out.result_status == ("ok", "ok") and out.adopted == {} and _free(c)["swa"] == swa - 4
    c.check_invariants()


def test_the_new_units_of_a_three_field_result_are_recorded() -> None:
    c = TieredCache(h1(), 32, None)
    _decoding(c, "a", "abcd")
    _decoding(c, "b", "efgh")
    out = c.step(results=[("a", 1, ("e",)), ("b", 1)])
    assert out.result_status == ("ok", "ok") and out.errors == {}
    assert c.table.get("a").units == list("abcde") and c.table.get("b").units == list("efgh")
    assert [c.table.get(rid).tokens for rid in "ab"] == [9, 9]
    c.check_invariants()


# ----------------------------------------------------- arguments the general path checks, item by item
BAD_RESULTS = [
    (("a", [1]), "request 'a': computed_tokens must be an int >= 0, got [1]"),
    (("a", "1"), "request 'a': computed_tokens must be an int >= 0, got '1'"),
    (("a", 1, ""), "request 'a': step_done new_units must be a list or tuple of unit keys, got ''"),
    (("a", 1, None), "request 'a': step_done new_units must be a list or tuple of unit keys, got None"),
    (("a", 1, ([1],)), "request 'a': step_done new_units: unit keys must be hashable, got [1]"),
    (("a", 1, (), 1), "request 'a': step_done checkpoint must be True or False, got 1"),
]


@pytest.mark.parametrize(("item", "message"), BAD_RESULTS)
def test_a_result_with_a_bad_argument_is_refused_alone(item: tuple[Any, ...], message: str) -> None:
    """a's pass would be on the hot path with good arguments: a bad one is still refused
    with its message, changing nothing, and b's hot-path result after it is applied."""
    c = TieredCache(h1(), 32, None)
    _decoding(c, "a", "abcd")
    _decoding(c, "b", "efgh")
    before = _rec(c, "a")
    out = c.step(results=[item, ("b", 1)])
    assert out.result_status == ("refused", "ok")
    assert list(out.errors) == [("results", 0)]
    err = out.errors[("results", 0)]
    assert type(err) is UsageError and str(err) == message
    assert _rec(c, "a") == before and c.table.get("b").tokens == 9
    c.check_invariants()


@pytest.mark.parametrize(("tokens", "shown"), [([1], "[1]"), ("1", "'1'")])
def test_a_reservation_with_bad_tokens_is_refused_alone(tokens: Any, shown: str) -> None:
    c = TieredCache(h1(), 32, None)
    _decoding(c, "a", "abcd", reserve=0)
    _decoding(c, "b", "efgh", reserve=0)
    before = _rec(c, "a")
    out = c.step(reserve=[("a", tokens), ("b", 1)])
    assert out.reserve_status == ("refused", "ok") and list(out.errors) == [("reserve", 0)]
    err = out.errors[("reserve", 0)]
    assert type(err) is UsageError and str(err) == f"request 'a': reserve tokens must be an int >= 1, got {shown}"
    assert _rec(c, "a") == before and c.table.get("b").reserved == 9
    c.check_invariants()


def test_a_reservation_in_a_state_that_refuses_it_changes_nothing() -> None:
    """a is finishing (its writeback out) and its pages still cover a 10th token: the
    reservation is refused by its state all the same, and no pass is counted."""
    c = TieredCache(h1(), 32, 32, policy="write_back", finish_writeback=True)
    assert c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9) is not None
    c.step_done("a", 9)
    c.finish("a")
    _decoding(c, "b", "efgh", reserve=0)
    r = c.table.get("a")
    assert (r.state, r.tokens, r.room, r.passes, r.results) == ("finishing", 9, 10, 1, 1)
    before = _rec(c, "a")
    out = c.step(reserve=[("b", 1), ("a", 1)])
    assert out.reserve_status == ("ok", "refused") and list(out.errors) == [("reserve", 1)]
    assert str(out.errors[("reserve", 1)]) == ("request 'a': reserve in state 'finishing' "
                                               "(accepted in loading, running)")
    assert _rec(c, "a") == before
    c.check_invariants()


# ----------------------------------------------------------------------------- refused batches
def _refused(c: TieredCache, message: str, **kw: Any) -> None:
    before = [_rec(c, rid) for rid in "ab"]
    with pytest.raises(UsageError) as exc:
        c.step(**kw)
    assert str(exc.value) == message
    assert [_rec(c, rid) for rid in "ab"] == before


def test_field_counts_and_messages_of_refused_batches() -> None:
    c = TieredCache(h1(), 32, None)
    _decoding(c, "a", "abcd")
    _decoding(c, "b", "efgh")
    _refused(c, "step: results must hold tuples of 2..4 fields (ForwardResult / Reservation), "
                "got ('a', 1, (), False, None)", results=[("b", 1), ("a", 1, (), False, None)])
    _refused(c, "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), "
                "got ('b', 1, 2)", reserve=[("a", 1), ("b", 1, 2)])
    _refused(c, "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), "
                "got ['b', 1]", reserve=[("a", 1), ["b", 1]])
    _refused(c, "step: results must hold tuples of 2..4 fields (ForwardResult / Reservation), "
                "got ['a', 1]", results=[["a", 1]])
    _refused(c, "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), "
                "got ('a',)", reserve=[("a",)])
    _refused(c, "step: reserve must be a list of tuples, got 'a'", reserve="a")
    _refused(c, "step: request ids in reserve must be str, got ('a', ['b'])", reserve=[("a", 1), (["b"], 1)])
    _refused(c, "step: a request appears twice in results (one pass per step): ('a', 'b', 'a')",
             results=[("a", 1), ("b", 1), ("a", 0)])
    _refused(c, "step: results must be a list of tuples, got 5", results=5)
    _refused(c, "step: stop_on_short must be True or False, got 1", results=[("a", 1)], stop_on_short=1)
    # the bounds themselves are accepted: a 4-field result, a 2-field reservation
    out = c.step(results=[("a", 1, (), False), ("b", 1)], reserve=[("a", 1)])
    assert out.ok and (out.result_status, out.reserve_status) == (("ok", "ok"), ("ok",))
    c.check_invariants()
