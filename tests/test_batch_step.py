"""The batched step (issue 14): one call per scheduler step, outcomes per request, a
refusal for one request leaving the others intact, and the single calls as its wrappers."""

from __future__ import annotations

import pytest

from kvtier.fsm import GuardRejected, UsageError
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
