"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) left unchecked in
``l3.py``, ``batch.py`` and ``invariants.py``, session 6: the L3 tier's messages, its store
op ids (1, 2, 3 ... one per command, in order), its counters, the records of objects in
flight and ended, the recently-put hint (exactly ``hint_size`` keys, the oldest dropped),
where a prefetch's local hit ends, get acknowledgements, leases, removes and expiry; a
batched step's per-item ``ok`` flags and errors, ``StepOutcome.ok``, the order in which
``raise_first`` raises, the fields of result tuples, the hot paths; the invariant each
corruption of a node's resources or tree links is reported under."""

from __future__ import annotations

import dataclasses

import pytest
from core_helpers import ack, h1, h2, put, src

from kvtier.fsm import CacheCore, ConfigError, KvtierError, UsageError
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.l3 import (L3Object, L3Options, L3Stats, L3Tier, StoreCommand, StoreOp, StoreResult, chain_keys,
                          namespace)
from kvtier.fsm.l3options import Prefetch
from kvtier.fsm.names import HOST_VISIBLE
from kvtier.fsm.presets import preset
from kvtier.tiered import TieredCache


# ------------------------------------------------------------------ L3 helpers
def _answer(store: dict[str, object], cmd: StoreCommand) -> StoreResult:
    """A store answered at once: exists counts the leading keys it holds, put stores
    (16 bytes a key), get serves what it holds, remove drops."""
    if cmd.kind is StoreOp.EXISTS:
        n = 0
        while n < len(cmd.keys) and cmd.keys[n] in store:
            n += 1
        return StoreResult(cmd.op_id, present=n)
    if cmd.kind is StoreOp.PUT:
        store.update(zip(cmd.keys, cmd.pages))
        return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys), nbytes=16 * len(cmd.keys))
    if cmd.kind is StoreOp.GET:
        return StoreResult(cmd.op_id, ok=tuple(k in store for k in cmd.keys))
    for k in cmd.keys:
        store.pop(k, None)
    return StoreResult(cmd.op_id, ok=(True,) * len(cmd.keys))


def _tier(**kw: object) -> L3Tier:
    return L3Tier(CacheCore(h1(), 16, 16), L3Options(deadline_s=1.0, **kw))  # type: ignore[arg-type]


def _backed(core: CacheCore, key: tuple[str, ...]) -> None:
    """Publish ``key`` on the device and acknowledge its writeback (host-visible)."""
    res = put(core, key)
    cmd = core.writeback(res.node)
    assert cmd is not None
    ack(core, cmd)
    assert res.node.state in HOST_VISIBLE


def _one(tier: L3Tier) -> StoreCommand:
    [cmd] = tier.poll_commands()
    return cmd


def _stored(key: tuple[str, ...]) -> dict[str, object]:
    """A store holding every object of ``key``'s prefix, put by a tier that had it backed."""
    store: dict[str, object] = {}
    ta = _tier()
    _backed(ta.core, key)
    assert ta.offer(key, 0.0) == len(key)
    ta.complete(_answer(store, _one(ta)), 0.0)
    return store


KEY = ("a", "b", "c")


# ------------------------------------------------------------------ l3.py: ConfigError messages
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


# ------------------------------------------------------------------ l3.py: op ids
def test_l3_store_commands_are_numbered_1_2_3_in_the_order_they_are_issued() -> None:
    """l3.py:87 (``_issued`` starts at 0) and :150 (one more per command): the commands of
    one tier carry op ids 1, 2, 3 ..., whether put/remove (``_new_op``) or a prefetch's
    exists then its get (numbered when the exists is answered)."""
    store: dict[str, object] = {}
    ta = _tier()
    _backed(ta.core, KEY)
    assert ta.offer(KEY[:1], 0.0) == 1
    assert ta.offer(KEY[:2], 0.0) == 1  # "a" is still being put: only "b"
    assert ta.remove(["not-there"], 0.0) == 1
    cmds = ta.poll_commands()
    assert [(c.op_id, c.kind) for c in cmds] == [(1, StoreOp.PUT), (2, StoreOp.PUT), (3, StoreOp.REMOVE)]
    assert ta.operations.keys() == {1, 2, 3}
    for c in cmds:
        ta.complete(_answer(store, c), 0.0)
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

    tb = _tier()
    assert tb.prefetch("r1", KEY, 0.0)
    exists = _one(tb)
    assert (exists.op_id, exists.kind) == (1, StoreOp.EXISTS)
    tb.complete(_answer(store, exists), 0.0)
    get = _one(tb)
    assert (get.op_id, get.kind, len(get.keys)) == (2, StoreOp.GET, 2)
    assert tb.remove(["not-there"], 0.0) == 1
    assert _one(tb).op_id == 3
    tb.complete(_answer(store, get), 0.0)
    assert tb.fetched_units("r1") == 2


