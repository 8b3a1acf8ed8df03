"""Eviction (issue 3, "Eviction"; invariants 9, 14, 15 of source_system.md 3.1): device
eviction in LRU order with a total tie-break, demote vs drop, locked and borrowed nodes
never evicted, host eviction only from unpinned host leaves (source tests 15-17), both
returning exactly what they freed and terminating when nothing is evictable; host-only
host eviction sparing a ``backed`` node unless the host tier is exclusive and the node was
loaded back."""

from __future__ import annotations

import pytest
from core_helpers import ack, free, h1, h2, keys, put, src, state

from kvtier.fsm import CacheCore
from kvtier.fsm.errors import CapacityError, UsageError
from kvtier.fsm.node.eviction import HeapIndex
from kvtier.fsm.node import Node


def lru(c: CacheCore) -> HeapIndex:
    """The core's eviction index (the default LRU one)."""
    assert isinstance(c.eviction, HeapIndex)
    return c.eviction


def three_leaves():
    c = CacheCore(h1(), 8, 8)
    x = put(c, "x").node
    y = put(c, "y").node
    z = put(c, "z").node
    return c, x, y, z


def test_device_eviction_is_lru():
    c, x, y, z = three_leaves()
    c.unlock(c.lock(x))  # x is now the most recent
    assert c.evict_device({"kv": 1}) == {"kv": 1}
    c.check_invariants()
    assert state(c) == {x.node_id: "device", z.node_id: "device"}
    assert c.evict_device({"kv": 1}) == {"kv": 1}
    assert state(c) == {x.node_id: "device"}
    assert c.stats.device_evictions == 2 and free(c) == {"kv": 7}


def test_device_eviction_tie_break_is_total():
    c, x, y, z = three_leaves()
    for n in (x, y, z):
        n.last_access = 5  # a tie on the clock
        c.eviction.touch(n)  # the LRU heap is lazy: a hand-set stamp needs a touch
    c.check_invariants()
    assert c.evict_device({"kv": 1}) == {"kv": 1}
    assert state(c) == {y.node_id: "device", z.node_id: "device"}  # lowest node id
    # deeper first on equal stamps
    c2 = CacheCore(h1(), 8, 8)
    r = put(c2, "p")
    deep = put(c2, "pq", r.pages).node
    shallow = put(c2, "s").node
    r.node.last_access = deep.last_access = shallow.last_access = 9
    for n in (r.node, deep, shallow):
        c2.eviction.touch(n)
    assert c2.evict_device({"kv": 1}) == {"kv": 1}
    assert state(c2) == {r.node.node_id: "device", shallow.node_id: "device"}
    c2.check_invariants()


def history(c: CacheCore) -> list:
    out = []
    ra = put(c, "ab")
    put(c, "abc", ra.pages)
    put(c, "abd", ra.pages)
    rx = put(c, "xy")
    ack(c, c.writeback(rx.node))
    c.unlock(c.lock(ra.node))
    out.append(c.evict_device({"kv": 3}))
    out.append(sorted((n.node_id, n.state, tuple(n.dev.get("kv", ()))) for n in c.nodes()))
    out.append(c.alloc_device({"kv": 4}))
    out.append(sorted((n.node_id, n.state) for n in c.nodes()))
    return out


def test_same_history_same_decisions():
    runs = [history(CacheCore(h1(), 6, 8)) for _ in range(2)]
    assert runs[0] == runs[1]
    # and exactly: leaves C (stamp 2) and D (stamp 3) dropped, then X (stamp 4, backed)
    # split so that only its last unit is demoted (exact eviction: 3 pages asked, 3
    # freed); its prefix fragment (node 6) stays backed until the allocation of 4 pages
    # demotes it too; A (stamp 6, after the lock) stays
    assert runs[0] == [
        {"kv": 3},
        [(1, "device", (0, 1)), (4, "host", ()), (6, "backed", (4,))],
        {"kv": [4, 5, 3, 2]},
        [(1, "device"), (4, "host"), (6, "host")],
    ]


