"""The L3 tier's core lifecycle (kvtier.fsm.l3 + kvtier.fsm.node.fetch) against an in-memory
fake store answered synchronously: puts pin, visibility only through the store's answer,
gets invisible until acked, failures shorten the hit, deadlines, leases, late results; the
store command kinds by name and what a bare store result means.

The store commands' exact values and counters are in test_tier_commands.py; the claims that
L3 works against a real store are in tests/transfer/store/."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from core_helpers import ack, h1, put, snapshot, src
from l3_helpers import KEY, FakeStore, backed, make, pump

from kvtier.fsm import CacheCore, ConfigError, IllegalTransition, InvariantViolation, UsageError
from kvtier.fsm.l3 import L3Options, L3Tier, StoreOp, StoreResult, chain_keys, namespace
from kvtier.fsm.lifecycle.names import L3_STATE


def test_put_pins_then_another_instance_fetches_through_the_stores_answer() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    assert ta.offer(KEY, 0.0) == 4
    node = a.walk(KEY)[-1]
    assert node.host_pin == 1  # pinned while the put is in flight
    ta.check_invariants()
    cmds = pump(ta, store)
    assert [c.kind for c in cmds] == [StoreOp.PUT] and node.host_pin == 0
    assert len(store.data) == 4 and ta.offer(KEY, 0.0) == 0  # not put twice
    b, tb = make()
    assert tb.prefetch("r1", KEY + ("e",), 0.0)
    assert tb.prefetching("r1")
    [exists] = tb.poll_commands()
    assert exists.kind is StoreOp.EXISTS and len(exists.keys) == 5
    tb.complete(store.answer(exists), 0.0)
    [get] = tb.poll_commands()
    assert get.kind is StoreOp.GET and len(get.keys) == 4
    # reserved pages are invisible to matching until the get is acked
    assert b.match(KEY).host_units == 0
    assert [n.state for n in b.walk(KEY)] == ["fetching"] * 4
    b.check_invariants()
    tb.check_invariants()
    tb.complete(store.answer(get), 0.0)
    assert not tb.prefetching("r1") and tb.fetched_units("r1") == 4
    m = b.match(KEY + ("e",))
    assert m.host_units == 4 and len(m.host_nodes) == 4
    assert tb.stats.get_ok == 4 and b.stats.fetched_units == 4
    b.check_invariants()
    # keys agree across instances and are chained over the prefix
    assert ta.keys_for(KEY) == tb.keys_for(KEY) == list(store.data)


def test_keys_separate_models_ranks_and_prefixes() -> None:
    lay = h1()
    s0 = namespace(lay, "m", "bf16", 0, 2)
    assert s0 != namespace(lay, "m", "bf16", 1, 2) != namespace(lay, "m2", "bf16", 0, 2)
    assert s0 != namespace(lay, "m", "fp8", 0, 2)
    k1 = chain_keys(s0, ["a", "b"])
    k2 = chain_keys(s0, ["x", "b"])
    assert k1[1] != k2[1]  # same unit, different prefix
    assert chain_keys(s0, ["a", "b"], 1, k1[0]) == k1[1:]


def test_store_drop_between_exists_and_get_shortens_the_hit() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b, tb = make()
    tb.prefetch("r", KEY, 0.0)
    [ex] = tb.poll_commands()
    tb.complete(store.answer(ex), 0.0)
    [get] = tb.poll_commands()
    del store.data[get.keys[2]]  # the store evicts unit 2 after answering
    tb.complete(store.answer(get), 0.0)
    assert b.match(KEY).host_units == 2
    assert tb.stats.get_misses == 1 and tb.stats.get_failed == 2  # unit 3 is past the gap
    assert b.stats.fetch_failed_units == 2
    b.check_invariants()
    tb.check_invariants()
    assert b.host is not None and b.host["kv"].free == 16 - 2  # failed reservations freed


def test_deadline_fails_a_hung_get_and_absorbs_its_late_result() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b, tb = make()
    tb.prefetch("r", KEY, 0.0)
    [ex] = tb.poll_commands()
    tb.complete(store.answer(ex), 0.0)
    [get] = tb.poll_commands()
    assert tb.expire(0.5) == []
    cancelled: list[int] = []
    assert tb.expire(1.0, cancelled.append) == [get.op_id] and cancelled == [get.op_id]
    assert b.match(KEY).host_units == 0 and not tb.prefetching("r")
    assert tb.stats.expired_ops == 1 and tb.stats.get_failed == 4
    tb.complete(store.answer(get), 2.0)  # the late answer changes nothing
    assert tb.stats.absorbed_late_results == 1 and b.match(KEY).host_units == 0
    with pytest.raises(UsageError, match="never issued"):
        tb.complete(StoreResult(99), 2.0)
    b.check_invariants()
    tb.check_invariants()


def test_failed_put_unpins_and_counts() -> None:
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    [cmd] = ta.poll_commands()
    ta.complete(StoreResult(cmd.op_id, error="ConnectionError: refused"), 0.0)
    assert all(n.host_pin == 0 for n in a.walk(KEY))
    assert ta.stats.put_failed == 4 and ta.stats.op_errors == 1 and ta.stats.errors == {"ConnectionError": 1}
    assert ta.offer(KEY, 0.0) == 4  # not remembered as put: tried again
    a.check_invariants()


def test_lease_blocks_remove_until_it_ends() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b, tb = make(lease=10.0)
    tb.prefetch("r", KEY, 0.0)
    pump(tb, store)
    key = tb.keys_for(KEY)[0]
    assert tb.objects[key].state == "leased"
    assert tb.remove([key], 1.0) == 0 and tb.stats.removes_deferred_by_lease == 1
    assert tb.poll_commands() == [] and key in store.data
    from kvtier.fsm.lifecycle.machines import l3_lifecycle
    with pytest.raises(IllegalTransition):
        l3_lifecycle().fire(tb.objects[key], "remove_submit")
    tb.expire(10.0)  # the lease ends; the deferred remove goes out
    [rm] = tb.poll_commands()
    assert rm.kind is StoreOp.REMOVE and rm.keys == (key,)
    tb.complete(store.answer(rm), 10.0)
    assert key not in store.data and tb.objects == {}


def test_a_refused_remove_defers_nothing() -> None:
    """A remove with a bad key among busy ones is refused before it defers any (it once
    queued the busy keys it had seen: a later expiry would have removed them)."""
    store = FakeStore()
    b, tb = make(lease=10.0)
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    tb.prefetch("r", KEY, 0.0)
    pump(tb, store)
    leased = tb.keys_for(KEY)[:2]
    assert [tb.objects[k].state for k in leased] == ["leased", "leased"]
    with pytest.raises(UsageError, match="key must be a string, got 5"):
        tb.remove([*leased, 5], 1.0)  # type: ignore[list-item]
    assert tb.stats.removes_deferred_by_lease == 0
    tb.expire(10.0)  # the leases end: nothing was waiting to be removed
    assert tb.poll_commands() == [] and tb.objects == {} and all(k in store.data for k in leased)


def test_a_failed_get_is_leased_too_and_a_corrupt_objects_remove_waits_for_the_lease() -> None:
    """Mooncake leases an object when it is asked for it, before any byte moves: a get that
    failed (here: a corrupt object) leaves the object leased, and its remove goes out only
    after lease_end."""
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b, tb = make(lease=5.0)
    tb.prefetch("r", KEY, 0.0)
    [ex] = tb.poll_commands()
    tb.complete(store.answer(ex), 0.0)
    [get] = tb.poll_commands()
    bad = get.keys[1]
    tb.complete(StoreResult(get.op_id, ok=(True, False, False, False), corrupt=(bad,)), 1.0)
    assert b.match(KEY).host_units == 1 and tb.stats.get_corrupt == 1
    assert {k: o.state for k, o in tb.objects.items()} == {k: "leased" for k in get.keys}
    assert all(o.lease_until == 6.0 for o in tb.objects.values())
    tb.check_invariants()
    assert tb.expire(5.9) == [] and tb.poll_commands() == []  # lease holds: no remove
    tb.expire(6.0)
    [rm] = tb.poll_commands()
    assert rm.kind is StoreOp.REMOVE and rm.keys == (bad,) and tb.objects[bad].state == "removing"
    tb.complete(store.answer(rm), 6.0)
    assert bad not in store.data and tb.objects == {}
    _, tn = make(lease=0.0)  # a store without leases: the failed objects are not kept
    tn.prefetch("r", KEY, 0.0)
    [ex] = tn.poll_commands()
    tn.complete(store.answer(ex), 0.0)
    [get] = tn.poll_commands()
    tn.complete(StoreResult(get.op_id, error="ConnectionError: refused"), 0.0)
    assert tn.objects == {}


def test_prefetch_skips_what_is_local_and_refuses_bad_input() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    assert not ta.prefetch("r", KEY, 0.0)  # all local
    assert ta.prefetch("r", KEY + ("e", "f"), 0.0)
    [ex] = ta.poll_commands()
    assert len(ex.keys) == 2  # only beyond the local hit
    ta.complete(store.answer(ex), 0.0)
    assert not ta.prefetching("r") and ta.poll_commands() == []
    with pytest.raises(UsageError):
        ta.prefetch(3, KEY, 0.0)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ta.complete("x", 0.0)  # type: ignore[arg-type]


def test_selective_policy_and_config_errors() -> None:
    store = FakeStore()
    a, ta = make(write_policy="selective", write_threshold=2)
    backed(a, KEY)
    assert ta.offer(KEY, 0.0) == 0  # not reused yet
    node = a.walk(KEY)[-1]
    a.unlock(a.lock(node, "x"))
    a.unlock(a.lock(node, "y"))
    assert ta.offer(KEY, 0.0) == 4
    pump(ta, store)
    with pytest.raises(ConfigError, match="write_policy"):
        L3Tier(a, L3Options(write_policy="always"))
    with pytest.raises(ConfigError, match="host tier"):
        L3Tier(CacheCore(h1(), 8), L3Options())
    with pytest.raises(ConfigError, match="continuation-state"):
        L3Tier(CacheCore(src(), 8, 8), L3Options())


def test_host_eviction_policy_puts_the_next_victims() -> None:
    store = FakeStore()
    a, ta = make(write_policy="host_eviction", eviction_lookahead=8)
    backed(a, KEY)
    node = a.walk(KEY)[-1]
    a.evict_device({"kv": 16})  # demote: host-only leaves are host victims
    assert node.state == "host"
    assert ta.offer((), 0.0) == 4
    pump(ta, store)
    assert len(store.data) == 4


def test_no_room_fetches_less_and_never_overwrites() -> None:
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b = CacheCore(h1(), 16, 2)
    tb = L3Tier(b, L3Options())
    tb.prefetch("r", KEY, 0.0)
    pump(tb, store)
    assert b.match(KEY).host_units == 2 and tb.stats.get_no_room == 2
    b.check_invariants()


def test_l3_refuses_a_bool_op_id_and_str_units() -> None:
    """A bool op id would complete op 1 (True == 1) and a str is a sequence of characters,
    not of unit keys: both are refused and nothing changes."""
    _, tier = make()
    with pytest.raises(UsageError, match="op_id must be an int, got True"):
        tier.complete(StoreResult(True), 0.0)
    with pytest.raises(UsageError, match="op_id must be an int, got 'x'"):
        tier.complete(StoreResult("x"), 0.0)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="not a str or bytes"):
        tier.prefetch("r", "abcd", 0.0)
    with pytest.raises(UsageError, match="not a str or bytes"):
        tier.offer(b"abcd", 0.0)
    assert tier.poll_commands() == [] and tier.stats.op_errors == 0


# ---------------------------------------------------------------------------- L3 store records
def l3_pair() -> tuple[CacheCore, L3Tier, CacheCore, L3Tier]:
    """Two h1 cores with L3 tiers (deadline 1 s, no lease); the first holds units abcd on
    the host (backed: written back and acknowledged)."""
    a, b = CacheCore(h1(), 16, 16), CacheCore(h1(), 16, 16)
    res = put(a, tuple("abcd"))
    cmd = a.writeback(res.node)
    assert cmd is not None
    ack(a, cmd)
    return a, L3Tier(a, L3Options(deadline_s=1.0)), b, L3Tier(b, L3Options(deadline_s=1.0))


def test_store_commands_carry_their_kind_by_name() -> None:
    """A backend (or a log) reads a command's kind by its value: exists, put, get, remove;
    an object left in the wrong state names its operation's kind in the invariant."""
    assert [(k.name, k.value) for k in StoreOp] == [("EXISTS", "exists"), ("PUT", "put"), ("GET", "get"),
                                                    ("REMOVE", "remove")]
    assert [StoreOp(v) for v in ("exists", "put", "get", "remove")] == list(StoreOp)
    _, ta, _, tb = l3_pair()
    assert ta.offer(tuple("abcd"), 0.0) == 4
    (put_cmd,) = ta.poll_commands()
    assert put_cmd.kind.value == "put" and len(put_cmd.keys) == 4
    obj = ta.objects[put_cmd.keys[0]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        ta.check_invariants()
    assert (exc.value.invariant, str(exc.value).endswith(f"in put op {put_cmd.op_id} but leased")) == (
        "l3_ends_by_deadline", True), str(exc.value)
    obj.state = state
    ta.complete(StoreResult(put_cmd.op_id, ok=(True,) * 4), 0.0)
    stored = set(put_cmd.keys)
    assert tb.prefetch("r", tuple("abcd") + ("e",), 0.0)
    (exists,) = tb.poll_commands()
    assert exists.kind.value == "exists" and len(exists.keys) == 5
    tb.complete(StoreResult(exists.op_id, present=4), 0.0)
    (get,) = tb.poll_commands()
    assert get.kind.value == "get" and set(get.keys) == stored
    obj = tb.objects[get.keys[1]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        tb.check_invariants()
    assert str(exc.value).endswith(f"in get op {get.op_id} but leased"), str(exc.value)
    obj.state = state
    tb.complete(StoreResult(get.op_id, ok=(True,) * 4), 0.0)
    assert tb.remove(list(get.keys[:2]), 0.0) == 2
    (rm,) = tb.poll_commands()
    assert rm.kind.value == "remove" and rm.keys == get.keys[:2]
    obj = tb.objects[rm.keys[0]]
    state, obj.state = obj.state, L3_STATE.leased
    with pytest.raises(InvariantViolation) as exc:
        tb.check_invariants()
    assert str(exc.value).endswith(f"in remove op {rm.op_id} but leased"), str(exc.value)
    obj.state = state
    tb.complete(StoreResult(rm.op_id, ok=(True, True)), 0.0)
    tb.check_invariants()


def test_a_bare_store_result_moved_nothing_and_succeeded_at_nothing() -> None:
    """StoreResult's defaults: no key ok, none present, nothing corrupt, 0 bytes in 0 s, no
    error; so a bare result of an exists finds nothing, of a put stores nothing, and the
    failures the tier makes itself at a deadline add no bytes and no seconds."""
    r = StoreResult(7)
    assert (r.op_id, r.ok, r.present, r.corrupt, r.nbytes, r.seconds, r.error) == (7, (), 0, (), 0, 0.0, None)
    assert type(r.seconds) is float and type(r.nbytes) is int and type(r.present) is int
    a, ta, b, tb = l3_pair()
    # a put answered by a bare result (no error): no key was stored
    assert ta.offer(tuple("abcd"), 0.0) == 4
    (put1,) = ta.poll_commands()
    ta.complete(StoreResult(put1.op_id), 0.0)
    assert (ta.stats.put_ok, ta.stats.put_failed, ta.stats.bytes_out, ta.stats.seconds) == (0, 4, 0, 0.0)
    assert all(n.host_pin == 0 for n in a.walk(tuple("abcd")))
    # the put again, past its deadline: failed by the tier, 0 bytes in 0 seconds
    assert ta.offer(tuple("abcd"), 1.0) == 4
    (put2,) = ta.poll_commands()
    assert ta.expire(2.0) == [put2.op_id]
    assert (ta.stats.put_failed, ta.stats.expired_ops, ta.stats.bytes_out, ta.stats.seconds) == (8, 1, 0, 0.0)
    ta.check_invariants()
    # an exists answered by a bare result: none present, so no get
    assert tb.prefetch("r", tuple("abcd"), 0.0)
    (ex,) = tb.poll_commands()
    tb.complete(StoreResult(ex.op_id), 0.0)
    assert (tb.stats.exists_present, tb.poll_commands(), tb.prefetching("r")) == (0, [], False)
    assert (tb.stats.get_seconds, tb.stats.seconds) == (0.0, 0.0)
    # a get past its deadline adds no bytes and no seconds either
    ta.offer(tuple("abcd"), 3.0)
    (put3,) = ta.poll_commands()
    ta.complete(StoreResult(put3.op_id, ok=(True,) * 4, nbytes=400, seconds=0.25), 3.0)
    assert (ta.stats.put_ok, ta.stats.bytes_out, ta.stats.seconds) == (4, 400, 0.25)
    tb.forget("r")
    assert tb.prefetch("r2", tuple("abcd"), 3.0)
    (ex2,) = tb.poll_commands()
    tb.complete(StoreResult(ex2.op_id, present=4, seconds=0.5), 3.0)
    (get,) = tb.poll_commands()
    assert tb.expire(5.0) == [get.op_id]
    assert (tb.stats.bytes_in, tb.stats.get_seconds, tb.stats.seconds, tb.stats.expired_ops) == (0, 0.5, 0.5, 1)
    assert b.match(tuple("abcd")).host_units == 0
    tb.check_invariants()
    b.check_invariants()


# ------------------------------------------------------------------ hostile store results
def forged(op_id: int, **fields: object) -> StoreResult:
    """A StoreResult with ``fields`` set around its constructor (which refuses them), as a
    buggy backend or a pickled record from another version could hand one over."""
    r = StoreResult(op_id)
    for name, value in fields.items():
        object.__setattr__(r, name, value)
    return r


def tier_view(tier: L3Tier) -> tuple[Any, ...]:
    """Everything observable about a tier and its core, through public views."""
    return ({i: (o.kind, [x.key for x in o.objects], o.deadline, o.owner) for i, o in tier.operations.items()},
            {k: (o.state, o.op_id, o.lease_until) for k, o in tier.objects.items()},
            tier.prefetching("r1"), tier.fetched_units("r1"), dataclasses.asdict(tier.stats), snapshot(tier.core))


BAD_RESULTS = [  # (the operation it answers, field, value, what the message says is expected)
    ("exists", "present", None, "an int >= 0"),
    ("exists", "present", math.nan, "an int >= 0"),
    ("exists", "present", "lots", "an int >= 0"),
    ("exists", "present", 2.0, "an int >= 0"),
    ("exists", "present", True, "an int >= 0"),
    ("exists", "present", -1, "an int >= 0"),
    ("exists", "nbytes", -8, "an int >= 0"),
    ("exists", "seconds", math.nan, "a finite number >= 0"),
    ("exists", "seconds", math.inf, "a finite number >= 0"),
    ("exists", "error", 500, "a str or None"),
    ("get", "ok", None, "a tuple of bools"),
    ("get", "ok", "yes", "a tuple of bools"),
    ("get", "ok", (True, None), "a tuple of bools"),
    ("get", "ok", (1, 1), "a tuple of bools"),
    ("get", "corrupt", None, "a tuple of key strings"),
    ("get", "corrupt", (7,), "a tuple of key strings"),
]


@pytest.mark.parametrize("then", ["complete", "expire"])
@pytest.mark.parametrize(("stage", "field", "bad", "expected"), BAD_RESULTS,
                         ids=[f"{s}-{f}={v!r}" for s, f, v, _ in BAD_RESULTS])
def test_a_store_result_with_a_bad_field_is_refused_and_the_prefetch_can_still_end(
        stage: str, field: str, bad: object, expected: str, then: str) -> None:
    """A result whose ``present`` is None, NaN or 'lots' (or whose ``ok`` is None, ...) is
    refused with a UsageError naming the field and the value before anything changes: the
    operation stays in flight, so its real answer, or its deadline, still ends the prefetch
    (once the operation was dropped first, and the request waited on it forever)."""
    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    b, tb = make()
    assert tb.prefetch("r1", KEY, 0.0)
    cmd = tb.poll_commands()[0]
    if stage == "get":
        tb.complete(store.answer(cmd), 0.0)
        cmd = tb.poll_commands()[0]
    assert cmd.kind.value == stage
    before = tier_view(tb)
    with pytest.raises(UsageError) as exc:
        tb.complete(forged(cmd.op_id, **{field: bad}), 0.5)
    assert type(exc.value) is UsageError
    assert str(exc.value) == f"l3 complete: op {cmd.op_id}: {field} must be {expected}, got {bad!r}"
    assert tier_view(tb) == before and tb.prefetching("r1") and cmd.op_id in tb.operations
    assert tb.poll_commands() == []
    tb.check_invariants()
    b.check_invariants()
    if then == "expire":
        assert tb.expire(1.0) == [cmd.op_id]
        assert not tb.prefetching("r1") and tb.ops_in_flight() == 0 and tb.stats.expired_ops == 1
    else:
        tb.complete(store.answer(cmd), 0.5)
        if stage == "exists":
            tb.complete(store.answer(tb.poll_commands()[0]), 0.5)
        assert not tb.prefetching("r1") and tb.fetched_units("r1") == 4 and b.match(KEY).host_units == 4
    tb.check_invariants()
    b.check_invariants()