# ------------------------------------------------------------------ l3.py: an object that ends
def test_a_record_taken_while_in_flight_reads_as_unknown_with_no_op_and_no_answer_once_it_ends() -> None:
    """l3.py:142-143: ``objects`` and ``operations`` are snapshots of the live records; once
    an object is back to ``unknown`` (dropped from the table) its record says no operation
    is in flight (``op_id`` None) and the store's answer no longer covers it
    (``store_answered`` False: the guard of ``get_submit`` needs an answer issued after the
    object was last unknown, spec ``[l3.guards.store_answered]``)."""
    store: dict[str, object] = {}
    ta = _tier()
    _backed(ta.core, KEY[:1])
    ta.offer(KEY[:1], 0.0)
    [rec] = ta.objects.values()
    put_op = ta.operations[1]
    assert (rec.state, rec.op_id, rec.store_answered) == ("putting", 1, False)
    ta.complete(_answer(store, _one(ta)), 0.0)
    assert ta.objects == {} and put_op.objects == [rec]
    assert rec.state == "unknown" and rec.op_id is None and rec.store_answered is False

    tb = _tier()  # no read lease: an acknowledged get ends in unknown
    tb.prefetch("r1", KEY[:1], 0.0)
    tb.complete(_answer(store, _one(tb)), 0.0)
    [rec] = tb.objects.values()
    assert (rec.state, rec.op_id, rec.store_answered) == ("getting", 2, True)
    tb.complete(_answer(store, _one(tb)), 0.0)
    assert tb.fetched_units("r1") == 1 and tb.objects == {}
    assert rec.state == "unknown" and rec.op_id is None and rec.store_answered is False


# ------------------------------------------------------------------ l3.py: the recently-put hint
def test_the_hint_remembers_exactly_hint_size_keys_and_drops_the_oldest() -> None:
    """l3.py:163-164: after a put is acknowledged its keys are remembered (not put again on
    the next offer) up to ``hint_size`` keys, the least recently put dropped first."""
    store: dict[str, object] = {}
    t3 = _tier(hint_size=3)
    _backed(t3.core, KEY)
    assert t3.offer(KEY, 0.0) == 3
    t3.complete(_answer(store, _one(t3)), 0.0)
    assert t3.offer(KEY, 0.0) == 0  # all three remembered

    t2 = _tier(hint_size=2)
    _backed(t2.core, KEY)
    k = t2.keys_for(KEY)
    assert t2.offer(KEY, 0.0) == 3
    t2.complete(_answer(store, _one(t2)), 0.0)  # remembered in order k0, k1, k2: k0 dropped
    assert t2.offer(KEY, 0.0) == 1
    cmd = _one(t2)
    assert cmd.keys == (k[0],)
    t2.complete(_answer(store, cmd), 0.0)  # k0 again, the most recent: now k1 is the oldest, dropped
    assert t2.offer(KEY, 0.0) == 1
    assert _one(t2).keys == (k[1],)



# ------------------------------------------------------------------ l3.py: where the local hit ends
def test_a_prefetch_asks_beyond_host_only_nodes_and_stops_before_fetching_ones() -> None:
    """l3.py:172: the local hit of a prefetch runs through host-only nodes (host-visible,
    not device-readable) and ends before a node being fetched (neither): a second
    prefetch of a longer prefix while a get is in flight asks the store again from there."""
    full = KEY + ("d",)
    store = _stored(full)
    tb = _tier()
    k = tb.keys_for(full)
    assert tb.prefetch("r1", full[:1], 0.0)
    tb.complete(_answer(store, _one(tb)), 0.0)
    tb.complete(_answer(store, _one(tb)), 0.0)
    assert [n.state for n in tb.core.walk(full[:1])] == ["host"]
    assert tb.prefetch("r2", KEY, 0.0)  # the hit ends after the host node "a"
    exists = _one(tb)
    assert exists.keys == tuple(k[1:3])
    tb.complete(_answer(store, exists), 0.0)
    get = _one(tb)
    assert get.keys == tuple(k[1:3])
    assert [n.state for n in tb.core.walk(full)] == ["host", "fetching", "fetching"]
    assert tb.prefetch("r3", full, 0.0)  # the hit ends before the fetching "b"
    assert _one(tb).keys == tuple(k[1:4])
    tb.complete(_answer(store, get), 0.0)
    assert tb.fetched_units("r2") == 2
    tb.core.check_invariants()
    tb.check_invariants()