def test_backed_demoted_device_dropped():
    c = CacheCore(h1(), 8, 8)
    b = put(c, "ab").node
    ack(c, c.writeback(b))
    d = put(c, "cd").node
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    c.check_invariants()
    assert state(c) == {b.node_id: "host"}  # d was dropped, b demoted
    assert (b.dev, b.host) == ({}, {"kv": [0, 1]}) and d.state == "removed"
    assert (c.stats.demotions, c.stats.device_evictions) == (1, 1)


def test_chain_eviction_reaches_parents_after_children():
    c = CacheCore(h1(), 8, None)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    c.unlock(c.lock(rb.node))
    # B (2 pages) then the last unit of A, split off: exactly the 3 pages asked for
    assert c.evict_device({"kv": 3}) == {"kv": 3}
    assert [(n.key, n.state) for n in c.nodes()] == [(("a",), "device")] and free(c) == {"kv": 7}
    c.check_invariants()


def test_locked_and_borrowed_never_evicted_and_eviction_terminates():
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    b = put(c, "cd").node
    ack(c, c.writeback(b))
    lk = c.lock(a)
    rcpt = c.borrow([b])
    assert c.evict_device({"kv": 8}) == {"kv": 0}
    assert c.alloc_device({"kv": 4}) == {"kv": [4, 5, 6, 7]}
    with pytest.raises(CapacityError):
        c.alloc_device({"kv": 1})
    c.check_invariants()
    assert state(c) == {a.node_id: "device", b.node_id: "backed"}
    c.release(rcpt)
    assert c.evict_device({"kv": 8}) == {"kv": 2}  # only b (demoted); a still locked
    c.unlock(lk)
    assert c.evict_device({"kv": 8}) == {"kv": 2}
    assert c.evict_device({"kv": 8}) == {"kv": 0}
    c.check_invariants()


def test_locked_child_protects_parent_path():
    c = CacheCore(h1(), 8, None)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    lk = c.lock(rb.node)
    assert (ra.node.lock_ref, rb.node.lock_ref) == (1, 1)
    assert c.evict_device({"kv": 4}) == {"kv": 0}
    c.unlock(lk)
    c.check_invariants()


def test_eviction_returns_checkpoint_pages_too():
    c = CacheCore(src(), {"fh": 4, "swa": 8}, None)
    put(c, "ab", ckpt=True)
    # one unit is enough: the tail "b" goes with the checkpoint at its end, "a" stays
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    assert free(c) == {"fh": 3, "swa": 8}
    assert [(n.key, n.state, bool(n.dev_ckpt)) for n in c.nodes()] == [(("a",), "device", False)]
    c.check_invariants()


def test_eviction_multi_group_need():
    c = CacheCore(h2(), {"a": 8, "b": 4}, None)
    x = put(c, "x").node
    put(c, "y")
    assert c.evict_device({"b": 1}) == {"a": 2, "b": 1}
    assert [n.key for n in c.nodes()] == [("y",)] and x.state == "removed"
    assert c.evict_device({"a": 0, "b": 0}) == {"a": 0, "b": 0}
    assert c.evict_device({}) == {"a": 0, "b": 0}
    with pytest.raises(UsageError, match=r"^unknown cache group 'nope'; groups: \['a', 'b'\]$"):
        c.evict_device({"nope": 1})
    with pytest.raises(UsageError, match="^page count for group 'a' must be an int >= 0, got -1$"):
        c.evict_device({"a": -1})
    c.check_invariants()


# ---------------------------------------------------------------------- host eviction
def test_host_eviction_frees_history_and_state_pages():
    # source test 15: KVHostEvictReleasesPagedCacheHostSnapshotPages
    c = CacheCore(src(), {"fh": 2, "swa": 4}, {"fh": 2, "swa": 4})
    a = put(c, "a", ckpt=True).node
    ack(c, c.writeback(a))
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    assert free(c, "host") == {"fh": 1, "swa": 0}
    assert c.evict_host({"fh": 1}) == {"fh": 1, "swa": 4}
    assert free(c, "host") == {"fh": 2, "swa": 4} and c.nodes() == []
    assert c.stats.host_evictions == 1
    c.check_invariants()


