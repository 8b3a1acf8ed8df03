"""What the L3 tier holds or owes (``L3Tier.outstanding``, the facade's ``outstanding()`` and
``quiescent()``) at every stage of a prefetch and a put, and cancelling the prefetch of an
aborted request: withdrawn before it is handed out, cancelled through the store driver's
``cancel``, or detached until the store answers; its reserved host pages are released once."""

from __future__ import annotations

import pytest
from core_helpers import h1
from l3_helpers import KEY, FakeStore, backed, make, pump

from kvtier import TieredCache
from kvtier.fsm import UsageError
from kvtier.fsm.l3 import L3Options, L3Outstanding, StoreOp, StoreResult


def _host_free(core) -> int:  # type: ignore[no-untyped-def]
    assert core.ledger.host is not None
    return core.ledger.host["kv"].free


def _stocked() -> FakeStore:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    return store


def _at_get(store: FakeStore, owner: str = "r"):  # type: ignore[no-untyped-def]
    core, tier = make()
    assert tier.prefetch(owner, KEY + ("e",), 0.0)
    [exists] = tier.poll_commands()
    tier.complete(store.answer(exists), 0.0)
    return core, tier


def test_a_prefetch_is_outstanding_at_every_stage_until_its_get_settles() -> None:
    store = _stocked()
    core, tier = make()
    assert tier.outstanding() == L3Outstanding() and tier.outstanding().quiescent
    assert tier.prefetch("r", KEY + ("e",), 0.0)
    assert tier.outstanding() == L3Outstanding((1,), (1,), ("r",))  # exists, not handed out
    [exists] = tier.poll_commands()
    assert tier.outstanding() == L3Outstanding((1,), (), ("r",)) and not tier.outstanding().quiescent
    tier.complete(store.answer(exists), 0.0)
    out = tier.outstanding()
    assert out == L3Outstanding((2,), (2,), ("r",), 4, 0, 0)  # the get reserves one page a unit
    assert _host_free(core) == 16 - 4
    [get] = tier.poll_commands()
    assert tier.outstanding() == L3Outstanding((2,), (), ("r",), 4)
    tier.complete(store.answer(get), 0.0)
    assert tier.outstanding() == L3Outstanding() and tier.fetched_units("r") == 4


def test_a_put_is_outstanding_with_its_pin_until_the_store_answers() -> None:
    core, tier = make()
    backed(core, KEY)
    assert tier.offer(KEY, 0.0) == 4
    assert tier.outstanding() == L3Outstanding((1,), (1,), (), 0, 1)
    [put] = tier.poll_commands()
    tier.complete(StoreResult(put.op_id, ok=(True, False, True, True)), 0.0)
    assert tier.outstanding() == L3Outstanding() and core.walk(KEY)[-1].host_pin == 0


def test_a_lease_is_counted_but_ends_by_time() -> None:
    store = _stocked()
    core, tier = make(lease=5.0)
    tier.prefetch("r", KEY, 0.0)
    pump(tier, store)
    out = tier.outstanding()
    assert out == L3Outstanding(leases=4) and out.quiescent
    tier.expire(5.0)
    assert tier.outstanding() == L3Outstanding()


def test_cancel_withdraws_a_get_not_handed_out_and_releases_its_pages_once() -> None:
    store = _stocked()
    core, tier = _at_get(store)
    assert _host_free(core) == 12
    assert tier.cancel("r", 0.0)
    assert tier.poll_commands() == []  # withdrawn: the store never sees it
    assert tier.outstanding() == L3Outstanding() and _host_free(core) == 16
    assert not tier.prefetching("r") and tier.stats.cancelled_prefetches == 1
    assert tier.stats.op_errors == 0 and tier.stats.errors == {}
    assert not tier.cancel("r", 0.0)  # nothing left to cancel
    tier.complete(StoreResult(2, ok=(True,) * 4), 0.0)  # an answer anyway: absorbed, nothing released twice
    assert tier.stats.absorbed_late_results == 1 and _host_free(core) == 16
    core.check_invariants()
    tier.check_invariants()