def test_a_prefetch_is_refused_with_its_exact_message_or_skipped_after_a_device_only_end() -> None:
    """l3.py:191, 193, 329, 396, 398: bad arguments name the value; l3.py:199: when the local hit ends on a
    node with no host copy (device only) nothing is asked and the prefetch returns False."""
    t = _tier()
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
    store = _stored(full)
    tb = _tier()
    assert tb.prefetch("r1", full[:2], 0.0) and tb.prefetch("r2", full, 0.0)
    for _ in range(2):  # the two exists, then r1's get
        for c in tb.poll_commands():
            tb.complete(_answer(store, c), 0.0)
    assert (tb.fetched_units("r1"), tb.fetched_units("r2"), tb.prefetching("r2")) == (2, 0, False)
    assert tb.prefetch("r2", full, 0.0)  # again, from the fetched prefix
    for _ in range(2):
        tb.complete(_answer(store, _one(tb)), 0.0)
    assert tb.fetched_units("r2") == 2
    zero = {f.name: f.default for f in dataclasses.fields(L3Stats) if f.name != "errors"}
    assert dataclasses.asdict(tb.stats) == {**zero, "errors": {}, "prefetches": 3, "exists_ops": 3,
                                            "exists_keys": 8, "exists_present": 8, "get_ops": 2, "get_keys": 4,
                                            "get_ok": 4, "get_no_room": 4}



def test_an_owner_named_by_the_empty_string_gets_its_prefetch() -> None:
    """l3.py:213 (and the get's end): the owner is any string, the empty one too: its
    exists answer leads to its get, and the get's end is recorded for it."""
    store = _stored(KEY)
    tb = _tier()
    assert tb.prefetch("", KEY, 0.0) and tb.prefetching("")
    tb.complete(_answer(store, _one(tb)), 0.0)
    get = _one(tb)
    assert get.kind is StoreOp.GET and len(get.keys) == 3
    tb.complete(_answer(store, get), 0.0)
    assert not tb.prefetching("") and tb.fetched_units("") == 3
    assert [n.state for n in tb.core.walk(KEY)] == ["host"] * 3


def test_an_exists_that_failed_counts_nothing_present_and_gets_nothing() -> None:
    """l3.py:214: an exists answered with an error counts 0 keys present, ends the prefetch
    and submits no get (the store's answer is the only source of presence)."""
    store = _stored(KEY)
    tb = _tier()
    assert tb.prefetch("r1", KEY, 0.0)
    exists = _one(tb)
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
    store = _stored(full)
    tb = _tier(lease_s=0.5)
    k = tb.keys_for(full)

    def get(owner: str, ok: tuple[bool, ...]) -> StoreCommand:
        assert tb.prefetch(owner, full, 0.0)
        tb.complete(_answer(store, _one(tb)), 0.0)
        cmd = _one(tb)
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
    t = _tier()
    _backed(t.core, KEY)
    assert t.offer(KEY, 0.0) == 3
    receipt = t.operations[1].receipt
    assert receipt is not None and receipt.owner == "l3-put" and receipt.kind == "pin"
    assert [n.key for n in receipt.nodes] == [KEY] and t.core.walk(KEY)[0].host_pin == 1
    # l3.py:304: the records of the objects being put hold no guard value once submitted
    # (host_visible is put_submit's guard input only, set just before it fires)
    recs = t.objects
    assert [(o.state, o.op_id, o.host_visible, o.store_answered) for o in recs.values()] == [
        ("putting", 1, False, False)] * 3
    t.complete(_answer({}, _one(t)), 0.0)
    assert receipt.released and t.core.walk(KEY)[0].host_pin == 0



def test_host_eviction_puts_each_unit_of_a_victim_under_its_own_key_unless_recently_put() -> None:
    """l3.py:368: under ``host_eviction`` each unit of a victim is checked against the
    hint under its own key: with a hint of one key, the last unit put is skipped when the
    victim is offered again, and the first two are put again, in order."""
    store: dict[str, object] = {}
    t = _tier(write_policy="host_eviction", hint_size=1)
    _backed(t.core, KEY)
    t.core.evict_device({"kv": 16})
    [node] = t.core.walk(KEY)
    assert node.state == "host" and t.core.evictable_on_host(node)
    k = t.keys_for(KEY)
    assert t.offer((), 0.0) == 3
    cmd = _one(t)
    assert cmd.keys == tuple(k)
    t.complete(_answer(store, cmd), 0.0)  # remembered k0, k1, k2 in turn: only k2 is kept
    assert t.offer((), 0.0) == 2
    assert _one(t).keys == (k[0], k[1])