def test_host_eviction_only_from_host_leaves():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(rb.node))
    assert c.evict_device({"kv": 4}) == {"kv": 4}
    a, b = ra.node, rb.node
    a.last_access, b.last_access = 1, 100  # the parent is older, but not a leaf
    c.eviction.touch(a)
    c.eviction.touch(b)
    assert c.evict_host({"kv": 1}) == {"kv": 1}  # the last unit of the leaf b, split off
    c.check_invariants()
    assert state(c) == {a.node_id: "host", b.parent.node_id: "host"}
    m = c.match(list("abcd"))
    assert (m.host_nodes, m.host_units) == ((a, b.parent), 3)


def test_backed_node_sheds_host_copy_and_stays_on_device():
    c = CacheCore(h1(), 8, 8)
    ra = put(c, "ab")
    rb = put(c, "abcd", ra.pages)
    ack(c, c.writeback(ra.node))
    assert c.evict_host({"kv": 8}) == {"kv": 2}
    c.check_invariants()
    assert (ra.node.state, ra.node.dev, ra.node.host) == ("device", {"kv": [0, 1]}, {})
    assert c.stats.host_drops == 1 and c.match(list("abcd")).device_units == 4
    assert rb.node.state == "device"


def test_host_eviction_skips_pinned_and_terminates():
    c = CacheCore(h1(), 8, 8)
    x = put(c, "x").node
    y = put(c, "y").node
    for n in (x, y):
        ack(c, c.writeback(n))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    pin = c.pin([x], "r1")
    assert c.evict_host({"kv": 8}) == {"kv": 1}
    assert state(c) == {x.node_id: "host"}
    assert c.evict_host({"kv": 8}) == {"kv": 0}
    c.check_invariants()
    c.release(pin)
    assert c.evict_host({"kv": 8}) == {"kv": 1}
    assert c.nodes() == [] and free(c, "host") == {"kv": 8}
    c.check_invariants()


def test_host_eviction_is_lru_and_protects():
    c = CacheCore(h1(), 8, 8)
    nodes = [put(c, k).node for k in "pqr"]
    for n in nodes:
        ack(c, c.writeback(n))
    c.unlock(c.lock(nodes[0]))
    assert c.evict_host({"kv": 1}, protect=[nodes[1]]) == {"kv": 1}
    assert [n.state for n in nodes] == ["backed", "backed", "device"]
    assert c.evict_host({"kv": 1}) == {"kv": 1}
    assert [n.state for n in nodes] == ["backed", "device", "device"]  # q (stamp 2) before p (stamp 5)
    c.check_invariants()


def test_no_host_tier_host_eviction_is_empty():
    c = CacheCore(h1(), 4, None)
    put(c, "ab")
    assert c.evict_host({"kv": 4}) == {}
    c.check_invariants()


def test_host_eviction_skips_a_locked_host_node():
    # after a failed loadback the request still holds its lock on the (host) terminal
    c = CacheCore(h1(), 8, 8)
    a = put(c, "ab").node
    ack(c, c.writeback(a))
    assert c.evict_device({"kv": 2}) == {"kv": 2}
    lr = c.load(c.match(list("ab")), "r1")
    ack(c, lr.command, ok=False)
    c.release(lr.pin)
    assert (a.state, a.host_pin, a.lock_ref) == ("host", 0, 1)
    assert c.evict_host({"kv": 2}) == {"kv": 0}
    c.check_invariants()
    c.unlock(lr.lock)
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    assert c.nodes() == []
    c.check_invariants()


def test_lazy_lru_heaps_are_rebuilt_and_keep_lru_order():
    """Every touch pushes a heap entry; past 4 x nodes + 256 entries the heaps are rebuilt
    from the live nodes, and eviction still takes the least recently used leaf."""
    c = CacheCore(h1(), 8, 8)
    x = put(c, "x").node
    y = put(c, "y").node
    for _ in range(400):  # y is used over and over: its stale entries pile up
        c.unlock(c.lock(y))
    limit = 4 * len(c.nodes()) + 256
    dev_len, host_len = lru(c).heap_sizes()
    assert dev_len <= limit and host_len <= limit
    assert dev_len < 400  # rebuilt at least once
    assert all(n is not c.root for n in lru(c).heap_nodes())  # only tree nodes
    c.check_invariants()
    assert c.evict_device({"kv": 1}) == {"kv": 1}  # x (older, one page) goes first
    assert state(c) == {y.node_id: "device"} and x.node_id not in state(c)


