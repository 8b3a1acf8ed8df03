"""The L3 tier's options, counters, records and keys (kvtier.fsm.l3.options): the documented
defaults of :class:`L3Options`, every refusal of ``L3Options.check`` with its exact message
and its boundaries, the fresh counters of :class:`L3Stats`, a new :class:`L3Object` and
:class:`Prefetch`, and the key format (``namespace``, ``chain_keys``: keys are shared through
the store between instances and releases, so they must not drift)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest
from core_helpers import h1, h2

from kvtier.fsm import CacheCore, ConfigError
from kvtier.fsm.l3 import L3Object, L3Options, L3Stats, L3Tier, chain_keys, namespace
from kvtier.fsm.l3.options import WRITE_POLICIES, Prefetch
from kvtier.fsm.lifecycle.spec import load_spec


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
        ({"deadline_s": 0}, "L3 deadline_s must be a finite number of seconds (> 0 for deadline_s), got 0"),
        ({"deadline_s": -1.0}, "L3 deadline_s must be a finite number of seconds (> 0 for deadline_s), got -1.0"),
        ({"deadline_s": True}, "L3 deadline_s must be a finite number of seconds (> 0 for deadline_s), got True"),
        ({"lease_s": -0.5}, "L3 lease_s must be a finite number of seconds (> 0 for deadline_s), got -0.5"),
        ({"lease_s": "1"}, "L3 lease_s must be a finite number of seconds (> 0 for deadline_s), got '1'"),
        ({"deadline_s": 10**400}, f"L3 deadline_s must be a finite number of seconds (> 0 for deadline_s), got {10**400}"),
        ({"lease_s": 10**400}, f"L3 lease_s must be a finite number of seconds (> 0 for deadline_s), got {10**400}"),
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
        "op_errors": 0, "expired_ops": 0, "cancelled_prefetches": 0, "absorbed_late_results": 0, "prefetches": 0, "bytes_in": 0,
        "bytes_out": 0, "seconds": 0.0, "get_seconds": 0.0, "errors": {}}
    assert st.errors is not L3Stats().errors


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
        _refused(f"L3 {name} must be a finite number of seconds (> 0 for deadline_s), got {bad!r}", **{name: bad})


NON_FINITE = [("deadline_s", math.nan), ("deadline_s", math.inf), ("deadline_s", -math.inf),
              ("lease_s", math.nan), ("lease_s", math.inf), ("lease_s", -math.inf)]


@pytest.mark.parametrize(("name", "bad"), NON_FINITE, ids=[f"{n}={v!r}" for n, v in NON_FINITE])
def test_check_refuses_a_deadline_or_lease_that_is_not_finite(name: str, bad: float) -> None:
    """NaN compares false with everything, so ``deadline_s=nan`` passed the old bounds and
    stamped operations that never expire (``inf`` too); a lease of NaN or inf never ends.
    Both are refused by name, by ``check`` and so by the tier's constructor."""
    _refused(f"L3 {name} must be a finite number of seconds (> 0 for deadline_s), got {bad!r}", **{name: bad})
    with pytest.raises(ConfigError) as exc:
        L3Tier(CacheCore(h1(), 16, 16), L3Options(**{name: bad}))  # type: ignore[arg-type]
    assert type(exc.value) is ConfigError and repr(bad) in str(exc.value) and name in str(exc.value)

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