def test_removes_wait_for_leases_and_every_end_of_an_operation_is_counted_exactly() -> None:
    """l3.py:390-497 (remove, complete, expire): a corrupt object's remove and a remove
    under a read lease wait for the lease's end, a key given twice waits for the first
    remove; an expired operation is cancelled, failed and counted as expired (not as a
    backend error), its late result absorbed; a backend error counts by its kind; bytes
    and seconds add up."""
    store = _stored(KEY)
    t = _tier(lease_s=0.5)
    k = t.keys_for(KEY)
    assert t.prefetch("r1", KEY, 0.0)
    exists = _one(t)
    t.complete(StoreResult(exists.op_id, present=3, seconds=0.125), 0.0)
    get = _one(t)
    t.complete(StoreResult(get.op_id, ok=(True, True, False), corrupt=(k[2],), nbytes=64, seconds=0.25), 0.0)
    assert t.fetched_units("r1") == 2
    assert {key: o.state for key, o in t.objects.items()} == {key: "leased" for key in k}
    assert t.remove([k[0], "zz", "zz"], 0.1) == 1  # k0 leased: waits; the second "zz" waits for the first
    rm1 = _one(t)
    assert (rm1.op_id, rm1.kind, rm1.keys, rm1.deadline) == (3, StoreOp.REMOVE, ("zz",), 1.1)
    t.complete(StoreResult(rm1.op_id, ok=(True,)), 0.2)
    assert t.expire(0.4) == []  # "zz" is free again: its second remove goes; the leases hold until 0.5
    rm2 = _one(t)
    assert (rm2.op_id, rm2.keys, rm2.deadline) == (4, ("zz",), 1.4)
    t.complete(StoreResult(rm2.op_id, ok=(True,)), 0.4)
    cancelled: list[int] = []
    assert t.expire(0.5, cancelled.append) == []  # the leases end: the waiting removes go, in order
    rm3 = _one(t)
    assert (rm3.op_id, rm3.keys, rm3.deadline) == (5, (k[2], k[0]), 1.5)
    assert t.expire(1.4, cancelled.append) == [] and cancelled == []
    assert t.expire(1.5, cancelled.append) == [5] and cancelled == [5]
    assert t.objects == {} and t.ops_in_flight() == 0
    t.complete(StoreResult(5, ok=(True, True)), 1.6)  # too late: absorbed
    assert t.remove(["q"], 2.0) == 1
    t.complete(StoreResult(_one(t).op_id, error="TimeoutError: " + "x" * 80, seconds=0.5), 2.1)
    for key in ("q2", "q3"):  # an error kind is the text before the first ':', at most 60 characters
        assert t.remove([key], 2.0) == 1
        t.complete(StoreResult(_one(t).op_id, error="E" * 70 + ": no: detail"), 2.1)
    assert t.prefetch("r2", KEY, 2.2)  # c again, after the local hit a, b: 1 key, 32 bytes
    exists = _one(t)
    assert exists.keys == (k[2],)
    t.complete(StoreResult(exists.op_id, present=1, seconds=0.0625), 2.2)
    t.complete(StoreResult(_one(t).op_id, ok=(True,), nbytes=32, seconds=0.0625), 2.2)
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


# ------------------------------------------------------------------ batch.py: outcomes
def _cache(device: int = 16) -> TieredCache:
    return TieredCache(preset("llama-3-8b"), device_pages=device)


