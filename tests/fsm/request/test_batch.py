"""The batched step (kvtier.fsm.request.batch): one call per scheduler step, outcomes per request, a
refusal for one request leaving the others intact, and the single calls as its wrappers;
several hot-path items in one batch (each applied, none dropped), hot-path and general
items mixed, the checkpoint flag and new unit keys of 3- and 4-field results, the
arguments the hot path leaves to the general path's checks, a reservation in a state that
does not accept it, ``stop_on_short`` skipping every later reservation, each item's ``ok``
flag and error and the order ``raise_first`` raises in, the exact messages and field-count
bounds of a refused batch, items that cannot be read, and the records' defaults,
immutability and slots."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn

import pytest
from core_helpers import h1, src
from facade_helpers import seen, two_decoding

from kvtier.fsm import GuardRejected, UsageError
from kvtier.fsm.request.batch import OK, REFUSED, ItemOutcome, StepOutcome
from kvtier.fsm.presets import preset
from kvtier.tiered import ForwardResult, Reservation, TieredCache


def _cache(device: int = 16) -> TieredCache:
    return TieredCache(preset("llama-3-8b"), device_pages=device)


def _admit(c: TieredCache, rid: str, tokens: int, chunk: int) -> None:
    assert c.admit(rid, [(rid, i) for i in range(tokens // 16)], tokens, chunk) is not None


def test_one_call_reports_and_reserves_for_every_request() -> None:
    c = _cache()
    _admit(c, "a", 40, 32)
    _admit(c, "b", 20, 20)
    out = c.step(results=[ForwardResult("a", 32), ("b", 20)], reserve=[Reservation("a", 8), ("b", 1)])
    assert out.result_status == ("ok", "ok") and out.reserve_status == ("ok", "ok") and out.ok
    assert out.reserve_ids == ("a", "b") and out.errors == {}
    assert list(out.new_pages) == [0]  # a's chunk needs a third page; b's decode token fits in its own
    assert [len(p) for p in out.new_pages[0].values()] == [1]
    assert [(o.request_id, o.status, o.pages) for o in out.reserved] == [("a", "ok", out.new_pages[0]),
                                                                        ("b", "ok", {})]
    ra, rb = c.table.get("a"), c.table.get("b")
    assert (ra.tokens, ra.reserved, rb.tokens, rb.reserved) == (32, 40, 20, 21)
    c.check_invariants()


def test_a_refused_item_changes_nothing_and_leaves_the_others_intact() -> None:
    c = _cache()
    _admit(c, "a", 40, 32)
    _admit(c, "b", 40, 32)
    before = c.request("b")
    b = c.table.get("b")
    out = c.step(results=[("a", 32), ("b", 99), ("nobody", 1)], reserve=[("a", 8), ("b", 0)])
    assert out.result_status == ("ok", "refused", "refused")
    assert out.reserve_status == ("ok", "refused")
    assert isinstance(out.errors[("results", 1)], UsageError)  # more tokens than reserved
    assert isinstance(out.errors[("results", 2)], UsageError)  # unknown request
    assert isinstance(out.errors[("reserve", 1)], UsageError)  # tokens < 1
    assert c.request("b") == before  # nothing changed for b
    assert (b.tokens, b.reserved, b.passes, b.results) == (0, 32, 1, 0)
    assert c.table.get("a").tokens == 32 and c.table.get("a").reserved == 40
    with pytest.raises(UsageError, match="more tokens than|reserved"):
        out.raise_first()
    assert not out.ok
    c.check_invariants()


def test_short_reservations_and_stop_on_short() -> None:
    c = _cache(device=6)
    _admit(c, "a", 32, 32)  # 2 pages
    _admit(c, "b", 32, 32)  # 2 pages
    out = c.step(results=[("a", 32), ("b", 32)], reserve=[("a", 64), ("b", 1)])
    assert out.reserve_status == ("short", "ok")  # a wants 4 more pages, 2 are free
    assert c.table.get("a").reserved == 32  # nothing changed for a
    out = c.step(results=[("b", 1)], reserve=[("a", 64), ("b", 1)], stop_on_short=True)
    assert out.reserve_status == ("short", "skipped")
    assert c.request("b").owed_forward == 0  # skipped: no pass reserved for b
    c.check_invariants()


def test_bad_batches_are_refused_whole() -> None:
    c = _cache()
    _admit(c, "a", 40, 32)
    with pytest.raises(UsageError, match="twice"):
        c.step(results=[("a", 32), ("a", 0)])
    with pytest.raises(UsageError, match="tuples"):
        c.step(reserve=["a"])
    with pytest.raises(UsageError, match="list of tuples"):
        c.step(reserve="a")  # type: ignore[arg-type]
    assert c.request("a").tokens == 0 and c.request("a").owed_forward == 1  # nothing changed


def test_single_calls_are_the_same_code() -> None:
    c = _cache()
    _admit(c, "a", 40, 32)
    assert c.step_done("a", 32) == {}
    assert list(c.reserve("a", 8).values()) == [[2]]  # a third page
    with pytest.raises(UsageError):
        c.step_done("a", 99)
    with pytest.raises(GuardRejected):
        c.finish("a")  # a pass is owed
    assert c.step(results=[("a", 8)]).ok
    c.finish("a")
    c.check_invariants()


def test_each_item_outcome_has_its_own_ok_flag_and_error_and_results_raise_first() -> None:
    """batch.py:88 (``ItemOutcome.ok``), :122/:128 (an item's error is the one stored under
    ``("results", i)`` / ``("reserve", i)``), :133 (``raise_first`` raises a refused forward
    result's error before any refused reservation's, whatever their indices)."""
    c = _cache()
    _admit(c, "a", 40, 32)
    _admit(c, "b", 40, 32)
    out = c.step(results=[("a", 32), ("b", 99)], reserve=[("nobody", 1), ("a", 8)])
    assert out.result_status == ("ok", "refused") and out.reserve_status == ("refused", "ok")
    assert list(out.errors) == [("results", 1), ("reserve", 0)]
    bad_result, bad_reserve = out.errors[("results", 1)], out.errors[("reserve", 0)]
    assert isinstance(bad_result, UsageError) and isinstance(bad_reserve, UsageError)
    assert "'b'" in str(bad_result) and "'nobody'" in str(bad_reserve)
    assert [(o.request_id, o.status, o.ok, o.error) for o in out.results] == [
        ("a", "ok", True, None), ("b", "refused", False, bad_result)]
    assert [(o.request_id, o.status, o.ok, o.error) for o in out.reserved] == [
        ("nobody", "refused", False, bad_reserve), ("a", "ok", True, None)]
    with pytest.raises(UsageError) as e:
        out.raise_first()  # the result (index 1) before the reservation (index 0)
    assert e.value is bad_result
    assert not out.ok
    clean = c.step(results=[("b", 32)])
    assert clean.ok and clean.results[0].ok and clean.raise_first() is None
    c.check_invariants()


def test_step_outcome_ok_needs_no_error_and_every_reservation_applied() -> None:
    """batch.py:117: a step is ok only when no item was refused AND every reservation was
    applied: a refused result with no reservation is not ok, nor is a short reservation
    with no error."""
    c = _cache(device=6)
    _admit(c, "a", 32, 32)
    _admit(c, "b", 32, 32)
    out = c.step(results=[("nobody", 1)])
    assert out.reserve_status == () and list(out.errors) == [("results", 0)]
    assert not out.ok and not out.results[0].ok
    out = c.step(results=[("a", 32), ("b", 32)], reserve=[("a", 64), ("b", 1)])
    assert out.errors == {} and out.reserve_status == ("short", "ok")
    assert not out.ok
    assert [(o.status, o.ok, o.error) for o in out.reserved] == [("short", False, None), ("ok", True, None)]
    out = c.step(results=[("b", 1)], reserve=[("a", 64), ("b", 1), ("nobody", 1)], stop_on_short=True)
    # every reservation after the short one is skipped, unlooked-at (an unknown one too)
    assert out.reserve_status == ("short", "skipped", "skipped") and out.errors == {} and not out.ok
    assert out.reserve_ids == ("a", "b", "nobody")
    assert [o.ok for o in out.reserved] == [False, False, False]
    c.check_invariants()


def test_a_batch_of_the_wrong_shape_is_refused_whole_with_its_exact_message() -> None:
    """batch.py:191-193: forward results are tuples of 2..4 fields and reservations of
    exactly 2 (one more is refused, not ignored); each message names the list and the
    value; ``stop_on_short`` must be a bool."""
    c = _cache()
    _admit(c, "a", 40, 32)
    cases = [
        ({"results": [("a", 32, (), False, "x")]},
         "step: results must hold tuples of 2..4 fields (ForwardResult / Reservation), "
         "got ('a', 32, (), False, 'x')"),
        ({"reserve": [("a", 8, 1)]},
         "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), got ('a', 8, 1)"),
        ({"results": [("a", 32), ("a", 0)]},
         "step: a request appears twice in results (one pass per step): ('a', 'a')"),
        ({"reserve": [("a", 8), ("a", 1)]},
         "step: a request appears twice in reserve (one pass per step): ('a', 'a')"),
        ({"results": [("a", 32)], "stop_on_short": "yes"},
         "step: stop_on_short must be True or False, got 'yes'"),
    ]
    for kw, msg in cases:
        with pytest.raises(UsageError) as e:
            c.step(**kw)  # type: ignore[arg-type]
        assert str(e.value) == msg
    a = c.table.get("a")
    assert (a.tokens, a.reserved, a.results, c.request("a").owed_forward) == (0, 32, 0, 1)  # nothing changed
    assert c.step(results=[("a", 32)], reserve=[("a", 8)]).ok
    c.check_invariants()


def test_the_fields_of_a_forward_result_tuple_are_read_by_position() -> None:
    """batch.py:202-206: a forward result is (request, tokens[, new units[, checkpoint]]):
    a 2-tuple carries no checkpoint (the tree adopts no state pages), a 4-tuple's checkpoint
    is used, a 3-tuple's units are used; tokens and units of the wrong type are refused
    (not taken on the hot path), naming the value."""
    c = TieredCache(src(), 32, None)  # alignment 4; a checkpoint is 4 swa pages
    for rid in "ab":
        c.admit(rid, [rid + k for k in "wxyz"], prompt_tokens=9, chunk_tokens=9)
    out = c.step(results=[("a", 9), ("b", 9, (), True)])
    assert out.result_status == ("ok", "ok") and out.errors == {}
    assert out.adopted == {1: {"swa": [8, 9, 10, 11]}}  # b's checkpoint only
    assert [o.pages for o in out.results] == [{}, {"swa": [8, 9, 10, 11]}]
    a, b = c.table.get("a"), c.table.get("b")
    assert (a.tokens, a.results, b.tokens, b.results) == (9, 1, 9, 1)
    c.check_invariants()
    # tokens of the wrong type (not an int, a bool, unhashable): refused, nothing changed
    c.reserve("a", 1)
    for n in (1.0, True, [1]):
        out = c.step(results=[("a", n)])
        assert out.result_status == ("refused",)
        assert str(out.errors[("results", 0)]) == f"request 'a': computed_tokens must be an int >= 0, got {n!r}"
        assert (a.tokens, a.results) == (9, 1)
    # units of the wrong type in a 3-tuple, a checkpoint of the wrong type in a 4-tuple
    out = c.step(results=[("a", 1, "")])
    assert str(out.errors[("results", 0)]) == ("request 'a': step_done new_units must be a list or tuple "
                                               "of unit keys, got ''")
    out = c.step(results=[("a", 1, (), "yes")])
    assert str(out.errors[("results", 0)]) == "request 'a': step_done checkpoint must be True or False, got 'yes'"
    out = c.step(results=[("a", 1, (["x"],))])  # units in a tuple are checked too, not taken as they are
    assert str(out.errors[("results", 0)]) == "request 'a': step_done new_units: unit keys must be hashable, got ['x']"
    assert (a.tokens, a.results, a.units) == (9, 1, ["aw", "ax", "ay", "az"])
    # a 3-tuple's new units are taken
    out = c.step(results=[("a", 1, ["a4"])])
    assert out.ok and (a.tokens, a.results, a.units) == (10, 2, ["aw", "ax", "ay", "az", "a4"])
    c.check_invariants()


def test_hot_path_items_are_each_taken_and_a_checkpoint_result_leaves_the_hot_path() -> None:
    """batch.py:207-209, 226: decode results and reservations on the hot path go on to the
    next item; a decode result with a checkpoint (a 4-tuple) is not taken on the hot path:
    the tree adopts the checkpoint's state pages; reservation tokens of the wrong type are
    refused naming the value."""
    c = TieredCache(src(), 32, None)
    for rid in "abc":
        c.admit(rid, [rid + k for k in "wxyz"], prompt_tokens=9, chunk_tokens=9)
    out = c.step(results=[("a", 9), ("b", 9), ("c", 9)], reserve=[("a", 1), ("b", 1), ("c", 1)])
    assert out.ok and out.adopted == {} and out.new_pages == {}
    out = c.step(results=[("a", 1), ("b", 1), ("c", 1, (), True)], reserve=[("a", 1), ("b", 1), ("c", 1)])
    assert out.result_status == ("ok", "ok", "ok") and out.reserve_status == ("ok", "ok", "ok")
    assert out.adopted == {2: {"swa": [12, 13, 14, 15]}}
    assert [(r.tokens, r.results, r.reserved) for r in map(c.table.get, "abc")] == [(10, 2, 11)] * 3
    out = c.step(reserve=[("a", [1]), ("b", 1.0)])
    assert out.reserve_status == ("refused", "refused")
    assert [str(out.errors[("reserve", i)]) for i in (0, 1)] == [
        "request 'a': reserve tokens must be an int >= 1, got [1]",
        "request 'b': reserve tokens must be an int >= 1, got 1.0"]
    c.check_invariants()


def test_a_reservation_in_a_state_that_does_not_take_one_is_refused_even_when_pages_cover_it() -> None:
    """batch.py:228: the reservation hot path is only for states that accept ``reserve``: a
    finishing request whose pages would cover one more token is refused, unchanged."""
    c = TieredCache(h1(), 8, 8, policy="write_back", finish_writeback=True)
    c.admit("a", list("abcd"), prompt_tokens=9, chunk_tokens=9)
    c.step_done("a", 9)
    c.finish("a")
    r = c.table.get("a")
    assert (r.state, r.tokens, r.reserved, r.room, r.passes) == ("finishing", 9, 9, 10, 1)
    out = c.step(reserve=[("a", 1)])
    assert out.reserve_status == ("refused",)
    assert str(out.errors[("reserve", 0)]) == "request 'a': reserve in state 'finishing' (accepted in loading, running)"
    assert (r.state, r.tokens, r.reserved, r.passes) == ("finishing", 9, 9, 1)
    c.check_invariants()


def test_a_batch_of_the_wrong_shape_names_the_first_bad_item() -> None:
    """batch.py:251-265: every shape refusal names the list and the first bad item (a list
    is not a tuple; a tuple with too few or too many fields), an unhashable request id and
    a list that is not one. Nothing changes."""
    c = _cache()
    _admit(c, "a", 40, 32)
    _admit(c, "b", 40, 32)
    head = "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), got "
    cases = [
        ({"reserve": [("a", 8), ("b", 1, 2)]}, head + "('b', 1, 2)"),
        ({"reserve": [("a", 8), ["b", 1]]}, head + "['b', 1]"),
        ({"reserve": [("a", 8), ("b",)]}, head + "('b',)"),
        ({"results": [("a", 32, (), False), ("b",)]},
         "step: results must hold tuples of 2..4 fields (ForwardResult / Reservation), got ('b',)"),
        ({"reserve": "ab"}, "step: reserve must be a list of tuples, got 'ab'"),
        ({"results": 7}, "step: results must be a list of tuples, got 7"),
        ({"reserve": [(["a"], 8)]}, "step: request ids in reserve must be str, got (['a'],)"),
    ]
    for kw, msg in cases:
        with pytest.raises(UsageError) as e:
            c.step(**kw)  # type: ignore[arg-type]
        assert str(e.value) == msg
    a = c.table.get("a")
    assert (a.tokens, a.reserved, a.results, a.passes) == (0, 32, 0, 1)  # nothing changed
    c.check_invariants()


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


def test_forward_result_defaults_ask_for_no_units_and_no_checkpoint() -> None:
    f = ForwardResult("a", 7)
    assert f == ("a", 7, (), False)
    assert f.new_units == () and f.checkpoint is False
    assert Reservation("a", 1) == ("a", 1)


def test_item_outcome_defaults_to_no_pages_and_no_error() -> None:
    item = ItemOutcome("a", OK)
    assert item.pages == {} and item.error is None
    assert item.ok is True
    assert ItemOutcome("a", REFUSED).ok is False
    assert ItemOutcome("b", OK).pages is not item.pages  # a fresh dict per record


@pytest.mark.parametrize(("record", "field"), [
    (ItemOutcome("a", OK), "status"),
    (StepOutcome(("a",), (OK,), (), (), {}, {}, {}), "errors"),
])
def test_outcomes_are_frozen_and_slotted(record: object, field: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, None)
    assert not hasattr(record, "__dict__")
    assert type(record).__slots__


class _Tuple(tuple):  # type: ignore[type-arg]
    """A tuple whose items cannot be read (``x[0]`` raises TypeError)."""

    def __getitem__(self, i: Any) -> NoReturn:
        raise TypeError("no items")


class _Seq(Sequence[Any]):
    """A sequence of one item that cannot be read (iterating it raises TypeError)."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: Any) -> NoReturn:
        raise TypeError("no items")

    def __repr__(self) -> str:
        return "_Seq()"


@pytest.mark.parametrize("kw, message", [
    ({"reserve": [_Tuple(("a", 1))]},
     "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), got [('a', 1)]"),
    ({"results": [_Tuple(("a", 1))]},
     "step: results must hold tuples of 2..4 fields (ForwardResult / Reservation), got [('a', 1)]"),
    ({"reserve": _Seq()},
     "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), got _Seq()"),
    ({"results": [("a", 1)], "reserve": _Seq()},
     "step: reserve must hold tuples of 2..2 fields (ForwardResult / Reservation), got _Seq()"),
])
def test_step_with_items_that_cannot_be_read_is_refused(kw: dict[str, Any], message: str) -> None:
    """Was StopIteration (a tuple whose items raise TypeError) or a bare TypeError (a
    sequence whose items raise TypeError)."""
    c = two_decoding()
    before = seen(c)
    with pytest.raises(UsageError) as exc:
        c.step(**kw)
    assert type(exc.value) is UsageError
    assert str(exc.value) == message
    assert seen(c) == before
    c.check_invariants()
