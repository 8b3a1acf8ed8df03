"""Cache policies (kvtier.fsm.node.eviction): reuse counting, exact eviction, the exclusive host
tier, eviction policies by name with their defaults, their determinism and their
tie-breaks."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, keys, put

from kvtier.fsm import CacheCore, ConfigError, MatchMode
from kvtier.fsm.node.eviction import POLICIES


# ------------------------------------------------------------------ reuse counting
def test_a_request_relocking_its_path_counts_one_reuse() -> None:
    c = CacheCore(h1(), 16, 16)
    node = put(c, keys("a", 4)).node
    for _ in range(3):  # one request locks again after each prefill chunk
        c.unlock(c.lock(node, "r1"))
    assert node.hit_count == 1
    c.unlock(c.lock(node, "r2"))
    assert node.hit_count == 2
    c.unlock(c.lock(node, "r2"))
    assert node.hit_count == 2
    c.unlock(c.lock(node, "r1"))  # another request than the last one
    assert node.hit_count == 3
    c.check_invariants()


def test_anonymous_locks_count_every_time() -> None:
    c = CacheCore(h1(), 16, 16)
    node = put(c, keys("a", 2)).node
    for i in range(3):
        c.unlock(c.lock(node))
        assert node.hit_count == i + 1


def test_selective_writeback_follows_distinct_requests_not_chunks() -> None:
    c = CacheCore(h1(), 16, 16, policy="write_through_selective", write_threshold=2)
    node = put(c, keys("a", 4)).node
    for _ in range(4):
        c.unlock(c.lock(node, "r1"))
    assert c.queued_writebacks() == []
    c.unlock(c.lock(node, "r2"))
    assert c.queued_writebacks() == [node.node_id]


def test_prev_use_is_set_only_from_the_second_distinct_use() -> None:
    c = CacheCore(h1(), 16, 16)
    node = put(c, keys("a", 2)).node
    c.unlock(c.lock(node, "r1"))
    assert node.prev_use == 0
    stamp = node.last_access
    c.unlock(c.lock(node, "r2"))
    assert node.prev_use == stamp


# ------------------------------------------------------------------ exact eviction
def test_device_eviction_splits_a_leaf_to_free_what_is_asked() -> None:
    c = CacheCore(h1(), 8)  # 8 units of one page each, device only
    res = put(c, keys("a", 8))
    assert free(c) == {"kv": 0}
    freed = c.evict_device({"kv": 3})
    assert freed == {"kv": 3}
    assert free(c) == {"kv": 3}
    (left,) = c.nodes()
    assert left.key == keys("a", 5) and left.state == "device"
    assert c.stats.device_evictions == 1 and c.stats.splits == 1
    assert res.node.state == "removed"  # the tail fragment kept the original node
    c.check_invariants()


def test_demotion_is_exact_too() -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through")
    res = put(c, keys("a", 6))
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    assert res.node.state == "backed"
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    states = sorted((len(n.key), n.state) for n in c.nodes())
    assert states == [(2, "host"), (4, "backed")]
    m = c.match(keys("a", 6))
    assert (m.device_units, m.host_units) == (4, 6)
    c.check_invariants()


def test_host_eviction_is_exact() -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through")
    put(c, keys("a", 6))
    (cmd,) = c.issue_writebacks()
    ack(c, cmd)
    c.evict_device({"kv": 6})  # all of it demoted: 6 host-only units
    assert free(c, "host") == {"kv": 2}
    assert c.evict_host({"kv": 1}) == {"kv": 1}
    assert sorted((len(n.key), n.state) for n in c.nodes()) == [(5, "host")]
    assert free(c, "host") == {"kv": 3}
    c.check_invariants()


def test_an_eviction_that_needs_a_whole_leaf_does_not_split() -> None:
    c = CacheCore(h1(), 8)
    put(c, keys("a", 3))
    assert c.evict_device({"kv": 3}) == {"kv": 3}
    assert c.nodes() == [] and c.stats.splits == 0


# ------------------------------------------------------------------ exclusive host tier
def _loaded_back(exclusive: bool) -> tuple[CacheCore, object, object]:
    """A host-only node 'old' (older) and a node 'hot' loaded back to the device."""
    c = CacheCore(h1(), 4, 4, policy="write_through", exclusive=exclusive)
    old = put(c, keys("o", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    hot = put(c, keys("h", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    c.evict_device({"kv": 4})  # both demoted: the host holds 4 pages, full
    m = c.match(keys("h", 2))
    load = c.load(m, "r1")
    assert load.command is not None
    ack(c, load.command)
    c.release(load.pin)
    c.unlock(load.lock)
    assert hot.state == "backed" and hot.reloaded and old.state == "host"
    return c, old, hot


def test_exclusive_host_drops_a_reloaded_duplicate_before_a_host_only_node() -> None:
    c, old, hot = _loaded_back(exclusive=True)
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    assert hot.state == "device" and old.state == "host"
    assert c.stats.host_drops == 1 and c.stats.host_evictions == 0
    c.check_invariants()


def test_exclusive_host_drops_both_fragments_of_a_split_reloaded_duplicate() -> None:
    c, old, hot = _loaded_back(exclusive=True)
    c.match(keys("h", 1))  # splits the reloaded node
    head = hot.parent
    assert c.stats.splits == 1 and head.reloaded and hot.reloaded
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    assert (head.state, hot.state, old.state) == ("device", "device", "host")
    assert c.stats.host_drops == 2 and c.stats.host_evictions == 0
    c.check_invariants()


def test_inclusive_host_evicts_in_lru_order() -> None:
    c, old, hot = _loaded_back(exclusive=False)
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    assert old.state == "removed" and hot.state == "backed"
    c.check_invariants()


def test_write_back_queues_only_what_the_demand_needs() -> None:
    c = CacheCore(h1(), 8, 16, policy="write_back")
    for p in "abcd":
        put(c, keys(p, 2))
    c.evict_device({"kv": 2})  # one leaf's pages are enough
    assert len(c.queued_writebacks()) == 1
    c.check_invariants()


def test_exclusive_is_ignored_without_a_host_tier() -> None:
    assert CacheCore(h1(), 4, None, exclusive=True).exclusive is False


def test_exclusive_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="exclusive must be True or False, got 'yes'"):
        CacheCore(h1(), 4, 4, exclusive="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------ policies by name
def test_unknown_eviction_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"eviction policy must be one of \['lru', 'lru2', 'lru_turns'\], got 'mru'"):
        CacheCore(h1(), 4, eviction="mru")


def _host_pair(policy: str) -> tuple[object, object]:
    """Two host-only nodes: 'shared' (two requests used it, older) and 'once' (one, newer)."""
    c = CacheCore(h1(), 4, 4, policy="write_through", eviction=policy)
    shared = put(c, keys("s", 2)).node
    c.unlock(c.lock(shared, "r1"))
    c.unlock(c.lock(shared, "r2"))
    once = put(c, keys("o", 2)).node
    c.unlock(c.lock(once, "r3"))
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    c.evict_device({"kv": 4})
    assert shared.state == once.state == "host"
    c.evict_host({"kv": 2})
    return shared, once


def test_lru2_host_keeps_what_two_requests_used_over_a_newer_one_off() -> None:
    shared, once = _host_pair("lru2")
    assert once.state == "removed" and shared.state == "host"


def test_lru_host_evicts_the_older_node() -> None:
    shared, once = _host_pair("lru")
    assert shared.state == "removed" and once.state == "host"


def test_lru2_device_side_is_lru() -> None:
    c = CacheCore(h1(), 4, eviction="lru2")
    shared = put(c, keys("s", 2)).node
    c.unlock(c.lock(shared, "r1"))
    c.unlock(c.lock(shared, "r2"))
    once = put(c, keys("o", 2)).node
    c.unlock(c.lock(once, "r3"))
    c.evict_device({"kv": 2})
    assert shared.state == "removed" and once.state == "device"


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("exclusive", [False, True])
def test_every_policy_decides_the_same_for_the_same_calls(policy: str, exclusive: bool) -> None:
    def drive() -> list[tuple[int, str, int]]:
        c = CacheCore(h1(), 12, 12, policy="write_back", eviction=policy, exclusive=exclusive)
        events: list[tuple[int, str, int]] = []
        for i in range(40):
            key = keys(f"p{i % 5}-", 1 + i % 4) + keys(f"q{i}-", 2)
            m = c.match(key, MatchMode.PREFIX_REUSE)
            if m.needs_loadback:
                try:
                    load = c.load(m, f"r{i}")
                except Exception:
                    continue
                if load.command is not None:
                    ack(c, load.command)
                c.release(load.pin)
                c.unlock(load.lock)
            else:
                try:
                    res = put(c, key, c.device_pages(m.device_node) if m.device_units else None)
                except Exception:
                    c.evict_device({"kv": 6})
                    continue
                c.unlock(c.lock(res.node, f"r{i}"))
            for cmd in c.issue_writebacks():
                ack(c, cmd)
            c.evict_device({"kv": 2})
            events.extend((n.node_id, n.state, n.depth) for n in sorted(c.nodes(), key=lambda n: n.node_id))
            c.check_invariants()
        return events

    assert drive() == drive()


# ------------------------------------------------------------------ lru_turns
def _turn(c: CacheCore, prev, key: tuple[str, ...], rid: str):
    """A request ``rid`` that matched ``prev`` (locked it) publishes ``key`` below it and
    locks its new terminal, as the request lifecycle does."""
    if prev is not None:
        c.unlock(c.lock(prev, rid))
    res = put(c, key, c.device_pages(prev) if prev is not None else None)
    c.unlock(c.lock(res.node, rid))
    return res.node


def test_turns_grow_along_a_conversation_not_along_one_requests_chunks_nor_on_a_branch() -> None:
    c = CacheCore(h1(), 64, eviction="lru_turns")
    a = _turn(c, None, keys("a", 2), "r1")
    assert a.turns == 1
    b = _turn(c, a, keys("a", 2) + keys("b", 2), "r2")  # the next turn extends a's leaf
    assert (a.turns, b.turns) == (2, 2)
    d = _turn(c, b, keys("a", 2) + keys("b", 2) + keys("d", 2), "r3")
    assert (a.turns, b.turns, d.turns) == (3, 3, 3)
    # one request's second chunk below its own first one (only it used that node): same turn
    y1 = _turn(c, None, keys("y", 2), "r4")
    y2 = put(c, keys("y", 2) + keys("z", 2), c.device_pages(y1)).node
    assert (y1.hit_count, y1.turns, y2.turns) == (1, 1, 1)
    # a branch off a node that already has a child starts a conversation of its own
    e = _turn(c, a, keys("a", 2) + keys("e", 2), "r5")
    assert (e.turns, a.turns) == (1, 3)  # a's turns only grow
    c.check_invariants()


def test_a_split_keeps_the_turns_on_both_fragments() -> None:
    c = CacheCore(h1(), 64, eviction="lru_turns")
    a = _turn(c, None, keys("a", 4), "r1")
    b = _turn(c, a, keys("a", 4) + keys("b", 2), "r2")
    c.match(keys("a", 2))  # splits a
    assert a.parent is not None and a.parent.turns == a.turns == b.turns == 2


@pytest.mark.parametrize("policy", ["lru", "lru_turns"])
def test_lru_turns_keeps_a_returning_conversation_over_a_slightly_newer_one_turn_leaf(policy: str) -> None:
    c = CacheCore(h1(), 64, eviction=policy)
    assert getattr(c.eviction, "window") == 16  # 64 units / 4 (read by lru_turns only)
    a = _turn(c, None, keys("a", 4), "r1")
    conv = _turn(c, a, keys("a", 4) + keys("b", 4), "r2")  # two turns: bonus 16 ticks
    once = _turn(c, None, keys("x", 4), "r3")  # newer, by 3 ticks, but one turn
    assert conv.last_access < once.last_access < conv.last_access + 16
    c.evict_device({"kv": 4})
    assert (conv.state, once.state) == (("device", "removed") if policy == "lru_turns" else ("removed", "device"))
    # beyond the window recency wins again: the conversation is older by more than its bonus
    c2 = CacheCore(h1(), 64, eviction=policy)
    a = _turn(c2, None, keys("a", 4), "r1")
    conv = _turn(c2, a, keys("a", 4) + keys("b", 4), "r2")
    c2.tick(), [c2.tick() for _ in range(16)]
    once = _turn(c2, None, keys("x", 4), "r3")
    assert once.last_access > conv.last_access + 16
    c2.evict_device({"kv": 4})
    assert (conv.state, once.state) == ("removed", "device")
    c.check_invariants()


def test_eviction_policies_by_name_and_their_defaults() -> None:
    import pytest

    from kvtier.fsm.errors import ConfigError
    from kvtier.fsm.node.eviction import HeapIndex, lru_key, make_policy

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
    from kvtier.fsm.node.eviction import lru2_key

    c = CacheCore(h1(), 8)
    put(c, list("ab"))
    put(c, list("abcd"))
    short, deep = c.match(list("ab")).device_node, c.match(list("abcd")).device_node
    assert deep.depth > short.depth
    for n in (short, deep):
        n.prev_use, n.last_access = 3, 7
    assert lru2_key(deep) < lru2_key(short)
    assert lru2_key(deep) == (3, 7, -deep.depth, deep.node_id)
