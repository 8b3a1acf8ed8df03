"""Exact values of ``fsm/l3options.py`` (and the L3 parts of ``fsm/fetch.py`` and
``fsm/l3checks.py``) that the mutation run (bench/mutation, issue 12) left unchecked,
session 6 (helper G): the documented defaults of :class:`L3Options`, every refusal of
``L3Options.check`` with its exact message and its boundaries, the fresh counters of
:class:`L3Stats`, a new :class:`L3Object` and :class:`Prefetch`, and the key format
(``namespace``, ``chain_keys``: keys are shared through the store between instances and
releases, so they must not drift); and every ``l3_*`` invariant check of ``check_l3`` with
its exact invariant, subject and message, each on a tier corrupted in one place."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvtier.fsm import CacheCore, ConfigError
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.l3 import L3Tier, StoreResult
from kvtier.fsm.l3options import (WRITE_POLICIES, L3Object, L3Options, L3Stats, Prefetch, chain_keys,
                                  namespace)
from kvtier.fsm.spec import load_spec

from core_helpers import ack, h1, put


# ------------------------------------------------------------------ L3Options
def test_l3_options_defaults_are_the_documented_ones() -> None:
    o = L3Options()
    assert dataclasses.asdict(o) == {
        "model": "model", "dtype": "bfloat16", "tp_rank": 0, "world_size": 1, "write_policy": "host_write",
        "write_threshold": 2, "prefetch_units": 512, "min_prefetch_units": 1, "deadline_s": 2.0,
        "lease_s": 0.0, "max_put_units": 1024, "eviction_lookahead": 64, "hint_size": 2048}
    o.check()  # the defaults are valid


def test_l3_options_are_frozen_and_slotted() -> None:
    o = L3Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.model = "other"  # type: ignore[misc]
    assert not hasattr(o, "__dict__") and "hint_size" in L3Options.__slots__


def test_write_policies_are_the_three_documented_ones_and_each_is_accepted() -> None:
    assert WRITE_POLICIES == ("host_write", "selective", "host_eviction")
    for p in WRITE_POLICIES:
        L3Options(write_policy=p).check()


_POSITIVE = ("write_threshold", "prefetch_units", "min_prefetch_units", "max_put_units", "hint_size", "world_size")
_NON_NEGATIVE = ("tp_rank", "eviction_lookahead")


def _refused(message: str, **kw: object) -> None:
    with pytest.raises(ConfigError) as exc:
        L3Options(**kw).check()  # type: ignore[arg-type]
    assert str(exc.value) == message


def test_check_refuses_an_unknown_write_policy_with_the_exact_message() -> None:
    _refused("L3 write_policy must be one of ('host_write', 'selective', 'host_eviction'), got 'always'",
             write_policy="always")


@pytest.mark.parametrize("name", _POSITIVE)
def test_check_takes_1_and_refuses_0_bools_and_non_ints_for_count_options(name: str) -> None:
    L3Options(**{name: 1}).check()  # type: ignore[arg-type]
    for bad in (0, -3, True, "2", 2.0):
        _refused(f"L3 {name} must be an int >= 1, got {bad!r}", **{name: bad})


@pytest.mark.parametrize("name", _NON_NEGATIVE)
def test_check_takes_0_and_refuses_negatives_bools_and_non_ints(name: str) -> None:
    kw: dict[str, object] = {"world_size": 2}
    L3Options(**{**kw, name: 0}).check()  # type: ignore[arg-type]
    L3Options(**{**kw, name: 1}).check()  # type: ignore[arg-type]
    for bad in (-1, False, "0", 0.0):
        _refused(f"L3 {name} must be an int >= 0, got {bad!r}", **{**kw, name: bad})


def test_check_refuses_a_rank_not_below_the_world_size() -> None:
    L3Options(tp_rank=1, world_size=2).check()
    _refused("L3 tp_rank 2 is not below world_size 2", tp_rank=2, world_size=2)
    _refused("L3 tp_rank 3 is not below world_size 2", tp_rank=3, world_size=2)


def test_check_takes_seconds_and_refuses_a_zero_deadline_but_not_a_zero_lease() -> None:
    for ok in ({"deadline_s": 0.5}, {"deadline_s": 1}, {"lease_s": 0}, {"lease_s": 0.0}, {"lease_s": 0.5},
               {"lease_s": 3}):
        L3Options(**ok).check()  # type: ignore[arg-type]
    for name, bad in (("deadline_s", 0), ("deadline_s", 0.0), ("deadline_s", -1.0), ("deadline_s", True),
                      ("deadline_s", "2"), ("lease_s", -0.5), ("lease_s", False), ("lease_s", "0"),
                      ("lease_s", None)):
        _refused(f"L3 {name} must be a number of seconds (> 0 for deadline_s), got {bad!r}", **{name: bad})


# ------------------------------------------------------------------ records
def test_l3_stats_start_at_zero_with_an_empty_error_table_of_their_own() -> None:
    a, b = L3Stats(), L3Stats()
    d = dataclasses.asdict(a)
    assert d.pop("errors") == {} and type(a.errors) is dict and a.errors is not b.errors
    assert d and all(v == 0 for v in d.values())
    assert type(a.seconds) is float and type(a.get_seconds) is float


def test_a_new_l3_object_is_unknown_with_no_copy_answer_lease_or_operation() -> None:
    key = "0123456789abcdef0123"
    o = L3Object(key)
    assert o.key == key and o.state == load_spec().l3.initial == "unknown"
    assert (o.host_visible, o.store_answered, o.lease_holds, o.lease_until, o.op_id) == (False, False, False, 0.0, None)
    assert o.label == "0123456789ab"
    assert not hasattr(o, "__dict__")


def test_a_new_prefetch_has_fetched_nothing_and_is_not_done() -> None:
    p = Prefetch("r", ("a", "b"), 1, ["k"], 7)
    assert (p.owner, p.units, p.start, p.keys, p.op_id, p.fetched, p.done) == ("r", ("a", "b"), 1, ["k"], 7, 0, False)


# ------------------------------------------------------------------ keys
def test_the_key_seed_is_stable() -> None:
    """namespace: a 16-byte blake2b of the version tag, the model, dtype, rank, size and the
    layout's geometry. Keys are shared through the store between instances and releases, so
    the value is pinned (a change of the key format must change the version tag)."""
    lay = h1()
    parts = ["kvtier-l3/1", "m", "bf16", 0, 2, "h1", 2,
             ("kv", "history", 2, (0, 1), (("kv", 16),))]
    want = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    assert [g.family.value for g in lay.groups] == ["history"] and lay.num_layers == 2
    assert namespace(lay, "m", "bf16", 0, 2) == want and len(want) == 16


def test_chain_keys_hash_each_unit_after_the_previous_digest_from_the_seed() -> None:
    seed = b"s" * 16
    d0 = hashlib.blake2b(seed + repr("a").encode(), digest_size=16).digest()
    d1 = hashlib.blake2b(d0 + repr(7).encode(), digest_size=16).digest()
    assert chain_keys(seed, ["a", 7]) == [d0, d1]
    assert chain_keys(seed, ["a", 7], 1, d0) == [d1]
    assert chain_keys(seed, ["a", 7], 2, d1) == [] and chain_keys(seed, []) == []


# ------------------------------------------------------------------ l3checks.py
def _put_in_flight() -> tuple[L3Tier, object]:
    """An h1 core holding units abcd on the host (backed) with an L3 put of them in flight."""
    core = CacheCore(h1(), 16, 16)
    ack(core, core.writeback(put(core, tuple("abcd")).node))
    tier = L3Tier(core, L3Options(deadline_s=1.0))
    assert tier.offer(tuple("abcd"), 0.0) == 4
    (cmd,) = tier.poll_commands()
    op = tier.operations[cmd.op_id]
    assert [o.state for o in op.objects] == ["putting"] * 4 and op.receipt is not None
    tier.check_invariants()
    return tier, op


def _get_in_flight() -> tuple[L3Tier, object]:
    """A second instance whose prefetch of abcd (stored by the first) has its get in flight."""
    tier, op = _put_in_flight()
    tier.complete(StoreResult(op.op_id, ok=(True,) * 4), 0.0)
    core = CacheCore(h1(), 16, 16)
    other = L3Tier(core, L3Options(deadline_s=1.0))
    assert other.prefetch("r", tuple("abcd"), 0.0)
    (exists,) = other.poll_commands()
    other.complete(StoreResult(exists.op_id, present=4), 0.0)
    (get,) = other.poll_commands()
    gop = other.operations[get.op_id]
    assert [o.state for o in gop.objects] == ["getting"] * 4 and get.op_id in core.fetches
    other.check_invariants()
    return other, gop


def _violation(tier: L3Tier) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as exc:
        tier.check_invariants()
    return exc.value


def test_an_object_of_a_put_in_the_wrong_state_or_op_is_named() -> None:
    tier, op = _put_in_flight()
    o = op.objects[2]
    o.state = "leased"
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_ends_by_deadline", f"object {o.key[:12]} (leased)")
    assert str(e) == (f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (leased): "
                      f"in put op {op.op_id} but leased")
    o.state = "putting"
    o.op_id = op.op_id + 50  # the right state, another operation
    assert str(_violation(tier)) == (f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (putting): "
                                     f"in put op {op.op_id} but putting")


def test_a_put_that_does_not_pin_its_source_is_named_by_its_first_object() -> None:
    tier, op = _put_in_flight()
    first = op.objects[0]
    want = (f"invariant 'l3_put_source_pinned' violated by object {first.key[:12]} (putting): "
            f"put {op.op_id} does not pin the host copies it reads")
    (node,) = op.receipt.nodes
    node.host_pin = 0  # unpinned, still host-visible
    assert str(_violation(tier)) == want
    node.host_pin = 1
    state, node.state = node.state, "device"  # pinned, but no visible host copy
    assert str(_violation(tier)) == want
    node.state = state
    tier.check_invariants()
    op.receipt = None
    assert str(_violation(tier)) == want
    objects = list(op.objects)
    op.objects.clear()  # a put of nothing: the subject is the tier
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_put_source_pinned", "the L3 tier")
    assert str(e) == f"invariant 'l3_put_source_pinned' violated by the L3 tier: put {op.op_id} does not pin the host copies it reads"
    op.objects.extend(objects)


def test_a_get_without_fetching_nodes_or_the_stores_answer_is_named() -> None:
    tier, op = _get_in_flight()
    first = op.objects[0]
    op.objects[3].store_answered = False
    assert str(_violation(tier)) == (f"invariant 'l3_visible_by_answer' violated by object {first.key[:12]} "
                                     "(getting): fetched without the store's answer")
    op.objects[3].store_answered = True
    tier.check_invariants()
    tier.core.fetches.settle(op.op_id, 0)  # the core's get ended behind the tier's back
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_get_invisible", f"object {first.key[:12]} (getting)")
    assert str(e) == (f"invariant 'l3_get_invisible' violated by object {first.key[:12]} (getting): "
                      f"get {op.op_id} owns no fetching nodes")


def test_an_object_in_flight_without_its_operation_is_named() -> None:
    tier, op = _put_in_flight()
    o = op.objects.pop(1)  # no longer listed by its put
    tier.check_invariants()  # still listed by the put's op id
    o.op_id = op.op_id + 50
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_ends_by_deadline", f"object {o.key[:12]} (putting)")
    assert str(e) == f"invariant 'l3_ends_by_deadline' violated by object {o.key[:12]} (putting): no operation in flight"


def test_fetching_nodes_of_a_get_the_tier_did_not_issue_are_named() -> None:
    tier, op = _put_in_flight()
    assert tier.core.fetches.reserve(tier.core.root, ["q"], 77)  # a get the tier never issued
    e = _violation(tier)
    assert (e.invariant, e.subject) == ("l3_get_invisible", "the L3 tier")
    assert str(e) == "invariant 'l3_get_invisible' violated by the L3 tier: fetching nodes of get 77, which is not in flight"
