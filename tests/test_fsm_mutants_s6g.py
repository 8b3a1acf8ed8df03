"""Exact values of fsm/ that the mutation run (bench/mutation, issue 12) left unchecked in
``spec.py``, ``checks.py``, ``fetch.py``, ``l3options.py``, ``l3checks.py`` and ``errors.py``,
session 6 (helper G): the defaults of the public spec records (``LifecycleSpec.calls`` is an
empty dict, ``Specification.l3`` is None and adds no lifecycle), and the exact text of the
spec's refusals; the argument checks of ``checks.py`` with their exact messages and
bounds, numpy integers and booleans turned into plain values, and the first unhashable
unit named; the L3 gets' host reservations of ``fetch.py`` (``core.fetches``): every
refusal with its exact message and nothing changed, the room a get reserves and reclaims,
settle's bounds, the exact counters and the fields of acknowledged and failed nodes, and
the ``l3_get_invisible`` checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.fsm import CacheCore, ConfigError, UsageError
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.checks import as_bool, as_int, as_keys, as_text, check_hashable, plain_bool, plain_int
from kvtier.fsm.spec import LifecycleSpec, Specification, load_spec, parse_spec
from core_helpers import ack, h1, put
from test_spec import MINIMAL


# ------------------------------------------------------------------ spec.py
def test_a_lifecycle_built_without_calls_accepts_no_call() -> None:
    """spec.py:84: ``LifecycleSpec.calls`` defaults to an empty dict (``[<lifecycle>.calls]``
    may be absent), a fresh one per record."""
    node = load_spec().node
    a = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    b = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    assert a.calls == {} and type(a.calls) is dict
    assert a.calls is not b.calls


def test_a_specification_built_without_l3_has_two_lifecycles() -> None:
    """spec.py:138: ``Specification.l3`` defaults to None (a spec without ``[l3]``), and
    ``lifecycles`` then holds only the node and request lifecycles."""
    full = load_spec()
    spec = Specification(full.version, full.node, full.request, full.invariants)
    assert spec.l3 is None
    assert spec.lifecycles == (full.node, full.request)
    assert full.l3 is not None and full.lifecycles == (full.node, full.request, full.l3)


def test_a_call_naming_an_undeclared_state_is_refused_with_the_exact_message() -> None:
    """spec.py:180: the whole message, naming the lifecycle, the call and the state."""
    text = MINIMAL.replace('[request.guards.ok]\ndoc = "G"\n',
                           '[request.guards.ok]\ndoc = "G"\n\n[request.calls]\nreserve = ["a", "zz"]\n')
    with pytest.raises(ConfigError) as exc:
        parse_spec(text)
    assert str(exc.value) == "spec [request]: call 'reserve' lists undeclared state 'zz'"


# ------------------------------------------------------------------ checks.py
def _says(call: object, message: str, error: type[Exception] = UsageError) -> None:
    with pytest.raises(error) as exc:
        call()  # type: ignore[operator]
    assert type(exc.value) is error and str(exc.value) == message


def test_as_int_takes_zero_by_default_and_names_value_and_bounds() -> None:
    assert as_int(0, "x") == 0 and as_int(7, "x") == 7
    _says(lambda: as_int(-1, "x"), "x must be an int >= 0, got -1")
    _says(lambda: as_int(True, "x"), "x must be an int >= 0, got True")
    _says(lambda: as_int("3", "x"), "x must be an int >= 0, got '3'")
    _says(lambda: as_int(2.0, "x", error=ConfigError), "x must be an int >= 0, got 2.0", ConfigError)


def test_as_int_bounds_are_inclusive_and_each_may_be_absent() -> None:
    assert as_int(1, "x", minimum=1) == 1 and as_int(4, "x", maximum=4) == 4
    assert as_int(1, "x", minimum=1, maximum=1) == 1
    assert as_int(-5, "x", minimum=None) == -5 and as_int(-5, "x", minimum=None, maximum=4) == -5
    _says(lambda: as_int(0, "x", minimum=1), "x must be an int >= 1, got 0")
    _says(lambda: as_int(5, "x", minimum=0, maximum=4), "x must be an int in 0..4, got 5")
    _says(lambda: as_int(-1, "x", minimum=0, maximum=4), "x must be an int in 0..4, got -1")
    _says(lambda: as_int(5, "x", minimum=None, maximum=4), "x must be an int <= 4, got 5")
    _says(lambda: as_int("a", "x", minimum=None), "x must be an int, got 'a'")


def test_as_int_and_plain_int_return_plain_ints_for_numpy_integers() -> None:
    v = as_int(np.int64(3), "x")
    assert v == 3 and type(v) is int
    p = plain_int(np.int32(5))
    assert p == 5 and type(p) is int
    assert plain_int(9) == 9 and type(plain_int(9)) is int
    assert plain_int(True) is None and plain_int(False) is None
    assert plain_int(2.0) is None and plain_int("2") is None


def test_plain_bool_takes_bools_and_numpy_booleans_only() -> None:
    assert plain_bool(True) is True and plain_bool(False) is False
    t, f = plain_bool(np.True_), plain_bool(np.False_)
    assert t is True and f is False
    old = type("bool_", (), {"__module__": "numpy", "__bool__": lambda self: True})  # numpy 1.x's name
    assert plain_bool(old()) is True
    other = type("bool", (), {"__module__": "elsewhere", "__bool__": lambda self: True})  # not numpy's
    assert plain_bool(other()) is None
    assert plain_bool(1) is None and plain_bool(0) is None and plain_bool(None) is None


def test_as_bool_returns_the_bool_and_refuses_anything_else_naming_it() -> None:
    assert as_bool(True, "flag") is True and as_bool(False, "flag") is False
    assert as_bool(np.True_, "flag") is True
    _says(lambda: as_bool(1, "flag"), "flag must be True or False, got 1")
    _says(lambda: as_bool(None, "flag", error=ConfigError), "flag must be True or False, got None", ConfigError)


def test_as_text_takes_non_empty_str_only() -> None:
    assert as_text("a", "name") == "a"
    _says(lambda: as_text("", "name"), "name must be a non-empty str, got ''")
    _says(lambda: as_text(5, "name"), "name must be a non-empty str, got 5")
    _says(lambda: as_text(b"a", "name", error=ConfigError), "name must be a non-empty str, got b'a'", ConfigError)


def test_as_keys_takes_lists_and_tuples_of_hashables_and_names_the_first_bad_unit() -> None:
    keys = ["a", 1]
    assert as_keys(keys, "k") is keys and as_keys((), "k") == ()
    _says(lambda: as_keys("ab", "k"), "k must be a list or tuple of unit keys, got 'ab'")
    _says(lambda: as_keys(b"ab", "k"), "k must be a list or tuple of unit keys, got b'ab'")
    _says(lambda: as_keys({1, 2}, "k"), "k must be a list or tuple of unit keys, got {1, 2}")  # type: ignore[arg-type]
    _says(lambda: as_keys(["a", [1], {2}], "k"), "k: unit keys must be hashable, got [1]")
    _says(lambda: check_hashable((1, {"a": 1}), "c", error=ConfigError), "c: unit keys must be hashable, got {'a': 1}",
          ConfigError)
    check_hashable([1, ("a", 2)], "c")


# ------------------------------------------------------------------ fetch.py
def _host_state(c: CacheCore) -> tuple:
    return (len(c.fetches), c.fetches.items(), c.host["kv"].free, len(list(c.tree)), c.stats.fetches)


def test_fetch_reserve_refusals_name_the_problem_and_change_nothing() -> None:
    with pytest.raises(UsageError) as exc:
        CacheCore(h1(), 8).fetches.reserve(CacheCore(h1(), 8).root, ["a"], 1)
    assert str(exc.value) == "fetch_reserve: the cache has no host tier"
    c = CacheCore(h1(), 8, 4)
    made = c.fetches.reserve(c.root, ["a", "b"], 900)
    dev = put(c, ["d1", "d2"]).node
    stranger = put(CacheCore(h1(), 8, 4), ["z"]).node
    before = _host_state(c)
    _says(lambda: c.fetches.reserve(c.root, ["x"], 900), "fetch_reserve: op 900 is already in flight")
    _says(lambda: c.fetches.reserve(c.root, [], 901), "fetch_reserve: no unit keys")
    _says(lambda: c.fetches.reserve(dev, ["x"], 901),
          f"fetch_reserve: node {dev.node_id} is device; a fetched chain continues the root or a node with a "
          "visible host copy")
    _says(lambda: c.fetches.reserve(stranger, ["x"], 901),
          f"fetch_reserve: {stranger!r} is not a node of this cache's tree", UsageError)
    assert _host_state(c) == before and c.fetches.nodes(900) == tuple(made)
    c.check_invariants()


def test_fetch_reserve_continues_a_host_copy_and_returns_nothing_for_a_present_first_unit() -> None:
    c = CacheCore(h1(), 8, 8)
    first = c.fetches.reserve(c.root, ["a"], 1)
    assert [n.key for n in c.fetches.settle(1, 1)] == [("a",)] and first[0].state == "host"
    below = c.fetches.reserve(first[0], ["b", "c"], 2)  # continues a host copy
    assert [(n.key, n.parent) for n in below] == [(("b",), first[0]), (("c",), below[0])]
    before = _host_state(c)
    assert c.fetches.reserve(c.root, ["a"], 3) == [] and c.fetches.reserve(c.root, ["a", "q"], 4) == []
    assert c.fetches.reserve(first[0], ["b"], 5) == []
    assert _host_state(c) == before and 3 not in c.fetches and 4 not in c.fetches and 2 in c.fetches
    c.check_invariants()


def test_fetch_reserve_reclaims_exactly_the_host_pages_it_needs() -> None:
    """A full host tier: a 3-unit get reclaims 3 units' pages from a 4-unit host leaf (split),
    and reserves one page per unit; a tier with less room reserves fewer units."""
    c = CacheCore(h1(), 8, 4)
    leaf = put(c, ["a", "b", "c", "d"]).node
    ack(c, c.writeback(leaf))
    c.evict_device({"kv": 8})
    assert leaf.state == "host" and c.host["kv"].free == 0
    made = c.fetches.reserve(c.root, ["x", "y", "z"], 5)
    assert [n.key for n in made] == [("x",), ("y",), ("z",)] and c.host["kv"].free == 0
    assert [len(n.pending["kv"]) for n in made] == [1, 1, 1] and c.stats.host_evictions == 1
    assert [n.state for n in c.tree if n.state == "host"] == ["host"]  # one unit of the old leaf is left
    small = CacheCore(h1(), 8, 2)
    assert [n.key for n in small.fetches.reserve(small.root, ["x", "y", "z"], 1)] == [("x",), ("y",)]
    assert small.fetches.reserve(small.root, ["q"], 2) == [] and small.stats.fetches == 1
    c.check_invariants()
    small.check_invariants()


def test_fetch_settle_bounds_and_exact_counters() -> None:
    c = CacheCore(h1(), 8, 8)
    made = c.fetches.reserve(c.root, ["a", "b", "c"], 7)
    before = (_host_state(c), [(n.state, n.pending, n.fetch_op) for n in made])
    for bad in (4, -1, True, "1", 1.0):
        _says(lambda: c.fetches.settle(7, bad), f"fetch_settle: acked must be an int in 0..3, got {bad!r}")
    with pytest.raises(KeyError):
        c.fetches.settle(8, 0)
    assert (_host_state(c), [(n.state, n.pending, n.fetch_op) for n in made]) == before
    pages = [n.pending for n in made]
    t0 = c.tick()
    got = c.fetches.settle(7, 1)
    assert got == made[:1] and 7 not in c.fetches and len(c.fetches) == 0
    a = made[0]
    assert (a.state, a.host, a.pending, a.fetch_op, a.last_access) == ("host", pages[0], {}, None, t0 + 1)
    for n in made[1:]:
        assert (n.state, n.pending, n.fetch_op) == ("removed", {}, None)
    assert (c.stats.fetches, c.stats.fetched_units, c.stats.fetch_failed_units) == (1, 1, 2)
    assert c.host["kv"].free == 7
    c.check_invariants()
    more = c.fetches.reserve(a, ["b", "c"], 9)
    t1 = c.tick()
    assert c.fetches.settle(9, 2) == more and [n.last_access for n in more] == [t1 + 1, t1 + 1]
    assert (c.stats.fetches, c.stats.fetched_units, c.stats.fetch_failed_units) == (2, 3, 2)
    assert c.fetches.reserve(c.root, ["e"], 10) and c.fetches.settle(10, 0) == []
    assert (c.stats.fetches, c.stats.fetched_units, c.stats.fetch_failed_units) == (3, 3, 3)
    c.check_invariants()


def test_fetch_check_names_a_listed_node_that_is_not_fetching_for_its_get() -> None:
    c = CacheCore(h1(), 8, 8)
    n = c.fetches.reserve(c.root, ["a", "b"], 3)[1]
    c.fetches.check()
    n.fetch_op = 4  # corrupt: fetching for another get
    with pytest.raises(InvariantViolation) as exc:
        c.fetches.check()
    assert (exc.value.invariant, exc.value.subject) == ("l3_get_invisible", f"node {n.node_id} (fetching)")
    assert str(exc.value) == (f"invariant 'l3_get_invisible' violated by node {n.node_id} (fetching): "
                              "in get 3 but not fetching for it")
    n.fetch_op = 3
    n.state = "host"  # corrupt: listed but no longer fetching
    with pytest.raises(InvariantViolation) as exc:
        c.fetches.check()
    assert str(exc.value) == (f"invariant 'l3_get_invisible' violated by node {n.node_id} (host): "
                              "in get 3 but not fetching for it")


def test_fetch_check_names_a_fetching_node_no_get_lists() -> None:
    c = CacheCore(h1(), 8, 8)
    listed = c.fetches.reserve(c.root, ["a"], 3)[0]
    stray = put(c, ["b"]).node
    c.fetches.check()
    stray.state = "fetching"  # corrupt: fetching, in no get
    with pytest.raises(InvariantViolation) as exc:
        c.fetches.check()
    assert (exc.value.invariant, exc.value.subject) == ("l3_get_invisible", f"node {stray.node_id} (fetching)")
    assert str(exc.value) == (f"invariant 'l3_get_invisible' violated by node {stray.node_id} (fetching): "
                              "fetching but no get in flight lists it")
    assert listed.state == "fetching"
