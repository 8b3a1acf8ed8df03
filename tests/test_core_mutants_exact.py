"""Exact values of the node core (fsm/core.py and its parts) that the mutation run
(bench/mutation, issue 12) found unchecked: defaults of the constructor and read-only views."""

from __future__ import annotations

from core_helpers import h1, h2, put

from kvtier.fsm import CacheCore


def test_the_host_tier_is_inclusive_unless_asked() -> None:
    assert CacheCore(h1(), 4, 8).exclusive is False
    assert CacheCore(h1(), 4, 8, exclusive=True).exclusive is True
    assert CacheCore(h1(), 4, None, exclusive=True).exclusive is False  # no host tier: nothing to be exclusive of


def test_alignment_is_the_layouts_in_tokens() -> None:
    assert CacheCore(h1(), 4).alignment == 2
    assert CacheCore(h2(), 4).alignment == 4


def test_keys_equal_but_not_identical_match_inside_a_node() -> None:
    """The radix walk compares units by equality, not only identity: token ids built apart
    (ints above CPython's small-int cache) still match inside a node, where the walk
    compares unit by unit (the query ends inside the node)."""
    c = CacheCore(h1(), 8)
    stored = [int(s) for s in ("1000", "1001", "1002", "1003")]
    put(c, stored)
    query = [int(s) for s in ("1000", "1001", "1002")]
    assert all(a is not b for a, b in zip(stored, query))
    assert c.match(query).device_units == 3


def test_receipts_count_locks_and_node_receipts() -> None:
    """``len(core.receipts)`` (the rank digest's count) is locks plus pins and borrows."""
    c = CacheCore(h1(), 8)
    res = put(c, list("abc"))
    node = res.node if hasattr(res, "node") else c.match(list("abc")).device_node
    assert len(c.receipts) == 0
    c.receipts.lock(node, "r", 1)
    c.receipts.take("pin", [node], "r")
    assert (len(c.receipts.locks()), len(c.receipts.node_receipts())) == (1, 1)
    assert len(c.receipts) == 2


def test_eviction_policies_by_name_and_their_defaults() -> None:
    import pytest

    from kvtier.fsm.errors import ConfigError
    from kvtier.fsm.eviction import HeapIndex, lru_key, make_policy

    c = CacheCore(h1(), 4, 8, eviction="lru2")
    assert c.eviction.name == "lru2"
    p = make_policy("lru", c.tree.__iter__, c.tree.__len__, c.tree.has)
    assert p.name == "lru" and p.dev_key is lru_key and p.host_key is lru_key  # not exclusive unless asked
    h = HeapIndex("lru", c.tree.__iter__, c.tree.__len__, c.tree.has)
    assert h.host_key is h.dev_key
    assert make_policy("lru", c.tree.__iter__, c.tree.__len__, c.tree.has, exclusive=True).host_key is not lru_key
    with pytest.raises(ConfigError) as exc:
        make_policy("fifo", c.tree.__iter__, c.tree.__len__, c.tree.has)
    assert str(exc.value) == "eviction policy must be one of ['lru', 'lru2', 'lru_turns'], got 'fifo'"


def test_lru2_breaks_ties_deepest_first_like_lru() -> None:
    from kvtier.fsm.eviction import lru2_key

    c = CacheCore(h1(), 8)
    put(c, list("ab"))
    put(c, list("abcd"))
    short, deep = c.match(list("ab")).device_node, c.match(list("abcd")).device_node
    assert deep.depth > short.depth
    for n in (short, deep):
        n.prev_use, n.last_access = 3, 7
    assert lru2_key(deep) < lru2_key(short)
    assert lru2_key(deep) == (3, 7, -deep.depth, deep.node_id)