def _admit(c: TieredCache, rid: str, tokens: int, chunk: int) -> None:
    assert c.admit(rid, [(rid, i) for i in range(tokens // 16)], tokens, chunk) is not None


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



# ------------------------------------------------------------------ invariants.py: what each check names
def _violation(c: CacheCore) -> tuple[str, str]:
    """The invariant ``check_invariants`` names and its message (it must raise)."""
    with pytest.raises(InvariantViolation) as e:
        c.check_invariants()
    return e.value.invariant, str(e.value)


def test_a_resource_held_against_the_nodes_state_names_its_invariant() -> None:
    """invariants.py:31-37 (``_HOLDS``): a node holding a resource its state does not
    declare, or lacking one it declares, is reported under that resource's invariant:
    pending host pages on a device node or missing on a writing one and missing host pages
    on a host node break ``state_matches_resources``; a loading node without its loadback
    op breaks ``loadback_source_pinned``; an L3 get's op on a node not being fetched, or a
    fetching node without one, breaks ``l3_get_invisible``. Each corruption is undone
    before the next."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    assert (n.node_id, n.state) == (1, "device")
    n.pending = {"kv": [7]}
    assert _violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(device): holds pending_host but state 'device' declares ['device_pages', 'shared_read']")
    n.pending = {}
    cmd = c.writeback(n)
    assert cmd is not None and n.state == "writing"
    pending, n.pending = n.pending, {}
    assert _violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(writing): state 'writing' declares pending_host but the node has none")
    n.pending = pending
    ack(c, cmd)
    assert n.state == "backed"
    n.state = "loading"  # no loadback op (nor pin) behind it
    assert _violation(c) == ("loadback_source_pinned", "invariant 'loadback_source_pinned' violated by node 1 "
                             "(loading): state 'loading' declares loadback_op but the node has none")
    n.state = "backed"
    c.evict_device({"kv": 8})
    assert n.state == "host"
    host, n.host = n.host, {}
    assert _violation(c) == ("state_matches_resources", "invariant 'state_matches_resources' violated by node 1 "
                             "(host): state 'host' declares host_pages but the node has none")
    n.host = host
    c.check_invariants()
    n.fetch_op = 5  # an L3 get's op on a node not being fetched
    assert _violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 1 (host): "
                             "holds fetch_op but state 'host' declares ['host_pages']")
    n.fetch_op = None
    [f] = c.fetches.reserve(c.root, ["f0"], 900)
    assert (f.node_id, f.state, f.fetch_op) == (2, "fetching", 900)
    f.fetch_op = None
    assert _violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 2 (fetching): "
                             "state 'fetching' declares fetch_op but the node has none")
    f.fetch_op = 900
    c.check_invariants()


def test_a_child_filed_under_another_key_than_its_first_unit_breaks_the_tree_links() -> None:
    """invariants.py:98: a node whose first unit is not the key its parent files it under
    (here its second unit is) breaks ``split_preserves_ownership``."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    n.key = ("x", "a")  # filed under "a"
    assert _violation(c) == ("split_preserves_ownership", "invariant 'split_preserves_ownership' violated by "
                             "node 1 (device): tree links are inconsistent")
    n.key = ("a", "b")
    c.check_invariants()



def test_a_loadback_whose_own_pin_does_not_list_exactly_its_nodes_is_reported() -> None:
    """invariants.py:148-151: a loadback's own pin (receipt ``-op_id``) must list exactly its
    nodes; one that lists none breaks ``loadback_source_pinned``, naming the op."""
    c = CacheCore(h1(), 8, 8)
    n = put(c, ("a", "b")).node
    ack(c, c.writeback(n))
    c.evict_device({"kv": 8})
    assert n.state == "host"
    res = c.load(c.match(("a", "b")), "r1")
    assert res.command is not None and n.state == "loading"
    op_id = res.command.op_id
    pin = c.receipts.get(-op_id)
    assert pin.nodes == [n] and pin.owner == f"op {op_id}"
    pin.nodes = []
    assert _violation(c) == ("loadback_source_pinned", f"invariant 'loadback_source_pinned' violated by node 1 "
                             f"(loading): loadback op {op_id} does not pin exactly its nodes")
    pin.nodes = [n]
    c.check_invariants()


# ------------------------------------------------------------------ l3checks.py: what each check names
def test_l3_checks_name_the_object_or_the_tier_and_what_is_wrong() -> None:
    """l3checks.py:22-32: an object whose op id is not its operation's, a put whose source
    node lost its pin (still host-visible), and fetching nodes of a get the tier does not
    have in flight are each reported under their invariant, naming the object (its key's
    first 12 characters and state) or the L3 tier."""
    t = _tier()
    _backed(t.core, KEY)
    assert t.offer(KEY[:1], 0.0) == 1
    [o] = t.objects.values()
    label = t.keys_for(KEY[:1])[0][:12]
    assert o.label == label
    o.op_id = 7
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_ends_by_deadline", f"invariant 'l3_ends_by_deadline' violated "
                                                 f"by object {label} (putting): in put op 1 but putting")
    o.op_id = 1
    [n] = t.core.walk(KEY[:1])
    assert n.host_pin == 1 and n.state == "backed"
    n.host_pin = 0
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_put_source_pinned", f"invariant 'l3_put_source_pinned' "
                                                 f"violated by object {label} (putting): put 1 does not pin "
                                                 f"the host copies it reads")
    n.host_pin = 1
    t.check_invariants()
    t.core.fetches.reserve(t.core.root, ["zz"], 77)  # fetching nodes behind the tier's back
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by "
                                                 "the L3 tier: fetching nodes of get 77, which is not in flight")



def test_l3_checks_of_gets_and_of_objects_without_an_operation() -> None:
    """l3checks.py:33-50: a get whose fetching nodes are gone, an object fetched without the
    store's answer, and an object in flight that no operation lists are reported under
    their invariants, naming the object."""
    store = _stored(KEY)
    t = _tier()
    label = t.keys_for(KEY)[0][:12]
    t.prefetch("r1", KEY, 0.0)
    t.complete(_answer(store, _one(t)), 0.0)
    get = _one(t)
    o = t.objects[t.keys_for(KEY)[0]]
    o.store_answered = False
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_visible_by_answer", f"invariant 'l3_visible_by_answer' "
                                                 f"violated by object {label} (getting): fetched without the "
                                                 f"store's answer")
    o.store_answered = True
    t.check_invariants()
    t.core.fetches.settle(get.op_id, 3)  # the nodes settle behind the tier's back
    with pytest.raises(InvariantViolation) as e:
        t.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_get_invisible", f"invariant 'l3_get_invisible' violated by "
                                                 f"object {label} (getting): get 2 owns no fetching nodes")
    tp = _tier()
    _backed(tp.core, KEY)
    tp.offer(KEY[:1], 0.0)
    [p] = tp.objects.values()
    tp.operations[1].objects.clear()  # no operation lists it any more
    p.op_id = 7
    with pytest.raises(InvariantViolation) as e:
        tp.check_invariants()
    assert (e.value.invariant, str(e.value)) == ("l3_ends_by_deadline", f"invariant 'l3_ends_by_deadline' violated "
                                                 f"by object {p.label} (putting): no operation in flight")