def test_cancel_calls_the_drivers_cancel_for_a_get_handed_out() -> None:
    store = _stocked()
    core, tier = _at_get(store)
    [get] = tier.poll_commands()
    cancelled: list[int] = []
    assert tier.cancel("r", 1.0, cancelled.append)
    assert cancelled == [get.op_id] and _host_free(core) == 16
    assert tier.outstanding() == L3Outstanding() and core.match(KEY).host_units == 0
    tier.complete(store.answer(get), 2.0)
    assert tier.stats.absorbed_late_results == 1 and _host_free(core) == 16
    tier.check_invariants()


def test_cancel_without_the_drivers_cancel_keeps_the_pages_until_the_store_answers() -> None:
    store = _stocked()
    core, tier = _at_get(store)
    [get] = tier.poll_commands()
    assert tier.cancel("r", 0.0)
    assert not tier.prefetching("r")
    assert tier.outstanding() == L3Outstanding((get.op_id,), (), (), 4)  # the backend may still write them
    assert _host_free(core) == 12
    tier.complete(store.answer(get), 0.0)
    assert tier.outstanding() == L3Outstanding() and core.match(KEY).host_units == 4
    assert tier.fetched_units("r") == 0  # no record: the request is gone


def test_cancel_drops_an_exists_and_its_answer_is_absorbed() -> None:
    store = _stocked()
    core, tier = make()
    tier.prefetch("r", KEY, 0.0)
    [exists] = tier.poll_commands()
    assert tier.cancel("r", 0.0, lambda op: None)
    assert tier.outstanding() == L3Outstanding()
    tier.complete(store.answer(exists), 0.0)
    assert tier.poll_commands() == [] and tier.stats.get_ops == 0


def test_forget_cancels_a_prefetch_in_flight() -> None:
    store = _stocked()
    core, tier = _at_get(store)
    tier.forget("r", 0.0)
    assert tier.outstanding() == L3Outstanding() and _host_free(core) == 16
    core, tier = _at_get(store)
    [get] = tier.poll_commands()
    tier.forget("r")  # no clock: detached, the get ends by its answer or deadline
    assert tier.outstanding() == L3Outstanding((get.op_id,), (), (), 4)
    assert tier.expire(10.0) == [get.op_id]
    assert tier.outstanding() == L3Outstanding() and _host_free(core) == 16


def test_cancel_rejects_bad_input_and_changes_nothing() -> None:
    store = _stocked()
    core, tier = _at_get(store)
    with pytest.raises(UsageError, match="owner must be a request id string, got 7"):
        tier.cancel(7, 0.0)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="now"):
        tier.cancel("r", float("nan"))
    assert tier.prefetching("r") and tier.outstanding().reserved_pages == 4


def test_the_facade_counts_the_l3_tier_and_an_abort_detaches_the_prefetch() -> None:
    cache = TieredCache(h1(), 16, 16, l3=L3Options(deadline_s=1.0))
    l3 = cache.l3
    assert l3 is not None and cache.quiescent()
    units = tuple(f"u{i}" for i in range(4))
    assert l3.prefetch("r", units, 0.0)
    out = cache.outstanding()
    assert (out.store_operations, out.store_commands, out.prefetches, out.reserved_pages) == ((1,), (1,), ("r",), 0)
    assert not cache.quiescent()
    [exists] = l3.poll_commands()
    l3.complete(StoreResult(exists.op_id, present=4), 0.0)
    [get] = l3.poll_commands()
    assert get.kind is StoreOp.GET
    out = cache.outstanding()
    assert (out.store_operations, out.store_commands, out.prefetches, out.reserved_pages) == ((2,), (), ("r",), 4)
    cache.admit("r", units, 8, 8)
    cache.abort("r")
    cache.step_done("r", 8)
    cache.poll()
    out = cache.outstanding()
    assert (out.store_operations, out.prefetches, out.reserved_pages) == ((2,), (), 4) and not cache.quiescent()
    l3.complete(StoreResult(get.op_id, ok=(True,) * 4), 0.0)
    assert cache.quiescent(), cache.outstanding()