def test_lazy_lru_heaps_grow_to_their_bound_and_no_further():
    """A touch that leaves a node's key alone, or raises it, files nothing new (the entry
    is re-filed when it reaches the top); one that lowers it files an entry. The heaps are
    rebuilt exactly when they pass 4 x nodes + 256 entries: never longer (memory), never
    rebuilt earlier (a rebuild costs O(nodes))."""
    c = CacheCore(h1(), 8, 8)
    y = put(c, "y").node
    ack(c, c.writeback(y))  # backed (as x): a victim of both tiers, filed on both heaps
    x = put(c, "x").node
    ack(c, c.writeback(x))
    assert (y.state, x.state) == ("backed", "backed")
    assert all(n is not c.root for n in lru(c).heap_nodes())  # only tree nodes
    base = lru(c).heap_sizes()
    for _ in range(50):
        c.eviction.touch(y)  # same key: nothing filed
    y.last_access += 100
    c.eviction.touch(y)  # a higher key: re-filed lazily
    assert lru(c).heap_sizes() == base
    limit = 4 * len(c.nodes()) + 256
    lengths = []
    for i in range(300):
        y.last_access = -1 - i  # a lower key each time: one entry per touch
        c.eviction.touch(y)
        dev_len, host_len = lru(c).heap_sizes()
        lengths.append(dev_len)
        assert host_len == dev_len  # nothing popped: both grow alike
    assert max(lengths) == limit
    after = lengths[lengths.index(limit) + 1]
    assert len(c.nodes()) <= after <= len(c.nodes()) + 2  # rebuilt from the live nodes only


def test_a_touch_files_a_node_only_on_the_tiers_its_state_may_be_a_victim_of():
    """A device node is filed on the device heap only, a host node on the host heap only,
    a backed one on both; a node writing back on neither (its writeback's end touches it)."""
    c = CacheCore(h1(), 8, 8)
    d = put(c, "d").node
    w = put(c, "w").node
    cmd = c.writeback(w)
    assert (d.state, w.state) == ("device", "writing")
    index = lru(c)
    dev = [n.node_id for n in index.heap_nodes()[:index.heap_sizes()[0]]]
    host = [n.node_id for n in index.heap_nodes()[index.heap_sizes()[0]:]]
    assert d.node_id in dev and d.node_id not in host and w.node_id not in host
    ack(c, cmd)
    assert w.state == "backed"
    sizes = index.heap_sizes()
    host = [n.node_id for n in index.heap_nodes()[sizes[0]:]]
    assert w.node_id in host and w.node_id in [n.node_id for n in index.heap_nodes()[:sizes[0]]]
    assert c.evict_device({"kv": 1}) == {"kv": 1} and (d.state, w.state) == ("removed", "backed")  # the older


def test_a_key_raised_without_a_fresh_entry_still_comes_out_in_key_order():
    """The lazy re-filing yields candidates in the order of their current keys."""
    c = CacheCore(h1(), 8, None)
    a = put(c, "a").node
    b = put(c, "b").node
    assert a.last_access < b.last_access
    a.last_access = b.last_access + 10  # a is now the most recent
    c.eviction.touch(a)
    assert [n.node_id for n in lru(c).device_candidates()][:2] == [b.node_id, a.node_id]


def test_a_parent_dropped_from_the_heap_comes_back_when_its_last_child_leaves():
    """An eviction pass drops nodes that are not victims from the LRU heap; a parent whose
    device child leaves later must become a candidate again (the trigger touches it)."""
    c = CacheCore(h1(), 4, None)
    a = put(c, "ab")
    b = put(c, "abcd", a.pages)
    borrow = c.borrow([b.node], "r1")
    assert c.evict_device({"kv": 1}) == {"kv": 0}  # B borrowed, A has a device child
    assert lru(c).heap_sizes()[0] == 0  # both were dropped from the device heap
    c.release(borrow)  # touches B only
    assert c.evict_device({"kv": 4}) == {"kv": 4}  # B goes, then A (touched by B's eviction)
    assert state(c) == {} and c.stats.device_evictions == 2
    c.check_invariants()


