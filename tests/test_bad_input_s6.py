"""Bad input found in session 6 (``fsm/``): each call raises kvtier's own error class with
a message naming the value and what was expected, and changes nothing.

Layout ``h1`` (``tests/core_helpers.py``): alignment 2, one history group ``kv`` of 2
tokens per page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import pytest
from core_helpers import ack, h1, put, snapshot, state

from kvtier.fsm import CacheCore, UsageError
from kvtier.tiered import TieredCache


def _cache() -> TieredCache:
    """Requests a and b decoding: prompts of 8 tokens computed and published, 1 more token reserved."""
    c = TieredCache(h1(), 32, None)
    for rid, key in (("a", "abcd"), ("b", "efgh")):
        assert c.admit(rid, list(key), prompt_tokens=8, chunk_tokens=8) is not None
        assert c.step_done(rid, 8) == {}
        assert c.reserve(rid, 1) is not None
    return c


def _seen(c: TieredCache) -> tuple[Any, ...]:
    """What a call may change: the counters, every request's record and the tree."""
    recs = [(r.request_id, r.state, r.tokens, r.reserved, r.passes, r.results, list(r.units),
             {g: list(p) for g, p in r.own.items()}) for r in c.table]
    return c.stats(), recs, snapshot(c.core)


# ------------------------------------------------------------------ 1. Batcher._ids
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
    c = _cache()
    before = _seen(c)
    with pytest.raises(UsageError) as exc:
        c.step(**kw)
    assert type(exc.value) is UsageError
    assert str(exc.value) == message
    assert _seen(c) == before
    c.check_invariants()


# ------------------------------------------------------------------ 2. CacheCore.walk
@pytest.mark.parametrize("key", ["ab", b"ab", 5, None])
def test_walk_refuses_a_key_that_is_not_a_sequence_of_unit_keys(key: Any) -> None:
    """Was: "ab" walked the units 'a', 'b' and split node ('a', 'b', 'c') silently (b"ab"
    walked ints 97, 98); 5 and None raised a bare TypeError."""
    c = CacheCore(h1(), 8, 8)
    put(c, "abc")
    before = snapshot(c)
    with pytest.raises(UsageError) as exc:
        c.walk(key)
    assert type(exc.value) is UsageError
    assert str(exc.value) == f"walk: key must be a sequence of unit keys (not a str or bytes), got {key!r}"
    assert snapshot(c) == before
    assert [n.key for n in c.nodes()] == [("a", "b", "c")]
    c.check_invariants()
    # the same units as a list are walked, splitting the node where the key ends
    assert [n.key for n in c.walk(list("ab"))] == [("a", "b")]
    c.check_invariants()


# ------------------------------------------------------------------ 3. CacheCore.evict_host
@pytest.mark.parametrize("need, message", [
    ({"zz": 1}, "unknown cache group 'zz'; groups: ['kv']"),
    ({"kv": 1, "zz": 1}, "unknown cache group 'zz'; groups: ['kv']"),
    ({"kv": -1}, "page count for group 'kv' must be an int >= 0, got -1"),
    ({"kv": 1.5}, "page count for group 'kv' must be an int >= 0, got 1.5"),
    ({"kv": True}, "page count for group 'kv' must be an int >= 0, got True"),
    ({"kv": "2"}, "page count for group 'kv' must be an int >= 0, got '2'"),
])
@pytest.mark.parametrize("host", [8, None])
def test_evict_host_refuses_unknown_groups_and_bad_counts(need: dict[str, Any], message: str,
                                                          host: int | None) -> None:
    """Was: a bare KeyError for an unknown group ({} with no host tier), {'kv': 0} for
    -1, 1.5 and True, a bare TypeError for '2'. Refused as evict_device refuses them,
    before any eviction: with {"kv": 1, "zz": 1} the host leaf ('a', 'b') stays."""
    c = CacheCore(h1(), 8, host)
    put(c, "ab")
    if host is not None:
        ack(c, c.writeback(c.nodes()[0]))
        assert c.evict_device({"kv": 2}) == {"kv": 2}
        assert state(c) == {1: "host"}
    before = snapshot(c)
    with pytest.raises(UsageError) as exc:
        c.evict_host(need)
    assert type(exc.value) is UsageError
    assert str(exc.value) == message
    assert snapshot(c) == before
    c.check_invariants()
    # the same call with a good need frees the host copy (none without a host tier)
    assert c.evict_host({"kv": 2}) == ({"kv": 2} if host is not None else {})
    assert state(c) == ({} if host is not None else {1: "device"})
    c.check_invariants()


# ------------------------------------------------------------------ 4. admit of an admitted id
def test_admit_of_an_admitted_request_says_it_is_already_admitted() -> None:
    """Was "request 'a': admit in state 'running' (accepted in ...)", which did not say
    that the id is in use. The record (its units, prompt, pages) stays as it was."""
    c = _cache()
    assert c.step_done("b", 1) == {}
    assert c.retract("b") is not None
    assert c.states(["a", "b"]) == ["running", "retracted"]
    before = _seen(c)
    for rid, st in (("a", "running"), ("b", "retracted")):
        with pytest.raises(UsageError) as exc:
            c.admit(rid, list("xyzw"), prompt_tokens=8, chunk_tokens=8)
        assert type(exc.value) is UsageError
        assert str(exc.value) == (f"request {rid!r} is already admitted: admit in state {st!r} "
                                  f"(accepted in aborted, finished, waiting)")
        assert _seen(c) == before
    c.check_invariants()
    # once it has ended, the id may be admitted again
    assert c.step_done("a", 1) == {}
    c.finish("a")
    assert c.admit("a", list("xyzw"), prompt_tokens=8, chunk_tokens=8) is not None
    assert c.states(["a"]) == ["running"] and list(c.table.get("a").units) == list("xyzw")


@pytest.mark.parametrize("history", [0, 3])
def test_an_unknown_request_id_names_the_id_and_how_many_ended_requests_are_remembered(history: int) -> None:
    c = TieredCache(h1(), 32, None, ended_history=history)
    for ask in (c.request, c.state):
        with pytest.raises(UsageError) as e:
            ask("nope")
        assert str(e.value) == f"unknown request 'nope' (the last {history} ended requests are remembered)"