# ------------------------------------------------------------------ l3options.py: options, keys, records
def test_l3_options_have_their_documented_defaults_and_refuse_each_bad_value_by_name() -> None:
    """l3options.py: the defaults the docstring documents; each bad option is refused with
    a message naming it and the value (bools are not ints or seconds); the boundaries
    (1 for counts, 0 for tp_rank / eviction_lookahead / lease_s, any time > 0 for
    deadline_s) are accepted."""
    o = L3Options()
    assert dataclasses.asdict(o) == {
        "model": "model", "dtype": "bfloat16", "tp_rank": 0, "world_size": 1, "write_policy": "host_write",
        "write_threshold": 2, "prefetch_units": 512, "min_prefetch_units": 1, "deadline_s": 2.0, "lease_s": 0.0,
        "max_put_units": 1024, "eviction_lookahead": 64, "hint_size": 2048}
    o.check()
    L3Options(write_threshold=1, prefetch_units=1, min_prefetch_units=1, max_put_units=1, hint_size=1,
              world_size=2, tp_rank=1, eviction_lookahead=0, deadline_s=0.001, lease_s=0).check()
    L3Options(write_policy="selective", deadline_s=3, lease_s=10).check()
    L3Options(write_policy="host_eviction").check()
    cases = [
        ({"write_policy": "x"}, "L3 write_policy must be one of ('host_write', 'selective', 'host_eviction'), got 'x'"),
        ({"write_threshold": 0}, "L3 write_threshold must be an int >= 1, got 0"),
        ({"prefetch_units": 1.0}, "L3 prefetch_units must be an int >= 1, got 1.0"),
        ({"min_prefetch_units": 0}, "L3 min_prefetch_units must be an int >= 1, got 0"),
        ({"max_put_units": -1}, "L3 max_put_units must be an int >= 1, got -1"),
        ({"hint_size": True}, "L3 hint_size must be an int >= 1, got True"),
        ({"world_size": 0}, "L3 world_size must be an int >= 1, got 0"),
        ({"tp_rank": -1}, "L3 tp_rank must be an int >= 0, got -1"),
        ({"tp_rank": False}, "L3 tp_rank must be an int >= 0, got False"),
        ({"eviction_lookahead": -1}, "L3 eviction_lookahead must be an int >= 0, got -1"),
        ({"eviction_lookahead": "8"}, "L3 eviction_lookahead must be an int >= 0, got '8'"),
        ({"tp_rank": 1}, "L3 tp_rank 1 is not below world_size 1"),
        ({"tp_rank": 3, "world_size": 2}, "L3 tp_rank 3 is not below world_size 2"),
        ({"deadline_s": 0}, "L3 deadline_s must be a number of seconds (> 0 for deadline_s), got 0"),
        ({"deadline_s": -1.0}, "L3 deadline_s must be a number of seconds (> 0 for deadline_s), got -1.0"),
        ({"deadline_s": True}, "L3 deadline_s must be a number of seconds (> 0 for deadline_s), got True"),
        ({"lease_s": -0.5}, "L3 lease_s must be a number of seconds (> 0 for deadline_s), got -0.5"),
        ({"lease_s": "1"}, "L3 lease_s must be a number of seconds (> 0 for deadline_s), got '1'"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError) as e:
            L3Options(**kw).check()  # type: ignore[arg-type]
        assert str(e.value) == msg


def test_l3_keys_are_a_fixed_function_of_the_model_layout_rank_and_prefix() -> None:
    """l3options.py namespace/chain_keys: instances (and versions) sharing a store must agree
    on every key, so the seed and the chained digests are pinned: 16-byte blake2b digests of
    the format ``kvtier-l3/1``; ``chain_keys`` from ``start`` with ``prev`` continues a chain."""
    seed = namespace(h1(), "m", "bf16", 0, 1)
    assert seed.hex() == "b9b9aaa8f7f02055790b46acbcf8298d"
    keys = chain_keys(seed, ["a", 1, ("b", 2)])
    assert [d.hex() for d in keys] == ["e1ff4dc4227a64048f728f25966d16a6", "0fbbd12ada1cbf71c7e9e6fed09146ff",
                                       "2e04979a09af042fd45c2d5af66f9d5b"]
    assert chain_keys(seed, ["a", 1, ("b", 2)], 1, keys[0]) == keys[1:]
    assert chain_keys(seed, ["a", 1, ("b", 2)], 3, keys[2]) == []
    assert namespace(h2(), "llama", "fp8", 1, 2).hex() == "e6b47110e927b7aee845008299e887d5"
    t = L3Tier(CacheCore(h1(), 4, 4), L3Options(model="m", dtype="bf16"))
    assert t.seed == seed and t.keys_for(["a", 1]) == [d.hex() for d in keys[:2]]


def test_l3_records_start_empty() -> None:
    """l3options.py: a new object record is unknown with nothing in flight, no guard value
    and no lease; its label is its key's first 12 characters; a prefetch record has fetched
    nothing and is not done; the counters start at zero."""
    o = L3Object("0123456789abcdef")
    assert (o.key, o.state, o.host_visible, o.store_answered, o.lease_holds, o.lease_until, o.op_id, o.label) == (
        "0123456789abcdef", "unknown", False, False, False, 0.0, None, "0123456789ab")
    p = Prefetch("r1", ("a",), 0, ["k"], 3)
    assert (p.owner, p.units, p.start, p.keys, p.op_id, p.fetched, p.done) == ("r1", ("a",), 0, ["k"], 3, 0, False)
    st = L3Stats()
    assert dataclasses.asdict(st) == {
        "exists_ops": 0, "exists_keys": 0, "exists_present": 0, "get_ops": 0, "get_keys": 0, "get_ok": 0,
        "get_failed": 0, "get_misses": 0, "get_corrupt": 0, "get_no_room": 0, "put_ops": 0, "put_keys": 0,
        "put_ok": 0, "put_failed": 0, "remove_ops": 0, "remove_keys": 0, "removes_deferred_by_lease": 0,
        "op_errors": 0, "expired_ops": 0, "absorbed_late_results": 0, "prefetches": 0, "bytes_in": 0,
        "bytes_out": 0, "seconds": 0.0, "get_seconds": 0.0, "errors": {}}
    assert st.errors is not L3Stats().errors



# ------------------------------------------------------------------ fetch.py: the core's side of an L3 get
def test_fetch_reservations_and_settlements_exactly() -> None:
    """fetch.py: each refusal of ``reserve``/``settle`` names what is wrong; a chain of
    fetching nodes is listed parent first; a settle keeps the acknowledged prefix as host
    copies and removes the rest; the counters count gets, fetched and failed units; a node
    in a get that it is not fetching for breaks ``l3_get_invisible``."""
    bare = CacheCore(h1(), 8)
    with pytest.raises(UsageError) as e:
        bare.fetches.reserve(bare.root, ["a"], 1)
    assert str(e.value) == "fetch_reserve: the cache has no host tier"
    c = CacheCore(h1(), 8, 8)
    with pytest.raises(UsageError) as e:
        c.fetches.reserve(c.root, [], 1)
    assert str(e.value) == "fetch_reserve: no unit keys"
    n = put(c, ("a",)).node
    with pytest.raises(UsageError) as e:
        c.fetches.reserve(n, ["b"], 1)
    assert str(e.value) == ("fetch_reserve: node 1 is device; a fetched chain continues the root or a node with a "
                            "visible host copy")
    nodes = c.fetches.reserve(c.root, ["x", "y", "z"], 5)
    assert [(m.node_id, m.key, m.depth, m.state, m.fetch_op) for m in nodes] == [
        (2, ("x",), 1, "fetching", 5), (3, ("y",), 2, "fetching", 5), (4, ("z",), 3, "fetching", 5)]
    assert c.fetches.nodes(5) == tuple(nodes) and c.fetches.items() == [(5, tuple(nodes))] and len(c.fetches) == 1
    with pytest.raises(UsageError) as e:
        c.fetches.reserve(c.root, ["q"], 5)
    assert str(e.value) == "fetch_reserve: op 5 is already in flight"
    assert c.fetches.reserve(c.root, ["x"], 6) == [] and 6 not in c.fetches  # "x" is taken
    for bad in (4, True, -1):
        with pytest.raises(UsageError) as e:
            c.fetches.settle(5, bad)
        assert str(e.value) == f"fetch_settle: acked must be an int in 0..3, got {bad!r}"
    nodes[1].fetch_op = 4
    assert _violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 3 (fetching): "
                             "in get 5 but not fetching for it")
    nodes[1].fetch_op = 5
    listed = c.fetches._ops[5]  # corrupt the table itself: its get no longer lists the last node
    last = listed.pop()
    assert _violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 4 (fetching): "
                             "fetching but no get in flight lists it")
    listed.append(last)
    c.check_invariants()
    assert c.fetches.settle(5, 2) == nodes[:2]
    assert [(m.state, m.fetch_op) for m in nodes[:2]] == [("host", None), ("host", None)]
    assert c.walk(("x", "y", "z")) == nodes[:2] and len(c.fetches) == 0
    assert (c.stats.fetches, c.stats.fetched_units, c.stats.fetch_failed_units) == (1, 2, 1)
    assert (nodes[2].state, nodes[2].pending, nodes[2].fetch_op) == ("removed", {}, None)  # the failed one
    more = c.fetches.reserve(c.root, ["p", "q"], 7)
    assert c.fetches.settle(7, 0) == [] and c.walk(("p",)) == [] and len(more) == 2
    assert [(m.state, m.pending, m.fetch_op) for m in more] == [("removed", {}, None)] * 2
    assert (c.stats.fetches, c.stats.fetched_units, c.stats.fetch_failed_units) == (2, 2, 3)
    c.check_invariants()



