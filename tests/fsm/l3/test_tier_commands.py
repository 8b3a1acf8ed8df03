"""The L3 tier's store commands and counters, exactly (kvtier.fsm.l3): its messages, its
store op ids (1, 2, 3 ... one per command, in order), the command kinds, a bare
:class:`StoreResult`, the records of objects in flight and ended, the recently-put hint
(exactly ``hint_size`` keys, the oldest dropped), where a prefetch's local hit ends, get
acknowledgements, leases, removes and expiry, every counter.

Layout ``h1`` (tests/core_helpers.py): one history group ``kv``, 2 tokens per page,
alignment 2 (one unit = 2 tokens = 1 page)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
from core_helpers import h1, put, snapshot, src
from l3_helpers import answer_at_once, backed, h1_tier, one_command, stored

from kvtier.fsm import CacheCore, ConfigError, UsageError
from kvtier.fsm.l3 import L3Stats, L3Tier, StoreCommand, StoreOp, StoreResult

KEY = ("a", "b", "c")


def test_l3_tier_config_errors_have_their_exact_messages() -> None:
    """l3.py:73, 76, 78-79: each refusal names what is wrong, word for word."""
    with pytest.raises(ConfigError) as e:
        L3Tier(CacheCore(h1(), 16, 16), "fast")  # type: ignore[arg-type]
    assert str(e.value) == "l3 options must be an L3Options, got 'fast'"
    with pytest.raises(ConfigError) as e:
        L3Tier(CacheCore(h1(), 16))
    assert str(e.value) == "the L3 tier needs a host tier (host_pages): gets land in host pages"
    with pytest.raises(ConfigError) as e:
        L3Tier(CacheCore(src(), 16, 16))
    assert str(e.value) == ("the L3 tier stores history pages only; layout 'src' has "
                            "continuation-state groups ['swa']")


def test_l3_store_commands_are_numbered_1_2_3_in_the_order_they_are_issued() -> None:
    """l3.py:87 (``_issued`` starts at 0) and :150 (one more per command): the commands of
    one tier carry op ids 1, 2, 3 ..., whether put/remove (``_new_op``) or a prefetch's
    exists then its get (numbered when the exists is answered)."""
    store: dict[str, object] = {}
    ta = h1_tier()
    backed(ta.core, KEY)
    assert ta.offer(KEY[:1], 0.0) == 1
    assert ta.offer(KEY[:2], 0.0) == 1  # "a" is still being put: only "b"
    assert ta.remove(["not-there"], 0.0) == 1
    cmds = ta.poll_commands()
    assert [(c.op_id, c.kind) for c in cmds] == [(1, StoreOp.PUT), (2, StoreOp.PUT), (3, StoreOp.REMOVE)]
    assert ta.operations.keys() == {1, 2, 3}
    for c in cmds:
        ta.complete(answer_at_once(store, c), 0.0)
    assert len(store) == 2 and ta.ops_in_flight() == 0
    assert (ta.stats.put_ops, ta.stats.put_keys, ta.stats.put_ok, ta.stats.remove_ops, ta.stats.remove_keys) == (
        2, 2, 2, 1, 1)
    assert ta.stats.bytes_out == 32  # 16 bytes from each put
    with pytest.raises(UsageError) as e:
        ta.complete(StoreResult(4), 0.0)
    assert str(e.value) == "l3 complete: op 4 was never issued"
    with pytest.raises(UsageError) as e:
        ta.complete("done", 0.0)  # type: ignore[arg-type]
    assert str(e.value) == "l3 complete: expected a StoreResult, got 'done'"
    with pytest.raises(UsageError) as e:
        ta.complete(StoreResult(True), 0.0)  # type: ignore[arg-type]
    assert str(e.value) == "l3 complete: op_id must be an int, got True"
    assert ta.stats.absorbed_late_results == 0

    tb = h1_tier()
    assert tb.prefetch("r1", KEY, 0.0)
    exists = one_command(tb)
    assert (exists.op_id, exists.kind) == (1, StoreOp.EXISTS)
    tb.complete(answer_at_once(store, exists), 0.0)
    get = one_command(tb)
    assert (get.op_id, get.kind, len(get.keys)) == (2, StoreOp.GET, 2)
    assert tb.remove(["not-there"], 0.0) == 1
    assert one_command(tb).op_id == 3
    tb.complete(answer_at_once(store, get), 0.0)
    assert tb.fetched_units("r1") == 2


def test_a_record_taken_while_in_flight_reads_as_unknown_with_no_op_and_no_answer_once_it_ends() -> None:
    """l3.py:142-143: ``objects`` and ``operations`` are snapshots of the live records; once
    an object is back to ``unknown`` (dropped from the table) its record says no operation
    is in flight (``op_id`` None) and the store's answer no longer covers it
    (``store_answered`` False: the guard of ``get_submit`` needs an answer issued after the
    object was last unknown, spec ``[l3.guards.store_answered]``)."""
    store: dict[str, object] = {}
    ta = h1_tier()
    backed(ta.core, KEY[:1])
    ta.offer(KEY[:1], 0.0)
    [rec] = ta.objects.values()
    put_op = ta.operations[1]
    assert (rec.state, rec.op_id, rec.store_answered) == ("putting", 1, False)
    ta.complete(answer_at_once(store, one_command(ta)), 0.0)
    assert ta.objects == {} and put_op.objects == [rec]
    assert rec.state == "unknown" and rec.op_id is None and rec.store_answered is False

    tb = h1_tier()  # no read lease: an acknowledged get ends in unknown
    tb.prefetch("r1", KEY[:1], 0.0)
    tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    [rec] = tb.objects.values()
    assert (rec.state, rec.op_id, rec.store_answered) == ("getting", 2, True)
    tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    assert tb.fetched_units("r1") == 1 and tb.objects == {}
    assert rec.state == "unknown" and rec.op_id is None and rec.store_answered is False


def test_the_hint_remembers_exactly_hint_size_keys_and_drops_the_oldest() -> None:
    """l3.py:163-164: after a put is acknowledged its keys are remembered (not put again on
    the next offer) up to ``hint_size`` keys, the least recently put dropped first."""
    store: dict[str, object] = {}
    t3 = h1_tier(hint_size=3)
    backed(t3.core, KEY)
    assert t3.offer(KEY, 0.0) == 3
    t3.complete(answer_at_once(store, one_command(t3)), 0.0)
    assert t3.offer(KEY, 0.0) == 0  # all three remembered

    t2 = h1_tier(hint_size=2)
    backed(t2.core, KEY)
    k = t2.keys_for(KEY)
    assert t2.offer(KEY, 0.0) == 3
    t2.complete(answer_at_once(store, one_command(t2)), 0.0)  # remembered in order k0, k1, k2: k0 dropped
    assert t2.offer(KEY, 0.0) == 1
    cmd = one_command(t2)
    assert cmd.keys == (k[0],)
    t2.complete(answer_at_once(store, cmd), 0.0)  # k0 again, the most recent: now k1 is the oldest, dropped
    assert t2.offer(KEY, 0.0) == 1
    assert one_command(t2).keys == (k[1],)


def test_a_prefetch_asks_beyond_host_only_nodes_and_stops_before_fetching_ones() -> None:
    """l3.py:172: the local hit of a prefetch runs through host-only nodes (host-visible,
    not device-readable) and ends before a node being fetched (neither): a second
    prefetch of a longer prefix while a get is in flight asks the store again from there."""
    full = KEY + ("d",)
    store = stored(full)
    tb = h1_tier()
    k = tb.keys_for(full)
    assert tb.prefetch("r1", full[:1], 0.0)
    tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    assert [n.state for n in tb.core.walk(full[:1])] == ["host"]
    assert tb.prefetch("r2", KEY, 0.0)  # the hit ends after the host node "a"
    exists = one_command(tb)
    assert exists.keys == tuple(k[1:3])
    tb.complete(answer_at_once(store, exists), 0.0)
    get = one_command(tb)
    assert get.keys == tuple(k[1:3])
    assert [n.state for n in tb.core.walk(full)] == ["host", "fetching", "fetching"]
    assert tb.prefetch("r3", full, 0.0)  # the hit ends before the fetching "b"
    assert one_command(tb).keys == tuple(k[1:4])
    tb.complete(answer_at_once(store, get), 0.0)
    assert tb.fetched_units("r2") == 2
    tb.core.check_invariants()
    tb.check_invariants()


def test_a_prefetch_is_refused_with_its_exact_message_or_skipped_after_a_device_only_end() -> None:
    """l3.py:191, 193, 329, 396, 398: bad arguments name the value; l3.py:199: when the local hit ends on a
    node with no host copy (device only) nothing is asked and the prefetch returns False."""
    t = h1_tier()
    with pytest.raises(UsageError) as e:
        t.prefetch(5, KEY, 0.0)  # type: ignore[arg-type]
    assert str(e.value) == "l3 prefetch: owner must be a request id string, got 5"
    with pytest.raises(UsageError) as e:
        t.remove("ab", 0.0)
    assert str(e.value) == "l3 remove: keys must be a sequence of key strings, got 'ab'"
    with pytest.raises(UsageError) as e:
        t.remove(["k", 5], 0.0)  # type: ignore[list-item]
    assert str(e.value) == "l3 remove: key must be a string, got 5"
    assert t.stats.remove_ops == 0 and t.expire(0.0) == [] and t.poll_commands() == []  # nothing deferred
    with pytest.raises(UsageError) as e:
        t.offer(b"ab", 0.0)
    assert str(e.value) == "l3 offer: units must be a sequence of unit keys (not a str or bytes), got b'ab'"
    with pytest.raises(UsageError) as e:
        t.prefetch("r1", "abc", 0.0)
    assert str(e.value) == "l3 prefetch: units must be a sequence of unit keys (not a str or bytes), got 'abc'"
    put(t.core, KEY[:1])  # on the device only: no writeback
    assert [n.state for n in t.core.walk(KEY)] == ["device"]
    assert t.prefetch("r1", KEY, 0.0) is False
    assert t.poll_commands() == [] and not t.prefetching("r1") and t.stats.prefetches == 0


def test_prefetch_counters_count_every_prefetch_and_exists() -> None:
    """l3.py:207-209 and the prefetch path's other counters, exactly: three prefetches
    (exists of 2, 4 and 2 keys, all present), two gets of 2 keys each, one exists whose
    keys were already being fetched (4 keys answered present, no room)."""
    full = KEY + ("d",)
    store = stored(full)
    tb = h1_tier()
    assert tb.prefetch("r1", full[:2], 0.0) and tb.prefetch("r2", full, 0.0)
    for _ in range(2):  # the two exists, then r1's get
        for c in tb.poll_commands():
            tb.complete(answer_at_once(store, c), 0.0)
    assert (tb.fetched_units("r1"), tb.fetched_units("r2"), tb.prefetching("r2")) == (2, 0, False)
    assert tb.prefetch("r2", full, 0.0)  # again, from the fetched prefix
    for _ in range(2):
        tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    assert tb.fetched_units("r2") == 2
    zero = {f.name: f.default for f in dataclasses.fields(L3Stats) if f.name != "errors"}
    assert dataclasses.asdict(tb.stats) == {**zero, "errors": {}, "prefetches": 3, "exists_ops": 3,
                                            "exists_keys": 8, "exists_present": 8, "get_ops": 2, "get_keys": 4,
                                            "get_ok": 4, "get_no_room": 4}


def test_an_owner_named_by_the_empty_string_gets_its_prefetch() -> None:
    """l3.py:213 (and the get's end): the owner is any string, the empty one too: its
    exists answer leads to its get, and the get's end is recorded for it."""
    store = stored(KEY)
    tb = h1_tier()
    assert tb.prefetch("", KEY, 0.0) and tb.prefetching("")
    tb.complete(answer_at_once(store, one_command(tb)), 0.0)
    get = one_command(tb)
    assert get.kind is StoreOp.GET and len(get.keys) == 3
    tb.complete(answer_at_once(store, get), 0.0)
    assert not tb.prefetching("") and tb.fetched_units("") == 3
    assert [n.state for n in tb.core.walk(KEY)] == ["host"] * 3


def test_an_exists_that_failed_counts_nothing_present_and_gets_nothing() -> None:
    """l3.py:214: an exists answered with an error counts 0 keys present, ends the prefetch
    and submits no get (the store's answer is the only source of presence)."""
    store = stored(KEY)
    tb = h1_tier()
    assert tb.prefetch("r1", KEY, 0.0)
    exists = one_command(tb)
    tb.complete(StoreResult(exists.op_id, present=3, error="ConnectionError: refused"), 0.0)
    assert tb.poll_commands() == [] and not tb.prefetching("r1") and tb.fetched_units("r1") == 0
    assert (tb.stats.exists_present, tb.stats.get_ops, tb.stats.op_errors) == (0, 0, 1)
    assert tb.stats.errors == {"ConnectionError": 1}
    assert tb.objects == {} and len(tb.core.fetches) == 0 and tb.core.walk(KEY) == []


def test_get_answers_count_acks_misses_and_failures_exactly_and_leave_read_leases() -> None:
    """l3.py:249-274: three gets with 4, 3 and 2 keys: acknowledged up to the first gap,
    a key the store says it lacks is a miss (one after a gap is not), flags past the keys
    asked (too many or too few) change nothing; every object of a get is leased for
    ``lease_s`` (0.5 s: any lease above 0 holds)."""
    full = KEY + ("d",)
    store = stored(full)
    tb = h1_tier(lease_s=0.5)
    k = tb.keys_for(full)

    def get(owner: str, ok: tuple[bool, ...]) -> StoreCommand:
        assert tb.prefetch(owner, full, 0.0)
        tb.complete(answer_at_once(store, one_command(tb)), 0.0)
        cmd = one_command(tb)
        tb.complete(StoreResult(cmd.op_id, ok=ok), 0.0)
        return cmd

    first = get("r1", (True, False, False, True))  # a, then two misses, then d after the gap
    assert first.keys == tuple(k) and tb.fetched_units("r1") == 1
    assert {key: (o.state, o.lease_until) for key, o in tb.objects.items()} == {key: ("leased", 0.5) for key in k}
    assert (tb.stats.get_ok, tb.stats.get_failed, tb.stats.get_misses) == (1, 3, 2)
    tb.expire(0.4)
    assert len(tb.objects) == 4  # the leases hold until 0.5
    tb.expire(0.5)
    assert tb.objects == {}
    second = get("r2", (True,))  # one flag for three keys: b acked, c and d failed, no miss
    assert second.keys == tuple(k[1:]) and tb.fetched_units("r2") == 1
    tb.expire(0.5)
    third = get("r3", (True, True, True))  # three flags for two keys: both acked
    assert third.keys == tuple(k[2:]) and tb.fetched_units("r3") == 2
    assert [n.state for n in tb.core.walk(full)] == ["host"] * 4
    assert (tb.stats.get_ops, tb.stats.get_keys, tb.stats.get_ok, tb.stats.get_failed, tb.stats.get_misses) == (
        3, 9, 4, 5, 2)
    tb.core.check_invariants()
    tb.check_invariants()


def test_a_put_pins_its_host_copies_under_the_owner_l3_put() -> None:
    """l3.py:297: the pin a put holds on the host copies it reads is owned by ``l3-put``;
    l3.py:304: its objects' records read ``host_visible`` False once submitted."""
    t = h1_tier()
    backed(t.core, KEY)
    assert t.offer(KEY, 0.0) == 3
    receipt = t.operations[1].receipt
    assert receipt is not None and receipt.owner == "l3-put" and receipt.kind == "pin"
    assert [n.key for n in receipt.nodes] == [KEY] and t.core.walk(KEY)[0].host_pin == 1
    # l3.py:304: the records of the objects being put hold no guard value once submitted
    # (host_visible is put_submit's guard input only, set just before it fires)
    recs = t.objects
    assert [(o.state, o.op_id, o.host_visible, o.store_answered) for o in recs.values()] == [
        ("putting", 1, False, False)] * 3
    t.complete(answer_at_once({}, one_command(t)), 0.0)
    assert receipt.released and t.core.walk(KEY)[0].host_pin == 0


def test_a_put_counts_one_operation_and_one_key_per_unit_of_a_node_holding_several() -> None:
    """``put_keys`` counts the store keys a put writes (one per unit), not the tree nodes it
    reads: one node of three units offered whole is one put of three keys, and the second
    put of a node split from it counts its own units only."""
    t = h1_tier()
    backed(t.core, KEY)
    assert len(t.core.walk(KEY)) == 1  # one node, three units
    assert t.offer(KEY, 0.0) == 3
    cmd = one_command(t)
    assert len(cmd.keys) == 3
    assert (t.stats.put_ops, t.stats.put_keys) == (1, 3)
    t.complete(answer_at_once({}, cmd), 0.0)
    assert (t.stats.put_ops, t.stats.put_keys, t.stats.put_ok) == (1, 3, 3)
    backed(t.core, KEY + ("d", "e"))
    assert t.offer(KEY + ("d", "e"), 0.0) == 2  # only the two new units
    assert (t.stats.put_ops, t.stats.put_keys) == (2, 5)


def test_host_eviction_puts_each_unit_of_a_victim_under_its_own_key_unless_recently_put() -> None:
    """l3.py:368: under ``host_eviction`` each unit of a victim is checked against the
    hint under its own key: with a hint of one key, the last unit put is skipped when the
    victim is offered again, and the first two are put again, in order."""
    store: dict[str, object] = {}
    t = h1_tier(write_policy="host_eviction", hint_size=1)
    backed(t.core, KEY)
    t.core.evict_device({"kv": 16})
    [node] = t.core.walk(KEY)
    assert node.state == "host" and t.core.evictable_on_host(node)
    k = t.keys_for(KEY)
    assert t.offer((), 0.0) == 3
    cmd = one_command(t)
    assert cmd.keys == tuple(k)
    t.complete(answer_at_once(store, cmd), 0.0)  # remembered k0, k1, k2 in turn: only k2 is kept
    assert t.offer((), 0.0) == 2
    assert one_command(t).keys == (k[0], k[1])


def test_removes_wait_for_leases_and_every_end_of_an_operation_is_counted_exactly() -> None:
    """l3.py:390-497 (remove, complete, expire): a corrupt object's remove and a remove
    under a read lease wait for the lease's end, a key given twice waits for the first
    remove; an expired operation is cancelled, failed and counted as expired (not as a
    backend error), its late result absorbed; a backend error counts by its kind; bytes
    and seconds add up."""
    store = stored(KEY)
    t = h1_tier(lease_s=0.5)
    k = t.keys_for(KEY)
    assert t.prefetch("r1", KEY, 0.0)
    exists = one_command(t)
    t.complete(StoreResult(exists.op_id, present=3, seconds=0.125), 0.0)
    get = one_command(t)
    t.complete(StoreResult(get.op_id, ok=(True, True, False), corrupt=(k[2],), nbytes=64, seconds=0.25), 0.0)
    assert t.fetched_units("r1") == 2
    assert {key: o.state for key, o in t.objects.items()} == {key: "leased" for key in k}
    assert t.remove([k[0], "zz", "zz"], 0.1) == 1  # k0 leased: waits; the second "zz" waits for the first
    rm1 = one_command(t)
    assert (rm1.op_id, rm1.kind, rm1.keys, rm1.deadline) == (3, StoreOp.REMOVE, ("zz",), 1.1)
    t.complete(StoreResult(rm1.op_id, ok=(True,)), 0.2)
    assert t.expire(0.4) == []  # "zz" is free again: its second remove goes; the leases hold until 0.5
    rm2 = one_command(t)
    assert (rm2.op_id, rm2.keys, rm2.deadline) == (4, ("zz",), 1.4)
    t.complete(StoreResult(rm2.op_id, ok=(True,)), 0.4)
    cancelled: list[int] = []
    assert t.expire(0.5, cancelled.append) == []  # the leases end: the waiting removes go, in order
    rm3 = one_command(t)
    assert (rm3.op_id, rm3.keys, rm3.deadline) == (5, (k[2], k[0]), 1.5)
    assert t.expire(1.4, cancelled.append) == [] and cancelled == []
    assert t.expire(1.5, cancelled.append) == [5] and cancelled == [5]
    assert t.objects == {} and t.ops_in_flight() == 0
    t.complete(StoreResult(5, ok=(True, True)), 1.6)  # too late: absorbed
    assert t.remove(["q"], 2.0) == 1
    t.complete(StoreResult(one_command(t).op_id, error="TimeoutError: " + "x" * 80, seconds=0.5), 2.1)
    for key in ("q2", "q3"):  # an error kind is the text before the first ':', at most 60 characters
        assert t.remove([key], 2.0) == 1
        t.complete(StoreResult(one_command(t).op_id, error="E" * 70 + ": no: detail"), 2.1)
    assert t.prefetch("r2", KEY, 2.2)  # c again, after the local hit a, b: 1 key, 32 bytes
    exists = one_command(t)
    assert exists.keys == (k[2],)
    t.complete(StoreResult(exists.op_id, present=1, seconds=0.0625), 2.2)
    t.complete(StoreResult(one_command(t).op_id, ok=(True,), nbytes=32, seconds=0.0625), 2.2)
    assert t.fetched_units("r2") == 1
    assert t.remove(["q4"], 3.0) == 1 and t.remove(["q5"], 3.0) == 1  # two operations expire at once
    assert [c.op_id for c in t.poll_commands()] == [11, 12]
    assert t.expire(4.0, cancelled.append) == [11, 12] and cancelled == [5, 11, 12]
    zero = {f.name: f.default for f in dataclasses.fields(L3Stats) if f.name != "errors"}
    assert dataclasses.asdict(t.stats) == {
        **zero, "prefetches": 2, "exists_ops": 2, "exists_keys": 4, "exists_present": 4, "get_ops": 2,
        "get_keys": 4, "get_ok": 3, "get_failed": 1, "get_corrupt": 1, "remove_ops": 8, "remove_keys": 9,
        "removes_deferred_by_lease": 1, "op_errors": 3, "expired_ops": 3, "absorbed_late_results": 1,
        "bytes_in": 96, "seconds": 1.0, "get_seconds": 0.5, "errors": {"TimeoutError": 1, "E" * 60: 2}}
    t.check_invariants()


# ------------------------------------------------------------------ hostile clock values and records
BAD_NOW = [math.nan, math.inf, -math.inf, None, "0", True, 1j, 10**400, -10**400]  # (an int past a float's range too)
CALLS: dict[str, Callable[[L3Tier, int, object], object]] = {
    "prefetch": lambda t, op, now: t.prefetch("r2", KEY + ("d", "e"), now),  # type: ignore[arg-type]
    "offer": lambda t, op, now: t.offer(KEY, now),  # type: ignore[arg-type]
    "remove": lambda t, op, now: t.remove(t.keys_for(("z",)), now),  # type: ignore[arg-type]
    "expire": lambda t, op, now: t.expire(now),  # type: ignore[arg-type]
    "complete": lambda t, op, now: t.complete(StoreResult(op, present=1), now),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("bad", BAD_NOW, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("call", list(CALLS))
def test_every_call_that_takes_now_refuses_a_clock_value_that_is_not_a_finite_number(call: str, bad: object) -> None:
    """``now`` stamps deadlines and leases: an operation stamped at NaN (or inf) never
    expires, so a store that never answers would hold its request forever. Each call
    refuses it with a UsageError naming ``now`` and the value, and changes nothing
    (``expire`` takes ``inf``: every deadline has passed; see the next test)."""
    if call == "expire" and bad == math.inf:
        return
    t = h1_tier()
    backed(t.core, KEY)
    assert t.prefetch("r1", KEY + ("d",), 0.0)
    [exists] = t.poll_commands()

    def view() -> tuple[object, ...]:
        return ({i: (o.kind, o.deadline, o.owner) for i, o in t.operations.items()},
                {k: (o.state, o.lease_until) for k, o in t.objects.items()}, t.prefetching("r1"),
                t.prefetching("r2"), dataclasses.asdict(t.stats), snapshot(t.core))

    before = view()
    with pytest.raises(UsageError) as exc:
        CALLS[call](t, exists.op_id, bad)
    assert type(exc.value) is UsageError
    inf = " or inf" if call == "expire" else ""
    assert str(exc.value) == f"l3 {call}: now must be a finite number of seconds{inf}, got {bad!r}"
    assert view() == before and t.poll_commands() == []
    t.check_invariants()
    t.core.check_invariants()
    assert t.expire(1.0) == [exists.op_id] and not t.prefetching("r1")  # stamped at 0.0, not at NaN


def test_now_may_be_any_finite_real_number() -> None:
    """ints and numpy floats are clock values too; the deadline is stamped from them."""
    t = h1_tier()
    backed(t.core, KEY)
    assert t.prefetch("r1", KEY + ("d",), np.float32(0.5)) and t.offer(KEY, 2) == 3  # type: ignore[arg-type]
    assert [(c.kind, c.deadline) for c in t.poll_commands()] == [(StoreOp.EXISTS, 1.5), (StoreOp.PUT, 3.0)]
    assert t.expire(np.float64(3.0)) == [1, 2]


def test_expire_at_inf_fails_every_operation_and_ends_every_lease() -> None:
    """At shutdown (kvtier.replay) ``expire(inf)`` ends everything in flight: the get it
    fails leaves its objects leased until ``inf``, which has passed too, and the remove
    waiting for that lease is submitted."""
    full = KEY + ("d",)
    t = h1_tier(lease_s=10.0)
    store = stored(full)
    assert t.prefetch("r1", full, 0.0)
    t.complete(answer_at_once(store, one_command(t)), 0.0)
    get = one_command(t)
    assert t.remove(list(get.keys[:1]), 0.0) == 0  # deferred: the get is in flight
    assert t.expire(math.inf) == [get.op_id] and not t.prefetching("r1")
    [rm] = t.poll_commands()
    assert rm.kind is StoreOp.REMOVE and rm.keys == get.keys[:1] and list(t.objects) == list(rm.keys)
    t.check_invariants()


BAD_FIELDS = [("ok", None, "a tuple of bools"), ("ok", "yes", "a tuple of bools"), ("ok", (True, 2), "a tuple of bools"),
              ("present", None, "an int >= 0"), ("present", math.nan, "an int >= 0"),
              ("present", "lots", "an int >= 0"), ("present", False, "an int >= 0"), ("present", -1, "an int >= 0"),
              ("corrupt", "k", "a tuple of key strings"), ("corrupt", (b"k",), "a tuple of key strings"),
              ("nbytes", 1.5, "an int >= 0"), ("nbytes", -1, "an int >= 0"),
              ("seconds", math.nan, "a finite number >= 0"), ("seconds", -0.5, "a finite number >= 0"),
              ("seconds", "1", "a finite number >= 0"), ("seconds", 10**400, "a finite number >= 0"),
              ("error", ValueError("x"), "a str or None")]


@pytest.mark.parametrize(("field", "bad", "expected"), BAD_FIELDS, ids=[f"{f}={v!r:.24}" for f, v, _ in BAD_FIELDS])
def test_a_store_result_refuses_a_bad_field_when_it_is_built(field: str, bad: object, expected: str) -> None:
    """Like the other records, StoreResult checks its fields when built (ConfigError naming
    the op, the field and the value), so a store driver that builds one from a backend's
    bad answer reports the operation failed instead of handing the tier a bad record."""
    with pytest.raises(ConfigError) as exc:
        StoreResult(3, **{field: bad})  # type: ignore[arg-type]
    assert type(exc.value) is ConfigError
    assert str(exc.value) == f"store result for op 3: {field} must be {expected}, got {bad!r}"


def test_a_store_result_takes_numpy_values_and_lists_as_plain_values() -> None:
    r = StoreResult(3, ok=[np.bool_(True), False], present=np.int64(2), corrupt=["k"], nbytes=np.int32(8),
                    seconds=1)  # type: ignore[arg-type]
    assert (r.ok, r.present, r.corrupt, r.nbytes, r.seconds) == ((True, False), 2, ("k",), 8, 1.0)
    assert [type(x) for x in (*r.ok, r.present, r.nbytes, r.seconds)] == [bool, bool, int, int, float]
    assert type(r.ok) is tuple and type(r.corrupt) is tuple


class _RaisingKey:
    """A unit key whose hash and ``==`` raise (an engine's key type with a bug)."""

    def __hash__(self) -> int:
        raise RuntimeError("broken key hash")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("broken key eq")


@pytest.mark.parametrize(("units", "fragment"), [
    ((["a"], ["b"]), "unit keys must be hashable, got ['a']"),
    (("a", {"b": 1}), "unit keys must be hashable, got {'b': 1}"),
    ((_RaisingKey(),), "a unit key's hash raised RuntimeError: broken key hash"),
], ids=["lists", "dict", "raising-hash"])
@pytest.mark.parametrize("call", ["prefetch", "offer"])
def test_prefetch_and_offer_refuse_unit_keys_that_cannot_be_hashed_naming_the_key(
        call: str, units: tuple[object, ...], fragment: str) -> None:
    """Unit keys are hashed in the core's radix tree: a key that cannot be (a list) or whose
    hash raises is refused with a UsageError naming it, as the facade's admit does (it was a
    TypeError or the key's own exception from deep in the tree), before anything changes:
    an owner's ended prefetch keeps its record (prefetch dropped it first)."""
    store = stored(KEY)
    t = h1_tier()
    assert t.prefetch("r1", KEY, 0.0)
    for _ in range(2):  # exists, then get
        t.complete(answer_at_once(store, one_command(t)), 0.0)
    assert t.fetched_units("r1") == 3
    before = (dataclasses.asdict(t.stats), snapshot(t.core), t.outstanding())
    with pytest.raises(UsageError) as e:
        if call == "prefetch":
            t.prefetch("r1", units, 0.0)  # type: ignore[arg-type]
        else:
            t.offer(units, 0.0)  # type: ignore[arg-type]
    assert type(e.value) is UsageError and str(e.value) == f"l3 {call}: units: {fragment}"
    assert (dataclasses.asdict(t.stats), snapshot(t.core), t.outstanding()) == before
    assert t.fetched_units("r1") == 3 and t.poll_commands() == []


@pytest.mark.parametrize("owner", [["r1"], None, 5, b"r1"], ids=repr)
def test_forget_refuses_an_owner_that_is_not_a_request_id_string(owner: object) -> None:
    """``forget`` drops a prefetch record: an owner that is no string is refused naming it
    (a list raised TypeError: unhashable; None and 5 were taken silently), as cancel does."""
    t = h1_tier()
    with pytest.raises(UsageError) as e:
        t.forget(owner)  # type: ignore[arg-type]
    assert str(e.value) == f"l3 forget: owner must be a request id string, got {owner!r}"


def test_error_kinds_are_bounded_later_ones_count_as_other_and_expiries_still_uncount() -> None:
    """``stats.errors`` counts backend errors by kind (the text before the first ':'): a backend
    whose messages carry a changing detail before any ':' (``timeout after 1234 ms``) added a
    kind per message, without bound. The first ``MAX_ERROR_KINDS`` kinds get their own entry;
    every later one counts under ``other``; the total is every error; an expiry after the
    table is full is still no backend error (it is uncounted where it was counted)."""
    from kvtier.fsm.l3.options import MAX_ERROR_KINDS

    t = h1_tier()
    n = MAX_ERROR_KINDS + 50
    for i in range(n):
        assert t.remove([f"k{i}"], 0.0) == 1
        t.complete(StoreResult(one_command(t).op_id, error=f"timeout after {i} ms"), 0.0)
    errors = dict(t.stats.errors)
    assert len(errors) == MAX_ERROR_KINDS + 1 and errors["other"] == 50 and sum(errors.values()) == n
    assert [k for k in errors if k != "other"] == [f"timeout after {i} ms" for i in range(MAX_ERROR_KINDS)]
    assert t.stats.op_errors == n
    assert t.remove(["late"], 0.0) == 1
    t.poll_commands()
    assert t.expire(5.0) == [1 + n]  # its deadline (1 s) passed: not the store's error
    assert t.stats.errors == errors and t.stats.op_errors == n and t.stats.expired_ops == 1
