"""Host reservations for L3 gets (kvtier.fsm.node.fetch, ``core.fetches``): every refusal with its
exact message and nothing changed, the room a get reserves and reclaims, settle's bounds, the
exact counters and the fields of acknowledged and failed nodes, and the ``l3_get_invisible``
checks."""

from __future__ import annotations

import pytest
from core_helpers import ack, h1, put, says, violation

from kvtier.fsm import CacheCore, KvtierError, UsageError
from kvtier.fsm.errors import InvariantViolation


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
    assert violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 3 (fetching): "
                             "in get 5 but not fetching for it")
    nodes[1].fetch_op = 5
    listed = c.fetches._ops[5]  # corrupt the table itself: its get no longer lists the last node
    last = listed.pop()
    assert violation(c) == ("l3_get_invisible", "invariant 'l3_get_invisible' violated by node 4 (fetching): "
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
    says(lambda: c.fetches.reserve(c.root, ["x"], 900), "fetch_reserve: op 900 is already in flight")
    says(lambda: c.fetches.reserve(c.root, [], 901), "fetch_reserve: no unit keys")
    says(lambda: c.fetches.reserve(dev, ["x"], 901),
          f"fetch_reserve: node {dev.node_id} is device; a fetched chain continues the root or a node with a "
          "visible host copy")
    says(lambda: c.fetches.reserve(stranger, ["x"], 901),
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
        says(lambda: c.fetches.settle(7, bad), f"fetch_settle: acked must be an int in 0..3, got {bad!r}")
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