def test_a_fetch_reclaims_host_room_and_refuses_a_parent_of_another_tree() -> None:
    """fetch.py:77, 85: a reservation short of host pages first evicts unpinned host leaves
    off the parent's path (here one of two), so all three units fit; a parent that is not a
    node of this cache's tree is refused by name."""
    c = CacheCore(h1(), 8, 4)
    other = CacheCore(h1(), 8, 8)
    o = put(other, ("z",)).node
    with pytest.raises(KvtierError) as e:
        c.fetches.reserve(o, ["b"], 1)
    assert str(e.value) == f"fetch_reserve: {o!r} is not a node of this cache's tree"
    for k in ("a", "b"):
        n = put(c, (k,)).node
        ack(c, c.writeback(n))
    c.evict_device({"kv": 8})
    assert [n.state for n in c.nodes()] == ["host", "host"] and c.host is not None and c.host["kv"].free == 2
    made = c.fetches.reserve(c.root, ["x", "y", "z"], 5)
    assert [n.key for n in made] == [("x",), ("y",), ("z",)] and c.host["kv"].free == 0
    assert sorted(n.key for n in c.nodes() if n.state == "host") == [("b",)]  # "a", least recent, evicted
    c.check_invariants()


# ------------------------------------------------------------------ checks.py, spec.py
def test_as_bool_takes_numpy_bools_only_and_as_text_names_the_value() -> None:
    """checks.py:61, 77: a numpy bool is a bool (``numpy.bool`` in numpy 2, ``numpy.bool_``
    in numpy 1, stood in for by a class of that name and module), another numpy scalar is
    not; an empty text is refused naming the value."""
    import numpy as np

    from kvtier.fsm.checks import as_bool, as_text

    assert as_bool(np.bool_(True), "flag") is True and as_bool(np.bool_(False), "flag") is False
    numpy1_bool = type("bool_", (), {"__module__": "numpy", "__bool__": lambda self: True})
    assert as_bool(numpy1_bool(), "flag") is True
    with pytest.raises(UsageError) as e:
        as_bool(np.int64(1), "flag")
    assert str(e.value) == "flag must be True or False, got np.int64(1)"
    with pytest.raises(UsageError) as e:
        as_text("", "request id")
    assert str(e.value) == "request id must be a non-empty str, got ''"