def _backed(c: CacheCore, key: str) -> Node:
    n = put(c, key).node
    ack(c, c.writeback(n))
    assert n.state == "backed"
    return n


def test_host_only_eviction_spares_backed_nodes():
    c = CacheCore(h1(), 8, 8)
    x = _backed(c, "x")
    y = _backed(c, "y")
    assert c.evict_device({"kv": 1}) == {"kv": 1} and (x.state, y.state) == ("host", "backed")
    before_y = y.host
    # two pages asked, one host-only page to give: y's host copy is spared
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 1}
    assert x.node_id not in state(c) and (y.state, y.host) == ("backed", before_y)
    assert (c.stats.host_evictions, c.stats.host_drops) == (1, 0)
    c.check_invariants()


def test_host_copies_of_backed_nodes_are_dropped_even_when_locked_and_counted_each_time():
    c = CacheCore(h1(), 8, 8)
    x = _backed(c, "x")
    y = _backed(c, "y")
    lock = c.lock(x, "r1")  # a running request uses x: its device pages stay, its host copy may go
    assert c.evict_host({"kv": 2}) == {"kv": 2}
    assert (x.state, y.state, x.host, c.stats.host_drops) == ("device", "device", {}, 2)
    c.unlock(lock)
    c.check_invariants()


def test_a_demoted_chunk_checkpoint_comes_back_as_a_final_one():
    c = CacheCore(src(), {"fh": 8, "swa": 16}, {"fh": 8, "swa": 16})
    ra = put(c, "a", ckpt=True, chunk=True)
    a = ra.node
    ack(c, c.writeback(a))
    assert c.evict_device({"fh": 1}) == {"fh": 1, "swa": 4}
    assert (a.state, a.dev_ckpt, a.chunk_checkpoint) == ("host", {}, False)
    lr = c.load(c.match(list("a")), "r1")
    ack(c, lr.command)
    c.release(lr.pin)
    c.unlock(lr.lock)
    rab = put(c, "ab", c.device_pages(a), ckpt=True)  # a deeper checkpoint does not drop it now
    assert a.dev_ckpt and not a.chunk_checkpoint and rab.node.dev_ckpt
    c.check_invariants()


# ------------------------------------------------------------------ host_only eviction
@pytest.mark.parametrize("exclusive", [False, True])
def test_host_only_eviction_spares_a_backed_node_that_was_never_loaded_back(exclusive: bool) -> None:
    c = CacheCore(h1(), 8, 8, policy="write_through", exclusive=exclusive)
    n = put(c, keys("a", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert (n.state, n.reloaded, c.exclusive) == ("backed", False, exclusive)
    assert c.evict_host({"kv": 2}, host_only=True) == {"kv": 0}
    assert n.state == "backed" and n.host == {"kv": [0, 1]} and c.stats.host_drops == 0
    assert c.evict_host({"kv": 2}) == {"kv": 2}  # without host_only it is dropped
    assert n.state == "device" and c.stats.host_drops == 1
    c.check_invariants()


@pytest.mark.parametrize("exclusive", [False, True])
def test_host_only_eviction_drops_a_reloaded_copy_only_when_exclusive(exclusive: bool) -> None:
    c = CacheCore(h1(), 4, 4, policy="write_through", exclusive=exclusive)
    hot = put(c, keys("h", 2)).node
    for cmd in c.issue_writebacks():
        ack(c, cmd)
    assert c.evict_device({"kv": 2}) == {"kv": 2} and hot.state == "host"
    load = c.load(c.match(keys("h", 2)), "r1")
    assert load.command is not None
    ack(c, load.command)
    c.release(load.pin)
    c.unlock(load.lock)
    assert (hot.state, hot.reloaded) == ("backed", True)
    assert c.evict_host({"kv": 2}, host_only=True) == ({"kv": 2} if exclusive else {"kv": 0})
    assert hot.state == ("device" if exclusive else "backed")
    assert c.stats.host_drops == (1 if exclusive else 0)
    c.check_invariants()