def test_spec_records_default_to_no_calls_and_no_l3_and_a_call_of_an_undeclared_state_is_refused() -> None:
    """spec.py:84, 138: a lifecycle built without calls has none (a fresh dict), a
    specification built without an L3 lifecycle has ``l3`` None; spec.py:180: a call that
    lists an undeclared state is refused naming both."""
    from pathlib import Path

    from kvtier.fsm.spec import LifecycleSpec, Specification, load_spec, parse_spec

    shipped = load_spec()
    node = shipped.node
    bare = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial, node.states,
                         node.transitions, node.guards, node.resources)
    assert bare.calls == {} and bare.calls is not LifecycleSpec(
        node.name, node.title, node.description, node.subject, node.initial, node.states, node.transitions,
        node.guards, node.resources).calls
    assert Specification(shipped.version, shipped.node, shipped.request, shipped.invariants).l3 is None
    text = (Path(__file__).parents[1] / "spec" / "lifecycle.toml").read_text(encoding="utf-8")
    bad = text.replace('reserve = ["loading", "running"]', 'reserve = ["loading", "nowhere"]')
    assert bad != text
    with pytest.raises(ConfigError) as e:
        parse_spec(bad)
    assert str(e.value) == "spec [request]: call 'reserve' lists undeclared state 'nowhere'"
